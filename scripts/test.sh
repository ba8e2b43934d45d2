#!/usr/bin/env bash
# Installs everything the tests need, then runs them: real DeepSpeed jobs on CPU, 1 and 2 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
ruff check .
python -m pytest -q "$@"
