#!/usr/bin/env bash
# Every GPU-dependent test, on a machine with a CUDA GPU, in well under 5 minutes.
# With .whl/ present (scripts/gpu-wheels.sh, carried to a machine that reaches no registry): its wheels go to a
# folder on PYTHONPATH, beside the python3 that holds a CUDA torch. Otherwise .venv-gpu, installed from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  site=/tmp/otel-deepspeed-gpu-site
  python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" TEST_BIN="$site/bin"
  python=python3
else
  [ -x .venv-gpu/bin/python ] || python3 -m venv .venv-gpu
  python=.venv-gpu/bin/python
  $python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
    || $python -m pip install --quiet torch
  DS_BUILD_OPS=0 $python -m pip install --quiet -e ".[test]" deepspeed
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
$python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
export OMP_NUM_THREADS=4
timeout 290 $python -m pytest -v -s -p no:cacheprovider tests/gpu "$@"
