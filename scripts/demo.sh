#!/usr/bin/env bash
# Installs, then trains the example on 2 CPU ranks under opentelemetry-instrument.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
opentelemetry-instrument deepspeed --num_gpus 2 examples/train.py --steps 30 --zero-stage 2 --grad-accum 2 "$@"
echo
echo "Telemetry of this run (OTLP JSON lines, one file per rank and signal):"
ls -l "$(ls -td telemetry/*/ | head -n 1)"
