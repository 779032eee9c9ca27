"""Emulated Float8Linear forward+backward time over the faster high-precision nn.Linear,
both measured in the same run.

    python benchmarks/bench_linear.py [--sizes 1024 4096] [--tokens 4096] [--recipes ...] [--out results.json]

The baseline is whichever of bf16 and float32 ``nn.Linear`` (same shape, input of its own
dtype) is faster on this machine: bf16 where the CPU has native bf16 (AVX512-BF16, AMX),
float32 where it does not (there a bf16 GEMM is ~5x slower). Both are reported.
``Float8Linear`` takes a bf16 input, as under bf16 autocast. Each time is the median of
several repetitions, interleaved with the baselines so drifts in machine load hit all
alike. Prints a Markdown table and writes JSON.
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
from fp8train.nn.config import Float8ModuleConfig
from fp8train.quant.gemm.emulated import emulated_gemm_dtype
from fp8train.recipes import RECIPE_NAMES
from fp8train.diagnostics.markdown import markdown_table


def cpu_features() -> dict:
    """What decides the emulation's GEMM dtype on this CPU."""
    return {
        "processor": platform.processor() or platform.machine(),
        "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "amx_tile": bool(torch.cpu._is_amx_tile_supported()),
        "emulated_gemm_dtype": str(emulated_gemm_dtype()).removeprefix("torch."),
        "threads": torch.get_num_threads(),
    }


def _step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> float:
    module.weight.grad = None
    x.grad = None
    start = time.perf_counter()
    module(x).backward(grad)
    return time.perf_counter() - start


def _inputs(size: int, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, size, dtype=dtype, requires_grad=True)
    return x, torch.randn(tokens, size, dtype=dtype)


def measure(size: int, tokens: int, recipes: list[str], repeats: int, warmup: int) -> list[dict]:
    """Times of the two baselines and of every recipe at one size, interleaved."""
    torch.manual_seed(0)
    modules = {
        "bf16": nn.Linear(size, size, bias=False, dtype=torch.bfloat16),
        "fp32": nn.Linear(size, size, bias=False, dtype=torch.float32),
    }
    for recipe in recipes:
        config = Float8ModuleConfig(recipe=recipe, backend="emulated")
        fp8 = Float8Linear(size, size, bias=False, dtype=torch.bfloat16, config=config)
        fp8.load_state_dict(modules["bf16"].state_dict(), strict=False)
        modules[recipe] = fp8
    inputs = {name: _inputs(size, tokens, torch.float32 if name == "fp32" else torch.bfloat16) for name in modules}
    times: dict[str, list[float]] = {name: [] for name in modules}
    for repeat in range(warmup + repeats):
        for name, module in modules.items():
            elapsed = _step(module, *inputs[name])
            if repeat >= warmup:
                times[name].append(elapsed)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    baseline = "bf16" if ms["bf16"] <= ms["fp32"] else "fp32"
    return [
        {
            "size": size,
            "tokens": tokens,
            "recipe": recipe,
            "bf16_linear_ms": round(ms["bf16"], 2),
            "fp32_linear_ms": round(ms["fp32"], 2),
            "baseline": baseline,
            "fp8_emulated_ms": round(ms[recipe], 2),
            "ratio": round(ms[recipe] / ms[baseline], 3),
        }
        for recipe in recipes
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096], help="in = out features")
    parser.add_argument("--tokens", type=int, default=4096, help="flattened batch x sequence")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPE_NAMES), choices=RECIPE_NAMES)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results_linear.json", help="JSON output path")
    args = parser.parse_args()

    machine = cpu_features()
    rows = [row for size in args.sizes for row in measure(size, args.tokens, args.recipes, args.repeats, args.warmup)]
    print(", ".join(f"{k}={v}" for k, v in machine.items()))
    headers = ("size", "tokens", "recipe", "bf16 nn.Linear (ms)", "fp32 nn.Linear (ms)", "Float8Linear (ms)",
               "over the faster")
    cells = [
        (r["size"], r["tokens"], r["recipe"], f"{r['bf16_linear_ms']:.1f}", f"{r['fp32_linear_ms']:.1f}",
         f"{r['fp8_emulated_ms']:.1f}", f"{r['ratio']:.2f}x ({r['baseline']})")
        for r in rows
    ]
    print(markdown_table(headers, cells, align="rrlrrrr"))
    report = {
        "benchmark": "Float8Linear forward+backward, emulated backend, over the faster of bf16 and fp32 nn.Linear",
        "machine": machine,
        "torch": torch.__version__,
        "results": rows,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
