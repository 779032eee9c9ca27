"""``PrequantizedTensor``: a weight, input or grad_output whose FP8 (or 4-bit) GEMM operands
exist already, with a high-precision face for everything that is not such a GEMM.

It is the declared interface between the ``parallel`` layer, which produces one (FSDP2's
FP8 weight all-gather, :mod:`fp8train.parallel.fsdp`; sequence parallelism's FP8 activation
all-gather, :mod:`fp8train.parallel.sequence_gather`), and ``Float8LinearFunction`` in
``nn``, which asks it for its operands instead of quantizing a second time. It sits below
both so that ``nn`` never imports ``parallel``.
"""

from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_map_only

from ..spec.plan import Operand
from .cast import torch_dtype
from .tensor import QuantizedTensor, transpose

__all__ = ["PrequantizedTensor", "face_shape"]

aten = torch.ops.aten
_ALIASES = (aten.detach.default, aten.alias.default)
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


class PrequantizedTensor(torch.Tensor):
    """A tensor that arrived quantized: FP8 (or 4-bit) payload, high-precision face.

    Attributes:
        fp8_rowwise: the K-last operand of the last-dim usage (the weight's and the input's
            in the output GEMM, grad_output's in the grad_input GEMM), of the tensor's shape
            (4-bit data: its last dim halved, two codes a byte; the face has the whole dim).
        fp8_columnwise: the K-last operand of the first-dim usage (already transposed,
            2-D), or ``None`` where the transpose of ``fp8_rowwise`` serves.
        fp8_shard_amax: this rank's shard amax (float32 scalar), which delayed scaling
            records in place of the whole tensor's (the step's amax all-reduce makes it
            the whole tensor's); ``None`` for other recipes.

    Aliasing, dtype moves and reshapes that keep the last dim keep the payload (the 2-D
    view its scales describe does not change: a Linear layer flattens
    ``[batch, seq, features]`` to ``[tokens, features]``). Any other op (printing, a
    high-precision ``F.linear`` under ``autocast(enabled=False)``) sees the dequantized tensor.
    """

    fp8_rowwise: QuantizedTensor
    fp8_columnwise: QuantizedTensor | None
    fp8_shard_amax: torch.Tensor | None

    @staticmethod
    def __new__(cls, rowwise, columnwise, dtype, shard_amax=None):
        data = rowwise.data
        return torch.Tensor._make_wrapper_subclass(
            cls, face_shape(rowwise), dtype=dtype, device=data.device, requires_grad=False
        )

    def __init__(
        self,
        rowwise: QuantizedTensor,
        columnwise: QuantizedTensor | None,
        dtype: torch.dtype,
        shard_amax: torch.Tensor | None = None,
    ) -> None:
        self.set_payload(rowwise, columnwise, shard_amax)

    def set_payload(
        self, rowwise: QuantizedTensor, columnwise: QuantizedTensor | None, shard_amax: torch.Tensor | None = None
    ) -> None:
        """Replace the FP8 payload in place (FSDP2 reuses its unsharded tensor)."""
        self.fp8_rowwise, self.fp8_columnwise, self.fp8_shard_amax = rowwise, columnwise, shard_amax

    def last_dim_operand(self, slot: Operand) -> QuantizedTensor:
        """The K-last operand of the last-dim usage, which must be quantized as ``slot``
        (the consuming layer's plan) says.

        Raises:
            ValueError: it was quantized for another recipe (another granularity or format).
        """
        rowwise = self.fp8_rowwise
        dtype = torch.float4_e2m1fn_x2 if slot.granularity.fp4 else torch_dtype(slot.format)
        if rowwise.granularity is not slot.granularity or rowwise.dtype != dtype:
            raise ValueError(
                f"{slot.role.value} arrived all-gathered in FP8 as {str(rowwise.granularity)!r} {rowwise.dtype}, but "
                f"this layer's recipe quantizes it as {str(slot.granularity)!r} {dtype}: gather it with the recipe "
                "of the layers that consume it (e.g. PrepareFloat8ModuleInput(recipe=...))"
            )
        return rowwise

    def first_dim_operand(self) -> QuantizedTensor:
        """The K-last operand of the first-dim usage: its own, or the transpose of the
        last-dim one where that serves."""
        return transpose(self.fp8_rowwise) if self.fp8_columnwise is None else self.fp8_columnwise

    def _with_rowwise(self, rowwise: QuantizedTensor, dtype: torch.dtype) -> PrequantizedTensor:
        return PrequantizedTensor(rowwise, self.fp8_columnwise, dtype, self.fp8_shard_amax)

    def _reshaped(self, shape) -> PrequantizedTensor | None:
        """This tensor viewed as ``shape``, if that keeps the last dim (else ``None``)."""
        shape = _infer_shape(shape, self.numel())
        if shape is None or shape[-1:] != tuple(self.shape[-1:]):
            return None
        if shape == tuple(self.shape):
            return self._with_rowwise(self.fp8_rowwise, self.dtype)
        rowwise = self.fp8_rowwise
        data_shape = (*shape[:-1], rowwise.data.shape[-1])  # 4-bit: the last dim stays packed
        reshaped = QuantizedTensor(
            data=rowwise.data.reshape(data_shape),
            scale_inv=rowwise.scale_inv,
            granularity=rowwise.granularity,
            axis=rowwise.axis,
            power_2_scales=rowwise.power_2_scales,
            global_amax=rowwise.global_amax,
        )
        return self._with_rowwise(reshaped, self.dtype)

    def __repr__(self) -> str:
        return f"PrequantizedTensor({self.fp8_rowwise!r}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0]
        if func in _ALIASES:
            return tensor._with_rowwise(tensor.fp8_rowwise, tensor.dtype)
        if func is aten._to_copy.default and set(kwargs) <= {"dtype"}:
            return tensor._with_rowwise(tensor.fp8_rowwise, kwargs.get("dtype", tensor.dtype))
        if func is aten.as_strided.default and tuple(args[1]) == tuple(tensor.shape):
            return tensor._with_rowwise(tensor.fp8_rowwise, tensor.dtype)
        if func in _RESHAPES and not kwargs:
            reshaped = tensor._reshaped(args[1])
            if reshaped is not None:
                return reshaped
        dequantized = tree_map_only(cls, lambda t: t.fp8_rowwise.dequantize(t.dtype), (args, kwargs))
        return func(*dequantized[0], **dequantized[1])


def face_shape(rowwise: QuantizedTensor) -> tuple[int, ...]:
    """The shape of the tensor ``rowwise`` (a last-dim usage) quantizes: its data's, the
    last dim doubled for 4-bit data (packed two codes a byte along it)."""
    shape = tuple(rowwise.data.shape)
    return (*shape[:-1], 2 * shape[-1]) if rowwise.granularity.fp4 else shape


def _infer_shape(shape, numel: int) -> tuple[int, ...] | None:
    """``shape`` with a ``-1`` resolved (``None`` if it does not hold ``numel`` elements)."""
    shape = [int(s) for s in shape]
    if shape.count(-1) == 1:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or numel % known:
            return None
        shape[shape.index(-1)] = numel // known
    return tuple(shape) if shape and math.prod(shape) == numel else None
