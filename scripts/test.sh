#!/usr/bin/env bash
# Installs everything the tests need, then runs them: real DeepSpeed jobs on CPU, 1 and 2 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# A real Prometheus for the metrics tests (Debian's 2.42), when this machine can install it.
if ! command -v prometheus >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
    >/dev/null 2>&1 || echo "could not install prometheus; its tests will be skipped"
fi
. .venv/bin/activate
export OMP_NUM_THREADS=1
ruff check .
python -m pytest -q "$@"
