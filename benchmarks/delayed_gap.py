"""Where delayed scaling's extra loss gap comes from, on the trainer's default model.

    python benchmarks/delayed_gap.py [--model module:function] [--variants ...] [--seeds 0,1] [--steps 150]
        [--out benchmarks/results_delayed_gap.json]

Trains the default GPT (``TrainingArguments()`` defaults) once per variant and seed, every
variant from the same initialization and batches under one seed: bf16, tensorwise
(current scaling), and delayed scaling with the default history (1024 steps, ``max``,
margin 0) and with the changes a user can make (a short history, ``most_recent``, a
margin). With ``fp8_stats_interval`` the trainer records each layer's quantization
statistics; the table reports, per variant, the final train and validation loss, the
paired gap to bf16 and the mean underflow of the grad_output operands over the run (the
operand a stale delayed scale hurts first). Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

import fp8train
from fp8train import TrainingArguments
from fp8train.recipes import DelayedScaling
from fp8train.train.trainer import Trainer
from fp8train.train.trainer_setup import sample_batch
from fp8train.diagnostics.markdown import markdown_table
from fp8train.train.user_model import model_setup

CALIBRATED = "calibrated"
VARIANTS = {
    "bf16": None,
    "tensorwise": "tensorwise",
    "delayed (1024, max)": DelayedScaling(),
    "delayed (16, max)": DelayedScaling(amax_history_len=16),
    "delayed (1, most_recent)": DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent"),
    "delayed (1024, max, margin 1)": DelayedScaling(margin=1),
    # The scales of the first step from one forward and backward on the first batch,
    # instead of the initial 1.0.
    "delayed (1024, max, first step calibrated)": (DelayedScaling(), CALIBRATED),
}


def train(variant, args: TrainingArguments, setup) -> dict:
    recipe, calibrate = variant if isinstance(variant, tuple) else (variant, None)

    def model_factory():
        model = setup.model_factory()
        if isinstance(recipe, DelayedScaling):
            fp8train.convert_to_float8_training(model, recipe)
            if calibrate:
                inputs, targets = sample_batch(setup.train_dataset, args.seed, 0, args.batch_size)
                with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast():
                    loss = setup.loss_fn(model, inputs, targets)
                loss.backward()
                model.zero_grad(set_to_none=True)
        return model

    # A pre-converted model keeps its delayed recipe: the trainer's own conversion (with
    # the name given) swaps only the plain Linear layers, and there are none left.
    settings = dataclasses.replace(args, fp8_recipe=None if recipe is None else "tensorwise")
    trainer = Trainer(model_factory, settings, setup.train_dataset, setup.eval_dataset, loss_fn=setup.loss_fn)
    result = trainer.train()
    metrics = [json.loads(line) for line in open(f"{settings.output_dir}/metrics.jsonl")]
    underflow = [
        s["underflow_pct"]
        for record in metrics
        for s in record.get("fp8_stats", ())
        if s["operand"] == "grad_output"
    ]
    return {
        "final_train_loss": result["final_train_loss"],
        "final_val_loss": result["final_val_loss"],
        "grad_output_underflow_pct": statistics.mean(underflow) if underflow else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--stats_interval", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results_delayed_gap.json")
    parser.add_argument("--model", default=None, help="module:function of a model factory (default: the default GPT)")
    parser.add_argument("--variants", default=";".join(VARIANTS), help="variant names separated by ;")
    options = parser.parse_args()
    seeds = [int(s) for s in options.seeds.split(",")]
    base = TrainingArguments(steps=options.steps, save_checkpoints=False, fp8_stats_interval=options.stats_interval,
                             device="cpu", model=options.model)
    setup = model_setup(base)
    variants = {name: VARIANTS[name] for name in options.variants.split(";")}
    runs = {}
    for seed in seeds:
        for name, variant in variants.items():
            tag = (options.model or "gpt").replace(":", "_")
            args = dataclasses.replace(base, seed=seed, output_dir=f"/tmp/delayed_gap/{tag}/{seed}/{name.replace(' ', '_')}")
            torch.manual_seed(seed)
            runs.setdefault(name, {})[seed] = train(variant, args, setup)
            print(name, seed, runs[name][seed], flush=True)
    rows = []
    for name in variants:
        gaps = [
            100 * (runs[name][s]["final_val_loss"] - runs["bf16"][s]["final_val_loss"]) / runs["bf16"][s]["final_val_loss"]
            for s in seeds
        ]
        underflow = [runs[name][s]["grad_output_underflow_pct"] for s in seeds]
        rows.append({
            "variant": name,
            "final_val_loss": statistics.mean(runs[name][s]["final_val_loss"] for s in seeds),
            "val_gap_percent": gaps,
            "grad_output_underflow_pct": None if underflow[0] is None else statistics.mean(underflow),
        })
    cells = [
        (row["variant"], f"{row['final_val_loss']:.4f}", ", ".join(f"{g:+.2f}%" for g in row["val_gap_percent"]),
         "-" if row["grad_output_underflow_pct"] is None else f"{row['grad_output_underflow_pct']:.3f}%")
        for row in rows
    ]
    headers = ("variant", "final val loss (mean)", "val gap to bf16 per seed", "mean grad_output underflow")
    print(markdown_table(headers, cells, align="lrlr"))
    with open(options.out, "w") as file:
        json.dump({"seeds": seeds, "steps": options.steps, "rows": rows, "runs": runs}, file, indent=1)
    print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
