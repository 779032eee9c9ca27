"""The FP8 family's GPU quantizer (:mod:`fp8train.quant.kernels.compiled_fp8`) run on the
CPU, where inductor generates C++ in place of Triton: the same arithmetic and layouts as on
a GPU, held to the reference's bits (a NaN's sign aside, as for every kernel). The GPU
suite (``tests/gpu/test_quantize_kernel.py``) holds the Triton kernels to the CPU's bytes.

One case runs by default (a compile costs seconds); the matrix of granularities, formats
and dtypes is ``-m slow``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fp8train.quant.fp8_quantize import quantize_fp8
from fp8train.quant.gemm import emulated
from fp8train.quant.kernels import compiled_fp8, use_quant_settings
from fp8train.quant.tensor import QuantizedTensor, transpose
from fp8train.spec.formats import E4M3, E5M2
from fp8train.spec.rule import QuantRule

from .test_quantize_kernels import _assert_same


def _x(dtype: torch.dtype, shape=(256, 384)) -> torch.Tensor:
    """Values whose magnitude varies by column, zeros, tiny and huge ones, a NaN and infs."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=generator) * torch.exp(3 * torch.randn(1, shape[1], generator=generator))
    x[:, :32] = 0.0
    x[:16, 32:64] *= 1e-30
    x[16:32, 64:96] *= 1e30
    # Groups whose amax is so small that fp8_max / amax overflows float32: the scale takes
    # its largest value and 1 / scale is a float32 subnormal.
    x[128:256, 256:384] = 1e-38 * torch.randn(128, 128, generator=generator).sign()
    x[250, :] = -1e-38
    x[40, 200] = float("inf")
    x[41, 201] = -float("inf")
    x[100, 300] = float("nan")
    return x.to(dtype)


def _check_both(x: torch.Tensor, rule: QuantRule, scale: torch.Tensor | None = None) -> None:
    last, first = compiled_fp8.quantize_usages(x, rule, (-1, 0), scale)
    for axis, actual in ((-1, last), (0, first)):
        _assert_same(actual, quantize_fp8(x, rule, axis, scale))
    assert last.data.is_contiguous()
    # The first-dim usage is written column-major: its transpose, the K-last operand a
    # GEMM takes, is contiguous (no copy before torch._scaled_mm).
    assert transpose(first).data.is_contiguous() and not first.data.is_contiguous()


@pytest.mark.heavy  # a torch.compile or JAX compile of seconds: CI's second leg runs it (default run under 6 minutes)
def test_rowwise_both_usages_in_one_read_and_their_gemm_layouts():
    _check_both(_x(torch.bfloat16), QuantRule(granularity="row"))


def test_a_given_scale_saturates_values_beyond_its_range():
    """Delayed scaling's path: last step's per-tensor scale, values far beyond it."""
    _check_both(_x(torch.bfloat16), QuantRule(granularity="tensor"), scale=torch.tensor(3.0e3))


def test_the_door_leaves_to_the_reference_what_the_kernel_does_not_take():
    rule = QuantRule(granularity="row")
    assert compiled_fp8.quantize(torch.empty(0, 128), rule, -1, None) is None
    with use_quant_settings(quantize_kernel="reference"):
        assert compiled_fp8.quantize(torch.ones(4, 128), rule, -1, None) is None
        assert compiled_fp8.quantize_both(torch.ones(4, 128), rule) is None
    assert compiled_fp8.quantize(torch.ones(4, 4), QuantRule(granularity="nvfp4"), -1, None) is None


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "row", "block1x128", "block128x128", "mx"])
def test_every_granularity_matches_the_reference(granularity, fmt, dtype):
    _check_both(_x(dtype), QuantRule(granularity=granularity, format=fmt))
    single = compiled_fp8.quantize(_x(dtype), QuantRule(granularity=granularity, format=fmt), -1, None)
    _assert_same(single, quantize_fp8(_x(dtype), QuantRule(granularity=granularity, format=fmt), -1, None))


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["tensor", "row", "block1x128", "block128x128", "mx"])
def test_emulated_operands_from_codes_match_the_pytorch_ops(granularity):
    rule = QuantRule(granularity=granularity, power_2_scales=True)
    last, first = compiled_fp8.quantize_usages(_x(torch.bfloat16).nan_to_num(), rule, (-1, 0), None)
    for qt in (last, transpose(first)):
        bare = QuantizedTensor(
            data=qt.data, scale_inv=qt.scale_inv, granularity=qt.granularity, axis=qt.axis, power_2_scales=True
        )
        actual = compiled_fp8.operand_values(bare, True, torch.bfloat16)
        with use_quant_settings(quantize_kernel="reference"):
            expected, _ = emulated._operand(bare, torch.bfloat16)
        assert torch.equal(actual.view(torch.int16), expected.view(torch.int16)), granularity


@pytest.mark.heavy
def test_shapes_beyond_the_few_compiled_each_share_one_kernel_for_any_shape(monkeypatch):
    """Inputs whose length changes every step stop compiling after a few shapes: further
    ones go through one kernel compiled for any shape, with the same bits."""
    monkeypatch.setattr(compiled_fp8, "SHAPES_COMPILED_EACH", 1)
    compiled_fp8._quantize_kernel.cache_clear()  # a fresh variant: no shape met yet
    rule = QuantRule(granularity="row", format=E5M2)
    usages = (compiled_fp8._Groups(1, None),)
    kernel = compiled_fp8._quantize_kernel(usages, rule, False)
    for rows in (256, 288, 320):
        x = _x(torch.bfloat16, (rows, 384)).nan_to_num()
        _assert_same(compiled_fp8.quantize(x, rule, -1, None), quantize_fp8(x, rule, -1, None))
    assert len(kernel._by_shape) == 1 and kernel._any_shape is not None


def test_a_kernel_that_fails_to_compile_leaves_its_tensors_to_the_reference(monkeypatch):
    """An inductor or Triton release that cannot lower an op: one warning naming the error,
    then the reference quantizes (the door's ``None``), never a crash mid-training."""

    def compile_that_fails(fn, **options):
        def run(*args):
            raise RuntimeError("no lowering for this op")

        return run

    monkeypatch.setattr(torch, "compile", compile_that_fails)
    monkeypatch.setattr(compiled_fp8.CompiledKernel, "warned", False)
    compiled_fp8._quantize_kernel.cache_clear()  # a fresh variant, compiled by the failing compile
    rule = QuantRule(granularity="block1x128")
    try:
        with pytest.warns(RuntimeWarning, match="no lowering for this op"):
            assert compiled_fp8.quantize(_x(torch.bfloat16), rule, -1, None) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once, whichever variant fails next
            assert compiled_fp8.quantize_both(_x(torch.bfloat16), rule) is None
            assert compiled_fp8.quantize(_x(torch.bfloat16), rule, -1, None) is None
    finally:
        compiled_fp8._quantize_kernel.cache_clear()  # later tests compile for real
