"""NVFP4's arithmetic in one Float8Linear forward+backward at issue 38's host-cost shape, each
piece timed alone, without the host code around it, beside ``nn.Linear``'s whole step in the
same run: the floor the layer's host time cannot go under while its bits stay as they are.

    PYTHONPATH=src python benchmarks/bench_fp4_arithmetic.py [--rounds 15] [--out benchmarks/results_fp4_arithmetic.json]

Shape ``tests/helpers/host_calls.py``'s ``HOST_SHAPE`` (16 tokens x 256 in x 256 out, float32,
one thread); the tokens padded to 32 as the layer pads them. Each piece is one numba entry
point called with its arguments prepared (the CPU kernels the default path launches), the
float32 GEMMs as ``torch.mm`` (the same three ``nn.Linear`` runs) and stochastic rounding's two
``torch.rand`` draws (the reference's, which fix the bits). Medians of ``--rounds`` rounds of
100 calls, interleaved with ``nn.Linear``'s step. Prints a Markdown table, writes JSON.
Needs numba (the kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the shape lives with the tests that pin the host cost

from bench_host import cpu_name  # noqa: E402
from fp8train.quant.kernels.fp4 import COMPUTE_AMAX, launch_plan, quantize  # noqa: E402
from fp8train.quant.kernels.launch import BITS_LIKE, KERNEL_LAUNCH  # noqa: E402
from fp8train.quant.kernels.numba_fp4_values import E4M3_VALUES, fold_fp4_values_at, transpose_tiles_at  # noqa: E402
from fp8train.spec.rule import QuantRule  # noqa: E402
from tests.helpers.host_calls import HOST_SHAPE, LinearStep, format_table  # noqa: E402

TOKENS, FEATURES, OUT = HOST_SHAPE
PADDED = 32  # the 4-bit recipes' token alignment
GROUPS = QuantRule(granularity="nvfp4")
RHT = QuantRule(granularity="nvfp4", rht=True)
TILES = QuantRule(granularity="nvfp4_2d")


def kernel_call(rule: QuantRule, axis: int, shape: tuple[int, int], values: bool, stochastic: bool = False):
    """One launch of ``rule``'s kernel along ``axis`` on a random float32 tensor of ``shape``,
    computing its amax, writing its GEMM operand where ``values``, from given draws where
    ``stochastic``: a call with every argument prepared (its tensors held by the closure)."""
    m, k = shape
    plan = launch_plan(rule, axis)
    x, draws = torch.randn(m, k), torch.rand(m, k)
    data, scales = torch.empty(m * k // 2, dtype=torch.uint8), torch.empty(m * k // 16, dtype=torch.uint8)
    amax, out = torch.empty((), dtype=torch.float32), torch.empty(m, k)
    args = (x.data_ptr(), BITS_LIKE[torch.float32], m, k, data.data_ptr(), scales.data_ptr(), draws.data_ptr())
    args += (amax.data_ptr(), COMPUTE_AMAX, *plan.tails[torch.float32], stochastic, out.data_ptr() if values else 0, False)
    held = (x, draws, data, scales, amax, out)
    return lambda: plan.kernel(*args) and held


def weight_transpose():
    """The backward's transpose of the weight's 16x16 tiles with its GEMM operand (one launch)."""
    qt = quantize(torch.randn(OUT, FEATURES), TILES, -1)
    data, scales = qt.data.view(torch.uint8), qt.scale_inv.view(torch.uint8)
    codes, out = torch.empty(FEATURES, OUT // 2, dtype=torch.uint8), torch.empty(FEATURES, OUT)
    args = (data.data_ptr(), scales.data_ptr(), OUT, FEATURES, codes.data_ptr(), out.data_ptr(), False, 16, True)
    return lambda: transpose_tiles_at(*args) and (data, scales, codes, out)


def input_operand():
    """The backward's GEMM operand of the input's saved first-dim codes (one fold launch)."""
    qt = quantize(torch.randn(PADDED, FEATURES), RHT, 0)
    data, scales, out = qt.data.view(torch.uint8), qt.scale_inv.view(torch.uint8), torch.empty(FEATURES, PADDED)
    args = (data.data_ptr(), True, scales.data_ptr(), True, 1, 16, E4M3_VALUES, out.data_ptr(), FEATURES, PADDED, np.float32(0))
    return lambda: fold_fp4_values_at(*args) and (data, scales, out)


def pieces() -> dict[str, list]:
    """The step's arithmetic, by piece: the calls that make it."""
    a, w, g, i = torch.randn(TOKENS, FEATURES), torch.randn(OUT, FEATURES), torch.randn(OUT, TOKENS), torch.randn(FEATURES, TOKENS)
    draw_shape = (PADDED // 16, 16, OUT // 16, 16)
    return {
        "3 float32 GEMMs (torch.mm, as nn.Linear's)": [lambda: torch.mm(a, w.t()), lambda: torch.mm(a, w), lambda: torch.mm(g, i.t())],
        "stochastic rounding's 2 torch.rand": [lambda: torch.rand(draw_shape), lambda: torch.rand(draw_shape)],
        "input: 1x16 groups + operand": [kernel_call(GROUPS, -1, (PADDED, FEATURES), True)],
        "input: RHT columns (saved as codes)": [kernel_call(RHT, 0, (PADDED, FEATURES), False)],
        "weight: 16x16 tiles + operand": [kernel_call(TILES, -1, (OUT, FEATURES), True)],
        "weight: transpose + operand": [weight_transpose()],
        "grad_output: SR 1x16 groups + operand": [kernel_call(QuantRule(granularity="nvfp4", stochastic_rounding=True), -1, (PADDED, OUT), True, True)],
        "grad_output: SR RHT columns + operand": [kernel_call(QuantRule(granularity="nvfp4", rht=True, stochastic_rounding=True), 0, (PADDED, OUT), True, True)],
        "input: operand of its saved codes": [input_operand()],
    }


def timed(calls: list, count: int) -> float:
    """Microseconds per round of ``calls``, over ``count`` rounds."""
    start = time.perf_counter()
    for _ in range(count):
        for call in calls:
            call()
    return (time.perf_counter() - start) / count * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds of 100 calls per piece")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results_fp4_arithmetic.json"))
    options = parser.parse_args(argv)
    step = LinearStep(None)
    work = {"nn.Linear forward+backward": [lambda: (step.reset(), step.run())], **pieces()}
    samples: dict[str, list[float]] = {name: [] for name in work}
    torch.set_num_threads(1)
    with KERNEL_LAUNCH:  # as a layer's block holds the kernels
        for calls in work.values():
            timed(calls, 20)  # warm-up (numba compiles or loads its cache on first use)
        for _ in range(options.rounds):
            for name, calls in work.items():
                samples[name].append(timed(calls, 100))
    us = {name: statistics.median(values) for name, values in samples.items()}
    base = us["nn.Linear forward+backward"]
    arithmetic = sum(value for name, value in us.items() if name != "nn.Linear forward+backward")
    rows = [[name, f"{value:.0f}", f"{value / base:.2f}x"] for name, value in us.items()]
    rows.append(["NVFP4's arithmetic (sum, no host code)", f"{arithmetic:.0f}", f"{arithmetic / base:.2f}x"])
    print(format_table(["piece", "us", "vs nn.Linear"], rows))
    results = {"cpu": cpu_name(), "torch": torch.__version__, "threads": 1, "us": {k: round(v, 1) for k, v in us.items()},
               "arithmetic_us": round(arithmetic, 1), "arithmetic_ratio": round(arithmetic / base, 2)}
    Path(options.out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
