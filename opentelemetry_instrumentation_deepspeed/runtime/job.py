"""Who this process is in the training job: job id, rank, and the resource that says so."""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.runtime import clock
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env

_logger = logging.getLogger(__name__)

_STORE_KEY = "opentelemetry-instrumentation-deepspeed/job-id"


@dataclass(frozen=True)
class JobIdentity:
    job_id: str
    rank: int
    local_rank: int
    world_size: int
    clock: tuple[int, int] | None = None  # (offset, error) to rank 0's clock, nanoseconds (clock.py)

    def resource_attributes(self, extra: dict | None = None) -> dict[str, object]:
        """Ours (and ``extra``), less what the user set in ``OTEL_RESOURCE_ATTRIBUTES`` or ``OTEL_SERVICE_NAME``:
        theirs wins."""
        attributes: dict[str, object] = {
            semconv.SERVICE_NAME: _script_name(),
            semconv.SERVICE_INSTANCE_ID: f"{self.job_id}-rank{self.rank}",
            semconv.HOST_NAME: socket.gethostname(),
            semconv.PROCESS_PID: os.getpid(),
            semconv.TRAINING_JOB_ID: self.job_id,
            semconv.TRAINING_RANK: self.rank,
            semconv.TRAINING_LOCAL_RANK: self.local_rank,
            semconv.TRAINING_WORLD_SIZE: self.world_size,
            semconv.TRAINING_FRAMEWORK: semconv.TRAINING_FRAMEWORK_DEEPSPEED,
        }
        if self.clock is not None:
            attributes[semconv.TRAINING_CLOCK_OFFSET], attributes[semconv.TRAINING_CLOCK_OFFSET_ERROR] = self.clock
        deepspeed = sys.modules.get("deepspeed")
        if deepspeed is not None:
            attributes[semconv.DEEPSPEED_VERSION] = getattr(deepspeed, "__version__", "unknown")
        attributes.update(extra or {})
        user_keys = set(_user_resource_attributes())
        if os.environ.get("OTEL_SERVICE_NAME", "").strip():
            user_keys.add(semconv.SERVICE_NAME)
        return {key: value for key, value in attributes.items() if key not in user_keys}


def _user_resource_attributes() -> dict[str, str]:
    pairs = (pair.partition("=") for pair in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","))
    return {key.strip(): value.strip() for key, _, value in pairs if key.strip() and value.strip()}


def _script_name() -> str:
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    name = os.path.splitext(script)[0]
    return name if name and name != "-c" else "python"


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


def job_id_from_environment() -> str | None:
    """The run's id as the user, the launcher or the scheduler states it, if any does; an elastic agent's restart
    (or a Slurm requeue) is a run of its own: its steps count from the checkpoint again, and the same step numbers
    under the same id would share their traces with the attempt before."""
    found = _stated_job_id()
    if found is None:
        return None
    restarts = _env_int("TORCHELASTIC_RESTART_COUNT", 0) or _env_int("SLURM_RESTART_COUNT", 0)
    return f"{found}-restart{restarts}" if restarts > 0 else found


def _stated_job_id() -> str | None:
    configured = env.job_id() or _user_resource_attributes().get(semconv.TRAINING_JOB_ID)
    if configured:
        return configured
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id != "none":
        return run_id
    slurm_job = os.environ.get("SLURM_JOB_ID", "").strip()
    if slurm_job:
        # Several `srun` steps of one allocation are several runs.
        step = os.environ.get("SLURM_STEP_ID", "").strip()
        return f"slurm-{slurm_job}.{step}" if step else f"slurm-{slurm_job}"
    k8s_job = _user_resource_attributes().get(semconv.K8S_JOB_UID)
    if k8s_job:
        return f"k8s-{k8s_job}"
    return None


def _agree_through_store(rank: int) -> str | None:
    """Rank 0 publishes a fresh id in the process group's store; the others read it."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_available() or not dist.is_initialized():
        return None
    store = distributed_c10d._get_default_store()
    if rank == 0:
        job_id = uuid.uuid4().hex
        store.set(_STORE_KEY, job_id)
        return job_id
    timeout = env.job_id_timeout()
    try:
        store.wait([_STORE_KEY], timedelta(seconds=timeout))
    except RuntimeError:
        _logger.warning(
            "Rank %d did not get the job id from rank 0 within %s s (%s); it uses one of its own, "
            "so its traces will not join the other ranks'.",
            rank, timeout, env.OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT,
        )
        return None
    return store.get(_STORE_KEY).decode()


def identify() -> JobIdentity:
    """This process's place in the job; collective when the job id must be agreed on."""
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = _env_int("LOCAL_RANK", rank)
    clock.apply_test_skew(rank)
    job_id = job_id_from_environment()
    if job_id is None:
        try:
            job_id = _agree_through_store(rank)
        except Exception:
            _logger.warning("Could not agree on a job id through the process group's store", exc_info=True)
    job_id = job_id or uuid.uuid4().hex
    return JobIdentity(job_id, rank, local_rank, world_size, _clock_offset(job_id, rank, world_size))


def _clock_offset(job_id: str, rank: int, world_size: int) -> tuple[int, int] | None:
    dist = sys.modules.get("torch.distributed")
    if world_size < 2 or dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        found = clock.estimate(store, job_id, rank, world_size)
        clock.keep_fresh(store, job_id, rank, world_size)  # on a thread of its own, from now on
        return found
    except Exception:  # only the alignment of this rank's times is lost
        _logger.debug("No clock offset to rank 0", exc_info=True)
        return None
