#!/usr/bin/env bash
# The next GPU session's one prepared call (docs/gpu.md, "One prepared call"): what issue 40
# (and issues 38, 31 and 32 before it) left to measure on a GPU, each step under its own time
# limit so one that hangs does not take the rest, in about 11 minutes of a 15-minute budget.
#   1. the fused 4-bit quantizer's bytes against the reference (issue 40), the fused FP8
#      quantizer's, every recipe's Linear against the CPU (tests/gpu);
#   2. issue 40's rows: one Linear's forward+backward, eager, at 16384x8192x8192 and 4096^3
#      for mxfp8, nvfp4 and mxfp4 (one bf16 GEMM per emulated product) against bf16, and
#      tensorwise beside them; the launch counts (bench_gpu.py);
#   3. issue 40's training step: fp8train compare, nvfp4 against bf16, eager, at issue 38's
#      shape (n_embd 2048, 8 layers, 16 x 1024 tokens);
#   4. whole steps in CUDA graphs against eager steps (tests/gpu), then fp8train compare with
#      CUDA graphs for tensorwise, delayed and rowwise, if time is left.
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
linear_flags=(--sections linear,counts --skip-compile --recipes mxfp8,nvfp4,mxfp4,tensorwise)
compare_shape=(--compare-width 2048 --compare-layers 8 --compare-seq-len 1024 --compare-steps 20)
if [ "$device" != cuda ]; then
    sizes=(256x128x128)
    linear_flags+=(--quick)
    compare_shape=(--quick)
fi
step 150 python -m pytest -m gpu -q -p no:cacheprovider --gpu-suite-device "$device" \
    tests/gpu/test_quantize_kernel_fp4.py tests/gpu/test_quantize_kernel.py tests/gpu/test_linear.py
step 180 python benchmarks/bench_gpu.py --device "$device" --sizes "${sizes[@]}" "${linear_flags[@]}" \
    --json "$out/bench_linear.json"
step 120 python benchmarks/bench_gpu.py --device "$device" --sections compare --recipes nvfp4 \
    --compare-modes eager "${compare_shape[@]}" --json "$out/bench_compare_nvfp4.json"
step 120 python -m pytest -m gpu -q -p no:cacheprovider --gpu-suite-device "$device" \
    tests/gpu/test_cuda_graphs.py -k "not compiled"
step 90 python benchmarks/bench_gpu.py --device "$device" --sections compare --recipes tensorwise,delayed,rowwise \
    --compare-modes eager,graphs "${compare_shape[@]}" --json "$out/bench_compare.json"
