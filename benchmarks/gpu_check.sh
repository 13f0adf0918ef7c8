#!/usr/bin/env bash
# The GPU check of the Pallas kernels (issue: Pallas attention kernels). Needs only this
# tree and an installed jax with GPU support; prints one table, writes
# benchmarks/results/gpu_check.json (and, on a GPU, the simulator's calibration).
# On a CPU machine: bash benchmarks/gpu_check.sh --smoke
set -euo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 benchmarks/gpu_check.py "$@"
# On a GPU, also record the serving programs' step times for the simulator
# (benchmarks/plan_study.py takes its per-call overhead from this file).
if [[ " $* " != *" --smoke "* ]]; then
  python3 -m jaxdisagg.cli simulate --config configs/gpu-1-colocated.yaml \
    --calibrate benchmarks/results/calibration_gpu_llama3.2-1b.json
fi
