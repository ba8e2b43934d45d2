#!/usr/bin/env bash
# Installs everything the tests need, then runs them in lanes: ruff; the fast unit lane
# (pytest -m "not slow") on the lowest OpenTelemetry releases we allow (scripts/otel-lowest.txt),
# then on the newest; then the slow lane (real DeepSpeed jobs on CPU, 1 and 2 ranks) on the newest.
# Arguments go to every pytest lane: bash scripts/test.sh -k comm
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

# The lowest releases go into .venv and back out (pip's cache: a few seconds each way), which is
# much quicker than a second venv with its own torch and DeepSpeed.
otel_packages=$(sed -n 's/^\([a-z][a-z0-9-]*\)==.*/\1/p' scripts/otel-lowest.txt)
newest_otel() { pip install --quiet --upgrade $otel_packages -e . && pip check >/dev/null; }
given=$#
lane() {
  local name=$1 started=$SECONDS status=0
  shift
  echo "== $name lane, opentelemetry-sdk $(python -c 'from importlib.metadata import version; print(version("opentelemetry-sdk"))')"
  python -m pytest -q "$@" || status=$?
  echo "== $name lane: $((SECONDS - started)) s"
  # 5: the arguments given select no test of this lane.
  [ "$status" = 0 ] || { [ "$status" = 5 ] && [ "$given" -gt 0 ]; } || return "$status"
}

pip install --quiet -r scripts/otel-lowest.txt && pip check >/dev/null
trap newest_otel EXIT  # the venv goes back to the newest releases even when this lane fails
lane fast -m "not slow" "$@"
trap - EXIT
newest_otel
lane fast -m "not slow" "$@"
lane slow -m slow "$@"
