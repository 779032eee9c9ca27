"""The blockwise hardware GEMM's arguments, pinned without a GPU: fed to an independent
float64 reading of ``torch._scaled_mm`` (tests/quant/_scaled_mm_reference.py: PyTorch's
checks, cuBLAS's documented scale layouts), they give the emulated GEMM, at every K from
128 to 640, M not a multiple of 128 and N a vocabulary-like size. The reference itself is
held to what an H200 did (torch 2.11, CUDA 13.0)."""

from __future__ import annotations

import pytest
import torch

from fp8train.quant import quantize
from fp8train.quant.gemm import scaled_mm
from fp8train.quant.gemm.hardware import hardware_arguments
from fp8train.quant.tensor import QuantizedTensor, transpose

from .._gemm_reference import _assert_matches, _random, _reference
from .._scaled_mm_reference import Refused, reference_scaled_mm, scaling_modes

KS = (128, 256, 384, 512, 640)
MS = (1, 100, 128, 300)
NS = (128, 256, 384)


def _operand(rows: int, k: int, granularity: str, seed: int) -> QuantizedTensor:
    """A K-last operand of ``rows`` rows: 1x128 groups are per row, so any row count is a
    valid operand (cut from a tensor quantized at a multiple of 128 rows)."""
    qt = quantize(_random((-(-rows // 128) * 128, k), seed), granularity)
    if rows % 128 == 0:
        return qt
    return QuantizedTensor(data=qt.data[:rows], scale_inv=qt.scale_inv[:rows], granularity=granularity, power_2_scales=True)


def _check_against_reference(a: QuantizedTensor, b: QuantizedTensor) -> None:
    args = hardware_arguments(a, b)
    ref = reference_scaled_mm(args.a_data, args.b_data, args.scale_a, args.scale_b)[: args.rows]
    assert torch.equal(ref, _reference(a, b)), "the arguments do not compute a @ b^T"
    _assert_matches(scaled_mm(a, b, torch.float32, backend="emulated"), ref, torch.float32)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("b_gran", ["block128x128", "block1x128"])
def test_block1x128_a_arguments_compute_the_gemm(b_gran, k, m, n):
    _check_against_reference(_operand(m, k, "block1x128", 1), _operand(n, k, b_gran, 2))


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("k", KS)
def test_block128x128_a_arguments_compute_the_gemm(k, n):
    _check_against_reference(_operand(256, k, "block128x128", 3), _operand(n, k, "block1x128", 4))


@pytest.mark.parametrize("k", [384, 640])
def test_transposed_128x128_operand_arguments_compute_the_gemm(k):
    """The grad_input GEMM's weight: a 128x128 tensor [K, N] fed as its transpose (its
    scales a transposed view: 128x128 tiles follow the data whatever the axis)."""
    weight = quantize(_random((k, 256), 5), "block128x128")
    _check_against_reference(_operand(100, k, "block1x128", 6), transpose(weight))
    axis0 = quantize(_random((256, k), 7), "block128x128", axis=0)
    _check_against_reference(_operand(128, k, "block1x128", 8), axis0)


@pytest.mark.parametrize("m, n, k", [(1, 128, 384), (100, 384, 640), (300, 256, 128), (256, 256, 512)])
@pytest.mark.parametrize("pair", [("block1x128", "block128x128"), ("block1x128", "block1x128")])
def test_meta_registration_accepts_the_arguments(pair, m, n, k):
    """PyTorch's meta checks of _scaled_mm (shapes, K and N multiples of 16, layouts of the
    data) take the arguments; its blockwise stride checks live in the CUDA build only and
    are the reference's."""
    a, b = _operand(m, k, pair[0], 9), _operand(n, k, pair[1], 10)
    args = hardware_arguments(a, b)
    meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in args[:4]]
    out = torch._scaled_mm(*meta, out_dtype=torch.bfloat16)
    assert out.shape == (args.a_data.shape[0], n) and args.a_data.shape[0] >= m


# ---------------------------------------------------------------- the reference, held to the H200


def _scales_128x128_b(b: QuantizedTensor, k_stride: int) -> torch.Tensor:
    """A 128x128 ``b``'s scales ``(K/128, N/128)`` as the transpose of ``[N/128, k_stride]``."""
    kb = b.scale_inv.shape[1]
    storage = torch.zeros(b.scale_inv.shape[0], k_stride)
    storage[:, :kb] = b.scale_inv
    return storage[:, :kb].t()


def test_reference_refuses_the_padded_stride_torch_refused_at_k_384():
    """fp8train's layout before K padding: stride pad4(K/128) = 4, which PyTorch refused on
    the H200 ("Invalid scaling configuration") for K = 128, 256, 384, 640."""
    a, b = _operand(256, 384, "block1x128", 11), _operand(256, 384, "block128x128", 12)
    scale_a = a.scale_inv.t().contiguous().t()
    with pytest.raises(Refused, match="Invalid scaling configuration"):
        scaling_modes(a.data, b.data.t(), scale_a, _scales_128x128_b(b, 4))


def test_reference_reads_the_unpadded_stride_wrongly_as_the_h200_did():
    """The stride PyTorch accepts at K/128 = 3 (3, unpadded): cuBLAS reads with stride 4, and
    the H200 returned a wrong result; so does the reference (the same numbers, read shifted)."""
    a, b = _operand(256, 384, "block1x128", 13), _operand(256, 384, "block128x128", 14)
    scale_a = a.scale_inv.t().contiguous().t()
    with pytest.raises(RuntimeError, match="out of bounds"):
        # stored [N/128, 3] with nothing after: cuBLAS's stride-4 reading runs past its end
        reference_scaled_mm(a.data, b.data.t(), scale_a, _scales_128x128_b(b, 3))
    storage = torch.zeros(64)  # the same scales with room after them, as a caching allocator leaves
    storage[:6] = b.scale_inv.reshape(-1)
    wrong = reference_scaled_mm(a.data, b.data.t(), scale_a, storage[:6].view(2, 3).t())
    assert not torch.allclose(wrong, _reference(a, b))


def test_reference_reads_the_stride_torch_accepts_at_k_512_rightly():
    """At K = 512 (K/128 = 4) the stride is 4 either way, and the H200 gave the right result."""
    a, b = _operand(256, 512, "block1x128", 15), _operand(256, 512, "block128x128", 16)
    scale_a = a.scale_inv.t().contiguous().t()
    ref = reference_scaled_mm(a.data, b.data.t(), scale_a, _scales_128x128_b(b, 4))
    assert torch.equal(ref, _reference(a, b))
