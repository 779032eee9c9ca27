"""What training keeps, per parameter, and its peak memory: AdamW in float32 against
fp8train's low-precision configurations, on the trainer's default model and on a
~100M-parameter transformers Llama.

    python benchmarks/bench_memory.py [--models default llama100m] [--recipes <names>]
                                      [--steps 2] [--out benchmarks/results_memory.json]

Each configuration builds a fresh model and optimizer and trains ``--steps`` steps (bf16
``torch.autocast`` around the forward, batch ``--batch_size`` x ``--seq_len`` tokens), all
inside the measurement:

* ``fp32 AdamW``: float32 parameters, ``torch.optim.AdamW`` (the baseline);
* ``bf16 weights, fp32 masters``: bfloat16 parameters, ``fp8train.optim.AdamW(master_weight_dtype=float32)``;
* ``<recipe>``: converted with ``convert_to_float8_training``, float32 parameters, ``torch.optim.AdamW``;
* ``<recipe>, low-precision``: converted, bfloat16 parameters that are their own masters
  (stochastic rounding), ``exp_avg_dtype=float8_e4m3fn`` (a scale per 128), ``exp_avg_sq_dtype=bfloat16``;
* ``<recipe>, low-precision, FP8 weights``: the same with ``fp8_weights=True`` (each FP8
  Linear's weight kept only in FP8, its bfloat16 master in the optimizer).

Columns, bytes per parameter: weights (parameters and buffers), masters (copies the
optimizer keeps), gradients, optimizer states (moments, their scales, step counts); peak:
the most bytes PyTorch's CPU allocator held at once during the run (model, optimizer,
activations, emulated-GEMM temporaries), and its ratio over the baseline measured in the
same run. Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_linear import cpu_features  # noqa: E402
from bench_saved_activations import peak_allocated_bytes  # noqa: E402

import fp8train  # noqa: E402
from fp8train.optim import AdamW  # noqa: E402
from fp8train.spec.recipes import RECIPE_NAMES  # noqa: E402
from fp8train.train.arguments import TrainingArguments  # noqa: E402
from fp8train.train.commands.compare import build_model  # noqa: E402
from fp8train.diagnostics.markdown import markdown_table  # noqa: E402
from fp8train.train.memory import tensor_bytes  # noqa: E402

VOCAB = 256


def _default_model() -> torch.nn.Module:
    return build_model(TrainingArguments())


def _llama100m() -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=12, vocab_size=8192, max_position_embeddings=512,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


MODELS = {"default": _default_model, "llama100m": _llama100m}


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if not hasattr(model, "get_output_embeddings"):  # the default GPT computes its own loss
        return model(inputs, targets)
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _configs(recipes: list[str]) -> dict[str, dict]:
    low = dict(master_weight_dtype=torch.bfloat16, exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.bfloat16)
    configs = {
        "fp32 AdamW": dict(recipe=None, param_dtype=torch.float32, optimizer=None),
        "bf16 weights, fp32 masters": dict(
            recipe=None, param_dtype=torch.bfloat16, optimizer=dict(master_weight_dtype=torch.float32)
        ),
    }
    for recipe in recipes:
        configs[recipe] = dict(recipe=recipe, param_dtype=torch.float32, optimizer=None)
        configs[f"{recipe}, low-precision"] = dict(recipe=recipe, param_dtype=torch.bfloat16, optimizer=low)
        configs[f"{recipe}, low-precision, FP8 weights"] = dict(
            recipe=recipe, param_dtype=torch.bfloat16, optimizer=low, fp8_weights=True
        )
    return configs


def _train(build, config: dict, tokens: torch.Tensor, steps: int, record: dict) -> None:
    """Build, convert and train; write what it keeps into ``record`` (bytes)."""
    torch.manual_seed(0)
    model = build().to(config["param_dtype"])
    if config["recipe"] is not None:
        fp8train.convert_to_float8_training(model, config["recipe"], fp8_weights=config.get("fp8_weights", False))
    params = list(model.parameters())
    optimizer = (
        torch.optim.AdamW(params, lr=1e-4) if config["optimizer"] is None else AdamW(params, lr=1e-4, **config["optimizer"])
    )
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, tokens)
        loss.backward()
        record["gradients"] = tensor_bytes(p.grad for p in params if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad()
    state = [(name, v) for s in optimizer.state.values() for name, v in s.items() if torch.is_tensor(v)]
    record.update(
        parameters=sum(p.numel() for p in params),
        weights=tensor_bytes([*params, *model.buffers()]),
        masters=tensor_bytes(v for name, v in state if name == "master"),
        optimizer_states=tensor_bytes(v for name, v in state if name != "master"),
    )


def measure(model_name: str, recipes: list[str], steps: int, batch_size: int, seq_len: int) -> list[dict]:
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(1))
    rows = []
    for label, config in _configs(recipes).items():
        record: dict = {"model": model_name, "config": label}
        record["peak_bytes"] = peak_allocated_bytes(lambda: _train(MODELS[model_name], config, tokens, steps, record))
        rows.append(record)
        print(f"measured {model_name}: {label}", file=sys.stderr)
    baseline = rows[0]["peak_bytes"]
    for row in rows:
        row["peak_ratio"] = row["peak_bytes"] / baseline
    return rows


def print_table(rows: list[dict]) -> None:
    per = lambda r, key: f"{r[key] / r['parameters']:.2f}"  # noqa: E731
    table = [
        (r["model"], r["config"], per(r, "weights"), per(r, "masters"), per(r, "gradients"), per(r, "optimizer_states"),
         f"{r['peak_bytes'] / 2**20:.0f}", f"{r['peak_ratio']:.2f}")
        for r in rows
    ]  # fmt: skip
    headers = ("model", "configuration", "weights B/param", "masters", "gradients", "optimizer states",
               "peak (MiB)", "peak / fp32 AdamW")  # fmt: skip
    print(markdown_table(headers, table, align="llrrrrrr"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--recipes", nargs="+", default=list(RECIPE_NAMES), choices=RECIPE_NAMES)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--out", default=str(HERE / "results_memory.json"))
    args = parser.parse_args()
    rows = [row for name in args.models for row in measure(name, args.recipes, args.steps, args.batch_size, args.seq_len)]
    print_table(rows)
    Path(args.out).write_text(json.dumps({"cpu": cpu_features(), "settings": vars(args), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
