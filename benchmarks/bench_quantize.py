"""Quantization speed over a same-size memory copy, both measured in the same run.

    python benchmarks/bench_quantize.py [--shape 4096 4096] [--dtype bfloat16] [--threads N] [--values] [--out benchmarks/results_quantize.json]

For every granularity and axis, for both axes at once (``quantize_both``), and for the 4-bit
rules of the ``nvfp4`` recipe's operands that add options (stochastic rounding ``sr``, the
Hadamard transform ``rht``, both; the ``options`` column), and, with ``--reference``, on the
pure-PyTorch reference path too (every 4-bit rule has a numba kernel), the median time of
``quantize`` on one input against the median time of ``dst.copy_(x)`` for the same input
(with stochastic rounding, also the time of its uniform draws alone: ``torch.rand`` of the
input's shape, one value at a time from one generator, which both paths must draw);
``speed`` is copy time over quantize time, so 1.0 means as fast as a copy (a copy reads and
writes the whole input; quantize reads it and writes half); ``over reference`` is the
reference path's time over the kernel's. ``--values``: the CPU kernels also write the
emulated GEMM's float32 operand in their pass, as a layer's bound kernels ask them
(``values=`` of :func:`fp8train.quant.kernels.fp8.quantize` and
:func:`fp8train.quant.kernels.fp4.quantize`; numba path only, one usage a row).
Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from fp8train.quant.quantize import quantize, quantize_both
from fp8train.quant.kernels import fp4 as fp4_kernels
from fp8train.quant.kernels import fp8 as fp8_kernels
from fp8train.quant.kernels import use_quant_settings
from fp8train.spec.granularities import GRANULARITIES, Granularity
from fp8train.spec.rule import QuantRule
from fp8train.diagnostics.markdown import markdown_table

_SR, _RHT = {"stochastic_rounding": True}, {"rht": True}
CASES = [(g, axis, {}) for g in GRANULARITIES for axis in ((-1,) if Granularity(g).symmetric else (-1, 0))]
CASES += [(g, "both", {}) for g in ("row", "block1x128", "mx")]  # quantize_both: two usages, one read
# The nvfp4 recipe's operands with options (spec/fp4_recipes.py): grad_output for grad_input
# (sr), input for grad_weight (rht, axis 0), grad_output for grad_weight (rht and sr, axis 0);
# and the other axis of each, and mxfp4 with sr.
CASES += [("nvfp4", -1, _SR), ("nvfp4", 0, _SR), ("nvfp4", 0, _RHT), ("nvfp4", 0, _RHT | _SR), ("nvfp4", -1, _RHT)]
CASES += [("nvfp4", -1, _RHT | _SR), ("nvfp4_2d", -1, _SR), ("mxfp4", -1, _SR)]


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(x: torch.Tensor, granularity: str, axis, options: dict, path: str, repeats: int, values: bool = False) -> dict:
    with use_quant_settings(quantize_kernel=path):
        return _measure(x, granularity, axis, options, path, repeats, values)


def _measure(x: torch.Tensor, granularity: str, axis, options: dict, path: str, repeats: int, values: bool) -> dict:
    rule = QuantRule(granularity=granularity, **options)
    if values:  # the kernel with the GEMM operand written in its pass (a layer's bound call)
        kernels = fp4_kernels if rule.granularity.fp4 else fp8_kernels
        run = lambda: kernels.quantize(x, rule, axis, None, values=torch.float32)  # noqa: E731
    elif axis == "both":
        run = lambda: quantize_both(x, rule)  # noqa: E731
    else:
        run = lambda: quantize(x, rule, axis=axis)  # noqa: E731
    run()  # compile / warm up
    copy = torch.empty_like(x)
    copy_times, quantize_times = [], []
    for _ in range(repeats):  # interleave so drifts in machine load hit both
        copy_times.append(_median_ms(lambda: copy.copy_(x), 1))
        quantize_times.append(_median_ms(run, 1))
    copy_ms, quantize_ms = statistics.median(copy_times), statistics.median(quantize_times)
    draws = {}
    if rule.stochastic_rounding:  # the uniform draws alone (torch.rand, as both paths draw them)
        draws["draws_ms"] = round(_median_ms(lambda: torch.rand(x.shape, dtype=torch.float32), repeats), 3)
    return {
        "granularity": granularity,
        "axis": axis,
        "options": "+".join(_OPTION_NAMES[name] for name in options),
        "path": path,
        "copy_ms": round(copy_ms, 3),
        "quantize_ms": round(quantize_ms, 4),
        "operand_values": values,
        "speed_over_copy": round(copy_ms / quantize_ms, 3),
        **draws,
    }


_OPTION_NAMES = {"stochastic_rounding": "sr", "rht": "rht"}


def _add_speedups(rows: list[dict]) -> None:
    """``kernel_over_reference`` on each numba row whose case the reference path ran too:
    reference time over kernel time."""
    reference = {(r["granularity"], r["axis"], r["options"]): r for r in rows if r["path"] == "reference"}
    for row in rows:
        match = reference.get((row["granularity"], row["axis"], row["options"]))
        if row["path"] == "numba" and match is not None:
            row["kernel_over_reference"] = round(match["quantize_ms"] / row["quantize_ms"], 1)


def _cpu() -> str:
    """The CPU's model name and its widest vector extensions (Linux: /proc/cpuinfo), else
    what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    wide = [flag for flag in ("avx2", "avx512f", "avx512_bf16") if flag in flags]
    name = names[0] if names else platform.processor() or platform.machine()
    return f"{name} ({', '.join(wide)})" if wide else name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, default=[4096, 4096])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--reference", action="store_true", help="also time the pure-PyTorch reference path")
    parser.add_argument("--only", nargs="+", metavar="GRANULARITY", help="only these granularities' rows")
    parser.add_argument("--threads", type=int, help="intra-op threads (default: PyTorch's)")
    parser.add_argument("--values", action="store_true", help="the kernels also write the GEMM's float32 operand (numba only)")
    parser.add_argument("--out", default="benchmarks/results_quantize.json", help="JSON output path")
    args = parser.parse_args()
    if args.values and args.reference:
        parser.error("--values times the CPU kernels only: drop --reference")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(*args.shape, dtype=getattr(torch, args.dtype))
    paths = ["numba", "reference"] if args.reference else ["numba"]
    cases = [case for case in CASES if (args.only is None or case[0] in args.only) and not (args.values and case[1] == "both")]
    rows = [measure(x, g, axis, options, path, args.repeats, args.values) for path in paths for g, axis, options in cases]
    cpu = _cpu()
    _add_speedups(rows)
    operand = ", with the GEMM operand" if args.values else ""
    print(f"{args.shape[0]}x{args.shape[1]} {args.dtype}{operand}, {torch.get_num_threads()} threads, {cpu}")
    cells = [
        (r["granularity"], r["axis"], r["options"], r["path"], f"{r['copy_ms']:.3f}", f"{r['quantize_ms']:.3f}",
         f"{r['speed_over_copy']:.3g}x", f"{r['kernel_over_reference']:.0f}x" if "kernel_over_reference" in r else "",
         f"{r['draws_ms']:.2f}" if "draws_ms" in r else "")
        for r in rows
    ]
    headers = ("granularity", "axis", "options", "path", "copy (ms)", "quantize (ms)", "speed over copy", "over reference",
               "of it, draws (ms)")
    print(markdown_table(headers, cells, align="lrllrrrrr"))
    result = {"shape": args.shape, "dtype": args.dtype, "threads": torch.get_num_threads(), "cpu": cpu, "operand_values": args.values, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
