"""NVFP4 and MXFP4 quantization (NUMERICS.md 6) bit-exact against the independent NumPy
reference of ``_fp4_reference.py`` on every input class, both axes, three input dtypes;
the packed layout, transposes, saving for backward, and the errors."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8train
from fp8train.quant.tensor import QuantizedTensor, transpose

from . import _fp4_reference as ref

TINY = float.fromhex("0x1p-140")  # a float32 subnormal


def _classes(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Input classes, each a 32 x 64 tensor of ``dtype``."""
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(32, 64, generator=gen)
    ties = normal.clone()
    ties[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0])
    ties[0, 16] = 2688.0  # global amax 2688, so that a block of amax 6 is scaled by exactly 1
    ties[0, 17:32] = 0.0
    cases = {
        "normal": normal * 3,
        "zeros": torch.zeros(32, 64),
        "ties": ties,
        # one block far below the tensor's amax: its E4M3 scale rounds to zero
        "scale_to_zero": torch.cat([normal[:, :16] * 1e-6, normal[:, 16:] * 1e4], dim=1),
        "nan": normal.clone().index_put_((torch.tensor([3]), torch.tensor([5])), torch.tensor(math.nan)),
        "inf": normal.clone().index_put_((torch.tensor([3, 4]), torch.tensor([5, 6])), torch.tensor([math.inf, -math.inf])),
        "wide_range": normal * torch.logspace(-30, 30, 64, base=2.0),
    }
    # subnormal in the input dtype (and, for float32 and bfloat16, in float32 too)
    cases["subnormal"] = normal * (2.0**-20 if dtype == torch.float16 else 2.0**-130)
    if dtype == torch.float32:
        cases["deep_subnormal"] = normal * TINY
    return {name: value.to(dtype) for name, value in cases.items()}


def _reference(x: torch.Tensor, granularity: str, axis: int):
    values = ref.to_numpy_f32(x)
    m, k = values.shape
    block = 32 if granularity == "mxfp4" else 16
    rows, cols = (block, block) if granularity == "nvfp4_2d" else ((1, block) if axis == -1 else (block, 1))
    if granularity == "mxfp4":
        codes, scales = ref.mxfp4(values, rows, cols)
        global_amax = None
    else:
        codes, scales, global_amax = ref.nvfp4(values, rows, cols)
    return ref.pack(codes, -1 if axis == -1 or granularity == "nvfp4_2d" else 0), scales, global_amax


def _check(x, granularity, axis):
    qt = fp8train.quant.quantize(x, granularity, axis=axis)
    packed, scales, global_amax = _reference(x, granularity, axis)
    data = qt.data.view(torch.uint8).reshape(packed.shape).numpy()
    np.testing.assert_array_equal(data, packed)
    scale_bits = qt.scale_inv.view(torch.uint8).numpy()
    if granularity != "mxfp4":  # an E4M3 NaN's sign is unspecified (S.1111.111)
        scale_bits, scales = (np.where(b & 0x7F == 0x7F, 0x7F, b) for b in (scale_bits, scales))
    np.testing.assert_array_equal(scale_bits, scales)
    if global_amax is None:
        assert qt.global_amax is None
    else:
        assert qt.global_amax.dtype == torch.float32
        np.testing.assert_array_equal(qt.global_amax.numpy(), np.float32(global_amax))
    return qt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("granularity, axis", [("nvfp4", -1), ("nvfp4", 0), ("nvfp4_2d", -1), ("mxfp4", -1), ("mxfp4", 0)])
def test_bit_exact_against_the_numpy_reference(granularity, axis, dtype):
    for name, x in _classes(dtype).items():
        try:
            _check(x, granularity, axis)
        except AssertionError as error:
            raise AssertionError(f"input class {name!r}") from error


def test_nan_makes_every_nvfp4_scale_nan_and_mxfp4_only_its_block():
    x = _classes(torch.float32)["nan"]
    nv = fp8train.quant.quantize(x, "nvfp4")
    assert torch.isnan(nv.global_amax) and torch.isnan(nv.scale_inv.float()).all()
    assert torch.isnan(nv.dequantize()).all()
    mx = fp8train.quant.quantize(x, "mxfp4")
    nan_blocks = torch.isnan(mx.scale_inv.float())
    assert nan_blocks.sum() == 1 and nan_blocks[3, 0]
    assert torch.isnan(mx.dequantize()).sum() == 32


def test_a_block_whose_scale_rounds_to_zero_dequantizes_to_zero():
    x = _classes(torch.float32)["scale_to_zero"]
    qt = fp8train.quant.quantize(x, "nvfp4")
    assert (qt.scale_inv[:, 0].float() == 0).all() and (qt.dequantize()[:, :16] == 0).all()


def test_inf_takes_the_global_guard():
    # global_amax = inf: ge = 2688 / inf = 0 -> 1, so gd = 1 and the inf saturates to +-6 * 448
    x = torch.zeros(16, 16)
    x[0, 0] = math.inf
    qt = fp8train.quant.quantize(x, "nvfp4")
    assert qt.dequantize()[0, 0] == 6 * 448 and qt.scale_inv.float()[0, 0] == 448


@pytest.mark.parametrize("granularity", ["nvfp4", "mxfp4"])
def test_rank3_and_strided_inputs_quantize_their_2d_view(granularity):
    x = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(1))
    strided = x[:, :, ::2]
    assert not strided.is_contiguous()
    for axis in (-1, 0):
        qt = _check(strided, granularity, axis)
        expected = fp8train.quant.quantize(strided.contiguous().reshape(64, 64), granularity, axis=axis)
        assert torch.equal(qt.data.view(torch.uint8).reshape(expected.data.shape), expected.data.view(torch.uint8))
    assert fp8train.quant.quantize(strided, granularity).data.shape == (2, 32, 32)  # leading dims kept, K halved
    assert fp8train.quant.quantize(strided, granularity, axis=0).data.shape == (32, 64)  # the 2-D view, M halved


def test_packing_layout_by_hand():
    # One 1x16 block: values 0..6 in E2M1 steps with global amax 2688 -> scale exactly 1.
    x = torch.zeros(16, 32)
    x[0, :8] = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x[0, 8] = -0.5
    x[1, 0] = 2688.0
    qt = fp8train.quant.quantize(x, "nvfp4")
    assert qt.data.dtype == torch.float4_e2m1fn_x2 and qt.data.shape == (16, 16)
    # byte j = code(2j) | code(2j + 1) << 4
    assert qt.data.view(torch.uint8)[0, :5].tolist() == [0x10, 0x32, 0x54, 0x76, 0x09]
    columnwise = fp8train.quant.quantize(x, "nvfp4", axis=0)
    assert columnwise.data.shape == (8, 32)
    # rows 0 and 1 of column 0 pair: code(x[0,0]) = 0 low, code(x[1,0]) = 7 high (its block's scale maps 2688 to 6)
    assert columnwise.data.view(torch.uint8)[0, 0].item() == 0x70


@pytest.mark.parametrize("granularity", ["nvfp4", "nvfp4_2d", "mxfp4"])
def test_transpose_serves_the_other_usage(granularity):
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    rowwise = fp8train.quant.quantize(x, granularity, axis=-1)
    t = transpose(rowwise)
    assert t.global_amax is rowwise.global_amax
    assert torch.equal(t.dequantize(), rowwise.dequantize().t())
    if granularity == "nvfp4_2d":
        # square tiles: the transpose is the quantization of x^T, repacked along its last dim
        assert t.axis == -1 and t.data.shape == (32, 32)
        expected = fp8train.quant.quantize(x.t().contiguous(), granularity)
        assert torch.equal(t.data.view(torch.uint8), expected.data.view(torch.uint8))
        assert torch.equal(t.scale_inv.view(torch.uint8), expected.scale_inv.view(torch.uint8))
    else:
        # a first-dim quantization, transposed, is the K-last operand of x^T
        columnwise = transpose(fp8train.quant.quantize(x, granularity, axis=0))
        expected = fp8train.quant.quantize(x.t().contiguous(), granularity, axis=-1)
        assert columnwise.axis == -1
        assert torch.equal(columnwise.data.view(torch.uint8), expected.data.view(torch.uint8))


@pytest.mark.parametrize("granularity", ["nvfp4", "mxfp4"])
def test_saved_for_backward_and_restored(granularity):
    qt = fp8train.quant.quantize(torch.randn(32, 64), granularity)
    tensors, layout = qt.prepare_for_saving()
    assert len(tensors) == (3 if granularity == "nvfp4" else 2)
    assert not any(isinstance(v, torch.Tensor) for v in layout)
    restored = QuantizedTensor.restore_from_saved(layout, *tensors)
    assert torch.equal(restored.dequantize(), qt.dequantize())
    assert "global_amax=" in repr(qt) if granularity == "nvfp4" else "global_amax" not in repr(qt)


def test_e2m1_cast_matches_ml_dtypes_on_the_reference_path():
    # every representable value, every midpoint, and values between them, via quantize (scale 1)
    grid = np.array(ref.E2M1_GRID, dtype=np.float32)
    between = np.concatenate([grid, (grid[1:] + grid[:-1]) / 2, grid[1:] - 0.01, grid[:-1] + 0.01])
    values = np.concatenate([between, -between])[:48].astype(np.float32)
    x = torch.zeros(16, 64)
    x[0, :48] = torch.from_numpy(values.copy())
    x[1, 0] = 2688.0
    codes = fp8train.quant.quantize(x, "nvfp4").values_float32()[0, :48].numpy()
    np.testing.assert_array_equal(codes, values.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: fp8train.quant.quantize(torch.ones(16, 32), "nvfp4", dtype=torch.float8_e4m3fn), ValueError,
         r"granularity 'nvfp4' takes 4-bit E2M1 data, not format=E4M3"),
        (lambda: fp8train.quant.quantize(torch.ones(16, 32), "row", dtype=torch.float4_e2m1fn_x2), ValueError,
         r"format=E2M1 needs a 4-bit granularity"),
        (lambda: fp8train.quant.quantize(torch.ones(16, 32), "nvfp4", dtype=torch.int8), ValueError,
         r"dtype=torch.int8 is not an FP8 data dtype; .* or torch.float4_e2m1fn_x2 with a 4-bit granularity"),
        (lambda: fp8train.quant.quantize(torch.ones(16, 24), "nvfp4"), ValueError, r"divisible by 16; shape \(16, 24\)"),
        (lambda: fp8train.quant.quantize(torch.ones(16, 32), "nvfp4", stochastic_rounding=True, generator=3), TypeError,
         r"generator must be a torch.Generator"),
        (lambda: fp8train.quant.quantize(torch.ones(16, 32), "mxfp4", rht=True), ValueError, r"rht=True is not possible for 'mxfp4'"),
        (lambda: QuantizedTensor(data=torch.zeros(2, 2, dtype=torch.float8_e4m3fn), scale_inv=torch.ones(2, 1), granularity="mxfp4"),
         ValueError, r"data of granularity 'mxfp4' must be torch.float4_e2m1fn_x2"),
        (lambda: QuantizedTensor(data=torch.zeros(16, 8, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
                                 scale_inv=torch.ones(16, 1), granularity="nvfp4"),
         ValueError, r"global_amax must be a float32 scalar tensor for granularity 'nvfp4', got None"),
        (lambda: QuantizedTensor(data=torch.zeros(2, 2, dtype=torch.float8_e4m3fn), scale_inv=torch.ones(()),
                                 granularity="tensor", global_amax=torch.ones(())),
         ValueError, r"global_amax must be None for granularity 'tensor'"),
        (lambda: QuantizedTensor(data=torch.zeros(16, 8, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
                                 scale_inv=torch.ones(16, 1), granularity="nvfp4", global_amax=1.0),
         TypeError, r"global_amax must be a torch.Tensor, got float"),
    ],
)
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("granularity", ["nvfp4", "mxfp4"])
def test_stochastic_rounding_draws_from_the_generator_in_the_cast_only(granularity):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    draw = lambda seed: fp8train.quant.quantize(  # noqa: E731
        x, granularity, stochastic_rounding=True, generator=torch.Generator().manual_seed(seed)
    )
    first, again, other = draw(5), draw(5), draw(6)
    assert torch.equal(first.data.view(torch.uint8), again.data.view(torch.uint8))
    assert not torch.equal(first.data.view(torch.uint8), other.data.view(torch.uint8))
    nearest = fp8train.quant.quantize(x, granularity)
    assert torch.equal(first.scale_inv.view(torch.uint8), nearest.scale_inv.view(torch.uint8))
    # every code is the nearest one or its neighbour towards x
    step = (first.values_float32() - nearest.values_float32()).abs()
    assert (step <= 2).all() and (step > 0).any()


@pytest.mark.parametrize("granularity", ["nvfp4", "nvfp4_2d", "mxfp4"])
def test_a_4bit_rule_goes_to_its_own_familys_quantizers(granularity):
    from fp8train.quant.kernels import try_operand_values
    from fp8train.quant.quantize import FAMILIES, quantize_both, quantizers_for
    from fp8train.spec.rule import QuantRule

    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(8))
    rule = QuantRule(granularity=granularity)
    kernel, reference = quantizers_for(rule, x)
    assert reference is FAMILIES[4].reference and kernel in (None, FAMILIES[4].kernels["cpu"])
    assert try_operand_values(fp8train.quant.quantize(x, granularity), True, torch.float32) is None
    rowwise, columnwise = quantize_both(x, rule)  # no one-read 4-bit kernel: two quantizations
    assert torch.equal(rowwise.data.view(torch.uint8), fp8train.quant.quantize(x, granularity).data.view(torch.uint8))
    assert torch.equal(columnwise.data.view(torch.uint8), fp8train.quant.quantize(x, granularity, axis=0).data.view(torch.uint8))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("granularity, axis", [("nvfp4", -1), ("nvfp4", 0), ("nvfp4_2d", -1), ("mxfp4", -1), ("mxfp4", 0)])
def test_random_sweep_against_the_numpy_reference(granularity, axis, dtype):
    """Many seeds, values spread over most of the dtype's exponent range, zero blocks."""
    low, high = {torch.float32: (-120, 120), torch.bfloat16: (-120, 120), torch.float16: (-20, 14)}[dtype]
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(64, 128, generator=gen) * torch.exp2(torch.randint(low, high, (64, 1), generator=gen).float())
        x[torch.rand(64, 128, generator=gen) < 0.05] = 0.0
        _check(x.to(dtype), granularity, axis)


def _cat_bits(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.contiguous().view(torch.uint8) for p in parts])


@pytest.mark.parametrize(
    "granularity, axis, rht", [("nvfp4", -1, False), ("nvfp4", 0, True), ("nvfp4_2d", -1, False), ("nvfp4", 0, False)]
)
def test_shards_under_the_whole_tensors_global_amax_quantize_as_the_whole(granularity, axis, rht):
    # The kernel path (nvfp4 along -1) and the reference path (2-D tiles, axis 0, the transform).
    from fp8train.quant.hadamard import random_hadamard_transform
    from fp8train.quant.quantize import quantize
    from fp8train.spec.rule import QuantRule

    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(9))
    x[40, 3] = 1e3  # the outlier lies in the second shard only
    rule = QuantRule(granularity=granularity, rht=rht)
    whole = quantize(x, rule, axis=axis)
    shards = x.chunk(2, dim=0)
    transformed = [random_hadamard_transform(s, axis) if rht else s for s in shards]
    global_amax = torch.stack([t.abs().amax() for t in transformed]).amax()
    assert torch.equal(global_amax, whole.global_amax)
    parts = [quantize(s, rule, axis=axis, global_amax=global_amax) for s in shards]
    assert torch.equal(_cat_bits([p.data for p in parts]), whole.data.view(torch.uint8))
    assert torch.equal(_cat_bits([p.scale_inv for p in parts]), whole.scale_inv.view(torch.uint8))
    assert all(torch.equal(p.global_amax, global_amax) for p in parts)
    # Its own amax gives the first shard other scales.
    alone = quantize(shards[0], rule, axis=axis)
    assert not torch.equal(alone.scale_inv.view(torch.uint8), parts[0].scale_inv.view(torch.uint8))


@pytest.mark.parametrize(
    "granularity, global_amax, error, match",
    [
        ("mxfp4", torch.tensor(1.0), ValueError, r"global_amax is for NVFP4's two-level scales .* not granularity 'mxfp4'"),
        ("tensor", torch.tensor(1.0), ValueError, r"not granularity 'tensor'; leave it None"),
        ("nvfp4", torch.ones(2), ValueError, r"global_amax must be a one-element float32 tensor, got shape \(2,\)"),
        ("nvfp4", torch.tensor(1.0, dtype=torch.float64), ValueError, r"one-element float32 tensor, .* torch.float64"),
        ("nvfp4", 1.0, TypeError, r"global_amax must be a torch.Tensor"),
    ],
)
def test_global_amax_errors(granularity, global_amax, error, match):
    from fp8train.quant.quantize import quantize
    from fp8train.spec.rule import QuantRule

    with pytest.raises(error, match=match):
        quantize(torch.ones(32, 32), QuantRule(granularity=granularity), global_amax=global_amax)
