"""What in-training FP8 telemetry (``fp8_stats_interval``) costs, per recipe.

    python benchmarks/bench_telemetry.py [--recipes ...] [--steps 8] [--out benchmarks/results_telemetry.json]

Builds the default GPT as ``fp8train train`` does with its defaults (batch 16 x 128
tokens, bf16 autocast, every Linear converted) and, per recipe, times in one process:

* a training step (forward, backward, optimizer step) without telemetry: the baseline;
* a step with the FP8 layers hooked, plus the statistics of every layer, GEMM and operand
  (what the trainer does every ``fp8_stats_interval`` steps).

Steps alternate between the two kinds so that machine noise hits both alike; each figure
is the median over ``--steps`` steps after two warm-up steps. The overhead at interval N is
``(stats step - plain step) / (N * plain step)``. Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import fp8train
from fp8train import TrainingArguments
from fp8train.nn.modules.linear import Float8Linear
from fp8train.diagnostics.gemm_capture import capture_linear_calls, linear_call_statistics
from fp8train.recipes import RECIPE_NAMES
from fp8train.train.commands.compare import build_model
from fp8train.diagnostics.markdown import markdown_table

INTERVALS = (10, 50, 100)


def _step(model, optimizer, inputs, targets) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast():
        loss = model(inputs, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(recipe: str, steps: int) -> dict:
    args = TrainingArguments(fp8_recipe=recipe)
    torch.manual_seed(0)
    model = fp8train.convert_to_float8_training(build_model(args), recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    modules = {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=generator)
    targets = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=generator)
    plain, with_stats = [], []
    for index in range(steps + 2):
        start = time.perf_counter()
        _step(model, optimizer, inputs, targets)
        middle = time.perf_counter()
        with capture_linear_calls(modules) as calls:
            _step(model, optimizer, inputs, targets)
        for call in calls:
            linear_call_statistics(call, modules[call.layer].recipe)
        end = time.perf_counter()
        if index >= 2:
            plain.append(middle - start)
            with_stats.append(end - middle)
    plain_s, stats_s = statistics.median(plain), statistics.median(with_stats)
    return {
        "recipe": recipe,
        "plain_step_s": plain_s,
        "stats_step_s": stats_s,
        "overhead_pct": {str(n): 100 * (stats_s - plain_s) / (n * plain_s) for n in INTERVALS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(RECIPE_NAMES))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results_telemetry.json")
    options = parser.parse_args()
    rows = [measure(name, options.steps) for name in options.recipes.split(",")]
    headers = ("recipe", "plain step (ms)", "step with statistics (ms)", *(f"overhead at interval {n}" for n in INTERVALS))
    cells = [
        (row["recipe"], f"{1e3 * row['plain_step_s']:.0f}", f"{1e3 * row['stats_step_s']:.0f}",
         *(f"{row['overhead_pct'][str(n)]:.1f}%" for n in INTERVALS))
        for row in rows
    ]
    print(markdown_table(headers, cells, align="l" + "r" * (len(headers) - 1)))
    result = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "rows": rows}
    with open(options.out, "w") as file:
        json.dump(result, file, indent=2)
    print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
