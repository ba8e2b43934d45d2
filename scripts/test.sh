#!/usr/bin/env bash
# Installs everything the tests need, then runs them: real DeepSpeed jobs on CPU, 1 and 2 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# A real Prometheus for the metrics tests (Debian's 2.42) and Chromium for the HTML report's,
# when this machine can install them.
missing=""
command -v prometheus >/dev/null || missing="$missing prometheus"
command -v chromium >/dev/null || missing="$missing chromium"
if [ -n "$missing" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing) \
    >/dev/null 2>&1 || echo "could not install$missing; their tests will be skipped"
fi
. .venv/bin/activate
export OMP_NUM_THREADS=1
ruff check .
python -m pytest -q "$@"
