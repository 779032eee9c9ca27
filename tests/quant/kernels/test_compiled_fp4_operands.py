"""The 4-bit GPU quantizer's two usages by two rules from one read, and the emulated GEMM's
operand written in the same pass (:mod:`fp8train.quant.kernels.compiled_fp4`,
``quantize_pair`` and ``quantize_operand``), run on the CPU through inductor's C++ backend
as on a GPU through Triton:

* the pair's bits and the generator's state after are the reference's two calls' (the
  last-dim usage's draws first), for the NVFP4 recipe's input and grad_output (no
  transform and RNE or stochastic rounding last, the transform first) and MXFP4's;
* the values each usage holds in its ``gemm_cache`` (a first-dim usage's handed to its
  K-last transpose) are, bit for bit and in layout, what the GEMM computes from the codes
  (:func:`~fp8train.quant.gemm.fp4.fp4_operand_values`), and the GEMM that takes them gives
  the product of the reference's operands;
* a Linear's quantizer of a role (:class:`~fp8train.quant.operand.RoleQuantizer`) takes the
  pair where a kernel has one, and writes no values where the forward saves the usage.

The default run checks the wiring (no compile); the compiled cases are ``-m slow``.
"""

from __future__ import annotations

import pytest
import torch

from fp8train.quant.fp4_quantize import quantize_fp4
from fp8train.quant.gemm import scaled_mm
from fp8train.quant.gemm.fp4 import fp4_operand_values
from fp8train.quant.kernels import compiled_fp4, use_quant_settings
from fp8train.quant.kernels.compiled_fp4 import Usage
from fp8train.quant.operand import ROLE_USAGES, RoleQuantizer
from fp8train.quant.quantize import bound_quantizers
from fp8train.quant.tensor import QuantizedTensor, transpose
from fp8train.recipes import from_name
from fp8train.spec.roles import Role
from fp8train.spec.rule import QuantRule

from ..test_fp4_quantize import _classes
from .test_compiled_fp4 import _assert_same, _x

NVFP4_INPUT = (QuantRule(granularity="nvfp4"), QuantRule(granularity="nvfp4", rht=True))
NVFP4_GRAD_OUTPUT = (
    QuantRule(granularity="nvfp4", stochastic_rounding=True),
    QuantRule(granularity="nvfp4", rht=True, stochastic_rounding=True),
)
MXFP4_SR = (QuantRule(granularity="mxfp4", stochastic_rounding=True),) * 2


def _reference_values(qt, dtype):
    """What the GEMM computes from ``qt``'s codes (the PyTorch ops, on a copy with nothing cached)."""
    tensors, layout = qt.prepare_for_saving()
    with use_quant_settings(quantize_kernel="reference"):
        return fp4_operand_values(QuantizedTensor.restore_from_saved(layout, *tensors), dtype, False)


def _assert_values(qt, dtype) -> None:
    """``qt``'s cached values: the GEMM's own from the codes, bit for bit (NaN where NaN),
    contiguous, and what the GEMM takes."""
    cached = qt.gemm_cache.values
    assert cached is not None and cached.dtype == dtype and cached.is_contiguous()
    expected = _reference_values(qt, dtype)
    assert cached.shape == expected.shape
    nan = expected.isnan()
    assert torch.equal(cached.isnan(), nan), "NaN values differ"
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(cached[~nan].view(bits), expected[~nan].view(bits))
    assert fp4_operand_values(qt, dtype, False) is cached


def _check_pair(x, rules, dtype=torch.bfloat16, first_values=True) -> None:
    """The pair from one compiled call against the reference's two calls on generators
    seeded alike; each K-last operand's cached values against the GEMM's own."""
    last_rule, first_rule = rules
    first_axis = -1 if first_rule.axis_free else 0
    generators = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    first = Usage(first_rule, first_axis, dtype, True) if first_values else Usage(first_rule, first_axis)
    usages = (Usage(last_rule, -1, dtype), first)
    last, first = compiled_fp4.quantize_each(x, usages, generators[0])
    _assert_same(last, quantize_fp4(x, last_rule, -1, None, generators[1]))
    _assert_same(first, quantize_fp4(x, first_rule, first_axis, None, generators[1]))
    assert torch.equal(generators[0].get_state(), generators[1].get_state())
    _assert_values(last, dtype)
    if first_values:
        _assert_values(transpose(first), dtype)
    else:
        assert transpose(first).gemm_cache.values is None


# -- the wiring (no compile) ---------------------------------------------------------------


def test_a_layer_on_cuda_binds_the_pair_and_the_operand_writing_quantizer():
    quantize, quantize_both, reference, quantize_pair = bound_quantizers(4, "cuda")
    assert (quantize, quantize_both) == (compiled_fp4.quantize_operand, compiled_fp4.quantize_both)
    assert quantize_pair is compiled_fp4.quantize_pair
    assert getattr(reference, "func", reference) is quantize_fp4  # (the untraced reference: a partial)
    assert bound_quantizers(8, "cuda")[3] is None  # the FP8 family has no pair kernel
    assert bound_quantizers(4, "cpu")[3] is None  # nor the CPU's numba


def test_the_role_quantizer_takes_the_pair_where_the_usages_are_two_quantizations():
    plan = from_name("nvfp4").operand_plan
    pair = object()
    roles = {role: RoleQuantizer.of(plan, role, None, None, None, pair) for role in ROLE_USAGES}
    assert roles[Role.INPUT].quantize_pair is pair and roles[Role.GRAD_OUTPUT].quantize_pair is pair
    assert roles[Role.WEIGHT].quantize_pair is None  # 16x16 tiles: one quantization, transposed
    # The forward saves the input's first-dim usage without its GEMM values: none written.
    assert roles[Role.INPUT].pair_values == (True, False) and roles[Role.GRAD_OUTPUT].pair_values == (True, True)
    assert RoleQuantizer.of(plan, Role.INPUT, None, None).quantize_pair is None


def test_both_falls_back_to_two_calls_where_the_pair_leaves_the_tensor():
    plan, x = from_name("nvfp4").operand_plan, _x(torch.float32)
    calls = []

    def pair(*args):
        calls.append(args[1:])
        return None

    role = RoleQuantizer.of(plan, Role.GRAD_OUTPUT, lambda *a: None, None, quantize_fp4, pair)
    torch.manual_seed(3)
    last, first = role.both(x, None)
    assert calls == [(*NVFP4_GRAD_OUTPUT, 0, (True, True))]
    torch.manual_seed(3)
    _assert_same(last, quantize_fp4(x, NVFP4_GRAD_OUTPUT[0], -1))
    _assert_same(first, transpose(quantize_fp4(x, NVFP4_GRAD_OUTPUT[1], 0)))


def test_a_first_dim_usage_hands_its_cached_values_to_its_transpose():
    qt = quantize_fp4(_x(torch.float32), QuantRule(granularity="mxfp4"), 0)
    values = torch.ones(qt.unpacked_shape_2d[::-1], dtype=torch.bfloat16)  # [K, M]: the K-last layout
    qt.gemm_cache.put(torch.bfloat16, values.t(), None)
    assert transpose(qt).gemm_cache.get(torch.bfloat16)[0] is not None
    assert transpose(qt).gemm_cache.values.is_contiguous()
    last = quantize_fp4(_x(torch.float32), QuantRule(granularity="mxfp4"), -1)
    assert transpose(last).gemm_cache.values is None  # nothing cached: nothing handed on


# -- compiled (inductor's C++ backend) -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "name, rules", [("nvfp4_input", NVFP4_INPUT), ("nvfp4_grad_output", NVFP4_GRAD_OUTPUT), ("mxfp4_sr", MXFP4_SR)]
)
def test_the_pair_of_two_rules_is_the_references_two_calls_and_holds_the_gemm_values(name, rules, dtype):
    """Every input class of the 4-bit numerics tests (zeros, ties, NaN, infinities, wide
    ranges, subnormals); the GEMM values in bfloat16 and float32."""
    for case, x in _classes(torch.bfloat16).items():
        try:
            _check_pair(x, rules, dtype)
        except AssertionError as error:
            raise AssertionError(f"{name}, {case}: {error}") from error


@pytest.mark.slow
def test_the_values_of_one_usage_tiles_and_a_pair_without_the_first_ones():
    """nvfp4_2d's tiles (the weight's last-dim operand) and nvfp4 with the transform alone;
    the input's pair, whose first-dim usage the forward saves, writes no values for it."""
    x = _x(torch.bfloat16)
    for rule in (QuantRule(granularity="nvfp4_2d"), QuantRule(granularity="nvfp4", rht=True)):
        for axis in (-1,) if rule.axis_free else (-1, 0):
            (qt,) = compiled_fp4.quantize_each(x, (Usage(rule, axis, torch.bfloat16, axis == 0),))
            _assert_same(qt, quantize_fp4(x, rule, axis))
            _assert_values(qt if axis == -1 else transpose(qt), torch.bfloat16)
    _check_pair(x, NVFP4_INPUT, first_values=False)


@pytest.mark.slow
def test_the_gemm_takes_the_cached_operands_and_gives_the_reference_product():
    """The NVFP4 recipe's grad_weight GEMM (grad_output's and the input's first-dim usages,
    the transform on both) and grad_input GEMM from the pair's operands, against the
    product of the reference's operands (float32 GEMM: the CPU takes NVFP4's alpha there)."""
    grad_output, x = _x(torch.bfloat16, (64, 96)), _x(torch.bfloat16, (64, 128))
    torch.manual_seed(5)
    with use_quant_settings(emulated_gemm="float32"):
        dy, dy_t = compiled_fp4.quantize_pair(grad_output, *NVFP4_GRAD_OUTPUT, 0, (True, True))
        x_t = compiled_fp4.quantize_operand(x, NVFP4_INPUT[1], 0)
        weight = compiled_fp4.quantize_operand(_x(torch.bfloat16, (96, 128)).t().contiguous(), NVFP4_INPUT[0], -1)
        dy_t, x_t = transpose(dy_t), transpose(x_t)
        assert all(qt.gemm_cache.values is not None for qt in (dy, dy_t, x_t, weight))
        actual = scaled_mm(dy_t, x_t, torch.float32), scaled_mm(dy, weight, torch.bfloat16)
    torch.manual_seed(5)
    with use_quant_settings(quantize_kernel="reference", emulated_gemm="float32"):
        dy = quantize_fp4(grad_output, NVFP4_GRAD_OUTPUT[0], -1)
        dy_t = transpose(quantize_fp4(grad_output, NVFP4_GRAD_OUTPUT[1], 0))
        x_t = transpose(quantize_fp4(x, NVFP4_INPUT[1], 0))
        weight = quantize_fp4(_x(torch.bfloat16, (96, 128)).t().contiguous(), NVFP4_INPUT[0], -1)
        expected = scaled_mm(dy_t, x_t, torch.float32), scaled_mm(dy, weight, torch.bfloat16)
    for got, want in zip(actual, expected):
        assert torch.equal(got, want)


@pytest.mark.slow
def test_a_layers_role_quantizer_gives_the_two_calls_bits_from_the_pair():
    """grad_output's quantizer bound as on CUDA (the pair, the operand-writing quantizer),
    run on CPU tensors: both K-last operands and PyTorch's default generator after, as the
    reference's two calls leave them; the GEMM values in both."""
    plan, x = from_name("nvfp4").operand_plan, _x(torch.bfloat16)
    role = RoleQuantizer.of(
        plan, Role.GRAD_OUTPUT, compiled_fp4.quantize_operand, compiled_fp4.quantize_both, quantize_fp4,
        compiled_fp4.quantize_pair,
    )
    torch.manual_seed(9)
    last, first = role.both(x, None)
    state = torch.get_rng_state()
    torch.manual_seed(9)
    _assert_same(last, quantize_fp4(x, NVFP4_GRAD_OUTPUT[0], -1))
    _assert_same(first, transpose(quantize_fp4(x, NVFP4_GRAD_OUTPUT[1], 0)))
    assert torch.equal(state, torch.get_rng_state())
    _assert_values(last, compiled_fp4.gemm_values_dtype())
    _assert_values(first, compiled_fp4.gemm_values_dtype())
