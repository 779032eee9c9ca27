"""``Float8GatheredWeight``: a weight that arrives already quantized (e.g. all-gathered in
FP8 by FSDP2), with a high-precision face for everything that is not an FP8 GEMM.

It is the declared interface between whatever produces a prequantized weight (the
``parallel`` layer) and ``Float8Linear``, which checks for this type and feeds its payload
to the GEMMs without a second cast.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from .tensor import QuantizedTensor

__all__ = ["Float8GatheredWeight"]

aten = torch.ops.aten


class Float8GatheredWeight(torch.Tensor):
    """The unsharded weight after an FP8 all-gather: FP8 payload, high-precision face.

    Attributes:
        fp8_rowwise: the output GEMM's K-last operand (last-dim usage).
        fp8_columnwise: the grad_input GEMM's K-last operand (first-dim usage, already
            transposed), or ``None`` where the transpose of ``fp8_rowwise`` serves.
        fp8_shard_amax: this rank's shard amax (float32 scalar), which delayed scaling
            records in place of the whole weight's; ``None`` for other recipes.

    Ops other than aliasing and dtype moves see the dequantized weight.
    """

    fp8_rowwise: QuantizedTensor
    fp8_columnwise: QuantizedTensor | None
    fp8_shard_amax: torch.Tensor | None

    @staticmethod
    def __new__(cls, rowwise, columnwise, dtype, shard_amax=None):
        data = rowwise.data
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=False
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
        """Replace the FP8 payload in place (FSDP2 reuses the unsharded tensor)."""
        self.fp8_rowwise, self.fp8_columnwise, self.fp8_shard_amax = rowwise, columnwise, shard_amax

    def __repr__(self) -> str:
        return f"Float8GatheredWeight({self.fp8_rowwise!r}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = args[0]
        payload = (weight.fp8_rowwise, weight.fp8_columnwise)
        if func in (aten.detach.default, aten.alias.default):
            return cls(*payload, weight.dtype, weight.fp8_shard_amax)
        if func is aten._to_copy.default and set(kwargs) <= {"dtype"}:
            return cls(*payload, kwargs.get("dtype", weight.dtype), weight.fp8_shard_amax)
        if func in (aten.as_strided.default, aten.view.default) and tuple(args[1]) == tuple(weight.shape):
            return cls(*payload, weight.dtype, weight.fp8_shard_amax)
        # Anything else (printing, a high-precision F.linear under autocast(enabled=False))
        # sees the dequantized weight.
        dequantized = tree_map_only(cls, lambda t: t.fp8_rowwise.dequantize(t.dtype), (args, kwargs))
        return func(*dequantized[0], **dequantized[1])
