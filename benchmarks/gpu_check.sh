#!/usr/bin/env bash
# The GPU check, for one lent GPU; `e2e` (about 450 s on an H200 on 2026-12-04) and
# `kernels` each fit one 10-minute call, `all` needs longer. Greedy tokens against the
# CPU reference, in one process and in a two-process deployment sharing the GPU
# (benchmarks/gpu_e2e.py), then the Pallas kernels (benchmarks/gpu_check.py: correctness
# on every real head layout, a launch-shape sweep that updates
# jaxdisagg/pallas/tuned_blocks.json, speed beside JAX's own kernels and cuDNN), then
# whole-model step times against their floors and the simulator's calibration. Every
# part prints as it goes and writes its JSON when it ends; each has its own time limit,
# so one that hangs cannot take the others with it.
#
#   bash benchmarks/gpu_check.sh [kernels|e2e|all] [--smoke]
#
# Results and the log (gpu_check.log) go to $GPU_CHECK_OUT (default benchmarks/results).
# On a CPU machine, `--smoke` runs every path at toy shapes (interpret mode).
set -uo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=${GPU_CHECK_OUT:-benchmarks/results}
what=all smoke=()
for a in "$@"; do case $a in --smoke) smoke=(--smoke) ;; *) what=$a ;; esac; done
mkdir -p "$out"
# The log goes to the output folder line by line as well: a run cut short by an outer
# time limit keeps everything printed before the cut.
exec > >(tee -a "$out/gpu_check.log") 2>&1
py=${PYTHON:-python3}  # the interpreter with jax installed
"$py" -c 'import jax, flax, grpc, google.protobuf as pb; print("jax", jax.__version__,
  jax.devices(), "flax", flax.__version__, "grpc", grpc.__version__, "protobuf", pb.__version__)'
rc=0
part() {  # part SECONDS COMMAND...: runs it, reports a timeout or failure, goes on
  local limit=$1; shift
  echo "=== $* (limit ${limit}s)"
  timeout "$limit" "$@" || { echo "=== exit $? from: $*"; rc=1; }
}
# In `all`, the end-to-end token checks run first: they are the correctness anchor, and
# a run cut short by the lease keeps them. Then the kernels, then the timings.
if [[ $what == e2e || $what == all ]]; then
  part 120 "$py" benchmarks/gpu_e2e.py tokens --out-dir "$out" "${smoke[@]}"
  part 300 "$py" benchmarks/gpu_e2e.py disagg --out-dir "$out" "${smoke[@]}"
fi
if [[ $what == kernels || $what == all ]]; then
  part 270 "$py" benchmarks/gpu_check.py --resume --out "$out/gpu_check.json" "${smoke[@]}"
  cp jaxdisagg/pallas/tuned_blocks.json "$out/" 2>/dev/null
fi
if [[ $what == e2e || $what == all ]]; then
  part 120 "$py" benchmarks/gpu_e2e.py steps --out-dir "$out" "${smoke[@]}"
  if [[ ${#smoke[@]} -eq 0 ]]; then  # the serving programs' step times, for the simulator
    part 90 "$py" -m jaxdisagg.cli simulate --config configs/gpu-1-colocated.yaml \
      --calibrate "$out/calibration_gpu_llama3.2-1b.json"
  fi
fi
exit $rc
