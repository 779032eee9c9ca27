#!/usr/bin/env bash
# The next GPU session's one prepared call (docs/gpu.md, "One prepared call"): what issues 31
# and 32 left to measure on a GPU, each step under its own time limit so one that hangs does
# not take the rest, in about 8 minutes of a 15-minute device budget.
#   1. the fused quantizer's bytes, every recipe's Linear against the CPU, and the block-FP8
#      serving checkpoints through the block-scaled GEMM (tests/gpu);
#   2. one Linear's forward+backward at 16384x8192x8192 and 4096^3 per recipe against bf16,
#      the launch counts, and fp8train's AdamW against torch's fused one (bench_gpu.py).
# Usage (repository root):  benchmarks/gpu_session.sh          on the CUDA device
#                           benchmarks/gpu_session.sh cpu      a dry run here, at small sizes (--quick)
# Writes bench.json under $OUT (the device tool's folder) or benchmarks/gpu_session/.
set -uo pipefail
cd "$(dirname "$0")/.."
device=${1:-cuda}
out=${OUT:-benchmarks/gpu_session}
mkdir -p "$out"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"

step() {
    local limit=$1 start=$SECONDS rc
    shift
    echo "=== $* (limit ${limit} s)"
    timeout "$limit" "$@"
    rc=$?
    echo "=== exit $rc after $((SECONDS - start)) s"
}

sizes=(16384x8192x8192 4096x4096x4096)
bench_flags=(--skip-compare --skip-compile --recipes tensorwise,delayed,rowwise,rowwise_with_gw_hp,blockwise,mxfp8)
[ "$device" = cuda ] || { sizes=(512x256x256 256x128x128); bench_flags+=(--quick); }
step 240 python -m pytest -m gpu -q -p no:cacheprovider --gpu-suite-device "$device" \
    tests/gpu/test_quantize_kernel.py tests/gpu/test_linear.py tests/gpu/test_serving.py
step 240 python benchmarks/bench_gpu.py --device "$device" --sizes "${sizes[@]}" "${bench_flags[@]}" \
    --json "$out/bench.json"
