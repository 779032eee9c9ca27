"""The bound kernels of a Linear call (issue 38: choices made once, not per call) give the
bits of the checked doors, for every recipe and quantize path, and a call takes them only
where its tensors allow; their caches follow the settings."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

import fp8train
from fp8train.nn.modules.base import Float8Module
from fp8train.quant.operand import bound_kernels, checked_kernels, takes_bound_path
from fp8train.quant.kernels import use_quant_settings
from fp8train.quant.kernels.launch import launch_kernels
from fp8train.quant.kernels.settings import QuantSettings
from fp8train.spec.checks import UnsupportedHardwareError
from fp8train.spec.recipes import RECIPE_NAMES, resolve_recipe as get_recipe
from fp8train.spec.rule import QuantRule

DIM, TOKENS = 128, 32


def _step(recipe: str, bound: bool, monkeypatch, dtype=torch.float32):
    """Output and grads of two steps of a seeded Float8Linear, on the bound or the checked path."""
    with monkeypatch.context() as patch:
        if not bound:
            patch.setattr("fp8train.nn.modules.base.takes_bound_path", lambda *args: False)
        torch.manual_seed(0)
        layer = fp8train.Float8Linear(DIM, DIM, recipe=recipe).to(dtype)
        x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(1), dtype=dtype).requires_grad_()
        results = []
        for _ in range(2):
            with fp8train.autocast():
                out = layer(x)
            out.square().sum().backward()
            results += [out.detach().clone(), x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()]
            x.grad = None
            layer.zero_grad(set_to_none=True)
    return results


@pytest.mark.parametrize("kernel", ["auto", "reference"])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_bound_kernels_give_the_checked_doors_bits(recipe, kernel, monkeypatch):
    with use_quant_settings(quantize_kernel=kernel):
        bound, checked = _step(recipe, True, monkeypatch), _step(recipe, False, monkeypatch)
    for got, expected in zip(bound, checked):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("forward, backward", [("mxfp4", "nvfp4"), ("rowwise", "tensorwise"), ("nvfp4", "mxfp8")])
def test_bound_kernels_of_a_mixed_plan_give_the_checked_doors_bits(forward, backward, monkeypatch):
    """A first-dim usage quantized on its own by a rule with no axis (nvfp4_2d tiles,
    tensor) takes the axis the door gives it (-1), not 0."""
    recipe = fp8train.recipes.hybrid(forward=forward, backward=backward)
    bound, checked = _step(recipe, True, monkeypatch), _step(recipe, False, monkeypatch)
    for got, expected in zip(bound, checked):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_bound_kernels_in_bfloat16_give_the_checked_doors_bits(monkeypatch):
    bound = _step("mxfp8", True, monkeypatch, torch.bfloat16)
    checked = _step("mxfp8", False, monkeypatch, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(bound, checked))


@pytest.mark.parametrize("bound", [True, False])
def test_bound_kernels_check_the_shapes_the_checked_doors_check(bound, monkeypatch):
    if not bound:
        monkeypatch.setattr("fp8train.nn.modules.base.takes_bound_path", lambda *args: False)
    layer = fp8train.Float8Linear(64, 64, recipe="blockwise")  # 128 x 128 blocks do not tile 64
    with pytest.raises(ValueError, match="needs the last dim and the product of the other dims to be divisible by 128"):
        layer(torch.randn(TOKENS, 64))


def test_a_call_takes_the_bound_path_only_for_plain_tensors_it_can_serve():
    x, w, b = torch.randn(4, 8), torch.nn.Parameter(torch.randn(8, 8)), torch.randn(8)
    assert takes_bound_path(x, w, b, compiling=False)
    assert takes_bound_path(x, w, None, compiling=False)
    assert not takes_bound_path(x, w, b, compiling=True)  # a traced call takes the checked doors
    assert not takes_bound_path(torch.nn.Parameter(x), w, b, compiling=False)  # not a plain tensor
    assert not takes_bound_path(x.bfloat16(), w, b, compiling=False)  # two dtypes
    assert not takes_bound_path(torch.randn(0, 8), w, b, compiling=False)  # empty
    assert not takes_bound_path(x.to(torch.int32), w.data.to(torch.int32), b, compiling=False)

    class Wrapped(torch.Tensor):
        pass

    assert not takes_bound_path(x.as_subclass(Wrapped), w, b, compiling=False)
    assert not takes_bound_path(x, w, b.as_subclass(Wrapped), compiling=False)


def test_the_layer_runs_the_bound_kernels_of_its_plan_device_and_settings(monkeypatch):
    seen = []
    original = Float8Module._linear_call

    def spy(*args):  # what each forward takes (from linear_call, or as the module's config keeps it)
        call = original(*args)
        seen.append(call)
        return call

    monkeypatch.setattr(Float8Module, "_linear_call", spy)
    layer = fp8train.Float8Linear(DIM, DIM, recipe="rowwise")
    plan = layer.recipe.operand_plan
    layer(torch.randn(TOKENS, DIM))
    layer(torch.randn(TOKENS, DIM))
    assert seen[0] is seen[1]  # one call value, built once
    assert seen[0].kernels is bound_kernels(plan, "auto", "cpu")
    assert seen[0].kernels.bound and seen[0].kernels.launch is launch_kernels()
    with use_quant_settings(quantize_kernel="reference"):
        layer(torch.randn(TOKENS, DIM))
        reference = bound_kernels(plan, "auto", "cpu")
    assert seen[2].kernels is reference and reference is not seen[0].kernels
    assert reference.launch is None  # the reference launches no CPU kernel: no block to enter
    layer(torch.randn(TOKENS, DIM).requires_grad_().as_subclass(torch.nn.Parameter))
    assert not seen[3].kernels.bound  # a tensor subclass: the checked doors


def test_checked_kernels_hold_no_block_and_bind_nothing():
    kernels = checked_kernels(get_recipe("tensorwise").operand_plan, "emulated")
    assert not kernels.bound and kernels.launch is None


def test_bound_kernels_refuse_the_hardware_backend_off_cuda():
    with pytest.raises(UnsupportedHardwareError, match="need a CUDA device"):
        bound_kernels(get_recipe("tensorwise").operand_plan, "hardware", "cpu")


def test_the_kernel_block_is_reentrant_and_frees_the_lock_for_other_threads():
    launch = launch_kernels()
    with launch:
        with launch:  # a kernel's own launch inside a layer's block
            assert launch.depth == 2
        assert launch.depth == 1
    assert launch.depth == 0
    entered = threading.Event()

    def other():
        with launch_kernels():
            entered.set()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(timeout=30)
    assert entered.is_set()


@pytest.mark.parametrize(
    "value",
    [QuantRule(granularity="row"), get_recipe("delayed"), get_recipe("nvfp4").operand_plan, QuantSettings()],
    ids=["rule", "delayed recipe", "plan", "settings"],
)
def test_values_hashed_once_hash_as_equal_values_and_pickle_without_their_hash(value):
    assert hash(value) == hash(value)
    copy = pickle.loads(pickle.dumps(value))
    assert copy == value and hash(copy) == hash(value)
    assert "_hash_once" not in pickle.loads(pickle.dumps(value)).__dict__
    assert "_hash_once" not in value.__getstate__()


def test_a_layer_says_its_gemm_backend_again_after_the_log_forgets(caplog):
    """The bound kernels log their GEMM backend when built and are then cached; forgetting
    what was said empties the caches, so the next call builds and says it again."""
    import logging

    from fp8train.quant.gemm import backend_log

    layer = fp8train.Float8Linear(DIM, DIM, recipe="mxfp8")
    layer(torch.randn(TOKENS, DIM))
    caplog.set_level(logging.INFO, logger="fp8train")
    backend_log.forget()
    layer(torch.randn(TOKENS, DIM))
    assert any("mxfp8 GEMMs on cpu run emulated" in record.getMessage() for record in caplog.records)
