"""Quantization speed over a same-size memory copy, both measured in the same run.

    python benchmarks/bench_quantize.py [--shape 4096 4096] [--dtype bfloat16] [--out benchmarks/results_quantize.json]

For every granularity and axis, and for both axes at once (``quantize_both``; and, with ``--reference``, the pure-PyTorch reference path
too; of the 4-bit granularities, ``nvfp4`` and ``mxfp4`` (either axis) have a numba kernel, the others only the reference path), the median time of ``quantize`` on one input against the median time of
``dst.copy_(x)`` for the same input; ``speed`` is copy time over quantize time, so 1.0 means
as fast as a copy (a copy reads and writes the whole input; quantize reads it and writes half).
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
from fp8train.quant.settings import use_quant_settings
from fp8train.spec.granularities import GRANULARITIES, Granularity
from fp8train.spec.rule import QuantRule
from fp8train.train.markdown import markdown_table

CASES = [(g, axis) for g in GRANULARITIES for axis in ((-1,) if Granularity(g).symmetric else (-1, 0))]
CASES += [(g, "both") for g in ("row", "block1x128", "mx")]  # quantize_both: two usages, one read


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _fp4_kernel(granularity: str, axis) -> bool:
    """Whether the 4-bit kernel takes ``granularity`` along ``axis`` (fp8train.quant.fp4_kernels)."""
    return Granularity(granularity).across == 1 and axis in (-1, 0)


def _wanted(granularity: str, axis, path: str, paths: list[str]) -> bool:
    """A 4-bit case without a kernel runs the reference path on either: measured once."""
    if not Granularity(granularity).fp4 or _fp4_kernel(granularity, axis):
        return True
    return path == "reference" or "reference" not in paths


def measure(x: torch.Tensor, granularity: str, axis: int, path: str, repeats: int) -> dict:
    if Granularity(granularity).fp4 and not _fp4_kernel(granularity, axis):
        path = "reference"  # what runs: no 4-bit kernel for this case
    with use_quant_settings(quantize_kernel=path):
        return _measure(x, granularity, axis, path, repeats)


def _measure(x: torch.Tensor, granularity: str, axis: int, path: str, repeats: int) -> dict:
    rule = QuantRule(granularity=granularity)
    if axis == "both":
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
    return {
        "granularity": granularity,
        "axis": axis,
        "path": path,
        "copy_ms": round(copy_ms, 3),
        "quantize_ms": round(quantize_ms, 3),
        "speed_over_copy": round(copy_ms / quantize_ms, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, default=[4096, 4096])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--reference", action="store_true", help="also time the pure-PyTorch reference path")
    parser.add_argument("--out", default="benchmarks/results_quantize.json", help="JSON output path")
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(*args.shape, dtype=getattr(torch, args.dtype))
    paths = ["numba", "reference"] if args.reference else ["numba"]
    rows = [
        measure(x, g, axis, path, args.repeats)
        for path in paths
        for g, axis in CASES
        if _wanted(g, axis, path, paths)
    ]
    print(f"{args.shape[0]}x{args.shape[1]} {args.dtype}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    cells = [
        (r["granularity"], r["axis"], r["path"], f"{r['copy_ms']:.2f}", f"{r['quantize_ms']:.2f}",
         f"{r['speed_over_copy']:.2f}x")
        for r in rows
    ]
    headers = ("granularity", "axis", "path", "copy (ms)", "quantize (ms)", "speed over copy")
    print(markdown_table(headers, cells, align="lrlrrr"))
    with open(args.out, "w") as f:
        json.dump({"shape": args.shape, "dtype": args.dtype, "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
