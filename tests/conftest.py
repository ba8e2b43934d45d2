"""Runs of the real example through the real launchers, under ``opentelemetry-instrument``.

Tests that start real DeepSpeed are marked ``slow``; ``pytest -m "not slow"`` is the fast unit lane.
``launch()`` refuses to run in a test that is not marked ``slow``, so the fast lane cannot rot.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.otlp_json import Span, read_spans

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train.py"
# The interpreter's scripts, or those of the packages scripts/gpu-check.sh puts on PYTHONPATH of a GPU machine.
BIN = Path(os.environ.get("TEST_BIN") or Path(sys.executable).parent)
# Our variables and the SDK's must come from each test alone.
_INHERITED_PREFIXES = ("OTEL_", "TORCHELASTIC_", "SLURM_")
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


_PORTS = random.SystemRandom()  # not the global generator, which a test may seed: suites side by side would agree


def _ephemeral_ports() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def rank_process(launcher_pid: int, rank: int, timeout: float = 0.0):
    """The process under the launcher ``launcher_pid`` that trains as ``rank`` (a ``psutil.Process``), waiting
    up to ``timeout`` seconds for it to start."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        for child in psutil.Process(launcher_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.environ().get("RANK") == str(rank) and "train.py" in " ".join(child.cmdline()):
                    return child
        if time.monotonic() >= deadline:
            raise AssertionError(f"no rank {rank} under process {launcher_pid}")
        time.sleep(0.5)


def free_port() -> int:
    """A loopback port free now, from below the kernel's ephemeral range.

    A port is chosen seconds before the job binds it (DeepSpeed's rendezvous, after its imports: a
    minute on a loaded machine). One from the ephemeral range (bind to port 0) can be handed to any
    outgoing connection on the machine meanwhile, and the job then fails with EADDRINUSE (seen with
    several test suites running at once); below that range only a listener picked the same way can
    take it, one chance in thousands."""
    ephemeral = _ephemeral_ports()
    candidates = range(10000, ephemeral.start) if ephemeral.start > 12000 else range(ephemeral.stop, 65536)
    for _ in range(200):
        port = _PORTS.choice(candidates)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # every try taken: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**overrides: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(_INHERITED_PREFIXES) and key not in _RANK_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    # DeepSpeed's CPU build caches JIT extensions here; the example needs none, but keep it stable.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    env.update(overrides)
    return env


@dataclass
class Run:
    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    cwd: Path
    spans: list[Span] = field(default_factory=list)
    trace_files: list[Path] = field(default_factory=list)

    def check(self) -> Run:
        assert self.returncode == 0, f"{' '.join(self.command)} failed:\n{self.stdout[-3000:]}\n{self.stderr[-6000:]}"
        return self

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def by_rank(self) -> dict[int, list[Span]]:
        ranks: dict[int, list[Span]] = {}
        for span in self.spans:
            ranks.setdefault(span.resource["training.rank"], []).append(span)
        return ranks

    def trained(self) -> tuple[int, int]:
        """(steps, skipped) as DeepSpeed itself counted them, from the example's last line."""
        match = re.search(r"trained (\d+) steps \((\d+) skipped\)", self.output)
        assert match, self.output[-2000:]
        return int(match.group(1)), int(match.group(2))


# Whether the running test, and the fixtures set up for it, may start DeepSpeed: set before each test's set-up.
_running = {"slow": True}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _running["slow"] = item.get_closest_marker("slow") is not None


def launch(cwd: Path, launcher: str, *train_args: str, instrument: bool = True, env: dict | None = None,
           timeout: float = 300, script: Path = TRAIN) -> Run:
    """Run examples/train.py (or ``script``) as a user would: ``python``, or ``deepspeed``, ``torchrun`` or
    ``accelerate`` (``accelerate launch --use_deepspeed``) with 2 ranks."""
    if not _running["slow"]:
        pytest.fail("launch() starts real DeepSpeed: mark this test (or its module) with pytest.mark.slow",
                    pytrace=False)
    port = str(free_port())
    if launcher == "python":
        command = [sys.executable, str(script)]
        env = {"MASTER_PORT": port, **(env or {})}
    elif launcher == "deepspeed":
        command = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", port, str(script)]
    elif launcher == "torchrun":
        command = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", port, str(script)]
    elif launcher == "accelerate":  # Accelerate's DeepSpeed launcher: 2 processes through torchrun's machinery
        command = [str(BIN / "accelerate"), "launch", "--use_deepspeed", "--num_processes", "2", "--num_machines", "1",
                   "--main_process_port", port, "--mixed_precision", "no", "--dynamo_backend", "no", str(script)]
    else:
        raise ValueError(launcher)
    if instrument:
        command = [str(BIN / "opentelemetry-instrument"), *command]
    command += list(train_args)
    completed = subprocess.run(command, cwd=cwd, env=clean_env(**(env or {})), capture_output=True, text=True,
                               timeout=timeout, check=False)
    run = Run(command, completed.returncode, completed.stdout, completed.stderr, cwd)
    run.trace_files = sorted(cwd.glob("telemetry/*/traces-rank*.jsonl"))
    for path in run.trace_files:
        run.spans.extend(read_spans(path))
    return run


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("runs")
    yield path
    shutil.rmtree(path, ignore_errors=True)
