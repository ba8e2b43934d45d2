"""What is emitted and exported, off the training thread: spans and metric points from closed step records,
the embedded OTLP JSON files, delivery accounting, Prometheus, and the one door into the SDK's internals."""
