"""Names of the telemetry this project emits: the one place they are spelled.

docs/telemetry.md describes each; names that have shipped do not change.
"""

# Spans
SPAN_GLOBAL_STEP = "training.global_step"
SPAN_STEP = "training.step"
SPAN_DATA_WAIT = "training.data.wait"
SPAN_FORWARD = "training.forward"
SPAN_BACKWARD = "training.backward"
SPAN_OPTIMIZER_STEP = "training.optimizer.step"

# Span attributes
TRAINING_STEP = "training.step"
TRAINING_MICRO_STEP = "training.micro_step"
TRAINING_STEP_SAMPLES = "training.step.samples"
TRAINING_STEP_MICRO_BATCHES = "training.step.micro_batches"
TRAINING_STEP_SKIPPED = "training.step.skipped"
TRAINING_GRADIENT_ACCUMULATION_STEPS = "training.gradient_accumulation_steps"
TRAINING_MICRO_BATCH_SIZE = "training.micro_batch_size"
TRAINING_ZERO_STAGE = "training.zero_stage"
TRAINING_BACKWARD_DIRECT = "training.backward.direct"

# Resource attributes (service.*, host.name and process.pid are OpenTelemetry's own)
TRAINING_JOB_ID = "training.job.id"
TRAINING_RANK = "training.rank"
TRAINING_LOCAL_RANK = "training.local_rank"
TRAINING_WORLD_SIZE = "training.world_size"
TRAINING_FRAMEWORK = "training.framework"
DEEPSPEED_VERSION = "deepspeed.version"
