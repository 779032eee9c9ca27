"""Emulated Float8Linear forward+backward time over bf16 nn.Linear time, measured in the same run.

    python benchmarks/bench_linear.py [--sizes 1024 4096] [--tokens 4096] [--recipes ...] [--out results.json]

Prints a Markdown table and writes JSON. Each measurement is the median of several
repetitions, interleaved with its bf16 baseline so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from torch import nn

from fp8train import Float8Linear
from fp8train.recipes import RECIPE_NAMES


def _step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    module.weight.grad = None
    x.grad = None
    module(x).backward(grad)


def _time(module, x, grad, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _step(module, x, grad)
        times.append(time.perf_counter() - start)
    return times


def measure(size: int, tokens: int, recipe: str, repeats: int, warmup: int) -> dict:
    torch.manual_seed(0)
    baseline = nn.Linear(size, size, bias=False, dtype=torch.bfloat16)
    fp8 = Float8Linear(size, size, bias=False, dtype=torch.bfloat16, recipe=recipe, backend="emulated")
    fp8.load_state_dict(baseline.state_dict(), strict=False)
    x = torch.randn(tokens, size, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, size, dtype=torch.bfloat16)
    for _ in range(warmup):
        _step(baseline, x, grad)
        _step(fp8, x, grad)
    bf16_times, fp8_times = [], []
    for _ in range(repeats):  # interleave so drifts in machine load hit both
        bf16_times += _time(baseline, x, grad, 1)
        fp8_times += _time(fp8, x, grad, 1)
    bf16_ms = statistics.median(bf16_times) * 1e3
    fp8_ms = statistics.median(fp8_times) * 1e3
    return {
        "size": size,
        "tokens": tokens,
        "recipe": recipe,
        "bf16_ms": round(bf16_ms, 2),
        "fp8_emulated_ms": round(fp8_ms, 2),
        "ratio": round(fp8_ms / bf16_ms, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096], help="in = out features")
    parser.add_argument("--tokens", type=int, default=4096, help="flattened batch x sequence")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPE_NAMES), choices=RECIPE_NAMES)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results_linear.json", help="JSON output path")
    args = parser.parse_args()

    rows = [
        measure(size, args.tokens, recipe, args.repeats, args.warmup)
        for size in args.sizes
        for recipe in args.recipes
    ]
    print("| size | tokens | recipe | bf16 nn.Linear (ms) | emulated Float8Linear (ms) | ratio |")
    print("|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['size']} | {r['tokens']} | {r['recipe']} | {r['bf16_ms']:.1f} | "
            f"{r['fp8_emulated_ms']:.1f} | {r['ratio']:.2f}x |"
        )
    report = {
        "benchmark": "Float8Linear forward+backward, emulated backend, over bf16 nn.Linear",
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "results": rows,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
