"""The process's runtime: the session (when telemetry starts), its lifecycle (fork, signals, exit, flush order),
the job's identity, configuration from environment variables, and fail-open guards."""
