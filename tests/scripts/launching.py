"""``tests.conftest.launch`` for a script other than the example: the same launchers and environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import BIN, Run, clean_env, free_port
from tests.otlp_json import read_spans

SCRIPTS = Path(__file__).resolve().parent


def launch_script(cwd: Path, script: str, launcher: str, *args: str, instrument: bool = True,
                  env: dict | None = None, timeout: float = 240) -> Run:
    """Run ``tests/scripts/<script>`` with ``python`` (1 process) or ``torchrun`` (2 ranks)."""
    path = str(SCRIPTS / script)
    port = str(free_port())
    if launcher == "python":
        command = [sys.executable, path]
        env = {"MASTER_PORT": port, **(env or {})}
    elif launcher == "torchrun":
        command = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", port, path]
    else:
        raise ValueError(launcher)
    if instrument:
        command = [str(BIN / "opentelemetry-instrument"), *command]
    command += list(args)
    completed = subprocess.run(command, cwd=cwd, env=clean_env(**(env or {})), capture_output=True, text=True,
                               timeout=timeout, check=False)
    run = Run(command, completed.returncode, completed.stdout, completed.stderr, cwd)
    run.trace_files = sorted(cwd.glob("telemetry/*/traces-rank*.jsonl"))
    for trace_file in run.trace_files:
        run.spans.extend(read_spans(trace_file))
    return run
