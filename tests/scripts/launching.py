"""``tests.conftest.launch`` for a script of tests/scripts: the same launchers and environment."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import Run, launch

SCRIPTS = Path(__file__).resolve().parent


def launch_script(cwd: Path, script: str, launcher: str, *args: str, instrument: bool = True,
                  env: dict | None = None, timeout: float = 240) -> Run:
    """Run ``tests/scripts/<script>`` with ``python`` (1 process), or ``torchrun`` or ``accelerate`` (2 ranks)."""
    return launch(cwd, launcher, *args, instrument=instrument, env=env, timeout=timeout, script=SCRIPTS / script)
