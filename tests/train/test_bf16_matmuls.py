"""The trainer's side of issue 39: on a CPU without native bf16 the step's bf16 matmuls run
as float32 GEMMs of their bf16 operands rounded once (:mod:`fp8train.quant.gemm.bf16`),
decided by one value that every test here sets both ways, whatever this machine is."""

from __future__ import annotations

import pytest
import torch

import fp8train
import fp8train.nn.function as function
from fp8train.quant.gemm.bf16 import bf16_matmul_line, matmul_via_float32_active
from fp8train.train.arguments import TrainingArguments
from fp8train.train.commands.compare import format_report
from fp8train.train.trainer_setup import describe_bf16_matmuls, mixed_precision_autocast

CPU = torch.device("cpu")


@pytest.mark.parametrize(("native", "routed"), [(False, True), (True, False)])
def test_the_step_autocast_routes_bf16_matmuls_only_on_a_cpu_without_native_bf16(native, routed):
    with mixed_precision_autocast(TrainingArguments(), CPU, native_bf16=native):
        assert matmul_via_float32_active() is routed
        assert torch.is_autocast_enabled("cpu")
    assert not matmul_via_float32_active()


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_a_gpu_keeps_torchs_own_autocast():
    context = mixed_precision_autocast(TrainingArguments(), torch.device("cuda"), native_bf16=False)
    assert isinstance(context, torch.autocast)


def _rowwise_with_gw_hp_grad_weight(monkeypatch, native: bool) -> tuple[torch.Tensor, int]:
    """grad_weight of a rowwise_with_gw_hp layer (its GEMM in bf16) on integer data, where
    every float32 sum is exact; and how often the route's GEMM ran."""
    calls = []
    routed = function.matmul_bf16_via_float32
    monkeypatch.setattr(function, "matmul_bf16_via_float32", lambda a, b: calls.append(1) or routed(a, b))
    g = torch.Generator().manual_seed(0)
    model = fp8train.convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(64, 32)), "rowwise_with_gw_hp")
    x = torch.randint(-4, 5, (48, 64), generator=g).float()
    with mixed_precision_autocast(TrainingArguments(), CPU, native_bf16=native), fp8train.autocast():
        out = model(x)
    out.float().sum().backward()
    return model[0].weight.grad, len(calls)


def test_rowwise_with_gw_hp_takes_the_route_for_its_high_precision_grad_weight(monkeypatch):
    routed_grad, routed_calls = _rowwise_with_gw_hp_grad_weight(monkeypatch, native=False)
    native_grad, native_calls = _rowwise_with_gw_hp_grad_weight(monkeypatch, native=True)
    assert (routed_calls, native_calls) == (1, 0)
    assert routed_grad.dtype == torch.float32 and torch.equal(routed_grad, native_grad)


@pytest.mark.parametrize("native", [False, True])
def test_compare_names_the_route_in_its_log_line_and_report(native):
    args = TrainingArguments(device="cpu")
    line = describe_bf16_matmuls(args, native_bf16=native)
    assert line == bf16_matmul_line(not native)
    results = {
        "config": {**args.to_dict(), "steps": 2}, "model": "default GPT", "recipes": ["bf16"], "bf16_matmuls": line,
        "runs": {"bf16": {"final_train_loss": 1.0, "final_val_loss": 1.0, "tokens_per_second": 1.0,
                          "converted_layers": 0, "total_linear_layers": 5}},
    }
    assert f"Matmuls: {line}; tokens/s compare across recipes." in format_report(results)
