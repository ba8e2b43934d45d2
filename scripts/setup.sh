#!/usr/bin/env bash
# Creates .venv with the CPU build of torch, DeepSpeed without compiled ops, and this project.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
pip install --quiet --upgrade pip
# torch==2.13.0 is the CPU wheel on this machine; an unpinned torch would pull a CUDA build.
pip install --quiet torch==2.13.0
DS_BUILD_OPS=0 pip install --quiet -e ".[instruments,test]"
