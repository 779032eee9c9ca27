"""``Float8ExpertWeights``: a fused experts module's 3-D weight (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``) held only quantized, one :class:`~fp8train.nn.weights.float8_weight.Float8Weight`
per expert.

``Float8Experts`` runs each expert's GEMMs on its slice of the 3-D parameter, quantized on
its own (its own scales; under delayed scaling its own state, ``fp8_scale[e, projection]``).
Held in FP8, the parameter keeps its 3-D face (its ``state_dict`` entry, ``.grad``, master
and optimizer state are those of the plain parameter, element for element) and holds, per
expert, the ``Float8Weight`` of its slice: ``unbind(0)`` (what the forward does) gives them,
so ``Float8LinearFunction`` takes each as it takes a Linear layer's stored weight, and
autograd's unbind stacks their gradients into the 3-D ``.grad``. Every other op sees the
dequantized weight. After each optimizer step, every expert is re-quantized from its slice
of the master with the weight scale its next forward would use.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from ...spec.roles import Role
from .float8_weight import SPLIT_OPS, TO_COPY_KWARGS, Float8Weight, written_weight
from .master import WeightMaster

__all__ = ["Float8ExpertWeights", "Float8GateUpWeights", "Float8DownWeights"]

aten = torch.ops.aten
_KEPT = (aten.clone.default, aten.detach.default, aten.alias.default)


class Float8ExpertWeights(Float8Weight):
    """A 3-D ``[E, N, K]`` expert weight stored as ``E`` :class:`Float8Weight` (module docstring).

    Attributes:
        fp8_experts: the experts' ``Float8Weight`` (``[N, K]`` each), in order.
        fp8_projection: which projection of the module's delayed state it is (0:
            ``gate_up_proj``, 1: ``down_proj``).
        fp8_master: as :class:`Float8Weight`'s (``None`` for a frozen weight).
    """

    @staticmethod
    def __new__(cls, experts, dtype, *, projection, master=None):
        num_experts, (out_features, in_features) = len(experts), experts[0].shape
        return torch.Tensor._make_wrapper_subclass(
            cls, (num_experts, out_features, in_features), dtype=dtype, device=experts[0].device, requires_grad=False
        )

    def __init__(self, experts: list[Float8Weight], dtype: torch.dtype, *, projection: int, master=None) -> None:
        self.fp8_experts, self.fp8_projection, self.fp8_master = list(experts), projection, master
        self.fp8_slots = experts[0].fp8_slots
        self.fp8_rowwise = self.fp8_columnwise = None
        self.fp8_shard_amax = experts[0].fp8_shard_amax  # None unless delayed (check_plan reads that)

    projection: int = 0  # the projection of the subclasses below, for quantize

    @classmethod
    def quantize(cls, weight_hp, plan, scale=None, master: WeightMaster | None = None) -> Float8ExpertWeights:
        """``weight_hp`` ``[E, N, K]`` stored per expert (``Float8Weight.quantize`` of each
        slice, its refusals included), for the projection of ``cls``
        (:class:`Float8GateUpWeights`, :class:`Float8DownWeights`). The experts' weight
        scales are ``master``'s module's next ones (``scale``, one module-wide weight scale,
        does not apply: each expert has its own).

        Raises:
            ValueError: ``weight_hp`` is not 3-D.
        """
        if weight_hp.dim() != 3:
            shape = tuple(weight_hp.shape)
            raise ValueError(f"an experts weight stored in FP8 must be 3-D [E, N, K], got shape {shape}")
        scales = _next_forward_scales(master, cls.projection)
        experts = [
            Float8Weight.quantize(weight_hp[e], plan, None if scales is None else scales[e])
            for e in range(weight_hp.shape[0])
        ]
        if master is not None:
            master.quantized_scale = scales
        return cls(experts, weight_hp.dtype, projection=cls.projection, master=master)

    def requantize_(self, weight_hp: torch.Tensor, scale: torch.Tensor | None = None) -> Float8ExpertWeights:
        """Re-quantize each expert from its slice of ``weight_hp`` (this shape), ``scale``
        ``[E]`` or ``None``. Returns ``self``."""
        if tuple(weight_hp.shape) != tuple(self.shape):
            raise ValueError(f"cannot requantize a weight of shape {tuple(self.shape)} from {tuple(weight_hp.shape)}")
        weight_hp = weight_hp.detach().to(self.dtype)
        for e, expert in enumerate(self.fp8_experts):
            expert.requantize_(weight_hp[e], None if scale is None else scale[e])
        return self

    def weight_scale_of(self, scales: torch.Tensor) -> torch.Tensor:
        """Each expert's weight scale ``[E]`` among the module's delayed-scaling ``scales``."""
        return scales[:, self.fp8_projection, Role.WEIGHT.index]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.stack([expert.dequantize(dtype) for expert in self.fp8_experts])

    @property
    def storage_nbytes(self) -> int:
        return sum(expert.storage_nbytes for expert in self.fp8_experts)

    def check_plan(self, plan) -> None:
        """As :meth:`Float8Weight.check_plan`, for every expert."""
        self.fp8_experts[0].check_plan(plan)  # the slots and the plan, the same for every expert
        if self.requires_grad:
            super().check_plan(plan)

    def _moved(self, move, dtype: torch.dtype, rowwise=None) -> Float8ExpertWeights:
        experts = [expert._moved(move, dtype) for expert in self.fp8_experts]
        return type(self)(experts, dtype, projection=self.fp8_projection, master=self.fp8_master)

    def _inner_tensors(self) -> dict[str, torch.Tensor]:
        return {f"e{e}__{name}": t for e, x in enumerate(self.fp8_experts) for name, t in x._inner_tensors().items()}

    # A traceable wrapper subclass (torch.compile fakes it before Float8Experts runs it eagerly).
    def __tensor_flatten__(self):
        names = [list(expert._inner_tensors()) for expert in self.fp8_experts]
        contexts = [expert.__tensor_flatten__()[1] for expert in self.fp8_experts]
        return list(self._inner_tensors()), (self.dtype, self.fp8_projection, names, contexts)

    def __getattr__(self, name: str):
        expert, _, inner = name.partition("__")
        if not (expert.startswith("e") and expert[1:].isdigit() and inner):
            raise AttributeError(name)
        return getattr(self.fp8_experts[int(expert[1:])], inner)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride) -> Float8ExpertWeights:
        dtype, projection, names, contexts = ctx
        experts = [
            Float8Weight.__tensor_unflatten__({n: inner[f"e{e}__{n}"] for n in names[e]}, contexts[e], None, None)
            for e in range(len(names))
        ]
        return (Float8GateUpWeights, Float8DownWeights)[projection](experts, dtype, projection=projection)

    def __repr__(self) -> str:
        return f"Float8ExpertWeights(shape={tuple(self.shape)}, of {self.fp8_experts[0]!r} per expert)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = args[0]
        if func is aten.unbind.int and isinstance(weight, Float8ExpertWeights) and args[1:] in ((), (0,)):
            return tuple(expert._moved(lambda t: t, weight.dtype) for expert in weight.fp8_experts)
        if func in _KEPT and isinstance(weight, Float8ExpertWeights):
            move = torch.clone if func is aten.clone.default else (lambda t: t)
            return weight._moved(move, weight.dtype)
        if func is aten._to_copy.default and set(kwargs) <= TO_COPY_KWARGS:
            device = kwargs.get("device") or weight.device
            return weight._moved(lambda t: t.to(device), kwargs.get("dtype") or weight.dtype)
        written = written_weight(func, args, kwargs)
        if written is not None or (func in SPLIT_OPS and weight.fp8_master is not None):
            return Float8Weight.__torch_dispatch__.__func__(cls, func, types, args, kwargs)
        dequantized = tree_map_only(Float8Weight, lambda t: t.dequantize(), (args, kwargs))
        return func(*dequantized[0], **dequantized[1])


class Float8GateUpWeights(Float8ExpertWeights):
    """``gate_up_proj`` stored in FP8 (projection 0 of the delayed state)."""

    projection = 0


class Float8DownWeights(Float8ExpertWeights):
    """``down_proj`` stored in FP8 (projection 1 of the delayed state)."""

    projection = 1


def _next_forward_scales(master: WeightMaster | None, projection: int) -> torch.Tensor | None:
    """Each expert's weight scale ``[E]`` at the module's next forward, or ``None``."""
    state = None if master is None else master.delayed_state
    if state is None:
        return None
    return state.next_forward_scale(update_owed=True)[:, projection, Role.WEIGHT.index]
