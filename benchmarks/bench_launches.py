"""Aten ops per Float8Linear forward+backward, per recipe: on the CPU, the kernels a GPU would
launch (issue 31). The rule that counts them is ``tests/helpers/aten_ops.py``'s (docs/gpu.md,
"Launches counted on the CPU"); ``tests/nn/test_launch_counts.py`` pins them.

    PYTHONPATH=src python benchmarks/bench_launches.py [--recipes tensorwise,rowwise]
        [--shape 256x512x768] [--ops] [--out benchmarks/results_launches.json]

Prints a Markdown table (``--ops``: each recipe's counts by op too) and writes the JSON file.
Takes seconds: one small Linear per recipe, no timing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the harness lives with the tests that pin its counts

from fp8train.recipes import RECIPE_NAMES  # noqa: E402
from tests.helpers.aten_ops import HARNESS_SHAPE, count_linear_ops, format_table  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(RECIPE_NAMES), help="comma-separated recipe names")
    parser.add_argument("--shape", default="x".join(map(str, HARNESS_SHAPE)), help="tokens x in x out")
    parser.add_argument("--ops", action="store_true", help="also print each recipe's counts by op")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results_launches.json"))
    options = parser.parse_args(argv)
    shape = tuple(int(part) for part in options.shape.split("x"))
    counters = {recipe: count_linear_ops(recipe, shape) for recipe in options.recipes.split(",")}
    results = {
        "shape": {"tokens": shape[0], "in": shape[1], "out": shape[2]},
        "dtype": "bfloat16",
        "bias": True,
        "torch": torch.__version__,
        "aten_ops": {recipe: counter.total for recipe, counter in counters.items()},
        "by_op": {recipe: dict(counter.counts.most_common()) for recipe, counter in counters.items()},
    }
    print(format_table(results["aten_ops"]))
    if options.ops:
        for recipe, by_op in results["by_op"].items():
            print(f"\n{recipe}: " + ", ".join(f"{op} {count}" for op, count in by_op.items()))
    Path(options.out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
