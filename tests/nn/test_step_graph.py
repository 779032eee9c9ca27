"""Whole steps in CUDA graphs, checked on a CPU (``fp8train/nn/step_graph.py``): a step is
captured only after warm-up steps, two of which dispatch the same ops with the same shapes and
arguments and make no host read, tensor from Python data or copy between devices; what
cannot be captured is named once and runs eagerly. The capture itself is CUDA's; here a
stand-in replays the step eagerly on the static inputs, which checks the flow (the GPU suite
checks the replay bit for bit against eager steps)."""

import logging
import math

import pytest
import torch
from torch import nn

import fp8train
from fp8train.nn.step_graph import DEVICE_COPY, HOST_READ, PYTHON_DATA, StepGraph, StepTrace, trace_difference
from fp8train.quant.kernels import use_quant_settings

LOGGER = "fp8train.nn.step_graph"


class EagerCapture:
    """A stand-in for ``_CudaCapture``: replays by running the step on the static inputs,
    its gradients written into the tensors of the capture, as a graph's backward writes them."""

    made = 0

    def __init__(self, step, inputs, parameters) -> None:
        EagerCapture.made += 1
        self.step, self.inputs, self.parameters = step, inputs, parameters
        # A capture records and computes nothing: the gradients it leaves hold no values yet.
        self.grads = [torch.full_like(p, math.nan) for p in parameters]
        for parameter, grad in zip(parameters, self.grads):
            parameter.grad = grad

    def replay(self):
        # A graph writes into its gradient tensors and touches no attribute: the parameters'
        # .grad references stay what they were (the StepGraph's to set).
        held = [parameter.grad for parameter in self.parameters]
        for parameter in self.parameters:
            parameter.grad = None
        outputs = self.step(self.inputs)
        for parameter, grad, before in zip(self.parameters, self.grads, held):
            grad.copy_(parameter.grad)
            parameter.grad = before
        return outputs


def _sgd_step(model, bf16_autocast: bool = False):
    def step(inputs):
        (x,) = inputs
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast), fp8train.autocast():
            loss = model(x).float().square().mean()
        loss.backward()
        return (loss,)

    return step


def _graph(model, step=None, **kwargs):
    params = [p for p in model.parameters() if p.requires_grad]
    return StepGraph(step or _sgd_step(model), model, params, capture=EagerCapture, **kwargs)


def test_the_trace_records_signatures_and_breaks():
    with StepTrace() as trace:
        x = torch.ones(2, 3)
        (x * 2).sum().item()
        torch.tensor([1.0, 2.0])
    assert trace.breaks == [f"{HOST_READ}: aten._local_scalar_dense.default", f"{PYTHON_DATA}: aten.lift_fresh.default"]
    assert ("aten.mul.Tensor", (((("tensor", (2, 3), torch.float32, "cpu"), 2), {}))) in trace.ops


def test_a_copy_between_devices_is_a_break():
    # The meta device stands for a second device on a CPU-only machine.
    with StepTrace() as trace:
        torch.ones(2).to("meta")
        torch.empty(2, device="meta").copy_(torch.ones(2))
        torch.ones(2).to(torch.float64)  # a cast on the device: no break
    assert trace.breaks == [f"{DEVICE_COPY}: aten._to_copy.default", f"{DEVICE_COPY}: aten.copy_.default"]


def test_a_difference_between_steps_is_named_with_the_op():
    def traced(scalar):
        with StepTrace() as trace:
            torch.ones(4).mul(scalar)
        return trace

    assert trace_difference(traced(2.0), traced(2.0)) is None
    reason = trace_difference(traced(2.0), traced(3.0))
    assert reason.startswith("the step changes between steps: its op 1 was aten.mul.Tensor")
    assert "2.0" in reason and "3.0" in reason


@pytest.fixture
def gpu_conversions(monkeypatch):
    """FP8 codes to high precision as on a GPU (``data.to(dtype)``, the same bits): the CPU's
    faster conversion checks for NaN codes on the host, in a branch only CPU tensors take."""
    import fp8train.quant.fp8_quantize as fp8_quantize
    import fp8train.quant.gemm.emulated as emulated
    import fp8train.quant.tensor as tensor

    def to_dtype(data, dtype=torch.bfloat16, traced=False, numel=None):
        return data.to(dtype)

    for module in (emulated, tensor):
        monkeypatch.setattr(module, "fp8_to_hp", to_dtype)
    monkeypatch.setattr(emulated, "checked_fp8_to_hp", to_dtype)  # the GEMM operands' unchecked call
    monkeypatch.setattr(fp8_quantize, "checked_fp8_to_hp", to_dtype)  # the reference's operand values (CPU only)


@pytest.mark.parametrize("bf16_autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("recipe", fp8train.recipes.RECIPE_NAMES)
def test_every_recipe_s_step_is_captured_after_its_warm_up(small_model, recipe, bf16_autocast, gpu_conversions):
    # bf16 outputs take the emulated GEMM's bfloat16 path (the bias in an extra column).
    model = small_model((128, 128), "gelu", (128, 128), recipe=recipe)
    graph = _graph(model, _sgd_step(model, bf16_autocast))
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    made = EagerCapture.made
    with use_quant_settings(quantize_kernel="reference"):  # the path a GPU takes
        for call in range(6):
            model.zero_grad(set_to_none=True)
            graph([x])
            assert (EagerCapture.made - made, graph.reason) == (int(call >= 4), None)
    assert all(p.grad is g for p, g in zip(graph.parameters, graph.captured.grads))


def test_the_warm_up_is_four_steps_at_least():
    with pytest.raises(ValueError, match="warmup=3 must be at least 4"):
        _graph(nn.Linear(2, 2), warmup=3)


def test_a_host_read_in_the_step_keeps_it_eager_and_says_so(caplog):
    model = nn.Linear(4, 4)

    def step(inputs):
        loss = model(inputs[0]).sum()
        loss.backward()
        if loss.item() > 1e9:  # a host read of the loss
            raise AssertionError
        return (loss,)

    graph = _graph(model, step)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(4):
            graph([torch.ones(2, 4)])
    assert graph.captured is None
    assert graph.reason == f"the step makes a {HOST_READ}: aten._local_scalar_dense.default"
    assert [r.getMessage() for r in caplog.records] == [
        f"fp8train: CUDA graphs off, every step runs eagerly from now on: {graph.reason}"
    ]


def test_a_python_value_that_changes_between_steps_keeps_it_eager():
    model, count = nn.Linear(4, 4), [0]

    def step(inputs):
        count[0] += 1
        loss = model(inputs[0]).mul(count[0]).sum()  # a step counter frozen into a graph
        loss.backward()
        return (loss,)

    graph = _graph(model, step)
    for _ in range(4):
        graph([torch.ones(2, 4)])
    assert graph.captured is None and graph.reason.startswith("the step changes between steps")


def test_a_changing_shape_stops_the_graph_and_runs_eagerly():
    model = nn.Linear(4, 4)
    graph = _graph(model)
    for _ in range(5):
        graph([torch.ones(2, 4)])
    assert graph.captured is not None
    (loss,) = graph([torch.ones(3, 4)])
    assert graph.reason == "a changing shape: inputs of [(3, 4)] after [(2, 4)]"
    assert loss.item() == pytest.approx(model(torch.ones(3, 4)).square().mean().item())


def test_moe_experts_keep_the_step_eager_from_the_start(caplog):
    from fp8train.nn.modules.experts import Float8Experts

    model = nn.Sequential(nn.Linear(128, 128), Float8Experts(2, 128, 128, torch.relu))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        graph = _graph(model)
    assert graph.reason == (
        "1 (Float8Experts): its routing reads each expert's token count on the host (the GEMMs' shapes)"
    )
    assert len(caplog.records) == 1 and graph.reason in caplog.records[0].getMessage()


def test_trainable_fp8_weights_keep_the_step_eager_and_frozen_ones_do_not():
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
    fp8train.convert_to_float8_training(model, recipe="tensorwise", fp8_weights=True)
    assert _graph(model).reason == (
        "0.weight: a trainable weight stored in FP8 (fp8_weights=True) takes new FP8 tensors at each optimizer "
        "step, which a captured step would not read"
    )
    frozen = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
    fp8train.convert_to_float8_training(frozen, recipe="tensorwise")
    frozen[0].weight.requires_grad_(False)
    assert fp8train.store_frozen_weights_in_fp8(frozen) == ["0"]
    assert _graph(frozen).reason is None


def test_a_capture_that_fails_runs_the_step_eagerly_and_says_why(caplog):
    class FailingCapture:
        def __init__(self, step, inputs, parameters) -> None:
            for parameter in parameters:
                parameter.grad = torch.full_like(parameter, math.nan)  # what a broken capture may leave
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    model = nn.Linear(4, 4)
    graph = StepGraph(_sgd_step(model), model, list(model.parameters()), capture=FailingCapture)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(5):
            model.zero_grad(set_to_none=True)
            (loss,) = graph([torch.ones(2, 4)])
    assert graph.reason == "capturing the step failed: RuntimeError: operation not permitted when stream is capturing"
    assert graph.captured is None and caplog.records[-1].getMessage().endswith(graph.reason)
    expected = model(torch.ones(2, 4)).square().mean()
    assert loss.item() == expected.item()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())  # this step's, computed eagerly
