"""QuantizedTensor: granularity objects, the declared GEMM cache, and its transpose."""

import pytest
import torch

from fp8train import QuantizedTensor, quantize, scaled_mm
from fp8train.quant.emulated import emulated_mm
from fp8train.quant.tensor import GemmOperandCache, transpose
from fp8train.spec.granularities import view_2d_shape
from fp8train.spec.granularities import Granularity


def test_granularity_is_coerced_and_named_in_repr():
    qt = QuantizedTensor(data=torch.zeros(2, 2, dtype=torch.float8_e4m3fn), scale_inv=torch.tensor(1.0), granularity="tensor")
    assert qt.granularity is Granularity.TENSOR
    assert "granularity='tensor'" in repr(qt)
    with pytest.raises(ValueError, match="granularity='tile' is not one of"):
        QuantizedTensor(data=torch.zeros(2, 2, dtype=torch.float8_e4m3fn), scale_inv=torch.tensor(1.0), granularity="tile")


def test_quantize_takes_granularity_members_and_names_alike():
    x = torch.randn(128, 256)
    by_name, by_member = quantize(x, "block1x128"), quantize(x, Granularity.BLOCK_1X128)
    assert torch.equal(by_name.data.view(torch.uint8), by_member.data.view(torch.uint8))
    assert torch.equal(by_name.scale_inv, by_member.scale_inv)


@pytest.mark.parametrize("shape, expected", [((), (1, 1)), ((5,), (1, 5)), ((2, 3, 4), (6, 4)), ((0, 7), (0, 7))])
def test_view_2d_shape(shape, expected):
    assert view_2d_shape(torch.Size(shape)) == expected


def test_gemm_cache_is_filled_once_and_follows_symmetric_transposes():
    a = quantize(torch.randn(32, 64), "tensor", power_2_scales=True)
    b = quantize(torch.randn(16, 64), "tensor", power_2_scales=True)
    assert a.gemm_cache.get(torch.bfloat16) is None
    emulated_mm(a, b, torch.bfloat16, gemm_dtype=torch.bfloat16)
    values, out_scale = a.gemm_cache.get(torch.bfloat16)
    assert values.shape == (32, 64) and out_scale is None
    assert a.gemm_cache.get(torch.float32) is None  # cached for one compute dtype only
    at = transpose(a)
    t_values, _ = at.gemm_cache.get(torch.bfloat16)
    assert torch.equal(t_values, values.t())


def test_row_transposes_start_without_a_cache():
    a = quantize(torch.randn(32, 64), "row")
    scaled_mm(a, quantize(torch.randn(16, 64), "row"), torch.bfloat16, backend="emulated")
    assert a.gemm_cache.values is not None
    assert transpose(a).gemm_cache.values is None  # per-row scales do not fold for the transpose
    assert isinstance(a.gemm_cache, GemmOperandCache)
