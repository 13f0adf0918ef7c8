#!/usr/bin/env bash
# The GPU check of the Pallas kernels (issue: Pallas attention kernels). Needs only this
# tree and an installed jax with GPU support; prints one table, writes
# benchmarks/results/gpu_check.json. On a CPU machine: bash benchmarks/gpu_check.sh --smoke
set -euo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false
exec python3 benchmarks/gpu_check.py "$@"
