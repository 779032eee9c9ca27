"""What the non-finite sentinel costs: the detector on one training step, and the trainer's
per-step snapshot.

    python benchmarks/bench_sentinel.py [--recipes bf16,tensorwise,delayed] [--repeats 21]
        [--out benchmarks/results_sentinel.json]

Builds the default GPT exactly as ``fp8train train`` does with its defaults
(``TrainingArguments()``: 2 layers, width 128, 16 x 128 tokens, float32 parameters,
``torch.autocast`` bfloat16, every Linear converted, the ``auto`` backend: emulated on a
CPU) and times one training step (forward, backward, AdamW step), interleaving steps with
and without ``fp8train.detect_nonfinite(model, raise_on_first=False)`` around forward and
backward; reports the medians and their ratio. Then times what a good step of the trainer
adds: ``StepState.capture()`` (RNG states and copies of delayed scaling's buffers), as a
median over many calls and as a fraction of the step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time

import torch

import fp8train
from fp8train import TrainingArguments
from fp8train.train.commands.compare import build_model
from fp8train.diagnostics.markdown import markdown_table
from fp8train.train.nonfinite_step import StepState

BASELINE = "bf16"
SNAPSHOT_CALLS = 2000


def _model(recipe: str | None):
    torch.manual_seed(0)
    model = build_model(TrainingArguments())
    if recipe is not None:
        fp8train.convert_to_float8_training(model, recipe)
    return model


def _timed_step(model, optimizer, idx, targets, detect: bool) -> float:
    start = time.perf_counter()
    watch = fp8train.detect_nonfinite(model, raise_on_first=False) if detect else contextlib.nullcontext()
    with watch:
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast():
            loss = model(idx, targets)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def measure(recipe: str | None, repeats: int) -> dict:
    args = TrainingArguments()
    model = _model(recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=generator)
    targets = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=generator)
    for detect in (False, True, False, True):  # warm up: kernels, allocator
        _timed_step(model, optimizer, idx, targets, detect)
    plain, detected = [], []
    for _ in range(repeats):
        plain.append(_timed_step(model, optimizer, idx, targets, False))
        detected.append(_timed_step(model, optimizer, idx, targets, True))
    state = StepState(model)
    start = time.perf_counter()
    for _ in range(SNAPSHOT_CALLS):
        state.capture()
    capture_seconds = (time.perf_counter() - start) / SNAPSHOT_CALLS
    step_seconds = statistics.median(plain)
    return {
        "recipe": recipe or BASELINE,
        "step_ms": 1e3 * step_seconds,
        "step_with_detector_ms": 1e3 * statistics.median(detected),
        "detector_ratio": statistics.median(detected) / step_seconds,
        "fp8_state_tensors": 2 * sum(1 for m in model.modules() if hasattr(m, "fp8_amax_history")),
        "snapshot_us": 1e6 * capture_seconds,
        "snapshot_fraction_of_step": capture_seconds / step_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="bf16,tensorwise,delayed")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", default="benchmarks/results_sentinel.json")
    options = parser.parse_args()
    recipes = [None if name == BASELINE else name for name in options.recipes.split(",")]
    rows = [measure(recipe, options.repeats) for recipe in recipes]
    cells = [
        (row["recipe"], f"{row['step_ms']:.1f} ms", f"{row['step_with_detector_ms']:.1f} ms",
         f"{row['detector_ratio']:.2f}x", f"{row['snapshot_us']:.1f} us", f"{100 * row['snapshot_fraction_of_step']:.3f}%")
        for row in rows
    ]
    headers = ("model", "step", "with detector", "ratio", "snapshot per step", "of the step")
    print(markdown_table(headers, cells, align="lrrrrr"))
    machine = {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__}
    with open(options.out, "w") as f:
        json.dump({"machine": machine, "repeats": options.repeats, "results": rows}, f, indent=2)
    print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
