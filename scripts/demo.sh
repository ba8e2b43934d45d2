#!/usr/bin/env bash
# Installs, then trains the example on 2 CPU ranks under opentelemetry-instrument.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
# A data loader that stalls every 10th step: the diagnosis below should find it.
opentelemetry-instrument deepspeed --num_gpus 2 examples/train.py --steps 40 --zero-stage 2 --grad-accum 2 \
  --stall-every 10 --stall-ms 300 "$@"
job="$(ls -td telemetry/*/ | head -n 1)"
echo
echo "Telemetry of this run (OTLP JSON lines, one file per rank and signal): $job"
opentelemetry-deepspeed diagnose "$job" --html diagnosis.html
echo "Report: $(pwd)/diagnosis.html"
