#!/usr/bin/env bash
# The wheels scripts/gpu-check.sh installs on a GPU machine that reaches no package registry: run it here
# (PyPI reachable), then carry .whl/ there. Versions are .venv's (scripts/setup.sh), the ones CI tests; binaries
# are for that machine's CPython (GPU_PYTHON, default 3.12) on x86-64. What its image holds already (torch,
# pytest, numpy, psutil, wrapt, requests, nvidia-ml-py, ...) is not carried.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
python=.venv/bin/python
rm -rf .whl && mkdir .whl
pins=$($python - <<'PY'
import importlib.metadata as metadata

ours = "opentelemetry-instrumentation-deepspeed"
names = {d.metadata["Name"].lower().replace("_", "-") for d in metadata.distributions()}
wanted = sorted(n for n in names if n.startswith("opentelemetry-") and n != ours)
wanted += ["hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
           "protobuf", "googleapis-common-protos"]
print(" ".join(f"{name}=={metadata.version(name)}" for name in wanted))
PY
)
# shellcheck disable=SC2086 - one argument per pin
$python -m pip download --quiet --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $pins
# DeepSpeed publishes no wheel: built here, without its compiled ops (they build on first use, if ever).
DS_BUILD_OPS=0 $python -m pip wheel --quiet --no-deps --no-build-isolation -w .whl \
  "deepspeed==$($python -c 'import importlib.metadata as m; print(m.version("deepspeed"))')"
$python -m pip wheel --quiet --no-deps -w .whl .
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
