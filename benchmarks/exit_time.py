"""How much later a rank exits, instrumented, whatever the collector does; and how fast it dies on SIGTERM.

Each arm runs ``examples/train.py`` on 2 ranks under ``torchrun --nproc_per_node 2`` with the
OTLP exporter's defaults (no timeout or batch variable set), traces and metrics going to a
loopback collector that misbehaves:

- ``bare``: no OpenTelemetry (the reference);
- ``healthy``: a real OTLP/HTTP receiver that accepts everything;
- ``refused``: a port nobody listens on;
- ``black-hole``: a server that accepts connections and never answers;
- ``503`` / ``429``: a server answering every request with that status (retried by the exporter);
- ``slow``: a server answering after 3 s;
- ``grpc-black-hole``, ``grpc-refused``: the same over OTLP/gRPC (the exporter's default protocol);
- ``not-a-url``: ``OTEL_EXPORTER_OTLP_ENDPOINT="not a url"`` over gRPC.

``--profile-every 1`` makes every step a profiled one (hundreds of spans per step): many spans
are then queued when the process exits.

Two figures per run: ``run``, the launcher's wall time; ``tail``, from the moment rank 0 printed
its last line (training done) to the launcher's exit, which is where a failing collector costs
time. The extra exit time of an arm is its median tail minus bare's. ``--sigterm`` instead sends
SIGTERM to rank 1 once training is under way (steps made slow with the example's straggler
option) and reports how long that rank took to die. ``--sigterm --block-in-native`` sends it to
rank 0 while its training thread is blocked in native code (gloo's all-reduce, waiting for rank 1,
which hangs in the forward of step 8 for good), where the Python handler cannot run: the hang
watchdog's thread takes over after ``lifecycle.GRACE_SECONDS``.

    OMP_NUM_THREADS=1 python benchmarks/exit_time.py --rounds 2
    OMP_NUM_THREADS=1 python benchmarks/exit_time.py --arms bare black-hole --profile-every 1
    OMP_NUM_THREADS=1 python benchmarks/exit_time.py --sigterm --arms bare black-hole
    OMP_NUM_THREADS=1 python benchmarks/exit_time.py --sigterm --block-in-native --arms bare black-hole

Arms run interleaved, one run of each per round. The machine's load changes every figure: read
the differences to ``bare`` of the same sitting, never one run's seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import BIN, TRAIN, clean_env, free_port, rank_process  # noqa: E402
from tests.otlp_receiver import Misbehaving, OtlpReceiver, SilentSocket  # noqa: E402

ARMS = ("bare", "healthy", "refused", "black-hole", "503", "429", "slow", "grpc-refused", "grpc-black-hole",
        "not-a-url")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile-every", type=int, default=0, help="OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY")
    parser.add_argument("--sigterm", action="store_true", help="time a rank's death after SIGTERM instead")
    parser.add_argument("--block-in-native", action="store_true",
                        help="with --sigterm: signal rank 0 while it waits in a collective for a hung rank 1")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra variables for the instrumented arms")
    parser.add_argument("--json", help="write every run's figures here")
    return parser.parse_args(argv)


class _Collector:
    """The collector of one arm: (environment for the run, close())."""

    def __init__(self, arm: str):
        self.server = None
        http = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
        if arm in ("bare",):
            self.env = {}
        elif arm == "healthy":
            self.server = OtlpReceiver().__enter__()
            self.env = {**http, "OTEL_EXPORTER_OTLP_ENDPOINT": self.server.endpoint}
        elif arm in ("refused", "grpc-refused"):
            self.env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
                        **(http if arm == "refused" else {})}
        elif arm == "grpc-black-hole":
            self.server = SilentSocket()
            self.env = {"OTEL_EXPORTER_OTLP_ENDPOINT": self.server.endpoint}
        elif arm == "not-a-url":
            self.env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "not a url"}
        else:
            status = {"black-hole": None, "503": 503, "429": 429, "slow": 200}[arm]
            self.server = Misbehaving(status, delay=3.0 if arm == "slow" else 0.0)
            self.env = {**http, "OTEL_EXPORTER_OTLP_ENDPOINT": self.server.endpoint}

    def close(self):
        if self.server is not None:
            if hasattr(self.server, "close"):
                self.server.close()
            else:
                self.server.__exit__(None, None, None)


def _command(arm: str, steps: int, extra: list[str]) -> list[str]:
    command = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), str(TRAIN),
               "--steps", str(steps), *extra]
    return command if arm == "bare" else [str(BIN / "opentelemetry-instrument"), *command]


def one_run(arm: str, args, workdir: Path) -> dict:
    collector = _Collector(arm)
    env = dict(collector.env)
    if arm != "bare":
        env.update(item.split("=", 1) for item in args.env)
        if args.profile_every:
            env["OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY"] = str(args.profile_every)
    try:
        if args.sigterm:
            return _sigterm_run(arm, args, workdir, env)
        started = time.monotonic()
        process = subprocess.Popen(_command(arm, args.steps, []), cwd=workdir, env=clean_env(**env),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        trained_at, lines = None, []
        for line in process.stdout:
            lines.append(line)
            if "trained " in line and " steps (" in line:
                trained_at = time.monotonic()
        process.wait()
        ended = time.monotonic()
        if process.returncode != 0 or trained_at is None:
            sys.stderr.write("".join(lines[-40:]))
            raise SystemExit(f"{arm}: exit status {process.returncode}")
        lost = [line.strip() for line in lines if "were not delivered" in line]
        return {"arm": arm, "run": ended - started, "tail": ended - trained_at, "loss_lines": lost}
    finally:
        collector.close()


HUNG_STEP = 8


def _sigterm_run(arm: str, args, workdir: Path, env: dict) -> dict:
    if args.block_in_native:
        return _sigterm_in_native_run(arm, workdir, env)

    # Rank 1 computes 200 ms longer per forward: the signal lands inside a step.
    process = subprocess.Popen(_command(arm, 100_000, ["--slow-rank", "1", "--slow-ms", "200"]), cwd=workdir,
                               env=clean_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        rank = rank_process(process.pid, 1, timeout=240)
        time.sleep(25)  # past start-up and a few steps (and, instrumented, a few failed exports)
        died = _sigterm_and_time(rank, process, reader)
        lost = [line.strip() for line in lines if "were not delivered" in line]
        return {"arm": arm, "sigterm_to_death": died, "loss_lines": lost}
    finally:
        process.kill()


def _sigterm_and_time(rank, process: subprocess.Popen, reader: threading.Thread) -> float:
    """SIGTERM to ``rank`` (a ``psutil.Process``): seconds until it died; then the launcher's end."""
    import psutil

    sent = time.monotonic()
    rank.send_signal(signal.SIGTERM)
    with contextlib.suppress(psutil.TimeoutExpired):
        rank.wait(timeout=120)
    died = time.monotonic() - sent
    process.wait(timeout=120)
    reader.join(timeout=5)
    return died


def _sigterm_in_native_run(arm: str, workdir: Path, env: dict) -> dict:
    # Rank 1 blocks for good in the forward of HUNG_STEP; rank 0 goes on to that step's gradient
    # all-reduce and waits there, inside gloo. The hang threshold (30 s) is far off when the signal lands.
    extra = ["--print-steps", "--hang-rank", "1", "--hang-step", str(HUNG_STEP), "--hang-phase", "forward"]
    process = subprocess.Popen(_command(arm, 100, extra), cwd=workdir, env=clean_env(**env),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith(f"step {HUNG_STEP - 1} rank 0 "):
                break
        else:
            raise SystemExit(f"{arm}: the run ended before step {HUNG_STEP}: " + "".join(lines[-40:]))
        reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
        reader.start()
        rank0 = rank_process(process.pid, 0)
        # Well past rank 0's forward of the hung step, into the all-reduce (a few ms on a quiet machine).
        time.sleep(5)
        died = _sigterm_and_time(rank0, process, reader)
    finally:
        process.kill()
    output = "".join(lines)
    # Instrumented, the watchdog says it took over: proof that the handler could not run, i.e. the
    # thread was blocked in native code when the signal came.
    if arm != "bare" and "SIGTERM while the training thread is blocked" not in output:
        sys.stderr.write(output[-4000:])
        raise SystemExit(f"{arm}: the watchdog did not take over")
    lost = [line.strip() for line in lines if "were not delivered" in line]
    return {"arm": arm, "sigterm_to_death": died, "loss_lines": lost}


def main(argv=None) -> None:
    args = parse_args(argv)
    results = []
    for round_ in range(args.rounds):
        order = args.arms[round_ % len(args.arms):] + args.arms[:round_ % len(args.arms)]
        for arm in order:
            with tempfile.TemporaryDirectory() as workdir:
                result = one_run(arm, args, Path(workdir))
            result["load"] = os.getloadavg()[0]
            results.append(result)
            figures = {key: round(value, 2) for key, value in result.items() if isinstance(value, float)}
            print(json.dumps({"round": round_, "arm": arm, **figures}), flush=True)
            for line in result["loss_lines"]:
                print("   ", line[:300], flush=True)
    key = "sigterm_to_death" if args.sigterm else "tail"
    bare = [result[key] for result in results if result["arm"] == "bare"]
    print(f"\nmedian {key} (s), and over bare's median:")
    for arm in args.arms:
        values = [result[key] for result in results if result["arm"] == arm]
        over = f"  +{statistics.median(values) - statistics.median(bare):.2f}" if bare and arm != "bare" else ""
        runs = [result["run"] for result in results if result["arm"] == arm and "run" in result]
        whole = f"  (whole run {statistics.median(runs):.1f} s)" if runs else ""
        print(f"  {arm:16} {statistics.median(values):6.2f}{over}{whole}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
