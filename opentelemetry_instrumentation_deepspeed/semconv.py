"""Names of the telemetry this project emits: the one place they are spelled.

docs/telemetry.md describes each; names that have shipped do not change.
"""

# Instrumentation scope of this project's tracers and meters (Prometheus: the otel_scope_name label)
SCOPE_NAME = "opentelemetry_instrumentation_deepspeed"
# The collectives' metrics have carried their module's name as scope since they shipped.
COMM_SCOPE_NAME = "opentelemetry_instrumentation_deepspeed.comm"

# Spans
SPAN_GLOBAL_STEP = "training.global_step"
SPAN_STEP = "training.step"
SPAN_DATA_WAIT = "training.data.wait"
SPAN_FORWARD = "training.forward"
SPAN_BACKWARD = "training.backward"
SPAN_OPTIMIZER_STEP = "training.optimizer.step"
SPAN_PHASE_GPU = "training.{phase}.gpu"  # on CUDA: a phase's GPU-side interval, child of the phase
# The watchdog's report of a step that does not close: in the step's trace, from its start to the report
SPAN_HANG = "training.hang"
SPAN_CLOCK_SYNC = "training.clock.sync"  # a refreshed clock offset to rank 0 (training.clock.offset, .error)

# The exception event of a span that raised, as OpenTelemetry's exception conventions name it
EVENT_EXCEPTION = "exception"
EXCEPTION_TYPE = "exception.type"
EXCEPTION_MESSAGE = "exception.message"
EXCEPTION_STACKTRACE = "exception.stacktrace"
EXCEPTION_ESCAPED = "exception.escaped"

# A hang report's stack: one event per reported thread, with OpenTelemetry's thread and code attributes
EVENT_HANG_STACK = "training.hang.stack"
THREAD_ID = "thread.id"
THREAD_NAME = "thread.name"
CODE_STACKTRACE = "code.stacktrace"

# On training.hang (with training.step, training.phase, training.micro_step, and comm.op, comm.group.name,
# comm.sequence, comm.bytes, comm.dtype for the collective in flight, when there is one)
HANG_REASON = "training.hang.reason"  # HANG_REASON_WATCHDOG, or the exit's reason (terminated by SIGTERM)
HANG_REASON_WATCHDOG = "no step progress"
HANG_REASON_RESUMED = "resumed"  # a report made with no step open: the thread has moved on since
HANG_DURATION = "training.hang.duration"  # seconds since the open phase (else the step) started
HANG_THRESHOLD = "training.hang.threshold"  # the watchdog's threshold when it reported, seconds
HANG_COMM_DURATION = "training.hang.comm.duration"  # seconds the collective in flight has been running
HANG_COMM_SEQUENCES = "training.hang.comm.sequences"  # ["<group>:<last sequence issued>", ...]
HANG_BETWEEN_STEPS = "training.hang.between_steps"  # true: no step open (training.step is the next one)

# Span attributes
TRAINING_STEP = "training.step"
TRAINING_MICRO_STEP = "training.micro_step"
TRAINING_STEP_SAMPLES = "training.step.samples"
TRAINING_STEP_MICRO_BATCHES = "training.step.micro_batches"
TRAINING_STEP_SKIPPED = "training.step.skipped"
# A step the program left open as it ended normally (micro-batches of an epoch's end that no optimizer step took).
TRAINING_STEP_UNFINISHED = "training.step.unfinished"
TRAINING_STEP_PHASES_DROPPED = "training.step.phases_dropped"  # past the phases a step keeps: no span, no point
TRAINING_GRADIENT_ACCUMULATION_STEPS = "training.gradient_accumulation_steps"
TRAINING_MICRO_BATCH_SIZE = "training.micro_batch_size"
TRAINING_ZERO_STAGE = "training.zero_stage"
TRAINING_PRECISION = "training.precision"  # fp16, bf16, fp32: DeepSpeed's configuration
TRAINING_BACKWARD_DIRECT = "training.backward.direct"
# The model layer, on training.step: the step's loss (the mean over its micro-batches) and global
# gradient norm, and what the numerics watch found in them (one of NUMERICS_KINDS, comma-joined)
TRAINING_LOSS = "training.loss"
TRAINING_GRAD_NORM = "training.grad_norm"
TRAINING_NUMERICS_ANOMALY = "training.numerics.anomaly"
# GPU memory from PyTorch's caching allocator (bytes), on phase spans (at its end) and training.step
# (at its end or failure); the step also carries each phase's peak, and the phase an OOM ended
TRAINING_MEMORY_ALLOCATED = "training.memory.allocated"
TRAINING_MEMORY_RESERVED = "training.memory.reserved"
TRAINING_MEMORY_PEAK = "training.memory.peak"
TRAINING_MEMORY_PHASE_PEAK = "training.memory.{phase}.peak"  # on training.step, per phase
TRAINING_MEMORY_ALLOC_RETRIES = "training.memory.alloc_retries"  # in the step: cudaMalloc retries (cache flushes)
TRAINING_MEMORY_OOM = "training.memory.oom"  # on training.step: the phase an out-of-memory error ended
# What a micro-batch held as it left the DataLoader: on its training.forward and training.backward
TRAINING_BATCH_SAMPLES = "training.batch.samples"
TRAINING_BATCH_SEQUENCE_LENGTH = "training.batch.sequence_length"  # padded: the token ids' second dimension
TRAINING_BATCH_TOKENS = "training.batch.tokens"  # real: not padding
# ... and summed over the step's micro-batches, on training.step
TRAINING_STEP_TOKENS = "training.step.tokens"
TRAINING_STEP_PADDED_TOKENS = "training.step.padded_tokens"
TRAINING_STEP_SEQUENCE_LENGTH = "training.step.sequence_length"  # the longest of its micro-batches
# On training.step: CPUs in use on average during the step (recording/host_cpu.py): on the whole host,
# idle on the host, and by this process
TRAINING_STEP_HOST_CPU_BUSY = "training.step.host.cpu.busy"
TRAINING_STEP_HOST_CPU_IDLE = "training.step.host.cpu.idle"
TRAINING_STEP_PROCESS_CPU = "training.step.process.cpu"
# ... and the share of the step the training thread was ready to run but waited for a CPU (run-queue delay)
TRAINING_STEP_THREAD_CPU_WAIT = "training.step.thread.cpu.wait"
# ... and the run-queue delays of the process's native threads (communication, intra-op), summed, as a share of it
TRAINING_STEP_NATIVE_THREADS_CPU_WAIT = "training.step.native_threads.cpu.wait"
# On training.step: seconds the training thread spent in synchronous collectives after the previous step closed and
# before this one started (a barrier after rank 0's checkpoint): of the gap between the two, a wait for the other ranks
TRAINING_STEP_BETWEEN_COMM = "training.step.between.comm"
# On forward, backward and optimizer_step spans: the share of the phase the training thread waited for a CPU
TRAINING_PHASE_THREAD_CPU_WAIT = "training.phase.thread.cpu.wait"
# A plain PyTorch loop's data parallelism, on training.step: "ddp", "fsdp", or "none" (trace_training())
TRAINING_PARALLELISM = "training.parallelism"
# Pipeline parallelism (PipelineEngine): on training.step, and on the resource of the rank
TRAINING_PIPELINE_STAGE = "training.pipeline.stage"  # this rank's stage, 0-based
TRAINING_PIPELINE_STAGES = "training.pipeline.stages"  # stages in the pipeline
TRAINING_DATA_PARALLEL_RANK = "training.data_parallel.rank"  # this rank's pipeline among the data-parallel ones
TRAINING_DATA_PARALLEL_SIZE = "training.data_parallel.size"

# Collective spans (comm.<op>) and their metric attributes
SPAN_COMM_PREFIX = "comm."  # a collective's span is this prefix and its op: comm.all_reduce
COMM_OP = "comm.op"
COMM_BACKEND = "comm.backend"
COMM_GROUP_SIZE = "comm.group.size"
COMM_GROUP_NAME = "comm.group.name"
COMM_BYTES = "comm.bytes"
COMM_DTYPE = "comm.dtype"
COMM_ASYNC = "comm.async"
COMM_SEQUENCE = "comm.sequence"
# Point-to-point ops: only the ranks at their two ends issue them, so they count apart from the group's collectives
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list"})
COMM_ALGBW = "comm.algbw"
COMM_BUSBW = "comm.busbw"
COMM_TIMING = "comm.timing"
COMM_PEER_RANK = "comm.peer.rank"  # send / recv: the global rank at the other end
COMM_PEER_STAGE = "training.pipeline.peer_stage"  # a pipeline's send / recv: the stage at the other end
COMM_TIMING_GPU = "gpu"  # its value when CUDA events timed the call; absent for host times
COMM_COALESCED = "comm.coalesced"  # a block of torch's _coalescing_manager: the calls it ran as one
# On phase and step spans: collectives issued within them, and those beyond the span limit
COMM_COUNT = "comm.count"
COMM_SPANS_DROPPED = "comm.spans_dropped"

# Metrics
METRIC_STEP_DURATION = "training.step.duration"
METRIC_STEP_OPEN_DURATION = "training.step.open.duration"  # gauge: how long the open step has run (0: none)
METRIC_PHASE_DURATION = "training.phase.duration"
TRAINING_PHASE = "training.phase"  # its attribute: one of PHASES
PHASE_DATA_WAIT = "data.wait"
PHASE_FORWARD = "forward"
PHASE_BACKWARD = "backward"
PHASE_OPTIMIZER_STEP = "optimizer.step"
PHASES = (PHASE_DATA_WAIT, PHASE_FORWARD, PHASE_BACKWARD, PHASE_OPTIMIZER_STEP)
METRIC_SAMPLES = "training.samples"
METRIC_TOKENS = "training.tokens"
METRIC_BATCH_SEQUENCE_LENGTH = "training.batch.sequence_length"
METRIC_BATCH_TOKENS = "training.batch.tokens"
METRIC_SKIPPED_STEPS = "training.steps.skipped"
METRIC_LOSS_SCALE = "training.loss_scale"
METRIC_GRAD_NORM = "training.grad_norm"
METRIC_MFU = "training.mfu"
METRIC_LOSS = "training.loss"
METRIC_NUMERICS_ANOMALIES = "training.numerics.anomalies"
TRAINING_NUMERICS_KIND = "training.numerics.kind"  # its attribute: one of NUMERICS_KINDS
NUMERICS_NONFINITE_LOSS = "nonfinite_loss"
NUMERICS_NONFINITE_GRAD_NORM = "nonfinite_grad_norm"
NUMERICS_LOSS_SPIKE = "loss_spike"
NUMERICS_GRAD_NORM_SPIKE = "grad_norm_spike"
NUMERICS_SKIPPED_RUN = "skipped_run"
NUMERICS_KINDS = (NUMERICS_NONFINITE_LOSS, NUMERICS_NONFINITE_GRAD_NORM, NUMERICS_LOSS_SPIKE,
                  NUMERICS_GRAD_NORM_SPIKE, NUMERICS_SKIPPED_RUN)
METRIC_MEMORY_ALLOCATED = "training.memory.allocated"
METRIC_MEMORY_RESERVED = "training.memory.reserved"
METRIC_MEMORY_FRAGMENTATION = "training.memory.fragmentation"
METRIC_MEMORY_PEAK = "training.memory.peak"  # per training.phase
METRIC_MEMORY_ALLOC_RETRIES = "training.memory.alloc_retries"
METRIC_MEMORY_OOMS = "training.memory.ooms"
METRIC_WORKERS = "training.data.workers"
METRIC_WORKERS_CPU = "training.data.workers.cpu.utilization"
METRIC_WORKERS_MEMORY = "training.data.workers.memory.usage"
METRIC_COMM_DURATION = "training.comm.duration"
METRIC_COMM_SIZE = "training.comm.size"
METRIC_COMM_BUS_SIZE = "training.comm.bus.size"

# GPU metrics (gpu_metrics.py, from NVML): OpenTelemetry's hardware semantic conventions where they
# define a name...
METRIC_HW_GPU_UTILIZATION = "hw.gpu.utilization"
METRIC_HW_GPU_MEMORY_UTILIZATION = "hw.gpu.memory.utilization"  # the fraction of the GPU's memory in use
METRIC_HW_GPU_MEMORY_USAGE = "hw.gpu.memory.usage"
METRIC_HW_GPU_MEMORY_LIMIT = "hw.gpu.memory.limit"
METRIC_HW_GPU_IO = "hw.gpu.io"  # PCIe
METRIC_HW_POWER = "hw.power"
METRIC_HW_ENERGY = "hw.energy"
METRIC_HW_TEMPERATURE = "hw.temperature"
METRIC_HW_ERRORS = "hw.errors"  # by error.type (ERROR_TYPE): ECC_CORRECTED, ECC_UNCORRECTED, PCIE_REPLAY, XID
METRIC_HW_STATUS = "hw.status"  # 1 for the GPU's current hw.state, 0 for the others
HW_STATE = "hw.state"
HW_STATE_OK = "ok"
HW_STATE_DEGRADED = "degraded"
HW_STATE_FAILED = "failed"
HW_STATES = (HW_STATE_OK, HW_STATE_DEGRADED, HW_STATE_FAILED)
# ... and NVML's own readings, ours, under nvidia.gpu.* (outside the conventions' hw.* namespace)
METRIC_NVIDIA_GPU_MEMORY_CONTROLLER_UTILIZATION = "nvidia.gpu.memory_controller.utilization"
METRIC_NVIDIA_GPU_CLOCK_SM = "nvidia.gpu.clock.sm"
METRIC_NVIDIA_GPU_CLOCK_MEMORY = "nvidia.gpu.clock.memory"
METRIC_NVIDIA_GPU_NVLINK_IO = "nvidia.gpu.nvlink.io"
METRIC_NVIDIA_GPU_THROTTLE = "nvidia.gpu.throttle"  # per NVIDIA_GPU_THROTTLE_REASON
METRIC_NVIDIA_GPU_PROCESS_MEMORY_USAGE = "nvidia.gpu.process.memory.usage"
METRIC_NVIDIA_GPU_SM_ACTIVITY = "nvidia.gpu.sm.activity"
METRIC_NVIDIA_GPU_XID = "nvidia.gpu.xid"  # the last XID error's code
METRIC_NVIDIA_GPU_REMAPPED_ROWS = "nvidia.gpu.memory.remapped_rows"  # by error.type: corrected, uncorrected
METRIC_NVIDIA_GPU_RETIRED_PAGES = "nvidia.gpu.memory.retired_pages"  # by error.type: corrected, uncorrected
NVIDIA_GPU_THROTTLE_REASON = "nvidia.gpu.throttle.reason"
# The names these had until version 0.1 (inside hw.gpu.*, where a convention may come to define them):
# still emitted, with the same values, for one release; then removed.
ALIASES = {
    METRIC_NVIDIA_GPU_CLOCK_SM: "hw.gpu.clock.sm",
    METRIC_NVIDIA_GPU_CLOCK_MEMORY: "hw.gpu.clock.memory",
    METRIC_NVIDIA_GPU_NVLINK_IO: "hw.gpu.nvlink.io",
    METRIC_NVIDIA_GPU_THROTTLE: "hw.gpu.throttle",
    METRIC_NVIDIA_GPU_PROCESS_MEMORY_USAGE: "hw.gpu.process.memory.usage",
    METRIC_NVIDIA_GPU_SM_ACTIVITY: "hw.gpu.sm.activity",
}
HW_GPU_THROTTLE_REASON = "hw.gpu.throttle.reason"  # the reason's attribute on the alias hw.gpu.throttle
# Attributes of every GPU point (hw.parent: a MIG instance's GPU), with their fixed values
HW_ID = "hw.id"
HW_NAME = "hw.name"
HW_VENDOR = "hw.vendor"
HW_VENDOR_NVIDIA = "NVIDIA"
HW_TYPE = "hw.type"
HW_TYPE_GPU = "gpu"
HW_PARENT = "hw.parent"
# On hw.gpu.io and hw.gpu.nvlink.io
NETWORK_IO_DIRECTION = "network.io.direction"
DIRECTION_TRANSMIT = "transmit"
DIRECTION_RECEIVE = "receive"
# error.type of hw.errors
ECC_CORRECTED = "corrected"
ECC_UNCORRECTED = "uncorrected"
PCIE_REPLAY = "pcie_replay"
XID = "xid"
# HW_GPU_THROTTLE_REASON's values on nvidia.gpu.throttle: NVML's clock event (throttle) reasons
THROTTLE_GPU_IDLE = "gpu_idle"
THROTTLE_APPLICATIONS_CLOCKS_SETTING = "applications_clocks_setting"
THROTTLE_SW_POWER_CAP = "sw_power_cap"
THROTTLE_HW_SLOWDOWN = "hw_slowdown"
THROTTLE_SYNC_BOOST = "sync_boost"
THROTTLE_SW_THERMAL_SLOWDOWN = "sw_thermal_slowdown"
THROTTLE_HW_THERMAL_SLOWDOWN = "hw_thermal_slowdown"
THROTTLE_HW_POWER_BRAKE_SLOWDOWN = "hw_power_brake_slowdown"
THROTTLE_DISPLAY_CLOCK_SETTING = "display_clock_setting"

# Host and process metrics: opentelemetry-instrumentation-system-metrics's own names, those the distro
# turns on (process: every rank; system: local rank 0 of each host)
METRIC_PROCESS_CPU_UTILIZATION = "process.cpu.utilization"
METRIC_PROCESS_MEMORY_USAGE = "process.memory.usage"
METRIC_PROCESS_THREAD_COUNT = "process.thread.count"
METRIC_PROCESS_OPEN_FILE_DESCRIPTOR_COUNT = "process.open_file_descriptor.count"
METRIC_SYSTEM_CPU_UTILIZATION = "system.cpu.utilization"
METRIC_SYSTEM_MEMORY_USAGE = "system.memory.usage"
METRIC_SYSTEM_MEMORY_UTILIZATION = "system.memory.utilization"
METRIC_SYSTEM_DISK_IO = "system.disk.io"
METRIC_SYSTEM_NETWORK_IO = "system.network.io"

# Telemetry about the telemetry (delivery.py): the SDK self-observability names of OpenTelemetry
METRIC_SPANS_EXPORTED = "otel.sdk.exporter.span.exported"
METRIC_SPANS_PROCESSED = "otel.sdk.processor.span.processed"
METRIC_POINTS_EXPORTED = "otel.sdk.exporter.metric_data_point.exported"
OTEL_COMPONENT_NAME = "otel.component.name"
ERROR_TYPE = "error.type"  # also on hw.errors

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

# Resource attributes (service.*, host.name, process.pid and k8s.* are OpenTelemetry's own)
SERVICE_NAME = "service.name"
SERVICE_INSTANCE_ID = "service.instance.id"
HOST_NAME = "host.name"
PROCESS_PID = "process.pid"
K8S_JOB_UID = "k8s.job.uid"  # read from OTEL_RESOURCE_ATTRIBUTES for the job id, never set
TRAINING_JOB_ID = "training.job.id"
TRAINING_RANK = "training.rank"
TRAINING_LOCAL_RANK = "training.local_rank"
TRAINING_WORLD_SIZE = "training.world_size"
# The status description of a step that no exception of its own ended: the process's exit during it (an exception in
# the loop's own code), or a signal (also a training.hang span's reason).
STATUS_EXITED = "the process exited during this step"
STATUS_UNFINISHED = "the program ended before this step's optimizer step"
STATUS_TERMINATED = "terminated by SIGTERM"
STATUS_INTERRUPTED = "interrupted by SIGINT"
# A training.hang report's reason where an uncaught exception ended the process with no step open.
STATUS_EXITED_BETWEEN = "the process exited between steps"
# The reasons of the last report an exit writes (with no step open: where the rank stopped, not a hang, when short).
HANG_EXIT_REASONS = (STATUS_TERMINATED, STATUS_INTERRUPTED, STATUS_EXITED_BETWEEN)
TRAINING_FRAMEWORK = "training.framework"
TRAINING_FRAMEWORK_DEEPSPEED = "deepspeed"  # its value
TRAINING_FRAMEWORK_PYTORCH = "pytorch"  # its value for a plain PyTorch loop (instrumentors/torch_loop.py)
DEEPSPEED_VERSION = "deepspeed.version"
# This rank's clock minus rank 0's, estimated at start through the process group's store (nanoseconds),
# and the half round trip that bounds the estimate's error
TRAINING_CLOCK_OFFSET = "training.clock.offset"
TRAINING_CLOCK_OFFSET_ERROR = "training.clock.offset.error"
