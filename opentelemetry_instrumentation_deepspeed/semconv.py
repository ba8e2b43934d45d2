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
SPAN_PHASE_GPU = "training.{phase}.gpu"  # on CUDA: a phase's GPU-side interval, child of the phase

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

# Collective spans (comm.<op>) and their metric attributes
COMM_OP = "comm.op"
COMM_BACKEND = "comm.backend"
COMM_GROUP_SIZE = "comm.group.size"
COMM_GROUP_NAME = "comm.group.name"
COMM_BYTES = "comm.bytes"
COMM_DTYPE = "comm.dtype"
COMM_ASYNC = "comm.async"
COMM_SEQUENCE = "comm.sequence"
COMM_ALGBW = "comm.algbw"
COMM_BUSBW = "comm.busbw"
COMM_TIMING = "comm.timing"
# On phase and step spans: collectives issued within them, and those beyond the span limit
COMM_COUNT = "comm.count"
COMM_SPANS_DROPPED = "comm.spans_dropped"

# Metrics
METRIC_STEP_DURATION = "training.step.duration"
METRIC_PHASE_DURATION = "training.phase.duration"
TRAINING_PHASE = "training.phase"  # its attribute: one of PHASES
PHASE_DATA_WAIT = "data.wait"
PHASE_FORWARD = "forward"
PHASE_BACKWARD = "backward"
PHASE_OPTIMIZER_STEP = "optimizer.step"
PHASES = (PHASE_DATA_WAIT, PHASE_FORWARD, PHASE_BACKWARD, PHASE_OPTIMIZER_STEP)
METRIC_SAMPLES = "training.samples"
METRIC_TOKENS = "training.tokens"
METRIC_SKIPPED_STEPS = "training.steps.skipped"
METRIC_LOSS_SCALE = "training.loss_scale"
METRIC_GRAD_NORM = "training.grad_norm"
METRIC_MFU = "training.mfu"
METRIC_WORKERS = "training.data.workers"
METRIC_WORKERS_CPU = "training.data.workers.cpu.utilization"
METRIC_WORKERS_MEMORY = "training.data.workers.memory.usage"
METRIC_COMM_DURATION = "training.comm.duration"
METRIC_COMM_SIZE = "training.comm.size"
METRIC_COMM_BUS_SIZE = "training.comm.bus.size"

# Telemetry about the telemetry (delivery.py): the SDK self-observability names of OpenTelemetry
METRIC_SPANS_EXPORTED = "otel.sdk.exporter.span.exported"
METRIC_SPANS_PROCESSED = "otel.sdk.processor.span.processed"
METRIC_POINTS_EXPORTED = "otel.sdk.exporter.metric_data_point.exported"
OTEL_COMPONENT_NAME = "otel.component.name"
ERROR_TYPE = "error.type"

# Operator and kernel spans of profiled steps (named after the operator or kernel)
PROFILE_KIND = "profile.kind"  # cpu_op, kernel, memcpy, memset
PROFILE_DEVICE = "profile.device"
PROFILE_STREAM = "profile.stream"
PROFILE_SHAPES = "profile.shapes"
PROFILE_FLOPS = "profile.flops"
# On the step span of a profiled step
PROFILE_OPS = "profile.ops"
PROFILE_OPS_EMITTED = "profile.ops.emitted"
PROFILE_KERNELS = "profile.kernels"
PROFILE_KERNELS_EMITTED = "profile.kernels.emitted"

# Resource attributes (service.*, host.name and process.pid are OpenTelemetry's own)
TRAINING_JOB_ID = "training.job.id"
TRAINING_RANK = "training.rank"
TRAINING_LOCAL_RANK = "training.local_rank"
TRAINING_WORLD_SIZE = "training.world_size"
TRAINING_FRAMEWORK = "training.framework"
DEEPSPEED_VERSION = "deepspeed.version"
