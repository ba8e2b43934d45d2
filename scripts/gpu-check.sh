#!/usr/bin/env bash
# Every GPU-dependent test, on a machine with a CUDA GPU, in well under 5 minutes.
# Needs a CUDA build of torch: this script installs the default one from PyPI into .venv-gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-gpu/bin/python ]; then
  python3 -m venv .venv-gpu
fi
. .venv-gpu/bin/activate
pip install --quiet --upgrade pip
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
  || pip install --quiet torch
DS_BUILD_OPS=0 pip install --quiet -e ".[test]" deepspeed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
export OMP_NUM_THREADS=4
timeout 290 python -m pytest -v -s tests/gpu "$@"
