#!/usr/bin/env bash
# The next GPU session's one prepared call (docs/gpu.md, "One prepared call"): what issue 38
# (and issues 31 and 32 before it) left to measure on a GPU, each step under its own time limit
# so one that hangs does not take the rest, in about 11 minutes of a 15-minute device budget.
#   1. whole steps in CUDA graphs against eager steps, bit for bit, every recipe; the fused
#      quantizer's bytes, every recipe's Linear against the CPU, the serving checkpoints
#      (tests/gpu);
#   2. one Linear's forward+backward at 4096^3 and 16384x8192x8192 per recipe against bf16,
#      the launch counts, and fp8train's AdamW against torch's fused one (bench_gpu.py);
#   3. fp8train compare at issue 38's shape (n_embd 2048, 8 layers, 16 x 1024 tokens): eager
#      and with CUDA graphs for tensorwise, delayed and rowwise; compiled, and compiled with
#      CUDA graphs, for tensorwise; each against bf16 in the same mode;
#   4. compiled steps with CUDA graphs against compiled eager steps, tensorwise, delayed and
#      nvfp4 (tests/gpu; the suite's full run takes every recipe).
# Usage (repository root):  benchmarks/gpu_session.sh          on the CUDA device
#                           benchmarks/gpu_session.sh cpu      a dry run here, at small sizes (--quick)
# Writes bench_linear.json and bench_compare*.json under $OUT (the device tool's folder) or
# benchmarks/gpu_session/.
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

sizes=(4096x4096x4096 16384x8192x8192)
linear_flags=(--sections linear,counts,optimizer --skip-compile
              --recipes tensorwise,delayed,rowwise,rowwise_with_gw_hp,blockwise,mxfp8)
compare_shape=(--compare-width 2048 --compare-layers 8 --compare-seq-len 1024 --compare-steps 20)
if [ "$device" != cuda ]; then
    sizes=(256x128x128)
    linear_flags+=(--quick)
    compare_shape=(--quick)
fi
step 150 python -m pytest -m gpu -q -p no:cacheprovider --gpu-suite-device "$device" \
    tests/gpu/test_cuda_graphs.py -k "not compiled"
step 120 python -m pytest -m gpu -q -p no:cacheprovider --gpu-suite-device "$device" \
    tests/gpu/test_quantize_kernel.py tests/gpu/test_linear.py
step 150 python benchmarks/bench_gpu.py --device "$device" --sizes "${sizes[@]}" "${linear_flags[@]}" \
    --json "$out/bench_linear.json"
step 120 python benchmarks/bench_gpu.py --device "$device" --sections compare --recipes tensorwise,delayed,rowwise \
    --compare-modes eager,graphs "${compare_shape[@]}" --json "$out/bench_compare.json"
step 120 python benchmarks/bench_gpu.py --device "$device" --sections compare --recipes tensorwise \
    --compare-modes compiled,compiled+graphs "${compare_shape[@]}" --json "$out/bench_compare_compiled.json"
step 90 python -m pytest -m gpu -q -p no:cacheprovider --gpu-suite-device "$device" \
    tests/gpu/test_cuda_graphs.py -k "compiled and (tensorwise or delayed or nvfp4)"
