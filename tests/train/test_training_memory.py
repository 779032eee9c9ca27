"""The trainer's low-precision optimizer settings (``optimizer_master_dtype``,
``optimizer_state_dtype``) and the bytes a run keeps between steps, hand-computed."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import fp8train
from fp8train.optim import AdamW
from fp8train.train.arguments import TrainingArguments
from fp8train.train.commands.compare import build_model
from fp8train.train.memory import state_bytes_per_parameter, tensor_bytes, training_state_bytes
from fp8train.train.trainer import Trainer

SIZES = ((128, 256), (256, 64))  # two Linears with biases: 4 parameter tensors
NUM_PARAMETERS = sum(i * o + o for i, o in SIZES)
TENSORS = [n for i, o in SIZES for n in (i * o, o)]


def _run(tmp_path, **settings):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(*SIZES[0]), nn.GELU(), nn.Linear(*SIZES[1]))
    x, y = torch.randn(64, 128), torch.randint(0, 64, (64,))
    args = TrainingArguments(
        output_dir=str(tmp_path), steps=3, batch_size=16, eval_interval=0, save_checkpoints=False, device="cpu",
        warmup_steps=1, fp8_recipe="mxfp8", **settings,
    )  # fmt: skip
    trainer = Trainer(model, args, TensorDataset(x, y), loss_fn=lambda m, a, b: nn.functional.cross_entropy(m(a), b))
    return trainer, trainer.train()


def test_the_default_is_torchs_adamw_in_float32(tmp_path):
    trainer, result = _run(tmp_path)
    assert type(trainer.optimizer) is torch.optim.AdamW
    # float32 weights and gradients; exp_avg + exp_avg_sq float32, and a float32 step per tensor.
    assert result["state_bytes"] == {
        "parameters": NUM_PARAMETERS, "weights": 4 * NUM_PARAMETERS, "gradients": 4 * NUM_PARAMETERS,
        "optimizer_state": 8 * NUM_PARAMETERS + 4 * len(TENSORS),
    }  # fmt: skip


def test_bf16_masters_and_fp8_moments_hold_the_bytes_they_should(tmp_path):
    trainer, result = _run(tmp_path, optimizer_master_dtype="bf16", optimizer_state_dtype="fp8")
    assert isinstance(trainer.optimizer, AdamW)
    group = trainer.optimizer.param_groups[0]
    assert (group["master_weight_dtype"], group["exp_avg_dtype"], group["exp_avg_sq_dtype"]) == (
        torch.bfloat16, torch.float8_e4m3fn, torch.bfloat16,
    )  # fmt: skip
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    # Per tensor of n values: E4M3 codes in whole blocks of 128, a float32 scale per block,
    # a bfloat16 second moment, a float32 step; no master (bf16 parameters are their own).
    blocks = [math.ceil(n / 128) for n in TENSORS]
    optimizer_bytes = sum(b * 128 + 4 * b + 2 * n + 4 for b, n in zip(blocks, TENSORS))
    assert result["state_bytes"] == {
        "parameters": NUM_PARAMETERS, "weights": 2 * NUM_PARAMETERS, "gradients": 2 * NUM_PARAMETERS,
        "optimizer_state": optimizer_bytes,
    }  # fmt: skip
    assert math.isfinite(result["final_train_loss"])


def test_bf16_moments_with_float32_masters(tmp_path):
    trainer, result = _run(tmp_path, optimizer_state_dtype="bf16")
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert result["state_bytes"]["optimizer_state"] == 4 * NUM_PARAMETERS + 4 * len(TENSORS)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"optimizer_master_dtype": "fp16"}, r"optimizer_master_dtype='fp16'.*float32.*bf16"),
        ({"optimizer_state_dtype": "int8"}, r"optimizer_state_dtype='int8'.*float32.*bf16.*fp8"),
        ({"optimizer_master_dtype": "bf16", "mixed_precision": "fp16"}, r"use mixed_precision='bf16'"),
    ],
)
def test_bad_settings_name_the_value_and_the_choices(settings, match):
    with pytest.raises(ValueError, match=match):
        TrainingArguments(**settings)


def test_bytes_count_each_storage_once_and_the_report_divides_by_parameters():
    weight = torch.zeros(10, 4)
    assert tensor_bytes([weight, weight[:5], weight.t()]) == 160  # views share one storage
    model = nn.Linear(4, 10)
    model.weight.requires_grad_(False)  # a frozen weight keeps no gradient
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    assert training_state_bytes(model, optimizer) == {
        "parameters": 50, "weights": 200, "gradients": 40, "optimizer_state": 40,
    }  # fmt: skip
    text = state_bytes_per_parameter({"parameters": 50, "weights": 200, "gradients": 40, "optimizer_state": 40})
    assert text == "4.0 + 0.8 + 0.8 = 5.6"


def test_a_weight_stored_in_fp8_counts_its_codes_and_scales():
    model = fp8train.convert_to_float8_training(nn.Sequential(nn.Linear(128, 64)), "tensorwise")
    model.requires_grad_(False)
    fp8train.store_frozen_weights_in_fp8(model)
    # 64 x 128 E4M3 codes, a float32 scale_inv, the float32 bias (tensorwise: one copy).
    assert tensor_bytes(model.parameters()) == 64 * 128 + 4 + 64 * 4


def test_fp8_weights_train_bit_identically_and_keep_one_byte_per_weight(tmp_path):
    """Without torch.autocast (which would quantize a bf16 copy of the weight where FP8
    weights quantize the float32 master) the run is the run without fp8_weights, bit for bit."""
    _, plain = _run(tmp_path / "plain", mixed_precision="no")
    trainer, fp8 = _run(tmp_path / "fp8", mixed_precision="no", fp8_weights=True)
    assert isinstance(trainer.optimizer, AdamW)
    assert fp8["losses"] == plain["losses"]
    # mxfp8 keeps two copies of each weight (rowwise and columnwise): 2 bytes per value and an
    # E8M0 scale per 32 of each copy; float32 biases. The masters (float32) are in the optimizer.
    weights = sum(2 * i * o + 2 * i * o // 32 + 4 * o for i, o in SIZES)
    assert fp8["state_bytes"]["weights"] == weights
    masters = 4 * sum(i * o for i, o in SIZES)
    assert fp8["state_bytes"]["optimizer_state"] == plain["state_bytes"]["optimizer_state"] + masters


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"fp8_weights": True, "fp8_recipe": "mxfp8", "strategy": "fsdp2", "tp": 2},
         r"fp8_weights=True with tp=2 is not supported: tensor parallelism does not shard"),
        ({"fp8_weights": True, "fp8_recipe": "rowwise", "strategy": "fsdp2"},
         r"fp8_weights=True with strategy='fsdp2' and fp8_recipe='rowwise' is not supported: FSDP2 shards FP8"),
    ],
)
def test_fp8_weights_refuse_tensor_parallelism_and_fsdp2_without_fp8_gather(settings, match):
    with pytest.raises(ValueError, match=match):
        TrainingArguments(**settings)


def test_fp8_weights_leave_a_run_without_a_recipe_as_it_was(tmp_path):
    """compare's bf16 baseline under --fp8_weights true: no FP8 Linear, torch's AdamW."""
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(tmp_path), steps=1, save_checkpoints=False, eval_interval=0, device="cpu", fp8_weights=True
    )
    x, y = torch.randn(16, 128), torch.randint(0, 64, (16,))
    loss_fn = lambda m, a, b: nn.functional.cross_entropy(m(a), b)  # noqa: E731
    trainer = Trainer(nn.Linear(128, 64), args, TensorDataset(x, y), loss_fn=loss_fn)
    assert type(trainer.optimizer) is torch.optim.AdamW


def test_fsdp2_counts_the_shards_it_keeps_after_an_evaluation(one_rank_group, tmp_path, datasets):
    """After the last step's evaluation (a forward, no backward) FSDP2's root module holds
    its gathered weights (here the lm_head's, gathered in FP8: a wrapper with no storage).
    What the run keeps between steps is its shards: on one rank, the bytes of the same run
    without FSDP2."""
    results = {}
    for strategy in ("none", "fsdp2"):
        args = TrainingArguments(
            output_dir=str(tmp_path / strategy), strategy=strategy, fp8_recipe="tensorwise", steps=1, n_layer=1,
            n_embd=128, n_head=2, seq_len=32, batch_size=2, eval_batches=1, save_checkpoints=False, device="cpu",
        )
        results[strategy] = Trainer(lambda: build_model(args), args, *datasets).train()["state_bytes"]
    assert results["fsdp2"] == results["none"]
