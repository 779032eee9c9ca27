"""Whole training steps in CUDA graphs (``--cuda_graphs``), on the device: for every recipe
and bf16, the losses and gradient norms of a run whose steps replay from a graph are those
of the eager run, bit for bit, step by step; compiled too (every recipe compiles: `--torch_compile true`). On the CPU dry run
(``--gpu-suite-device cpu``) both runs are eager (``auto`` captures only on CUDA): the code
paths and command lines."""

from __future__ import annotations

import json

import pytest

from fp8train.spec.recipes import RECIPE_NAMES
from fp8train.train.commands.cli import main

from ._suite import is_finite_number

STEPS = "10"  # 4 eager warm-up steps, then 6 replays


def _run(device, sizes, tmp_path, recipe: str | None, graphs: bool, compiled: bool = False) -> list[tuple]:
    output_dir = tmp_path / f"{recipe}-{graphs}-{compiled}"
    on = "true" if device.type == "cuda" else "auto"
    argv = ["train", "--device", device.type, "--output_dir", str(output_dir), "--save_checkpoints", "false",
            *sizes.train_flags, "--steps", STEPS, "--cuda_graphs", on if graphs else "false",
            "--torch_compile", "true" if compiled else "false"]
    if recipe is not None:
        argv += ["--fp8_recipe", recipe]
    assert main(argv) == 0, f"fp8train {' '.join(argv)} failed"
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [(record["loss"], record["grad_norm"]) for record in records if "loss" in record]


@pytest.mark.parametrize("recipe", [None, *RECIPE_NAMES])
def test_replayed_steps_train_as_eager_steps_bit_for_bit(device, sizes, tmp_path, recipe):
    eager = _run(device, sizes, tmp_path, recipe, graphs=False)
    graphed = _run(device, sizes, tmp_path, recipe, graphs=True)
    assert len(graphed) == int(STEPS) and all(is_finite_number(loss) for loss, _ in graphed)
    assert graphed == eager, f"{recipe or 'bf16'}: (loss, grad_norm) per step, graphed then eager"


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_compiled_replayed_steps_train_as_compiled_eager_steps(device, sizes, tmp_path, recipe):
    eager = _run(device, sizes, tmp_path, recipe, graphs=False, compiled=True)
    graphed = _run(device, sizes, tmp_path, recipe, graphs=True, compiled=True)
    assert graphed == eager, f"{recipe}: (loss, grad_norm) per step, compiled: graphed then eager"
