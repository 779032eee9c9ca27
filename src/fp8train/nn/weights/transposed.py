"""``TransposedFloat8Weight``: a weight stored ``[in, out]`` (transformers' ``Conv1D``, GPT-2's
projections) held only quantized, as the operands of its transpose ``[out, in]``.

A ``Conv1D`` computes ``x @ W`` with ``W[in, out]``; ``Float8Conv1D`` runs it as a Linear
layer on the view ``W.t()``, quantizing that view. Held in FP8, the parameter keeps its
face (``[in, out]``: the same ``state_dict`` entry, gradient, master and optimizer state as
the high-precision parameter, element for element) while its payload is that of
:class:`~fp8train.nn.weights.float8_weight.Float8Weight` for ``W.t()``: ``fp8_rowwise`` is the output
GEMM's operand ``[out, in]``. Its ``.t()`` (the module's forward) is that ``Float8Weight``,
sharing the payload and the master, so ``Float8LinearFunction`` takes it as it takes a
Linear layer's stored weight, and autograd's transpose carries the gradient back to the
``[in, out]`` parameter; every other op sees the dequantized ``[in, out]`` weight.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from ...quant.prequantized import face_shape
from ...spec.plan import OperandPlan
from .float8_weight import (
    SPLIT_OPS,
    TO_COPY_KWARGS,
    Float8Weight,
    quantize_payload,
    written_weight,
)

__all__ = ["TransposedFloat8Weight"]

aten = torch.ops.aten
_TRANSPOSES = (aten.t.default, aten.transpose.int, aten.permute.default)
# Ops whose Float8Weight handling keeps the payload as it is (same face): the base class's.
_KEPT = (aten.clone.default, aten.detach.default, aten.alias.default)


class TransposedFloat8Weight(Float8Weight):
    """A ``[in, out]`` weight stored as the FP8 operands of its transpose (module docstring).

    Build it with :meth:`quantize` from the ``[in, out]`` tensor; :meth:`dequantize` and
    :meth:`requantize_` take and give ``[in, out]`` tensors too.
    """

    @staticmethod
    def __new__(cls, rowwise, columnwise, dtype, shard_amax=None, *, slots, master=None):
        out_features, in_features = face_shape(rowwise)
        return torch.Tensor._make_wrapper_subclass(
            cls, (in_features, out_features), dtype=dtype, device=rowwise.data.device, requires_grad=False
        )

    @classmethod
    def quantize(cls, weight_hp, plan, scale=None, master=None) -> TransposedFloat8Weight:
        """``weight_hp`` ``[in, out]`` stored as ``Float8Weight.quantize(weight_hp.t(), ...)``'s
        operands (the same arguments and refusals)."""
        if weight_hp.dim() != 2:
            raise ValueError(f"a weight stored in FP8 must be 2-D [in, out], got shape {tuple(weight_hp.shape)}")
        gemm = Float8Weight.quantize(weight_hp.t(), plan, scale, master)
        return cls(
            gemm.fp8_rowwise, gemm.fp8_columnwise, gemm.dtype, gemm.fp8_shard_amax, slots=gemm.fp8_slots, master=master
        )

    def gemm_weight(self) -> Float8Weight:
        """The ``[out, in]`` :class:`Float8Weight` the GEMMs take: this payload and master."""
        return Float8Weight(
            self.fp8_rowwise, self.fp8_columnwise, self.dtype, self.fp8_shard_amax,
            slots=self.fp8_slots, master=self.fp8_master,
        )

    def requantize_(self, weight_hp: torch.Tensor, scale: torch.Tensor | None = None) -> TransposedFloat8Weight:
        """As :meth:`Float8Weight.requantize_`, from ``weight_hp`` ``[in, out]``."""
        if tuple(weight_hp.shape) != tuple(self.shape):
            raise ValueError(f"cannot requantize a weight of shape {tuple(self.shape)} from {tuple(weight_hp.shape)}")
        plan = OperandPlan(operands=self.fp8_slots)  # its slots say which are delayed
        self.set_payload(*quantize_payload(weight_hp.detach().to(self.dtype).t(), plan, scale))
        return self

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stored weight, a contiguous ``[in, out]`` tensor in ``dtype`` (default this weight's)."""
        out_features, in_features = self.shape[1], self.shape[0]
        gemm_hp = self.fp8_rowwise.dequantize(dtype or self.dtype).reshape(out_features, in_features)
        return gemm_hp.t().contiguous()

    def __repr__(self) -> str:
        return f"TransposedFloat8Weight(shape={tuple(self.shape)}, of {self.gemm_weight()!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = args[0]
        if func in _TRANSPOSES and isinstance(weight, TransposedFloat8Weight) and _swaps_the_dims(func, args):
            return weight.gemm_weight()
        kept = func in _KEPT or (func is aten._to_copy.default and set(kwargs) <= TO_COPY_KWARGS)
        kept = kept or (func in SPLIT_OPS and weight.fp8_master is not None)  # refused there
        if kept or written_weight(func, args, kwargs) is not None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        if func is aten.as_strided.default and tuple(args[1]) == tuple(weight.shape):
            return weight._moved(lambda t: t, weight.dtype)
        # Anything else (printing, a high-precision matmul, a reshape): the dequantized weight.
        dequantized = tree_map_only(Float8Weight, lambda t: t.dequantize(), (args, kwargs))
        return func(*dequantized[0], **dequantized[1])


def _swaps_the_dims(func, args) -> bool:
    """Whether ``func(*args)`` (``t``, ``transpose`` or ``permute``) transposes a 2-D tensor."""
    if func is aten.t.default:
        return True
    dims = [d % 2 for d in (args[1:3] if func is aten.transpose.int else args[1])]
    return sorted(dims) == [0, 1] and dims != [0, 1]
