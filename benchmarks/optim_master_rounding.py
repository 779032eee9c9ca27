"""Whether a bfloat16 master should round stochastically, and how an FP8 first moment should
be scaled: fp8train.optim.AdamW's precisions on the default GPT, side by side.

    python benchmarks/optim_master_rounding.py [--steps 300] [--seed 0]
        [--out benchmarks/results_optim_master_rounding.json]

Trains a small GPT (2 layers, width 128, byte tokens of the embedded text) in plain
PyTorch, once per optimizer configuration, every run from the same initialization and the
same batches; the learning rate decays by a cosine from 1e-3 to 1e-5, where a bfloat16
weight's update falls under half its ulp. Per run: the final train loss (mean of the last
20 steps), the validation loss, the weight drift (distance of the weights from those of
the float32 run with the same beta2, relative to how far that run's weights moved), and the
share of weights the last step left unchanged (updates that rounding dropped). beta2 is the
trainer's 0.95, and torch's default 0.999 for the bfloat16 second moment (where 0.999 * v
rounds back to v). Then, on the float32 run's final
first moments, the error of storing them in E4M3 per block of 32 to 2048 elements and per
tensor. Prints two Markdown tables and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from fp8train.optim import AdamW
from fp8train.optim.fp8_moment import dequantize_blocks, quantize_blocks
from fp8train.train.data import embedded_text, split_text
from fp8train.diagnostics.markdown import markdown_table
from fp8train.train.model import GPT, GPTConfig
from fp8train.train.trainer_setup import sample_batch

BF16 = torch.bfloat16
FP8_M_BF16_V = dict(exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=BF16)
# name: (parameter dtype, optimizer settings (None: torch.optim.AdamW), beta2). The trainer's
# beta2 is 0.95; torch's default, 0.999, is where a bfloat16 v rounded to nearest cannot decay.
CONFIGS = {
    "fp32 weights, torch.optim.AdamW": (torch.float32, None, 0.95),
    "bf16 weights, fp32 master": (BF16, dict(master_weight_dtype=torch.float32), 0.95),
    "bf16 master, round to nearest": (BF16, dict(master_weight_dtype=BF16, stochastic_rounding=False), 0.95),
    "bf16 master, stochastic": (BF16, dict(master_weight_dtype=BF16), 0.95),
    "fp32 weights, fp8 m + bf16 v": (torch.float32, FP8_M_BF16_V, 0.95),
    "bf16 master (stochastic), fp8 m + bf16 v": (BF16, dict(master_weight_dtype=BF16, **FP8_M_BF16_V), 0.95),
    "beta2 0.999: fp32 weights, torch.optim.AdamW": (torch.float32, None, 0.999),
    "beta2 0.999: bf16 v, round to nearest": (torch.float32, dict(exp_avg_sq_dtype=BF16, stochastic_rounding=False), 0.999),
    "beta2 0.999: bf16 v, stochastic": (torch.float32, dict(exp_avg_sq_dtype=BF16), 0.999),
}
REFERENCES = {0.95: "fp32 weights, torch.optim.AdamW", 0.999: "beta2 0.999: fp32 weights, torch.optim.AdamW"}
MODEL = GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64)
BATCH, LR, MIN_LR, LAST = 16, 1e-3, 1e-5, 20
BLOCK_SIZES = (32, 128, 256, 2048)


def _lr_factor(steps: int, step: int) -> float:
    return (MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * step / steps))) / LR


def train(name: str, steps: int, seed: int, data) -> dict:
    """One run: losses, final weights (float32) and, for the reference, the optimizer."""
    dtype, settings, beta2 = CONFIGS[name]
    train_set, val_set = data
    torch.manual_seed(seed)
    model = GPT(MODEL).to(dtype)
    initial = [p.detach().float().clone() for p in model.parameters()]
    if settings is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, beta2), weight_decay=0.1, foreach=False)
    else:
        optimizer = AdamW(model.parameters(), lr=LR, betas=(0.9, beta2), weight_decay=0.1, **settings)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(steps, step))
    losses, start = [], time.perf_counter()
    for step in range(steps):
        inputs, targets = sample_batch(train_set, seed, step, BATCH)
        loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()] if step == steps - 1 else None
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    unchanged = sum(int((p.detach() == b).sum()) for p, b in zip(model.parameters(), before))
    with torch.no_grad():
        val = [model(*sample_batch(val_set, seed, i, BATCH, stream=1)).item() for i in range(8)]
    return {
        "train_loss": sum(losses[-LAST:]) / len(losses[-LAST:]),
        "val_loss": sum(val) / len(val),
        "unchanged_last_step": unchanged / sum(p.numel() for p in model.parameters()),
        "seconds": time.perf_counter() - start,
        "weights": [p.detach().float() for p in model.parameters()],
        "initial": initial,
        "optimizer": optimizer,
        "params": list(model.parameters()),
    }


def weight_drift(run: dict, reference: dict) -> float:
    """||w - w_ref|| / ||w_ref - w_0|| over all parameters."""
    distance = sum(float(((w - r) ** 2).sum()) for w, r in zip(run["weights"], reference["weights"]))
    travelled = sum(float(((r - w0) ** 2).sum()) for r, w0 in zip(reference["weights"], reference["initial"]))
    return math.sqrt(distance / travelled)


def moment_errors(reference: dict) -> dict:
    """Mean elementwise relative error and share flushed to zero of the float32 run's final
    first moments (the matrices) stored in E4M3 per block and per tensor."""
    moments = [reference["optimizer"].state[p]["exp_avg"] for p in reference["params"] if p.dim() == 2]
    results = {}
    for block in (*BLOCK_SIZES, "tensor"):
        errors, flushed, count = 0.0, 0, 0
        for m in moments:
            size = m.numel() if block == "tensor" else block
            restored = dequantize_blocks(*quantize_blocks(m, size), m.shape)
            nonzero = m != 0
            errors += float(((restored - m).abs() / m.abs())[nonzero].sum())
            flushed += int((restored[nonzero] == 0).sum())
            count += int(nonzero.sum())
        bytes_per_param = 1 + (0 if block == "tensor" else 4 / block)
        results[str(block)] = {"mean_relative_error": errors / count, "flushed": flushed / count,
                               "bytes_per_param": bytes_per_param}  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results_optim_master_rounding.json")
    args = parser.parse_args()
    data = split_text(embedded_text(), MODEL.block_size)
    runs = {name: train(name, args.steps, args.seed, data) for name in CONFIGS}
    moments = moment_errors(runs[REFERENCES[0.95]])
    rows, results = [], {"steps": args.steps, "seed": args.seed, "configs": {}, "fp8_first_moment": moments}
    for name, run in runs.items():
        record = {key: run[key] for key in ("train_loss", "val_loss", "unchanged_last_step", "seconds")}
        record["weight_drift"] = weight_drift(run, runs[REFERENCES[CONFIGS[name][2]]])
        results["configs"][name] = record
        rows.append([name, f"{record['train_loss']:.4f}", f"{record['val_loss']:.4f}", f"{record['weight_drift']:.4f}",
                     f"{100 * record['unchanged_last_step']:.1f}%"])  # fmt: skip
    print(f"{args.steps} steps, lr {LR:g} -> {MIN_LR:g} (cosine), seed {args.seed}\n")
    print(markdown_table(["configuration", "train loss", "val loss", "weight drift", "unchanged (last step)"], rows))
    moment_rows = [[f"{block}" if block == "tensor" else f"block {block}", f"{r['bytes_per_param']:.3f}",
                    f"{r['mean_relative_error']:.4f}", f"{100 * r['flushed']:.2f}%"]
                   for block, r in results["fp8_first_moment"].items()]  # fmt: skip
    print("\nE4M3 first moment (the float32 run's final exp_avg of every matrix):\n")
    print(markdown_table(["scales", "bytes/param", "mean relative error", "flushed to 0"], moment_rows))
    with open(args.out, "w") as file:
        json.dump(results, file, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
