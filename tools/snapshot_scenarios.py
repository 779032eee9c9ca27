"""The scenarios ``tools/snapshot.py record`` runs: small seeded training runs of every
recipe through every module kind the converter produces, a quantization of one tensor by
every operand rule of every recipe, and one run of the ``fp8train train`` command.

Only public names are used (``import fp8train``'s top level, ``fp8train.quant``'s
``__all__``, ``fp8train.optim``, ``fp8train.recipes``, transformers, torch), so the same
scenarios run on a tree before and after a refactor that moves modules. Every value
recorded is a plain tensor cloned at the moment it is recorded, under a key such as
``tensorwise/linear/step1/grad/0.weight``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import fp8train
import fp8train.optim
import fp8train.quant

Snapshot = dict[str, torch.Tensor]

WIDTH = 128  # a whole 128-block (blockwise), 32 (mx, mxfp4) and 16 (nvfp4) group
TOKENS = 64  # rows of every GEMM: batch 2 x sequence 32
BATCH, SEQ, VOCAB = 2, 32, 256
LR, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-2, 0.1, 1.0
RESUME_SEED = 1234  # a fresh model's initial weights, overwritten by the checkpoint
TRAINER_RECIPE = "delayed"  # its checkpoint carries delayed scaling's state


# ------------------------------------------------------------------ models and batches


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)).to(dtype)


def _gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        n_layer=1, n_embd=WIDTH, n_inner=2 * WIDTH, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def _encoder_layer() -> nn.Module:
    return nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=2 * WIDTH, dropout=0.0, batch_first=True)


def _mixtral() -> nn.Module:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=WIDTH, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
    )
    return transformers.MixtralForCausalLM(config)


def _features(step: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(step)).to(dtype)


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _reconstruction_loss(
    model: nn.Module, step: int, *, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """An input of ``shape``, in the model's dtype, learns to reproduce itself."""
    x = _features(step, shape, next(model.parameters()).dtype)
    output = model(x)
    return F.mse_loss(output.float(), x.float()), output


def _language_model_loss(model: nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = _tokens(step)
    result = model(tokens, labels=tokens)
    return result.loss, result.logits


_rows_loss = partial(_reconstruction_loss, shape=(TOKENS, WIDTH))
_sequence_loss = partial(_reconstruction_loss, shape=(BATCH, SEQ, WIDTH))


def _freeze_first_linear(model: nn.Module) -> None:
    model[0].requires_grad_(False)


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One small training run, repeated for every recipe.

    Attributes:
        name: the key's second part.
        build: builds the unconverted model (the seed is set before).
        loss: ``(model, step) -> (loss, output)``.
        bf16_autocast: run forward and loss under ``torch.autocast`` in bfloat16.
        freeze: called on the model before conversion (frozen weights stored in FP8 after).
        fp8_weights: ``convert_to_float8_training(..., fp8_weights=True)``.
        adamw: extra keywords of ``fp8train.optim.AdamW`` (low-precision state).
    """

    name: str
    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int], tuple[torch.Tensor, torch.Tensor]]
    bf16_autocast: bool = False
    freeze: Callable[[nn.Module], None] | None = None
    fp8_weights: bool = False
    adamw: dict = field(default_factory=dict)


SCENARIOS = (
    Scenario(name="linear", build=_mlp, loss=_rows_loss),
    Scenario(
        name="linear_bf16_lowp_adamw", build=lambda: _mlp(torch.bfloat16), loss=_rows_loss,
        adamw=dict(master_weight_dtype=torch.bfloat16, exp_avg_dtype=torch.float8_e4m3fn,
                   exp_avg_sq_dtype=torch.bfloat16),
    ),
    Scenario(name="linear_fp8_weights", build=_mlp, loss=_rows_loss, fp8_weights=True),
    Scenario(name="linear_frozen_fp8", build=_mlp, loss=_rows_loss, freeze=_freeze_first_linear),
    Scenario(name="gpt2_conv1d", build=_gpt2, loss=_language_model_loss, bf16_autocast=True),
    Scenario(
        name="gpt2_conv1d_fp8_weights", build=_gpt2, loss=_language_model_loss, bf16_autocast=True, fp8_weights=True
    ),
    Scenario(name="multihead_attention", build=_encoder_layer, loss=_sequence_loss),
    Scenario(name="multihead_attention_fp8_weights", build=_encoder_layer, loss=_sequence_loss, fp8_weights=True),
    Scenario(name="mixtral_experts", build=_mixtral, loss=_language_model_loss),
    Scenario(name="mixtral_experts_fp8_weights", build=_mixtral, loss=_language_model_loss, fp8_weights=True),
)


# ------------------------------------------------------------------ recording values


def plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """A detached, contiguous copy of ``value`` as a plain tensor; a tensor subclass (an
    FP8-stored weight) is recorded by its dequantized value."""
    value = value.detach()
    if type(value) is not torch.Tensor:
        value = value.dequantize()
    return value.clone().contiguous()


def put(snapshot: Snapshot, key: str, value: object) -> None:
    """Record ``value`` under ``key``: tensors, numbers (as 0-d tensors), and dicts, lists
    and tuples of them (under ``key/item``); other values (strings, ``None``) are skipped."""
    if isinstance(value, torch.Tensor):
        if key in snapshot:
            raise ValueError(f"key {key!r} recorded twice")
        snapshot[key] = plain_tensor(value)
    elif isinstance(value, dict):
        for name, item in value.items():
            put(snapshot, f"{key}/{name}", item)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            put(snapshot, f"{key}/{index}", item)
    elif isinstance(value, (bool, int)):
        put(snapshot, key, torch.tensor(value, dtype=torch.int64))
    elif isinstance(value, float):
        put(snapshot, key, torch.tensor(value, dtype=torch.float64))


# ------------------------------------------------------------------ training scenarios


def _build(recipe: str, scenario: Scenario, seed: int) -> tuple[nn.Module, fp8train.optim.AdamW]:
    torch.manual_seed(seed)
    model = scenario.build()
    if scenario.freeze is not None:
        scenario.freeze(model)
    fp8train.convert_to_float8_training(model, recipe, backend="emulated", fp8_weights=scenario.fp8_weights)
    if scenario.freeze is not None:
        fp8train.store_frozen_weights_in_fp8(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = fp8train.optim.AdamW(trainable, lr=LR, weight_decay=WEIGHT_DECAY, **scenario.adamw)
    return model, optimizer


def _step(model: nn.Module, optimizer, recipe: str, scenario: Scenario, step: int, snapshot: Snapshot, prefix: str):
    """One training step; records its loss, output, every gradient and their norm (then
    clipped to ``MAX_GRAD_NORM``) before the update."""
    delayed = fp8train.recipes.from_name(recipe).operand_plan.delayed
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16) if scenario.bf16_autocast else contextlib.nullcontext()
    with bf16, fp8train.autocast() if delayed else contextlib.nullcontext():
        loss, output = scenario.loss(model, step)
    loss.backward()
    put(snapshot, f"{prefix}/step{step}/loss", loss)
    put(snapshot, f"{prefix}/step{step}/output", output)
    for name, parameter in model.named_parameters():  # as the backward left them, before clipping
        put(snapshot, f"{prefix}/step{step}/grad/{name}", parameter.grad)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_GRAD_NORM)
    put(snapshot, f"{prefix}/step{step}/grad_norm", grad_norm)
    optimizer.step()
    optimizer.zero_grad()


def _record_state(model: nn.Module, optimizer, snapshot: Snapshot, prefix: str) -> None:
    """Every parameter, the model's ``state_dict`` and the optimizer's state tensors."""
    for name, parameter in model.named_parameters():
        put(snapshot, f"{prefix}/param/{name}", parameter)
    put(snapshot, f"{prefix}/state_dict", model.state_dict())
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    for index, state in optimizer.state_dict()["state"].items():
        put(snapshot, f"{prefix}/optim/{names[index]}", state)


def run_scenario(recipe: str, scenario: Scenario, num_steps: int, snapshot: Snapshot) -> None:
    """``num_steps`` steps, the state after them; then a checkpoint (``torch.save`` of
    model and optimizer state) loaded into a fresh converted model and optimizer, which
    runs one more step (its loss, output, gradients and the parameters after it)."""
    prefix = f"{recipe}/{scenario.name}"
    model, optimizer = _build(recipe, scenario, seed=0)
    put(snapshot, f"{prefix}/num_converted", fp8train.conversion_report(model).num_converted)
    for step in range(1, num_steps + 1):
        _step(model, optimizer, recipe, scenario, step, snapshot, prefix)
    _record_state(model, optimizer, snapshot, f"{prefix}/final")
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "checkpoint.pt"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        del model, optimizer
        resumed, resumed_optimizer = _build(recipe, scenario, seed=RESUME_SEED)
        checkpoint = torch.load(path, weights_only=True)
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    _step(resumed, resumed_optimizer, recipe, scenario, num_steps + 1, snapshot, f"{prefix}/resumed")
    # The parameters after the resumed step show the optimizer's loaded state at work; its
    # whole state again would double the file for little.
    for name, parameter in resumed.named_parameters():
        put(snapshot, f"{prefix}/resumed/final/param/{name}", parameter)


# ------------------------------------------------------------------ quantization by rule


def _quant_input(dtype: torch.dtype) -> torch.Tensor:
    """256x256 values over 2**-12 .. 2**12 by row, with zeros, negative zeros and one
    large value among them."""
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(7))
    x = x * torch.exp2(torch.linspace(-12, 12, 256)).unsqueeze(1)
    x[3, :40], x[5, 7], x[9, 100] = 0.0, -0.0, 3.0e4
    return x.to(dtype)


def record_quantizations(snapshot: Snapshot) -> None:
    """``fp8train.quant.quantize`` of one tensor (float32 and bfloat16) by every operand
    rule of every recipe: the codes, scales and (NVFP4) global amax."""
    for recipe_name in fp8train.recipes.RECIPE_NAMES:
        for operand in fp8train.recipes.from_name(recipe_name).operand_plan.operands:
            rule = operand.rule
            for dtype in (torch.float32, torch.bfloat16):
                generator = torch.Generator().manual_seed(11) if rule.stochastic_rounding else None
                quantized = fp8train.quant.quantize(
                    _quant_input(dtype), rule.granularity, dtype=getattr(torch, rule.format.dtype_name),
                    axis=operand.axis, power_2_scales=rule.power_2_scales, amax_epsilon=rule.amax_epsilon,
                    mx_scale_rule=rule.mx_scale_rule, rht=rule.rht, stochastic_rounding=rule.stochastic_rounding,
                    generator=generator,
                )
                prefix = f"quant/{recipe_name}/{operand.usage.name.lower()}/{str(dtype).removeprefix('torch.')}"
                put(snapshot, f"{prefix}/data", quantized.data)
                put(snapshot, f"{prefix}/scale_inv", quantized.scale_inv)
                put(snapshot, f"{prefix}/global_amax", quantized.global_amax)


# ------------------------------------------------------------------ the trainer


def record_trainer_run(num_steps: int, snapshot: Snapshot) -> None:
    """``python -m fp8train train`` on its embedded default model and text, a few tiny
    steps in a child process of one thread: every step's logged numbers and the tensors
    of the checkpoint it writes (weights, optimizer state, RNG states)."""
    from safetensors.torch import load_file

    package_root = str(Path(fp8train.__file__).resolve().parents[1])  # the same fp8train in the child
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    prefix = f"trainer/{TRAINER_RECIPE}"
    with tempfile.TemporaryDirectory() as directory:
        command = [
            sys.executable, "-m", "fp8train", "train", "--output_dir", directory, "--fp8_recipe", TRAINER_RECIPE,
            "--steps", str(num_steps), "--n_layer", "1", "--n_embd", str(WIDTH), "--n_head", "2",
            "--seq_len", str(SEQ), "--batch_size", "4", "--eval_batches", "1", "--warmup_steps", "1",
            "--log_interval", "1", "--device", "cpu",
        ]
        run = subprocess.run(command, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited with {run.returncode}:\n{run.stderr[-4000:]}")
        for line in (Path(directory) / "metrics.jsonl").read_text().splitlines():
            metrics = json.loads(line)
            for name in ("loss", "lr", "grad_norm", "val_loss"):
                put(snapshot, f"{prefix}/step{metrics['step']}/{name}", metrics.get(name))
        checkpoint = Path(directory) / f"checkpoint-{num_steps}"
        put(snapshot, f"{prefix}/checkpoint/model", load_file(checkpoint / "model.safetensors"))
        put(snapshot, f"{prefix}/checkpoint/rng", load_file(checkpoint / "rng.safetensors"))
        optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
        put(snapshot, f"{prefix}/checkpoint/optimizer", optimizer["state"])


def record_all(num_steps: int, log: Callable[[str], None] = lambda message: None) -> Snapshot:
    """Every scenario, in a fixed order, on one CPU thread."""
    torch.set_num_threads(1)
    snapshot: Snapshot = {}
    record_quantizations(snapshot)
    log(f"quantizations: {len(snapshot)} tensors")
    for recipe in fp8train.recipes.RECIPE_NAMES:
        for scenario in SCENARIOS:
            run_scenario(recipe, scenario, num_steps, snapshot)
        log(f"{recipe}: {len(snapshot)} tensors")
    record_trainer_run(num_steps, snapshot)
    log(f"trainer: {len(snapshot)} tensors")
    return snapshot
