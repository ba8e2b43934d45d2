"""``opentelemetry-deepspeed diagnose``: the layer that holds a training job back, from its telemetry."""
