"""QuantizedTensor: granularity objects, the declared GEMM cache, and its transpose."""

import pytest
import torch

from fp8train.quant import QuantizedTensor, quantize, scaled_mm
from fp8train.quant.gemm.emulated import emulated_mm
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


@pytest.mark.parametrize("granularity", [g for g in Granularity if not g.fp4])  # 4-bit: test_fp4_quantize.py
@pytest.mark.parametrize("axis", [-1, 0])
def test_saved_for_backward_as_its_tensors_and_restored_alike(granularity, axis):
    qt = quantize(torch.randn(128, 256), granularity, axis=axis, power_2_scales=True)
    qt.gemm_cache.put(torch.float32, qt.dequantize(), None)
    (data, scale_inv), layout = qt.prepare_for_saving()
    # Only the tensors go to save_for_backward (saved-tensor hooks see them); the layout is plain values.
    assert data is qt.data and scale_inv is qt.scale_inv
    assert layout == (qt.granularity, qt.axis, True) and not any(isinstance(v, torch.Tensor) for v in layout)
    restored = QuantizedTensor.restore_from_saved(layout, data.clone(), scale_inv.clone())
    assert restored.prepare_for_saving()[1] == layout
    assert torch.equal(restored.data.view(torch.uint8), qt.data.view(torch.uint8))
    assert torch.equal(restored.scale_inv_float32(), qt.scale_inv_float32())
    assert restored.gemm_cache.values is None  # the converted copy is not saved
