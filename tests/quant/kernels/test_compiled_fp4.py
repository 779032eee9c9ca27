"""The 4-bit family's GPU quantizer (:mod:`fp8train.quant.kernels.compiled_fp4`) run on the
CPU, where inductor generates C++ in place of Triton: the same arithmetic and layouts as on
a GPU, held to the reference (:func:`fp8train.quant.fp4_quantize.quantize_fp4`) bit for
bit on the same generator state, and the generator's state after held too. The GPU suite
(``tests/gpu/test_quantize_kernel.py``) holds the Triton kernels to the CPU's bytes.

The default run checks what needs no compile (the draws, the door, the fallback); one
compiled case is ``-m heavy`` (a compile costs seconds), and the matrix of granularities,
transforms, rounding, dtypes, input classes and shapes is ``-m slow``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fp8train.quant.fp4_quantize import quantize_fp4
from fp8train.quant.gemm import scaled_mm
from fp8train.quant.kernels import compiled_fp4, compiled_fp8, use_quant_settings
from fp8train.quant.kernels import fp4 as fp4_kernels
from fp8train.quant.quantize import FAMILIES, bound_quantizers, quantizers_for
from fp8train.quant.tensor import QuantizedTensor, transpose
from fp8train.spec.rule import QuantRule

from ..test_fp4_quantize import _classes

E4M3_NAN = 0x7F


def _assert_same(fast: QuantizedTensor, reference: QuantizedTensor) -> None:
    """Equal bytes, dtypes, shapes, axis and global amax. A NaN scale's sign is not part of
    the contract (the reference's own depends on which PyTorch vector path ran)."""
    assert fast.data.dtype == reference.data.dtype and fast.data.shape == reference.data.shape
    assert torch.equal(fast.data.view(torch.uint8), reference.data.view(torch.uint8))
    assert fast.scale_inv.dtype == reference.scale_inv.dtype and fast.scale_inv.shape == reference.scale_inv.shape
    fast_scales, reference_scales = fast.scale_inv.view(torch.uint8), reference.scale_inv.view(torch.uint8)
    if fast.scale_inv.dtype == torch.float8_e4m3fn:
        nan = (reference_scales & 0x7F) == E4M3_NAN
        assert torch.equal(nan, (fast_scales & 0x7F) == E4M3_NAN), "NaN scales differ"
        fast_scales, reference_scales = fast_scales[~nan], reference_scales[~nan]
    assert torch.equal(fast_scales, reference_scales)
    assert fast.axis == reference.axis and fast.power_2_scales == reference.power_2_scales
    if reference.global_amax is None:
        assert fast.global_amax is None
    else:
        assert torch.equal(fast.global_amax.reshape(()), reference.global_amax.reshape(())) or (
            fast.global_amax.isnan().item() and reference.global_amax.isnan().item()
        )


def _check_usages(x: torch.Tensor, rule: QuantRule, axes=(-1, 0), global_amax=None) -> None:
    """The compiled usages of ``axes`` from one call against the reference's calls one after
    the other, each side drawing from a generator seeded alike; the generators' states after."""
    generators = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    fast = compiled_fp4.quantize_usages(x, rule, axes, generators[0], global_amax)
    for axis, actual in zip(axes, fast):
        _assert_same(actual, quantize_fp4(x, rule, axis, None, generators[1], global_amax))
    assert torch.equal(generators[0].get_state(), generators[1].get_state())
    if x.dim() == 2 and 0 in axes:
        # The first-dim usage is written column-major: its transpose, the K-last operand a
        # GEMM takes, is contiguous (no copy before the GEMM).
        first = fast[axes.index(0)]
        assert transpose(first).data.is_contiguous() and not first.data.is_contiguous()


def _x(dtype=torch.bfloat16, shape=(64, 96)) -> torch.Tensor:
    """Groups of very different ranges, a zero group, and values on E2M1's rounding ties."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=generator) * torch.exp(2 * torch.randn(1, shape[-1], generator=generator))
    x[..., :32] = 0.0
    x.reshape(-1, shape[-1])[0, 32:48] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * 448
    return x.to(dtype)


@pytest.mark.heavy  # a compile: 2 to 6 s on a 2-core CPU
def test_mxfp4_both_usages_in_one_read_draw_as_the_reference_and_take_their_gemm_layouts():
    _check_usages(_x(), QuantRule(granularity="mxfp4", stochastic_rounding=True))


def test_the_draws_are_the_references_same_calls_in_the_same_order():
    """No compile: the eager draws leave the generator where the reference's two calls do."""
    x, rule = _x(), QuantRule(granularity="nvfp4", rht=True, stochastic_rounding=True)
    generators = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    draws = compiled_fp4.stochastic_draws(x, rule, (-1, 0), generators[0])
    assert [d.shape for d in draws] == [(64, 1, 6, 16), (4, 16, 96, 1)]
    assert all(d.dtype == torch.float32 for d in draws)
    quantize_fp4(x, rule, -1, None, generators[1]), quantize_fp4(x, rule, 0, None, generators[1])
    assert torch.equal(generators[0].get_state(), generators[1].get_state())
    assert compiled_fp4.stochastic_draws(x, QuantRule(granularity="nvfp4"), (-1, 0), None) is None


def test_the_door_sends_cuda_tensors_here_and_keeps_numba_on_the_cpu():
    family = FAMILIES[4]
    assert family.kernels["cuda"].quantize is compiled_fp4.quantize
    assert family.kernels["cuda"].quantize_both is compiled_fp4.quantize_both
    assert bound_quantizers(4, "cuda")[0] is compiled_fp4.quantize_operand  # the GEMM values with the codes
    kernel, _ = quantizers_for(QuantRule(granularity="nvfp4"), torch.ones(32, 32))
    assert kernel is None or kernel.quantize is fp4_kernels.quantize  # the CPU path is unchanged


def test_what_the_kernel_does_not_take_goes_to_the_reference():
    rule = QuantRule(granularity="nvfp4")
    assert compiled_fp4.quantize(torch.empty(0, 32), rule, -1) is None
    assert compiled_fp4.quantize(torch.ones(32, 32), QuantRule(granularity="row"), -1) is None
    with use_quant_settings(quantize_kernel="reference"):
        assert compiled_fp4.quantize(torch.ones(32, 32), rule, -1) is None
        assert compiled_fp4.quantize_both(torch.ones(32, 32), rule) is None
    # nvfp4_2d with stochastic rounding: two quantizations draw twice, which no one read gives.
    assert compiled_fp4.quantize_both(_x(), QuantRule(granularity="nvfp4_2d", stochastic_rounding=True)) is None


def test_a_kernel_that_fails_to_compile_leaves_the_draws_to_the_reference(monkeypatch):
    """The generator is where it was before the call, so the reference draws what it would have."""

    def compile_that_fails(fn, **options):
        def run(*args):
            raise RuntimeError("no lowering for this op")

        return run

    monkeypatch.setattr(torch, "compile", compile_that_fails)
    monkeypatch.setattr(compiled_fp8.CompiledKernel, "warned", False)
    compiled_fp4._quantize_kernel.cache_clear()
    rule = QuantRule(granularity="mxfp4", stochastic_rounding=True)
    generator = torch.Generator().manual_seed(2)
    state = generator.get_state()
    try:
        with pytest.warns(RuntimeWarning, match="no lowering for this op"):
            assert compiled_fp4.quantize(_x(), rule, -1, None, generator) is None
        assert torch.equal(generator.get_state(), state)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once; the failed variant is not tried again
            assert compiled_fp4.quantize(_x(), rule, -1, None, generator) is None
        assert torch.equal(generator.get_state(), state)
    finally:
        compiled_fp4._quantize_kernel.cache_clear()  # later tests compile for real


_RULES = {
    "nvfp4": dict(granularity="nvfp4"),
    "nvfp4_rht": dict(granularity="nvfp4", rht=True),
    "nvfp4_sr": dict(granularity="nvfp4", stochastic_rounding=True),
    "nvfp4_rht_sr": dict(granularity="nvfp4", rht=True, stochastic_rounding=True),
    "nvfp4_2d": dict(granularity="nvfp4_2d"),
    "mxfp4": dict(granularity="mxfp4"),
    "mxfp4_sr": dict(granularity="mxfp4", stochastic_rounding=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("name", list(_RULES))
def test_every_rule_and_input_class_matches_the_reference(name, dtype):
    """Every input class of the 4-bit numerics tests (zeros, ties, scales that round to zero,
    NaN, infinities, wide ranges, subnormals), one compile per rule and dtype (one shape)."""
    rule = QuantRule(**_RULES[name])
    axes = (-1,) if rule.axis_free else (-1, 0)
    for case, x in _classes(dtype).items():
        try:
            _check_usages(x, rule, axes)
        except AssertionError as error:
            raise AssertionError(f"{name}, {case}: {error}") from error


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nvfp4_rht_sr", "nvfp4_2d", "mxfp4_sr"])
def test_odd_shapes_rank_3_strides_and_one_usage(name):
    rule = QuantRule(**_RULES[name])
    axes = (-1,) if rule.axis_free else (-1, 0)
    _check_usages(_x(torch.bfloat16, (96, 160)), rule, axes)  # not powers of two
    _check_usages(_x(torch.bfloat16, (2, 48, 64)), rule, axes)  # rank 3: the reference's layouts
    _check_usages(_x(torch.float32, (64, 128)).t(), rule, axes)  # a strided (transposed) input
    for axis in axes:
        _check_usages(_x(torch.float16, (32, 64)), rule, (axis,))


@pytest.mark.slow
def test_a_given_global_amax_sets_the_scales_of_a_shard():
    rule = QuantRule(granularity="nvfp4", rht=True)
    _check_usages(_x(), rule, global_amax=torch.tensor(3.0e4))
    _check_usages(_x(), rule, global_amax=torch.tensor(float("nan")))


@pytest.mark.slow
def test_the_door_and_the_gemm_take_the_column_major_operands():
    """Through the door's Quantizer (as on CUDA) into the emulated GEMM: the product of the
    compiled operands, one of them column-major, equals the reference's operands'."""
    rule = QuantRule(granularity="mxfp4")
    a, b = _x(torch.bfloat16, (64, 96)), _x(torch.bfloat16, (32, 96))
    a_first = compiled_fp4.quantize_both(a.t().contiguous(), rule)[1]
    b_last = compiled_fp4.quantize(b, rule, -1)
    with use_quant_settings(quantize_kernel="reference"):
        expected = scaled_mm(
            transpose(quantize_fp4(a.t().contiguous(), rule, 0)), quantize_fp4(b, rule, -1), torch.float32
        )
    actual = scaled_mm(transpose(a_first), b_last, torch.float32)
    assert torch.equal(actual, expected)
