"""What a rank that dies in native code leaves: the Python stack of each of its threads.

A fault in native code (SIGSEGV in an extension or a communication library, SIGABRT from a failed
check, SIGBUS, SIGFPE, SIGILL) kills a rank before any handler of ours can run: no span says where it
was, and what it had not exported goes with it. Python's ``faulthandler`` writes every thread's
stack from the signal handler itself, with no allocation and no lock. With the local files, it
writes them to ``native-crash-rank<N>.txt`` beside the rank's other files, after one JSON line that
names the job and the rank (``diagnose`` reads both). The rank's exit stages (a normal exit, or one
by a signal they see) remove the file; a rank killed otherwise (SIGKILL, ``os._exit``) leaves it with
that line alone. A program that enabled ``faulthandler`` before the SDK's start (torch.distributed.elastic's
``@record`` does) keeps its own; one that enables it later replaces ours, until the exit stages turn it off. A
forked child (a DataLoader worker) writes nothing there: its crash is the rank's exception, from its loader.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os

from opentelemetry_instrumentation_deepspeed.export import output
from opentelemetry_instrumentation_deepspeed.runtime import lifecycle
from opentelemetry_instrumentation_deepspeed.runtime.job import JobIdentity

_logger = logging.getLogger(__name__)

FILE = "native-crash-rank{rank}.txt"

_file = None  # open for as long as faulthandler writes into it


def watch(identity: JobIdentity) -> None:
    global _file  # noqa: PLW0603 - one per process
    if _file is not None or faulthandler.is_enabled():
        return
    folder = output.directory()
    if folder is None:
        return
    path = (folder / FILE.format(rank=identity.rank)).absolute()  # removed at exit, whatever the directory then
    try:
        _file = path.open("w", encoding="utf-8")
        _file.write(json.dumps({"job": identity.job_id, "rank": identity.rank, "pid": os.getpid()}) + "\n")
        _file.flush()
        faulthandler.enable(_file, all_threads=True)
    except (OSError, ValueError, RuntimeError) as error:
        _logger.warning("opentelemetry-instrumentation-deepspeed: %s: %s; a crash in native code will leave no Python "
                        "stack there", path, error)
        _close(remove=True)
        return
    lifecycle.at_exit(lifecycle.STOP_FAULT_HANDLER, lambda _reason: _close(remove=True))
    lifecycle.in_forked_child(lifecycle.SILENCE, lambda: _close(remove=False))


def _close(remove: bool) -> None:
    """Ours no more: faulthandler off, the file closed, and removed where this process made it (not a child's)."""
    global _file
    taken, _file = _file, None
    if taken is None:
        return
    faulthandler.disable()
    try:
        taken.close()
        if remove:
            os.unlink(taken.name)
    except OSError:
        pass
