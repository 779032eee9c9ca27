"""Float8Linear against nn.Linear: SQNR of output, grad_input and grad_weight for every
recipe, ranks/strides/padding, 16-bit dtypes and torch.autocast, module surface, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.helpers.tolerances import FP4_MIN_SQNR_DB, is_fp4
from fp8train.nn.config import Float8ModuleConfig
from fp8train.nn.modules.linear import Float8Linear
from fp8train.spec import recipes
from fp8train.spec.recipes import DelayedScaling, NVFP4Scaling

IN_FEATURES, OUT_FEATURES = 256, 384
NUM_TOKENS = 200  # not a multiple of 16, 32 or 128: Float8Linear pads internally
SEQ_LEN, BATCH = 64, 3  # 3-D input (BATCH, SEQ_LEN, K) = 192 tokens, non-contiguous

# Lower bounds on SQNR (dB) against float32 nn.Linear: a GEMM of two E4M3 operands, and one
# where the E5M2 grad_output is an operand (HYBRID recipes' grad GEMMs).
MIN_SQNR_DB = {"e4m3": 25.0, "e5m2": 20.0}
# Upper bound: an FP8 GEMM must actually lose precision (catches a silent high-precision path).
MAX_FP8_SQNR_DB = 45.0
E5M2_GRAD_RECIPES = ("tensorwise", "delayed")
GRADS = ("output", "grad_input", "grad_weight")
# Magnitudes of input and grad_output far from 1 (E4M3 and E5M2 without a scale would flush
# them to zero), so every test also checks that the scales are used. float16 keeps 1: its
# narrow range would itself lose the small grads.
MAGNITUDES = {torch.float32: (2.0**-10, 2.0**-20), torch.bfloat16: (2.0**-10, 2.0**-20), torch.float16: (1.0, 1.0)}
DELAYED_WARMUP_STEPS = 2  # step 1 quantizes with scale 1; from step 2 on scales are calibrated
# rowwise_with_gw_hp's grad_weight is a float32 GEMM: equal to nn.Linear's up to summation order.
# Tolerances relative to |expected| and to max|expected| (the grads are tiny, see MAGNITUDES).
GRAD_WEIGHT_HP_RTOL, GRAD_WEIGHT_HP_ATOL_OF_MAX = 1e-5, 1e-6
# In 16-bit parameters, "high precision" is one 16-bit rounding (and summation order).
GRAD_WEIGHT_HP_16BIT_RTOL, GRAD_WEIGHT_HP_16BIT_ATOL_OF_MAX = 2.0**-7, 2.0**-8


def _assert_close(got: torch.Tensor, expected: torch.Tensor, rtol: float, atol_of_max: float):
    expected = expected.to(torch.float32)
    atol = atol_of_max * expected.abs().max().item()
    torch.testing.assert_close(got.to(torch.float32), expected, rtol=rtol, atol=atol)


def _min_sqnr(recipe_name: str, which: str) -> float:
    if is_fp4(recipe_name):
        return FP4_MIN_SQNR_DB
    if which != "output" and recipe_name in E5M2_GRAD_RECIPES:
        return MIN_SQNR_DB["e5m2"]
    return MIN_SQNR_DB["e4m3"]


def _modules(recipe, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    reference = nn.Linear(IN_FEATURES, OUT_FEATURES, bias=bias, dtype=dtype)
    fp8 = Float8Linear(IN_FEATURES, OUT_FEATURES, bias=bias, dtype=dtype, recipe=recipe)
    with torch.no_grad():
        if bias:  # as large as x W^T, so the output's SQNR measures the GEMM
            reference.bias.mul_(MAGNITUDES[dtype][0] * 16)
        fp8.weight.copy_(reference.weight)
        if bias:
            fp8.bias.copy_(reference.bias)
    return reference, fp8


def _inputs(kind: str, dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    if kind == "2d":
        x = torch.randn(NUM_TOKENS, IN_FEATURES, generator=generator)
    else:
        x = torch.randn(SEQ_LEN, BATCH, IN_FEATURES, generator=generator).transpose(0, 1)
        assert not x.is_contiguous()
    grad_output = torch.randn(*x.shape[:-1], OUT_FEATURES, generator=generator)
    input_magnitude, grad_output_magnitude = MAGNITUDES[dtype]
    return (x * input_magnitude).to(dtype), (grad_output * grad_output_magnitude).to(dtype)


def _run(module, x, grad_output):
    """Forward and backward; returns output, grad_input, grad_weight (and grad_bias)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = module(x)
    out.backward(grad_output)
    grad_bias = module.bias.grad if module.bias is not None else None
    return {"output": out.detach(), "grad_input": x.grad, "grad_weight": module.weight.grad, "grad_bias": grad_bias}


def _warm_up(fp8, recipe_name, x, grad_output):
    if recipe_name == "delayed":
        for _ in range(DELAYED_WARMUP_STEPS):
            _run(fp8, x, grad_output)
        # Calibrated: input, weight and grad_output scales all moved off their initial 1.
        assert (fp8.fp8_scale != 1).all()


@pytest.mark.parametrize("bias, kind", [(True, "2d"), (False, "3d_noncontiguous")], ids=["2d_bias", "3d_noncontiguous"])
@pytest.mark.parametrize("recipe_name", recipes.RECIPE_NAMES)
def test_sqnr_against_nn_linear(recipe_name, bias, kind, sqnr_db):
    reference, fp8 = _modules(recipe_name, bias=bias)
    x, grad_output = _inputs(kind)
    _warm_up(fp8, recipe_name, x, grad_output)
    expected = _run(reference, x, grad_output)
    got = _run(fp8, x, grad_output)
    assert got["output"].shape == x.shape[:-1] + (OUT_FEATURES,)
    assert got["grad_input"].shape == x.shape
    for which in GRADS:
        if recipe_name == "rowwise_with_gw_hp" and which == "grad_weight":
            _assert_close(got[which], expected[which], GRAD_WEIGHT_HP_RTOL, GRAD_WEIGHT_HP_ATOL_OF_MAX)
            continue
        sqnr = sqnr_db(expected[which], got[which])
        assert _min_sqnr(recipe_name, which) <= sqnr <= MAX_FP8_SQNR_DB, f"{which}: {sqnr:.1f} dB"
    if bias:
        # grad_bias is a high-precision sum of grad_output.
        _assert_close(got["grad_bias"], expected["grad_bias"], GRAD_WEIGHT_HP_RTOL, GRAD_WEIGHT_HP_ATOL_OF_MAX)


# Not delayed: its scales move between the two calls.
@pytest.mark.parametrize("recipe_name", [name for name in recipes.RECIPE_NAMES if name != "delayed"])
def test_output_independent_of_layout(recipe_name):
    """A 3-D non-contiguous input gives, row by row, the output of its contiguous 2-D copy."""
    _, fp8 = _modules(recipe_name)
    x, _ = _inputs("3d_noncontiguous")
    out_3d = fp8(x)
    out_2d = fp8(x.reshape(-1, IN_FEATURES).contiguous())
    assert torch.equal(out_3d.reshape(-1, OUT_FEATURES), out_2d)


# Not delayed: its scales move between the two calls.
@pytest.mark.parametrize("recipe_name", [name for name in recipes.RECIPE_NAMES if name != "delayed"])
def test_internal_padding_changes_no_scale_and_no_sum(recipe_name):
    """NUM_TOKENS rows give the same results as the same rows zero-padded by the caller to
    a multiple of every block (256): zeros change no amax and add nothing (nor do they change
    a Hadamard-transformed group's codes). nvfp4 rounds to nearest here: stochastic rounding
    draws one number per element, so the two token counts draw different ones."""
    recipe = NVFP4Scaling(disable_stochastic_rounding=True) if recipe_name == "nvfp4" else recipe_name
    _, fp8 = _modules(recipe)
    x, grad_output = _inputs("2d")
    padded_rows = 256 - NUM_TOKENS
    x_padded = torch.cat([x, x.new_zeros(padded_rows, IN_FEATURES)])
    grad_output_padded = torch.cat([grad_output, grad_output.new_zeros(padded_rows, OUT_FEATURES)])
    got = _run(fp8, x, grad_output)
    expected = _run(fp8, x_padded, grad_output_padded)
    expected["output"] = expected["output"][:NUM_TOKENS]
    expected["grad_input"] = expected["grad_input"][:NUM_TOKENS]
    for which in GRADS:
        # Equal up to float32 summation order (the GEMMs' shapes differ).
        _assert_close(got[which], expected[which], GRAD_WEIGHT_HP_RTOL, GRAD_WEIGHT_HP_ATOL_OF_MAX)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("recipe_name", recipes.RECIPE_NAMES)
def test_16_bit_parameters_and_inputs(recipe_name, dtype, sqnr_db):
    reference, fp8 = _modules(recipe_name, dtype=dtype)
    x, grad_output = _inputs("2d", dtype=dtype)
    _warm_up(fp8, recipe_name, x, grad_output)
    got = _run(fp8, x, grad_output)
    for which in ("output", "grad_input", "grad_weight", "grad_bias"):
        assert got[which].dtype == dtype, which
    # Reference in float32 from the same (16-bit) values.
    reference_f32 = copy.deepcopy(reference).float()
    expected = _run(reference_f32, x.float(), grad_output.float())
    for which in GRADS:
        if recipe_name == "rowwise_with_gw_hp" and which == "grad_weight":
            # High precision here means the parameters' dtype: one 16-bit rounding.
            _assert_close(
                got[which], expected[which], GRAD_WEIGHT_HP_16BIT_RTOL, GRAD_WEIGHT_HP_16BIT_ATOL_OF_MAX
            )
            continue
        sqnr = sqnr_db(expected[which], got[which])
        assert _min_sqnr(recipe_name, which) <= sqnr <= MAX_FP8_SQNR_DB, f"{which}: {sqnr:.1f} dB"


@pytest.mark.parametrize("recipe_name", ["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"])
def test_float32_parameters_under_torch_autocast(recipe_name, sqnr_db):
    reference, fp8 = _modules(recipe_name)
    x, grad_output = _inputs("2d")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _warm_up(fp8, recipe_name, x, grad_output)
        got = _run(fp8, x, grad_output)
    assert got["output"].dtype == torch.bfloat16
    assert fp8.weight.dtype == torch.float32
    # Grads flow back to the float32 leaves in float32.
    for which in ("grad_input", "grad_weight", "grad_bias"):
        assert got[which].dtype == torch.float32, which
    expected = _run(reference, x, grad_output)
    for which in GRADS:
        sqnr = sqnr_db(expected[which], got[which])
        assert _min_sqnr(recipe_name, which) <= sqnr <= MAX_FP8_SQNR_DB, f"{which}: {sqnr:.1f} dB"


# ---------------------------------------------------------------- module surface


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("recipe_name", recipes.RECIPE_NAMES)
def test_parameters_and_state_dict_match_nn_linear(recipe_name, bias):
    reference, fp8 = _modules(recipe_name, bias=bias)
    assert [name for name, _ in fp8.named_parameters()] == [name for name, _ in reference.named_parameters()]
    delayed_keys = ["fp8_scale", "fp8_amax_history"] if recipe_name == "delayed" else []
    assert sorted(fp8.state_dict()) == sorted(list(reference.state_dict()) + delayed_keys)
    if recipe_name == "delayed":
        history_len = DelayedScaling().amax_history_len
        assert torch.equal(fp8.fp8_scale, torch.ones(3))
        assert torch.equal(fp8.fp8_amax_history, torch.zeros(history_len, 3))
        with torch.no_grad():
            fp8.fp8_scale.fill_(2.0)
    # A plain nn.Linear checkpoint loads strictly; delayed scaling keeps its own state.
    with torch.no_grad():
        reference.weight.add_(1.0)
    fp8.load_state_dict(reference.state_dict())
    assert torch.equal(fp8.weight, reference.weight)
    if recipe_name == "delayed":
        assert torch.equal(fp8.fp8_scale, torch.full((3,), 2.0))
    assert isinstance(fp8, nn.Linear)
    assert f"recipe={recipe_name}" in repr(fp8) and f"recipe={recipe_name}" in fp8.extra_repr()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("recipe_name", ["tensorwise", "delayed", "mxfp8"])
def test_from_linear_shares_parameters(recipe_name, bias, sqnr_db):
    linear = nn.Linear(IN_FEATURES, OUT_FEATURES, bias=bias)
    fp8 = Float8Linear.from_linear(linear, config=Float8ModuleConfig(recipe=recipe_name, backend="emulated"))
    assert fp8.weight is linear.weight
    assert fp8.bias is linear.bias if bias else fp8.bias is None
    assert (fp8.in_features, fp8.out_features) == (IN_FEATURES, OUT_FEATURES)
    assert fp8.recipe.name == recipe_name and fp8.backend == "emulated"
    assert all(not t.is_meta for t in list(fp8.parameters()) + list(fp8.buffers()))
    if recipe_name == "delayed":
        assert torch.equal(fp8.fp8_scale, torch.ones(3))
    x, grad_output = _inputs("2d")
    _warm_up(fp8, recipe_name, x, grad_output)
    got = _run(fp8, x, grad_output)
    # The FP8 module's backward wrote its grads into the shared parameters.
    assert linear.weight.grad is got["grad_weight"]
    expected = _run(linear, x, grad_output)
    assert sqnr_db(expected["output"], got["output"]) >= MIN_SQNR_DB["e4m3"]


def test_recipe_object_and_name_are_accepted():
    recipe = DelayedScaling(amax_history_len=16, margin=1)
    fp8 = Float8Linear(128, 128, recipe=recipe)
    assert fp8.recipe is recipe and fp8.fp8_amax_history.shape == (16, 3)
    assert Float8Linear(128, 128, recipe="current").recipe.name == "tensorwise"
    assert "recipe=tensorwise" in repr(Float8Linear(128, 128))  # the default


# ---------------------------------------------------------------- errors


def test_input_dtype_must_match_weight():
    fp8 = Float8Linear(128, 128, recipe="rowwise")
    with pytest.raises(TypeError, match=r"input dtype torch.bfloat16 does not match weight dtype torch.float32"):
        fp8(torch.randn(32, 128, dtype=torch.bfloat16))


def test_wrong_last_dim():
    fp8 = Float8Linear(128, 256)
    with pytest.raises(ValueError, match=r"input of shape \(32, 64\) does not end in in_features=128"):
        fp8(torch.randn(32, 64))


def test_bad_backend():
    with pytest.raises(ValueError, match=r"backend='gpu' must be one of auto, emulated, hardware"):
        Float8Linear(128, 128, config=Float8ModuleConfig(backend="gpu"))


def test_bad_recipe():
    with pytest.raises(TypeError, match=r"recipe=42 must be a Recipe or a recipe name"):
        Float8Linear(128, 128, recipe=42)
    with pytest.raises(ValueError, match=r"unknown FP8 recipe 'fp4'"):
        Float8Linear(128, 128, recipe="fp4")


@pytest.mark.parametrize("recipe_name", recipes.RECIPE_NAMES)
def test_unusual_input_shapes_work_like_nn_linear(recipe_name, sqnr_db):
    """1-D inputs, zero tokens (forward and backward), rank 4, transposed strides, frozen weight."""
    torch.manual_seed(0)
    reference = nn.Linear(128, 256)
    config = Float8ModuleConfig(recipe=recipe_name, backend="emulated")
    module = Float8Linear.from_linear(copy.deepcopy(reference), config=config)
    assert module(torch.randn(128)).shape == (256,)
    empty = torch.randn(2, 0, 128, requires_grad=True)
    out = module(empty)
    out.sum().backward()
    assert out.shape == (2, 0, 256) and empty.grad.shape == empty.shape
    assert torch.equal(module.weight.grad, torch.zeros_like(module.weight))  # no tokens, no gradient
    module.weight.grad = None
    x = torch.randn(3, 5, 7, 128)
    if recipe_name != "delayed":  # (delayed scales are still calibrating on these few calls)
        assert sqnr_db(reference(x), module(x)) >= _min_sqnr(recipe_name, "output")
    assert module(x).shape == (3, 5, 7, 256)
    transposed = torch.randn(128, 6).t()
    assert module(transposed).shape == (6, 256)
    module.weight.requires_grad_(False)
    x = torch.randn(4, 128, requires_grad=True)
    module(x).sum().backward()
    assert x.grad is not None and module.weight.grad is None


def test_to_linear_gives_back_the_module_from_linear_replaced():
    class MyLinear(nn.Linear):
        pass

    subclass = MyLinear(32, 16).eval()
    fp8 = Float8Linear.from_linear(subclass)
    assert fp8.to_linear() is subclass and not subclass.training
    plain = Float8Linear.from_linear(nn.Linear(32, 16))
    back = plain.to_linear()
    assert type(back) is nn.Linear and back.weight is plain.weight and back.bias is plain.bias


def test_a_parametrized_weight_is_read_through_its_property():
    """The forward reads its parameters from the module's own dict (issue 38: no
    ``__getattr__`` call); a parametrization moves the weight out of it, behind a property,
    which the forward then reads: the parametrized weight's output, not the original's."""

    class Doubled(nn.Module):
        def forward(self, weight):
            return 2 * weight

    torch.manual_seed(0)
    module = Float8Linear(64, 32, recipe="tensorwise")
    doubled = copy.deepcopy(module)
    with torch.no_grad():
        doubled.weight.mul_(2)
    nn.utils.parametrize.register_parametrization(module, "weight", Doubled())
    x = torch.randn(16, 64)
    assert torch.equal(module(x), doubled(x))
