"""``Float8Weight``: a module's weight held only quantized, in the operands its recipe's
plan needs, with no high-precision copy.

It is a :class:`~fp8train.quant.prequantized.PrequantizedTensor` (a tensor whose GEMM
operands exist already, with a high-precision face for every other op), so
:class:`~fp8train.nn.function.Float8LinearFunction` takes it as it takes a weight FSDP2
gathered in FP8: the forward uses its last-dim operand, the backward's grad_input GEMM its
first-dim one, and nothing is quantized per step.

What it holds, for a weight ``W[N, K]`` and the plan's two weight slots
(``OUTPUT_WEIGHT``, ``GRAD_INPUT_WEIGHT``; :meth:`~fp8train.spec.plan.OperandPlan.usages_of`):

* ``fp8_rowwise``: the output GEMM's operand, ``quantize(W, rule, axis=-1)``: data
  ``[N, K]`` (4-bit: ``[N, K/2]``) and its scales (:class:`~fp8train.quant.tensor.QuantizedTensor`).
* ``fp8_columnwise``: the grad_input GEMM's K-last operand ``[K, N]`` where the plan
  quantizes that slot on its own (``row``, ``mx``, ``mxfp4``, or another rule); ``None``
  where it is the transpose of ``fp8_rowwise`` (symmetric granularities under one rule:
  ``tensor``, ``block128x128``, ``nvfp4_2d``), so one copy is kept.
* ``fp8_shard_amax``: ``max|W|`` (float32 scalar) where the plan is delayed: delayed
  scaling records it (and takes a frozen weight's scale from it), as it would ``W``'s.

The quantization is the one the layer would make of ``W`` at each forward (the same
``quantize_usage`` calls, by the same rules and, for delayed scaling, the same scale), so a
module holding it computes what the module holding ``W`` computes, bit for bit.

It is the module's ``weight`` parameter itself (``nn.Parameter(Float8Weight(...))`` keeps
the type). A frozen one (``store_frozen_weights_in_fp8``) has no ``fp8_master``. A trainable
one (FP8 primary weights, ``convert_to_float8_training(..., fp8_weights=True)``) has a
:class:`~fp8train.nn.weights.master.WeightMaster`: its gradient reaches ``.grad`` as a plain
tensor of its face's shape and dtype, and an optimizer that holds its master
(``fp8train.optim.AdamW``) re-quantizes it after each step (:meth:`requantize_from_master_`);
a training forward without one is refused (:meth:`check_plan`). In-place ops (``add_``,
``copy_``: a PEFT merge, an init, ``torch.optim.AdamW``'s step) are refused: they would
change a dequantized temporary, not the weight; except ``copy_`` into a trainable weight,
which sets it (:meth:`load_`).
"""

from __future__ import annotations

import torch

from ...quant.operand import quantize_usage
from ...quant.prequantized import PrequantizedTensor
from ...quant.tensor import QuantizedLayout, QuantizedTensor
from ...spec.plan import Operand, OperandPlan
from ...spec.roles import Role, Usage
from ..delayed.amax import tensor_amax
from .master import MasterHeldWeight, WeightMaster

__all__ = [
    "Float8Weight",
    "RESTORE_HINT",
    "OPTIMIZER_HINT",
    "SHARDING_REFUSAL",
    # For the weights built on it (weights/transposed.py, weights/experts.py):
    "PAYLOAD_PARTS",
    "SPLIT_OPS",
    "TO_COPY_KWARGS",
    "copy_quantized",
    "quantize_payload",
    "restore_part",
    "written_weight",
]

aten = torch.ops.aten

RESTORE_HINT = (
    "call fp8train.restore_high_precision_weights(model) first (and fp8train.store_frozen_weights_in_fp8(model) "
    "again afterwards)"
)
"""How to get a high-precision weight back: what every refusal says."""

OPTIMIZER_HINT = (
    "build fp8train.optim.AdamW(model.parameters(), ...) before the first training forward: it keeps the "
    "master weights of FP8 weights and re-quantizes them after each step (torch.optim.AdamW cannot); or "
    "convert without fp8_weights=True"
)
"""How to train a weight stored in FP8: what the refusals of a trainable one say."""

# Ops that cut a tensor into shards (FSDP2's fully_shard, tensor parallelism's Shard): a
# trainable FP8 weight refuses them rather than be replaced by high-precision shards.
SPLIT_OPS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.tensor_split.sections)
SHARDING_REFUSAL = (
    "a weight stored in FP8 (fp8_weights=True) is sharded by FSDP2 only through "
    "fp8train.parallel.enable_fp8_all_gather(model), called before fully_shard, and only a Float8Linear's; "
    "tensor parallelism and the FP8 weights of Conv1D, attention and experts are not sharded: convert without "
    "fp8_weights=True for them"
)

TO_COPY_KWARGS = {"dtype", "device", "layout", "non_blocking", "memory_format"}
PAYLOAD_PARTS = ("fp8_rowwise", "fp8_columnwise")
_FIELDS = ("data", "scale_inv", "global_amax")
# The flattened names of the payload's tensors (``fp8_rowwise__data``, ...): attributes
# that read through to it (``__getattr__``).
_INNER = {f"{part}__{field}": (part, field) for part in PAYLOAD_PARTS for field in _FIELDS}


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def copy_quantized(qt: QuantizedTensor | None, move) -> QuantizedTensor | None:
    """``qt`` with ``move`` applied to each of its tensors (a fresh, empty ``gemm_cache``)."""
    if qt is None:
        return None
    tensors, layout = qt.prepare_for_saving()
    return QuantizedTensor.restore_from_saved(layout, *(move(t) for t in tensors))


class Float8Weight(PrequantizedTensor, MasterHeldWeight):
    """A weight stored quantized (FP8, or 4 bits for ``nvfp4``/``mxfp4``) for one plan.

    Build it with :meth:`quantize`; refresh it from a high-precision tensor with
    :meth:`requantize_`; read it back with :meth:`dequantize`. Its face (shape, dtype,
    device) is the high-precision weight's.

    Attributes:
        fp8_slots: ``(output slot, grad_input slot)``: the plan's
            :class:`~fp8train.spec.plan.Operand` of ``OUTPUT_WEIGHT`` and
            ``GRAD_INPUT_WEIGHT`` it was quantized for.
        fp8_rowwise, fp8_columnwise, fp8_shard_amax: see the module docstring.
        fp8_master: a trainable weight's link to its master
            (:class:`~fp8train.nn.weights.master.WeightMaster`), ``None`` for a frozen one.
    """

    cuda_graph_blocker = (
        "a trainable weight stored in FP8 (fp8_weights=True) takes new FP8 tensors at each optimizer step, "
        "which a captured step would not read"
    )
    """Read for a trainable one by :func:`~fp8train.nn.step_graph.module_blocker`."""

    fp8_slots: tuple[Operand, Operand]
    fp8_master: WeightMaster | None

    @staticmethod
    def __new__(cls, rowwise, columnwise, dtype, shard_amax=None, *, slots, master=None):
        return PrequantizedTensor.__new__(cls, rowwise, columnwise, dtype, shard_amax)

    def __init__(
        self,
        rowwise: QuantizedTensor,
        columnwise: QuantizedTensor | None,
        dtype: torch.dtype,
        shard_amax: torch.Tensor | None = None,
        *,
        slots: tuple[Operand, Operand],
        master: WeightMaster | None = None,
    ) -> None:
        super().__init__(rowwise, columnwise, dtype, shard_amax)
        self.fp8_slots = slots
        self.fp8_master = master

    @classmethod
    def quantize(
        cls,
        weight_hp: torch.Tensor,
        plan: OperandPlan,
        scale: torch.Tensor | None = None,
        master: WeightMaster | None = None,
    ) -> Float8Weight:
        """``weight_hp`` ``[N, K]`` quantized for ``plan``'s weight slots.

        Args:
            weight_hp: the high-precision weight (float32, bfloat16 or float16), 2-D.
            plan: the recipe's plan; its output and grad_input GEMMs must be quantized.
            scale: delayed scaling's weight scale (float32 scalar), or ``None``.
            master: for a trainable weight, its link to its master (``None``: frozen).

        Raises:
            NotImplementedError: the plan runs the output or grad_input GEMM in high precision.
            ValueError: ``weight_hp`` is not 2-D.
        """
        for usage in (Usage.OUTPUT_WEIGHT, Usage.GRAD_INPUT_WEIGHT):
            if not plan.quantizes_usage(usage):
                raise NotImplementedError(
                    f"the plan runs {usage.gemm.value} in high precision: a weight stored in FP8 needs it quantized"
                )
        if weight_hp.dim() != 2:
            raise ValueError(f"a weight stored in FP8 must be 2-D [out, in], got shape {tuple(weight_hp.shape)}")
        slots = (plan.operand(Usage.OUTPUT_WEIGHT), plan.operand(Usage.GRAD_INPUT_WEIGHT))
        payload = quantize_payload(weight_hp.detach(), plan, scale)
        if master is not None:
            master.quantized_scale = scale
        return cls(*payload[:2], weight_hp.dtype, payload[2], slots=slots, master=master)

    def requantize_(self, weight_hp: torch.Tensor, scale: torch.Tensor | None = None) -> Float8Weight:
        """Replace the stored operands by those of ``weight_hp`` (this weight's shape),
        quantized for the same plan; ``scale`` as in :meth:`quantize`. Returns ``self``.

        Raises:
            ValueError: ``weight_hp`` has another shape.
        """
        if tuple(weight_hp.shape) != tuple(self.shape):
            raise ValueError(f"cannot requantize a weight of shape {tuple(self.shape)} from {tuple(weight_hp.shape)}")
        plan = OperandPlan(operands=self.fp8_slots)  # its slots say which are delayed
        self.set_payload(*quantize_payload(weight_hp.detach().to(self.dtype), plan, scale))
        return self

    def requantize_from_master_(self, master: torch.Tensor) -> Float8Weight:
        """After an optimizer step: re-quantize from ``master`` (cast to this weight's dtype
        first, as a plain parameter would be) with the scale the next forward would use
        (:meth:`next_quantization_scale`), so the next forward computes what it would with a
        high-precision weight equal to ``master``. Returns ``self``."""
        scale = self.next_quantization_scale()
        if self.fp8_master is not None:
            self.fp8_master.quantized_scale = scale
        return self.requantize_(master, scale)

    def next_quantization_scale(self) -> torch.Tensor | None:
        """Delayed scaling's weight scale of the module's next forward (after an update it
        owes), or ``None``."""
        link = self.fp8_master
        if link is None or link.delayed_state is None:
            return None
        return self.weight_scale_of(link.delayed_state.next_forward_scale(update_owed=True))

    def weight_scale_of(self, scales: torch.Tensor) -> torch.Tensor:
        """This weight's scale among its module's delayed-scaling ``scales``."""
        return scales[Role.WEIGHT.index]

    @classmethod
    def requantize_from_masters_(cls, weights: list[Float8Weight], masters: list[torch.Tensor]) -> None:
        """:meth:`requantize_from_master_` of each weight from its master (no collective:
        each holds the whole weight)."""
        for weight, master in zip(weights, masters, strict=True):
            weight.requantize_from_master_(master)

    def load_(self, weight_hp: torch.Tensor) -> Float8Weight:
        """Set a trainable weight to ``weight_hp`` (this shape; any dtype): its master takes the
        value (:meth:`WeightMaster.load`) and the stored operands are re-quantized from it.
        ``weight.copy_(weight_hp)`` does this (a ``load_state_dict``, DDP's first broadcast).
        Returns ``self``."""
        if isinstance(weight_hp, Float8Weight):
            weight_hp = weight_hp.dequantize()
        weight_hp = weight_hp.detach().to(device=self.device, dtype=self.dtype)
        self.fp8_master.load(weight_hp)
        parameter = self.fp8_master.weight
        if parameter is not None and parameter is not self:  # an alias: the module's weight too
            parameter.requantize_from_master_(weight_hp)
        return self.requantize_from_master_(weight_hp)

    def checkpoint_value(self) -> torch.Tensor:
        """What a ``state_dict`` saves for this weight, a plain tensor of its shape and dtype:
        its master's value where an optimizer holds it (or one is pending), else the
        dequantized weight."""
        master = self.fp8_master
        value = None if master is None else master.master if master.master is not None else master.pending
        return self.dequantize() if value is None else value.detach().to(self.dtype, copy=True)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight the stored output operand holds, a plain tensor of this shape in
        ``dtype`` (default this weight's dtype)."""
        return self.fp8_rowwise.dequantize(dtype or self.dtype).reshape(self.shape)

    @property
    def storage_nbytes(self) -> int:
        """Bytes of every tensor held (data, scales, amaxes of both operands)."""
        return sum(t.numel() * t.element_size() for t in self._inner_tensors().values())

    def check_plan(self, plan: OperandPlan) -> None:
        """Check that a forward under ``plan`` can use this weight.

        Raises:
            ValueError: the plan quantizes the weight by other rules (a recipe other than
                the one it was stored for, e.g. an ``fp8train.autocast`` override); a
                frozen weight requires grad (it cannot train); a trainable weight runs a
                forward with grad while no optimizer holds its master.
        """
        usages = (Usage.OUTPUT_WEIGHT, Usage.GRAD_INPUT_WEIGHT)
        slots = tuple(plan.operand(u) if plan.quantizes_usage(u) else None for u in usages)
        stored_delayed = self.fp8_shard_amax is not None
        if slots != self.fp8_slots or plan.delayed != stored_delayed:
            raise ValueError(
                f"the weight is stored in FP8 for its module's recipe ({_describe(self.fp8_slots, stored_delayed)}), "
                f"but this forward's recipe quantizes it as {_describe(slots, plan.delayed)}: run the module's own "
                f"recipe, or {RESTORE_HINT}"
            )
        if not self.requires_grad:
            return
        if self.fp8_master is None:
            raise ValueError(f"the weight is stored in FP8 only and cannot train (requires_grad=True): {RESTORE_HINT}")
        if torch.is_grad_enabled() and self.fp8_master.master is None:
            raise ValueError(f"the weight is stored in FP8 and trains, but no optimizer holds its master weight: {OPTIMIZER_HINT}")

    def last_dim_operand(self, slot: Operand) -> QuantizedTensor:
        """The output GEMM's operand, a new :class:`QuantizedTensor` over the stored tensors:
        its ``gemm_cache`` (the emulated GEMM's converted copy) lives as long as the step."""
        return copy_quantized(super().last_dim_operand(slot), _keep)

    def first_dim_operand(self) -> QuantizedTensor:
        return copy_quantized(super().first_dim_operand(), _keep)

    def _with_rowwise(self, rowwise: QuantizedTensor, dtype: torch.dtype) -> Float8Weight:
        return self._moved(_keep, dtype, rowwise)

    def _moved(self, move, dtype: torch.dtype, rowwise: QuantizedTensor | None = None) -> Float8Weight:
        """This weight (of its own class) with ``move`` applied to its tensors, of face dtype ``dtype``."""
        rowwise = rowwise if rowwise is not None else copy_quantized(self.fp8_rowwise, move)
        columnwise = copy_quantized(self.fp8_columnwise, move)
        amax = None if self.fp8_shard_amax is None else move(self.fp8_shard_amax)
        return type(self)(rowwise, columnwise, dtype, amax, slots=self.fp8_slots, master=self.fp8_master)

    def __repr__(self) -> str:
        columnwise = "" if self.fp8_columnwise is None else f", columnwise={self.fp8_columnwise!r}"
        return f"Float8Weight({self.fp8_rowwise!r}{columnwise}, dtype={self.dtype})"

    # A traceable wrapper subclass: nn.Module.to() swaps the whole tensor (payload and face).
    def _inner_tensors(self) -> dict[str, torch.Tensor]:
        inner = {
            name: getattr(getattr(self, part), field)
            for name, (part, field) in _INNER.items()
            if getattr(self, part) is not None
        }
        inner["fp8_shard_amax"] = self.fp8_shard_amax
        return {name: t for name, t in inner.items() if t is not None}

    def __tensor_flatten__(self):
        layouts = tuple(None if getattr(self, p) is None else getattr(self, p).prepare_for_saving()[1] for p in PAYLOAD_PARTS)
        return list(self._inner_tensors()), (self.dtype, self.fp8_slots, layouts)

    def __getattr__(self, name: str):
        if name not in _INNER:
            raise AttributeError(name)
        part, field = _INNER[name]
        return getattr(getattr(self, part), field)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride) -> Float8Weight:
        """A weight of this class (a subclass's too) from ``__tensor_flatten__``'s parts."""
        dtype, slots, layouts = ctx
        rowwise, columnwise = (restore_part(inner, part, layout) for part, layout in zip(PAYLOAD_PARTS, layouts))
        return cls(rowwise, columnwise, dtype, inner.get("fp8_shard_amax"), slots=slots)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = args[0]
        if func is aten.clone.default:
            return weight._moved(torch.clone, weight.dtype)
        if func is aten._to_copy.default and set(kwargs) <= TO_COPY_KWARGS:
            device = kwargs.get("device") or weight.device
            return weight._moved(lambda t: t.to(device), kwargs.get("dtype") or weight.dtype)
        if func in SPLIT_OPS and weight.fp8_master is not None:
            raise NotImplementedError(f"{func._schema.name}: {SHARDING_REFUSAL}")
        written = written_weight(func, args, kwargs)
        if func is aten.copy_.default and written is args[0] and written.fp8_master is not None:
            return written.load_(args[1])
        if written is not None and written.fp8_master is not None:
            raise RuntimeError(f"{func._schema.name} would change a weight stored in FP8 (fp8_weights=True): {OPTIMIZER_HINT}")
        if written is not None:
            raise RuntimeError(
                f"{func._schema.name} would change a weight stored in FP8 only (fp8train.store_frozen_weights_in_fp8): "
                f"a PEFT merge, an init or a copy needs it in high precision: {RESTORE_HINT}"
            )
        return super().__torch_dispatch__(func, types, args, kwargs)


def _describe(slots: tuple[Operand | None, ...], delayed: bool) -> str:
    """How ``slots`` (output's, grad_input's) quantize a weight, in words."""
    rules = [f"{str(op.granularity)!r} {op.format.name}" if op else "high precision" for op in slots]
    return f"output {rules[0]}, grad_input {rules[1]}{', delayed scaling' if delayed else ''}"


def written_weight(func, args, kwargs) -> Float8Weight | None:
    """The :class:`Float8Weight` among ``func``'s arguments that it writes into, if any
    (reading one, as ``plain.copy_(weight)`` does, is fine: that sees the dequantized weight)."""
    for position, argument in enumerate(func._schema.arguments):
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        if isinstance(value, Float8Weight) and argument.alias_info is not None and argument.alias_info.is_write:
            return value
    return None


def restore_part(inner: dict, part: str, layout: QuantizedLayout | None) -> QuantizedTensor | None:
    if layout is None:
        return None
    tensors = [inner.get(f"{part}__{field}") for field in _FIELDS]
    return QuantizedTensor.restore_from_saved(layout, *tensors)


def quantize_payload(weight_hp: torch.Tensor, plan: OperandPlan, scale: torch.Tensor | None):
    """``(rowwise, columnwise or None, amax or None)`` of ``weight_hp`` for ``plan``: the
    ``quantize_usage`` calls the layer makes (columnwise ``None`` where it reuses rowwise)."""
    rowwise = quantize_usage(plan, Usage.OUTPUT_WEIGHT, weight_hp, scale)
    columnwise = None
    if not plan.reuses_last_dim(Usage.GRAD_INPUT_WEIGHT):
        columnwise = quantize_usage(plan, Usage.GRAD_INPUT_WEIGHT, weight_hp, scale)
    return rowwise, columnwise, tensor_amax(weight_hp) if plan.delayed else None
