"""What is patched: one ``BaseInstrumentor`` per target, each a thin wrapper that hands plain facts to ``recording``."""
