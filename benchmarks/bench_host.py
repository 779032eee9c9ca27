"""The host cost of one Float8Linear forward+backward per recipe (issue 38): Python calls as
``cProfile`` counts them, on the default CPU path and the reference path
(``FP8TRAIN_QUANTIZE_KERNEL=reference``), and host time beside ``nn.Linear``'s, measured in
the same run. The counting rule is ``tests/helpers/host_calls.py``'s; ``tests/nn/test_host_calls.py``
pins the counts.

    PYTHONPATH=src python benchmarks/bench_host.py [--recipes tensorwise,rowwise]
        [--repeats 300] [--top 0] [--tokens 16] [--out benchmarks/results_host.json]

Shape 16 tokens x 256 in x 256 out, float32, one thread: the arithmetic costs little, so the
time is mostly the host's (``--tokens`` sets another token count: at 32 only blockwise pads,
to 128). Times are medians of ``--repeats`` steps, interleaved with ``nn.Linear``'s.
``--top N`` also prints each recipe's N most frequent calls on the default path. Prints a
Markdown table and writes the JSON file. Takes about a minute (numba compiles on first use).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the harness lives with the tests that pin its counts

from fp8train.recipes import RECIPE_NAMES  # noqa: E402
from tests.helpers.host_calls import HOST_SHAPE, KERNELS, count_host_calls, format_table, profile_step, time_host  # noqa: E402


def cpu_name() -> str:
    """The CPU's model name (``lscpu``'s, from /proc/cpuinfo), or the platform's guess."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def print_top(recipe: str, top: int) -> None:
    """The ``top`` most frequent calls of ``recipe``'s step on the default path."""
    stats = profile_step(recipe).stats
    calls = sorted(((value[1], pstats_name(key)) for key, value in stats.items()), reverse=True)
    print(f"\n{recipe}: " + ", ".join(f"{name} {count}" for count, name in calls[:top]))


def pstats_name(key: tuple) -> str:
    """``file:line(function)`` shortened to ``module.function`` or the built-in's name."""
    filename, _, function = key
    if filename == "~":
        return function
    return f"{Path(filename).stem}.{function}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(RECIPE_NAMES), help="comma-separated recipe names")
    parser.add_argument("--repeats", type=int, default=300, help="timed steps per layer")
    parser.add_argument("--top", type=int, default=0, help="also print each recipe's N most frequent calls")
    parser.add_argument("--tokens", type=int, default=HOST_SHAPE[0], help="tokens (rows) of the Linear's input")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results_host.json"))
    options = parser.parse_args(argv)
    recipes = options.recipes.split(",")
    shape = (options.tokens, *HOST_SHAPE[1:])
    calls = {kernel: {recipe: count_host_calls(recipe, kernel, shape) for recipe in recipes} for kernel in KERNELS}
    linear_calls = count_host_calls(None, shape=shape)
    times_us = time_host(recipes, repeats=options.repeats, shape=shape)
    ratio = {recipe: times_us[recipe] / times_us["nn.Linear"] for recipe in recipes}
    rows = [["nn.Linear", linear_calls, linear_calls, f"{times_us['nn.Linear']:.0f}", "1.0x"]]
    rows += [
        [recipe, calls["auto"][recipe], calls["reference"][recipe], f"{times_us[recipe]:.0f}", f"{ratio[recipe]:.1f}x"]
        for recipe in recipes
    ]
    headers = ["recipe", "calls, default path", "calls, reference path", "host us", "vs nn.Linear"]
    print(format_table(headers, rows))
    for recipe in recipes if options.top else ():
        print_top(recipe, options.top)
    results = {
        "shape": dict(zip(("tokens", "in", "out"), shape)),
        "dtype": "float32",
        "threads": 1,
        "cpu": cpu_name(),
        "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "torch": torch.__version__,
        "nn_linear_calls": linear_calls,
        "calls": calls,
        "host_us": {name: round(value, 1) for name, value in times_us.items()},
        "host_ratio": {recipe: round(value, 2) for recipe, value in ratio.items()},
    }
    Path(options.out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
