"""``QuantizedTensor``: FP8 or 4-bit data with its scales, and its transpose.

The scale convention, defined once for the whole library (see :mod:`fp8train.quant.scaling`)::

    data = cast_to_fp8(x * scale)        x ~= data * scale_inv,   scale_inv = 1 / scale

NVFP4 adds a second, per-tensor level (NUMERICS.md 6): ``x ~= (e2m1(data) * scale_inv) * gd``
with ``gd`` derived from the tensor's ``global_amax``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..spec.checks import check_bool
from ..spec.granularities import Granularity, view_2d_shape
from .cast import FP8_DATA_DTYPES, check_tensor, fp8_to_hp
from .e2m1 import e2m1_to_float32, unpack_e2m1
from .scaling import e8m0_to_float32, nvfp4_global_scales

__all__ = ["QuantizedTensor", "QuantizedLayout", "GemmOperandCache", "transpose", "quantized_tensor"]


@dataclass(init=False)  # built empty, its fields' defaults on the class: no __init__ call (issue 38)
class GemmOperandCache:
    """The GEMM-ready values of a :class:`QuantizedTensor` for the emulated backend (its
    FP8 codes converted, power-of-two scales folded in), kept so that a tensor reused by
    the backward (as its transpose) is converted once.

    Attributes:
        compute_dtype: dtype of ``values`` (``None``: nothing cached).
        values: ``[rows, K]`` tensor of ``compute_dtype``.
        out_scale: the scales left to apply to the GEMM output, or ``None``.
        transposed: the cache of this tensor's transpose, where its values are these
            transposed (a symmetric granularity's: :func:`transpose` links it), which
            :meth:`put` fills too; ``None`` otherwise. One way only (no reference cycle,
            which would keep the values until the garbage collector ran).
    """

    compute_dtype: torch.dtype | None = None
    values: torch.Tensor | None = None
    out_scale: torch.Tensor | None = None
    transposed: "GemmOperandCache | None" = field(default=None, repr=False)

    def get(self, compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(values, out_scale)`` if cached for ``compute_dtype``, else ``None``."""
        if self.values is None or self.compute_dtype != compute_dtype:
            return None
        return self.values, self.out_scale

    def put(self, compute_dtype: torch.dtype, values: torch.Tensor, out_scale: torch.Tensor | None) -> None:
        """Cache ``values`` and ``out_scale`` for ``compute_dtype`` (and their transpose in
        the linked :attr:`transposed` cache, where that holds nothing yet)."""
        self.compute_dtype, self.values, self.out_scale = compute_dtype, values, out_scale
        partner = self.transposed
        if partner is not None and partner.values is None:
            partner.compute_dtype, partner.values, partner.out_scale = compute_dtype, values.T, out_scale


class QuantizedLayout(NamedTuple):
    """Everything of a :class:`QuantizedTensor` but its tensors: what
    :meth:`QuantizedTensor.restore_from_saved` needs besides the saved data and scales."""

    granularity: Granularity
    axis: int
    power_2_scales: bool


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """FP8 or 4-bit data with its scales.

    ``x ~= data * scale_inv`` with ``scale_inv`` broadcast over each scaling group (times
    the global decode scale for NVFP4).

    Attributes:
        data: FP8 tensor (``float8_e4m3fn`` or ``float8_e5m2``) of the input's shape; for
            the 4-bit granularities ``torch.float4_e2m1fn_x2``, two codes a byte along the
            scaling axis: ``[..., K/2]`` (axis -1) or ``[M/2, K]`` (axis 0, the 2-D view).
        scale_inv: Per-group inverse scales in the compact layout, relative to the 2-D view
            ``(M, K)`` of ``data``: ``tensor`` ``()``; ``row`` ``(M,1)`` (axis -1) or ``(1,K)``
            (axis 0); ``block1x128`` ``(M,K/128)`` or ``(M/128,K)``; ``block128x128``
            ``(M/128,K/128)``; ``mx`` ``(M,K/32)`` or ``(M/32,K)`` as ``float8_e8m0fnu``.
            float32 for every granularity but ``mx``. 4-bit: ``nvfp4`` ``(M,K/16)`` or
            ``(M/16,K)``, ``nvfp4_2d`` ``(M/16,K/16)`` as ``float8_e4m3fn``; ``mxfp4``
            ``(M,K/32)`` or ``(M/32,K)`` as ``float8_e8m0fnu``.
        granularity: A :class:`~fp8train.spec.granularities.Granularity` (or its name).
        axis: -1 (groups along the last dim, rowwise usage) or 0 (columnwise usage).
        power_2_scales: Every scale is a power of two (set by :func:`quantize`; always
            true for ``mx``). Lets the emulated GEMM fold scales into its operands exactly.
        global_amax: NVFP4 only (``nvfp4``, ``nvfp4_2d``): the float32 scalar amax of the
            whole tensor, from which the global scales derive; ``None`` for every other
            granularity.
        gemm_cache: The emulated backend's converted operand (filled on first use;
            ``None`` inside ``torch.compile``).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    granularity: Granularity
    axis: int = -1
    power_2_scales: bool = False
    global_amax: torch.Tensor | None = None
    gemm_cache: GemmOperandCache | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Every check is a type test or a comparison unless it fails: the layer builds
        # several of these per GEMM (issue 38, the host cost of a step).
        if type(self.granularity) is not Granularity:
            object.__setattr__(self, "granularity", Granularity.coerce(self.granularity))
        if (type(self.data) is not torch.Tensor and not isinstance(self.data, torch.Tensor)) or (
            type(self.scale_inv) is not torch.Tensor and not isinstance(self.scale_inv, torch.Tensor)
        ):
            check_tensor("data", self.data)
            check_tensor("scale_inv", self.scale_inv)
        compiling = torch.compiler.is_compiling()
        self._check_data_and_global_amax(compiling)
        if (type(self.axis) is not int and isinstance(self.axis, bool)) or self.axis not in (-1, 0):
            raise ValueError(f"axis={self.axis!r} must be -1 (rowwise usage) or 0 (columnwise usage)")
        if type(self.power_2_scales) is not bool:
            check_bool("power_2_scales", self.power_2_scales)
        # Inside torch.compile nothing is cached (the graph holds the conversion once), and
        # Dynamo (torch 2.13) could not rebuild a cache object across a graph break.
        object.__setattr__(self, "gemm_cache", None if compiling else GemmOperandCache())

    def _check_data_and_global_amax(self, compiling: bool) -> None:
        granularity = self.granularity
        if granularity.fp4:
            # Inside torch.compile 4-bit data stays as its uint8 bytes (quant/e2m1.py pack_e2m1).
            fp4_dtypes = (torch.float4_e2m1fn_x2, torch.uint8) if compiling else (torch.float4_e2m1fn_x2,)
            if self.data.dtype not in fp4_dtypes:
                raise ValueError(
                    f"data of granularity {str(granularity)!r} must be torch.float4_e2m1fn_x2, got "
                    f"{self.data.dtype}; quantize high-precision tensors with fp8train.quant.quantize"
                )
        elif self.data.dtype not in FP8_DATA_DTYPES:
            raise ValueError(
                f"data must be float8_e4m3fn or float8_e5m2, got {self.data.dtype}; quantize high-precision "
                "tensors with fp8train.quant.quantize"
            )
        if granularity.two_level_scales != (self.global_amax is not None):
            raise ValueError(
                f"global_amax must be {'a float32 scalar tensor' if granularity.two_level_scales else 'None'} for "
                f"granularity {str(granularity)!r}, got {self.global_amax!r}"
            )
        if self.global_amax is not None:
            check_tensor("global_amax", self.global_amax)

    @property
    def unpacked_shape_2d(self) -> tuple[int, int]:
        """``(M, K)`` of the 2-D view of the values :attr:`data` holds (4-bit data holds
        two a byte along the scaling axis)."""
        # As granularity.values_shape_2d, inline: the GEMMs ask for it several times each.
        try:
            m, k = self.data.shape
        except ValueError:
            m, k = view_2d_shape(self.data.shape)
        if not self.granularity.fp4:
            return m, k
        return (m, 2 * k) if self.axis == -1 else (2 * m, k)

    @property
    def dtype(self) -> torch.dtype:
        """FP8 (or packed 4-bit) dtype of :attr:`data`."""
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        """Shape of :attr:`data` (the input's shape; 4-bit data: packed, see :attr:`unpacked_shape_2d`)."""
        return self.data.shape

    def scale_inv_float32(self) -> torch.Tensor:
        """:attr:`scale_inv` as float32 (E8M0 decoded), same shape."""
        if self.granularity.e8m0_scales:
            return e8m0_to_float32(self.scale_inv)
        return self.scale_inv.to(torch.float32)

    def scales_per_k_chunk(self, chunk: int) -> torch.Tensor:
        """The float32 scale of every (row, K chunk) of this K-last operand, ``[rows, K / chunk]``
        (``chunk`` divides the groups along K, or they span all of K): what a GEMM promoting
        each chunk of K with its own scales multiplies by (tiles repeated over their rows)."""
        rows, k = self.unpacked_shape_2d
        group_rows, group_cols = self.group_shape
        scale_inv = self.scale_inv_float32().reshape(rows // group_rows, k // group_cols)
        scale_inv = scale_inv.repeat_interleave(group_rows, dim=0)
        if group_cols == k:
            return scale_inv.expand(rows, k // chunk)
        return scale_inv.repeat_interleave(group_cols // chunk, dim=1)

    @property
    def group_shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of one scaling group in the 2-D view of :attr:`data`."""
        return self.granularity.group_shape(self.axis, self.unpacked_shape_2d)

    def values_float32(self) -> torch.Tensor:
        """The unscaled data values as float32 (4-bit codes unpacked): the 2-D view
        :attr:`unpacked_shape_2d` for 4-bit data, :attr:`data`'s shape for FP8."""
        if not self.granularity.fp4:
            return fp8_to_hp(self.data, torch.float32)
        packed = self.data.reshape(view_2d_shape(self.data.shape))
        return e2m1_to_float32(unpack_e2m1(packed, self.axis))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Return ``data * scale_inv`` (computed in float32; NVFP4: ``(e2m1(data) * scale_inv) * gd``)
        as ``dtype``, in the input's shape (4-bit: the last dim doubled for axis -1, the 2-D
        view ``[M, K]`` for axis 0)."""
        m, k = self.unpacked_shape_2d
        shape = self.data.shape if not self.granularity.fp4 else self._unpacked_shape()
        if self.data.numel() == 0:
            return torch.zeros(shape, dtype=dtype, device=self.data.device)
        rows, cols = self.group_shape
        values = self.values_float32().reshape(m // rows, rows, k // cols, cols)
        scale_inv = self.scale_inv_float32().reshape(m // rows, 1, k // cols, 1)
        out = values * scale_inv
        if self.global_amax is not None:
            out = out * nvfp4_global_scales(self.global_amax)[1]
        return out.reshape(shape).to(dtype)

    def _unpacked_shape(self) -> tuple[int, ...]:
        if self.axis == 0:
            return self.unpacked_shape_2d
        return (*self.data.shape[:-1], 2 * self.data.shape[-1])

    def prepare_for_saving(self) -> tuple[tuple[torch.Tensor, ...], QuantizedLayout]:
        """What an autograd function saves of this tensor for its backward.

        Returns:
            ``(data, scale_inv)`` (NVFP4: ``(data, scale_inv, global_amax)``), for
            ``ctx.save_for_backward`` (so that saved-tensor hooks, activation checkpointing
            and offloading, see them), and the :class:`QuantizedLayout` to keep beside them
            (on ``ctx``), which :meth:`restore_from_saved` takes back. The ``gemm_cache`` is
            not saved.
        """
        tensors = (self.data, self.scale_inv)
        if self.global_amax is not None:
            tensors = (*tensors, self.global_amax)
        return tensors, QuantizedLayout(self.granularity, self.axis, self.power_2_scales)

    @classmethod
    def restore_from_saved(
        cls,
        layout: QuantizedLayout,
        data: torch.Tensor,
        scale_inv: torch.Tensor,
        global_amax: torch.Tensor | None = None,
        cached: bool | None = None,
    ) -> QuantizedTensor:
        """The tensor that :meth:`prepare_for_saving` took apart, from its saved tensors
        (``data``, ``scale_inv`` and, for NVFP4, ``global_amax``) and its ``layout`` (with an
        empty ``gemm_cache``; ``cached``: as :func:`quantized_tensor`'s, ``None`` asks)."""
        if cached is None:
            cached = not torch.compiler.is_compiling()
        granularity, axis, power_2_scales = layout
        return quantized_tensor(data, scale_inv, granularity, axis, power_2_scales, global_amax, cached)

    def __repr__(self) -> str:
        global_amax = "" if self.global_amax is None else f", global_amax={float(self.global_amax)!r}"
        return (
            f"QuantizedTensor(shape={tuple(self.data.shape)}, dtype={self.data.dtype}, "
            f"granularity={str(self.granularity)!r}, axis={self.axis}, "
            f"scale_inv.shape={tuple(self.scale_inv.shape)}{global_amax})"
        )


_new = object.__new__


def quantized_tensor(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    granularity: Granularity,
    axis: int,
    power_2_scales: bool,
    global_amax: torch.Tensor | None = None,
    cached: bool = True,
) -> QuantizedTensor:
    """A :class:`QuantizedTensor` of parts a quantizer made (valid by construction, so not
    checked again: two host calls where the checked constructor makes seven, issue 38).
    ``cached``: give it an empty ``gemm_cache`` (``False`` while ``torch.compile`` traces,
    where the tensor has none)."""
    qt = _new(QuantizedTensor)
    fields = qt.__dict__  # item by item: no call, where dict.update is one
    fields["data"], fields["scale_inv"], fields["granularity"] = data, scale_inv, granularity
    fields["axis"], fields["power_2_scales"], fields["global_amax"] = axis, power_2_scales, global_amax
    fields["gemm_cache"] = GemmOperandCache() if cached else None
    return qt


def transpose(qt: QuantizedTensor) -> QuantizedTensor:
    """The transpose of a 2-D-viewed :class:`QuantizedTensor`, as a view.

    Data ``[A, B]`` becomes ``[B, A]`` and the scales follow, so a tensor quantized along
    its first dim (``axis=0``) becomes a K-last operand (``axis=-1``) and vice versa.
    Symmetric granularities (``tensor``, ``block128x128``) keep their axis: one scale, or
    square tiles that transpose with the data. 4-bit data is packed along its scaling axis,
    which the byte transpose carries along; ``nvfp4_2d``'s, always along the last dim, is
    packed again along the new last dim (the same codes: not a view).
    """
    granularity = qt.granularity
    try:  # 2-D data (the layer's) transposes without a reshape
        m, k = qt.data.shape
        data = qt.data
    except ValueError:
        data = qt.data.reshape(view_2d_shape(qt.data.shape))
    # (.T of a 2-D tensor is .t() read as an attribute: no call, issue 38)
    data = _transpose_packed_along_rows(data) if granularity.fp4 and granularity.symmetric else data.T
    # One per-tensor scale (0-D, or 1-D as given: .t() returns it as it is) stays as it is.
    scale_inv = qt.scale_inv
    if not granularity.per_tensor and scale_inv.ndim:
        scale_inv = scale_inv.T if scale_inv.ndim == 2 else scale_inv.t()
    axis = qt.axis if granularity.symmetric else (0 if qt.axis == -1 else -1)
    cache = qt.gemm_cache  # None while torch.compile traces: the transpose has none either
    transposed = quantized_tensor(
        data, scale_inv, granularity, axis, qt.power_2_scales, qt.global_amax, cache is not None
    )
    if cache is None:
        return transposed
    if cache.values is not None and (granularity.symmetric or (cache.out_scale is None and axis == -1)):
        # Values with one scale, or with their scales folded, transpose as they are: a
        # quantizer that wrote them for a first-dim usage (the CPU's FP8 kernels, issue 38;
        # on a GPU quant/kernels/compiled_fp4.py) hands them to its K-last transpose here.
        partner = transposed.gemm_cache  # its put(), inline (issue 38)
        partner.compute_dtype, partner.values, partner.out_scale = cache.compute_dtype, cache.values.T, cache.out_scale
    elif granularity.symmetric:
        # The transpose takes them when this tensor is converted (the layer's grad_output:
        # by the grad_input GEMM, before the grad_weight GEMM takes its transpose).
        cache.transposed = transposed.gemm_cache
    return transposed


def _transpose_packed_along_rows(data: torch.Tensor) -> torch.Tensor:
    """The codes of 2-D 4-bit ``data`` (``[M, K/2]``, two codes a byte along K, M even)
    transposed and packed along M: ``[K, M/2]``, as ``pack_e2m1(unpack_e2m1(data.t(), 0), -1)``
    gives them, in fewer ops (byte ``i`` of row ``2j`` holds the low nibbles of rows ``2i`` and
    ``2i + 1``'s byte ``j``; of row ``2j + 1``, their high nibbles)."""
    codes = data.view(torch.uint8)
    even, odd = codes[0::2], codes[1::2]
    low = (even & 0x0F) | ((odd & 0x0F) << 4)
    high = (even >> 4) | (odd & 0xF0)
    pairs, columns = low.shape
    packed = torch.stack((low.t(), high.t()), dim=1).reshape(2 * columns, pairs)
    return packed if torch.compiler.is_compiling() else packed.view(torch.float4_e2m1fn_x2)
