"""Quantization: a high-precision tensor in, a :class:`QuantizedTensor` out.

Every granularity is one rule over *scaling groups*: the 2-D view ``(M, K)`` of the input
(leading dims flattened) is cut into a grid of groups of ``rows x cols`` values, each with
its own scale (see :mod:`fp8train.scaling` for the convention ``data = cast(x * scale)``):

=================  ===========================  ===========================
granularity        group, ``axis=-1`` (rowwise)  group, ``axis=0`` (columnwise)
=================  ===========================  ===========================
``tensor``         ``M x K``                    ``M x K``
``row``            ``1 x K``  -> scale ``(M,1)``  ``M x 1`` -> scale ``(1,K)``
``block1x128``     ``1 x 128`` -> ``(M,K/128)``   ``128 x 1`` -> ``(M/128,K)``
``block128x128``   ``128 x 128`` -> ``(M/128,K/128)`` (both axes)
``mx``             ``1 x 32`` -> ``(M,K/32)``     ``32 x 1`` -> ``(M/32,K)``
=================  ===========================  ===========================
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .formats import FP8_DATA_DTYPES, cast_to_fp8, format_of
from .scaling import FLOAT32_MAX, amax_to_scale, e8m0_to_float32, exp2_int, mx_scale_exponent

__all__ = ["GRANULARITIES", "QuantizedTensor", "quantize", "group_shape"]

GRANULARITIES = ("tensor", "row", "block1x128", "block128x128", "mx")
_BLOCK = {"block1x128": 128, "block128x128": 128, "mx": 32}
_HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _normalize_axis(axis: int, ndim: int) -> int:
    if axis in (-1, 0) or (ndim >= 2 and axis == ndim - 1):
        return -1 if axis != 0 else 0
    raise ValueError(
        f"axis={axis!r} is not supported for a rank-{ndim} input; use axis=-1 (groups along the "
        "last dim, rowwise usage) or axis=0 (groups along the first, flattened dim, columnwise usage)"
    )


def _view_2d_shape(shape: torch.Size) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return math.prod(shape[:-1]), shape[-1]


def group_shape(granularity: str, axis: int, shape_2d: tuple[int, int]) -> tuple[int, int]:
    """``(rows, cols)`` of one scaling group of ``granularity`` for a 2-D view of ``shape_2d``."""
    m, k = shape_2d
    if granularity == "tensor":
        return m, k
    if granularity == "row":
        return (1, k) if axis == -1 else (m, 1)
    if granularity == "block128x128":
        return 128, 128
    block = _BLOCK[granularity]
    return (1, block) if axis == -1 else (block, 1)


def _check_shape(x: torch.Tensor, granularity: str) -> None:
    if granularity == "row" and x.dim() < 1:
        raise ValueError(f"granularity 'row' needs a tensor of rank >= 1, got shape {tuple(x.shape)}")
    if granularity not in _BLOCK:
        return
    block = _BLOCK[granularity]
    if x.dim() < 2:
        raise ValueError(
            f"granularity {granularity!r} needs a tensor of rank >= 2, got shape {tuple(x.shape)}"
        )
    m, k = _view_2d_shape(x.shape)
    if k % block or m % block:
        raise ValueError(
            f"granularity {granularity!r} needs the last dim and the product of the other dims to "
            f"be divisible by {block}; shape {tuple(x.shape)} gives {m} x {k}. Pad the tensor, or "
            f"skip FP8 for this layer"
        )


def _group_amax(x_groups: torch.Tensor) -> torch.Tensor:
    """``max |x|`` per group of a ``(row groups, rows, col groups, cols)`` view, float32,
    keeping all four dims. NaN propagates; an empty group gives 0."""
    num_row_groups, rows, num_col_groups, cols = x_groups.shape
    if x_groups.numel() == 0:
        return torch.zeros(num_row_groups, 1, num_col_groups, 1, device=x_groups.device)
    if num_row_groups == num_col_groups == 1:
        low, high = torch.aminmax(x_groups)
        return torch.maximum(-low, high).to(torch.float32).reshape(1, 1, 1, 1)
    # Reduce the strided dim first (vectorizes across the contiguous one), then the
    # contiguous dim in float32 (PyTorch's short inner reductions are slow in 16-bit).
    magnitude = x_groups.abs()
    if rows > 1:
        magnitude = magnitude.amax(dim=1, keepdim=True)
    return magnitude.to(torch.float32).amax(dim=3, keepdim=True)


_CHUNK_ELEMENTS = 1 << 20  # a few MB per step: the scaled intermediate stays in cache


def _scale_and_cast(
    x_groups: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, scales_are_powers_of_2: bool
) -> torch.Tensor:
    """``cast_to_fp8(x_groups * scale)`` with the product rounded as float32 would round it.

    On CPU the work runs in chunks of whole row groups (or rows) so the scaled intermediate
    never has to be allocated, and paged in, at full size.
    """

    def scale_and_cast(x_part: torch.Tensor, scale_part: torch.Tensor) -> torch.Tensor:
        if scales_are_powers_of_2 and x_part.dtype == torch.bfloat16:
            # bfloat16 has float32's exponent range, so x * 2^k is exact in bfloat16 wherever
            # it can reach a non-zero FP8 value: the same product as float32, at half the traffic.
            scaled = x_part * scale_part.to(torch.bfloat16)
        elif x_part.dtype == torch.float32:
            scaled = x_part * scale_part  # scale is float32 and not 0-dim: no demotion
        else:
            scaled = x_part.to(torch.float32).mul_(scale_part)  # converting first beats promotion
        return cast_to_fp8(scaled, dtype)

    if x_groups.device.type != "cpu" or torch.compiler.is_compiling() or x_groups.numel() <= _CHUNK_ELEMENTS:
        return scale_and_cast(x_groups, scale)
    # Chunk along the row groups when there are several, else along the rows of the one group
    # (the scale is constant along that dim then).
    dim = 0 if x_groups.shape[0] > 1 else 1
    per_index = x_groups.numel() // x_groups.shape[dim]
    step = max(1, _CHUNK_ELEMENTS // per_index)
    out = torch.empty(x_groups.shape, dtype=dtype)
    for start in range(0, x_groups.shape[dim], step):
        part = slice(start, start + step)
        x_part = x_groups[part] if dim == 0 else x_groups[:, part]
        scale_part = scale[part] if dim == 0 else scale
        (out[part] if dim == 0 else out[:, part]).copy_(scale_and_cast(x_part, scale_part))
    return out


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """FP8 data with its scales.

    ``x ~= data * scale_inv`` with ``scale_inv`` broadcast over each scaling group.

    Attributes:
        data: FP8 tensor (``float8_e4m3fn`` or ``float8_e5m2``) of the input's shape.
        scale_inv: Per-group inverse scales in the compact layout, relative to the 2-D view
            ``(M, K)`` of ``data``: ``tensor`` ``()``; ``row`` ``(M,1)`` (axis -1) or ``(1,K)``
            (axis 0); ``block1x128`` ``(M,K/128)`` or ``(M/128,K)``; ``block128x128``
            ``(M/128,K/128)``; ``mx`` ``(M,K/32)`` or ``(M/32,K)`` as ``float8_e8m0fnu``.
            float32 for every granularity but ``mx``.
        granularity: One of :data:`GRANULARITIES`.
        axis: -1 (groups along the last dim, rowwise usage) or 0 (columnwise usage).
        power_2_scales: Every scale is a power of two (set by :func:`quantize`; always
            true for ``mx``). Lets the emulated GEMM fold scales into its operands exactly.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    granularity: str
    axis: int = -1
    power_2_scales: bool = False

    @property
    def dtype(self) -> torch.dtype:
        """FP8 dtype of :attr:`data`."""
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        """Shape of :attr:`data` (the input's shape)."""
        return self.data.shape

    def scale_inv_float32(self) -> torch.Tensor:
        """:attr:`scale_inv` as float32 (E8M0 decoded), same shape."""
        if self.granularity == "mx":
            return e8m0_to_float32(self.scale_inv)
        return self.scale_inv.to(torch.float32)

    @property
    def group_shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of one scaling group in the 2-D view of :attr:`data`."""
        return group_shape(self.granularity, self.axis, _view_2d_shape(self.data.shape))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Return ``data * scale_inv`` (computed in float32) as ``dtype``, in the input's shape."""
        m, k = _view_2d_shape(self.data.shape)
        if self.data.numel() == 0:
            return torch.zeros(self.data.shape, dtype=dtype, device=self.data.device)
        rows, cols = self.group_shape
        values = self.data.to(torch.float32).reshape(m // rows, rows, k // cols, cols)
        scale_inv = self.scale_inv_float32().reshape(m // rows, 1, k // cols, 1)
        return (values * scale_inv).reshape(self.data.shape).to(dtype)

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(shape={tuple(self.data.shape)}, dtype={self.data.dtype}, "
            f"granularity={self.granularity!r}, axis={self.axis}, "
            f"scale_inv.shape={tuple(self.scale_inv.shape)})"
        )


def quantize(
    x: torch.Tensor,
    granularity: str,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    axis: int = -1,
    power_2_scales: bool | None = None,
    amax_epsilon: float = 0.0,
    scale: torch.Tensor | None = None,
    mx_scale_rule: str = "ceil",
) -> QuantizedTensor:
    """Quantize ``x`` to FP8 with one scale per scaling group (NUMERICS.md sections 2-3).

    Args:
        x: float32, bfloat16 or float16 tensor. Ranks > 2 behave as their 2-D view
            ``(prod(leading dims), last dim)``; any strides.
        granularity: ``"tensor"``, ``"row"``, ``"block1x128"``, ``"block128x128"`` or ``"mx"``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        axis: -1 puts the scaling groups along the last dim (rowwise usage), 0 along the
            first (columnwise usage). Ignored by ``tensor`` and ``block128x128``.
        power_2_scales: round scales down to powers of two. ``None`` takes the recipe
            default: off for ``tensor``, on for ``row`` and the block granularities.
            ``mx`` scales are always powers of two.
        amax_epsilon: lower bound applied to each group's amax.
        scale: a precomputed float32 scale (``tensor`` granularity only, e.g. delayed
            scaling); skips the amax pass.
        mx_scale_rule: ``"ceil"`` (default, never saturates) or ``"ocp"``; ``mx`` only.

    Returns:
        A :class:`QuantizedTensor` whose ``data`` has ``x``'s shape.

    Raises:
        ValueError: unknown granularity, unsupported dtype or axis, or a shape the
            granularity cannot tile (rank < 2, or a dim not divisible by the block).
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is not one of {', '.join(GRANULARITIES)}")
    if dtype not in FP8_DATA_DTYPES:
        raise ValueError(f"dtype={dtype} is not an FP8 data dtype; use torch.float8_e4m3fn or torch.float8_e5m2")
    if x.dtype not in _HIGH_PRECISION_DTYPES:
        raise ValueError(f"quantize takes float32, bfloat16 or float16 input, got {x.dtype}")
    axis = _normalize_axis(axis, x.dim())
    if granularity in ("tensor", "block128x128"):
        axis = -1 if granularity == "tensor" else axis
    _check_shape(x, granularity)
    if scale is not None and granularity != "tensor":
        raise ValueError(f"a precomputed scale is only supported for granularity 'tensor', not {granularity!r}")
    if granularity == "mx" and power_2_scales is False:
        raise ValueError("power_2_scales=False is not possible for 'mx': E8M0 scales are powers of two")
    if power_2_scales is None:
        power_2_scales = granularity != "tensor"
    fp8_max = format_of(dtype).max

    m, k = _view_2d_shape(x.shape)
    rows, cols = group_shape(granularity, axis, (m, k))
    num_row_groups = m // rows if rows else 1
    num_col_groups = k // cols if cols else 1
    x_groups = x.reshape(num_row_groups, rows, num_col_groups, cols)

    user_scale = scale is not None
    if scale is None:
        amax = _group_amax(x_groups)
        if granularity == "mx":
            if amax_epsilon > 0:
                amax = torch.where(amax < amax_epsilon, torch.full_like(amax, amax_epsilon), amax)
            exponent = mx_scale_exponent(amax, fp8_max, mx_scale_rule)
            scale = exp2_int(127 - exponent.to(torch.int32))
            # A NaN anywhere in a block makes the whole block NaN.
            scale = torch.where(exponent == 0xFF, torch.full_like(scale, math.nan), scale)
            scale_inv = exponent  # uint8 bits; viewed as E8M0 once in its final shape
        else:
            inf_scale_value = torch.finfo(x.dtype).max if granularity in _BLOCK else FLOAT32_MAX
            scale = amax_to_scale(
                amax,
                fp8_max,
                power_2_scales=power_2_scales,
                amax_epsilon=amax_epsilon,
                inf_scale_value=inf_scale_value,
            )
            scale_inv = 1.0 / scale
    else:
        scale = scale.to(device=x.device, dtype=torch.float32).reshape(1, 1, 1, 1)
        scale_inv = 1.0 / scale

    scales_are_powers_of_2 = granularity == "mx" or (power_2_scales and not user_scale)
    data = _scale_and_cast(x_groups, scale, dtype, scales_are_powers_of_2).reshape(x.shape)
    scale_inv = scale_inv.reshape(num_row_groups, num_col_groups)
    if granularity == "mx" and not torch.compiler.is_compiling():
        # Inside torch.compile the scales stay as their uint8 bits: inductor (torch 2.13)
        # has no E8M0 kernels, and every reader here takes either dtype.
        scale_inv = scale_inv.view(torch.float8_e8m0fnu)
    if granularity == "tensor":
        scale_inv = scale_inv.reshape(())
    return QuantizedTensor(
        data=data,
        scale_inv=scale_inv,
        granularity=granularity,
        axis=axis,
        power_2_scales=scales_are_powers_of_2,
    )
