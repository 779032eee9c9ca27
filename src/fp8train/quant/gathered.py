"""``Float8GatheredActivation``: a Linear layer's input or grad_output that arrives already
quantized (all-gathered in FP8 across a tensor-parallel group, as sequence parallelism
gathers them), with a high-precision face for everything that is not an FP8 GEMM.

Like :class:`~fp8train.quant.weight.Float8GatheredWeight` it is an interface between the
``parallel`` layer, which produces it, and ``Float8LinearFunction``, which checks for the
type and feeds its payload to the GEMMs without a second cast.
"""

from __future__ import annotations

import math

import torch

from .tensor import QuantizedTensor
from .weight import Float8GatheredWeight

__all__ = ["Float8GatheredActivation"]

aten = torch.ops.aten
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


class Float8GatheredActivation(Float8GatheredWeight):
    """An activation after an FP8 all-gather: FP8 payload, high-precision face.

    Attributes:
        fp8_rowwise: the last-dim usage (input: the output GEMM's operand; grad_output: the
            grad_input GEMM's), of the activation's shape.
        fp8_columnwise: the first-dim usage (the grad_weight GEMM's operand, already
            transposed to K-last, 2-D), or ``None`` where the transpose of ``fp8_rowwise``
            serves.
        fp8_shard_amax: this rank's shard amax (float32 scalar), which delayed scaling
            records in place of the whole tensor's (the step's amax all-reduce makes it
            the whole tensor's); ``None`` for other recipes.

    Besides the weight's aliasing and dtype moves, reshapes that keep the last dim keep
    the payload (the 2-D view its scales describe does not change): a Linear layer
    flattens ``[batch, seq, features]`` to ``[tokens, features]``. Any other op sees the
    dequantized tensor.
    """

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _RESHAPES and not kwargs:
            activation, shape = args[0], _infer_shape(args[1], args[0].numel())
            if shape is not None and shape[-1:] == tuple(activation.shape[-1:]):
                rowwise = activation.fp8_rowwise
                reshaped = QuantizedTensor(
                    data=rowwise.data.reshape(shape),
                    scale_inv=rowwise.scale_inv,
                    granularity=rowwise.granularity,
                    axis=rowwise.axis,
                    power_2_scales=rowwise.power_2_scales,
                )
                return cls(reshaped, activation.fp8_columnwise, activation.dtype, activation.fp8_shard_amax)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _infer_shape(shape, numel: int) -> tuple[int, ...] | None:
    """``shape`` with a ``-1`` resolved (``None`` if it does not hold ``numel`` elements)."""
    shape = [int(s) for s in shape]
    if shape.count(-1) == 1:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or numel % known:
            return None
        shape[shape.index(-1)] = numel // known
    return tuple(shape) if shape and math.prod(shape) == numel else None
