"""``WeightMaster``: what a trainable :class:`~fp8train.nn.weights.float8_weight.Float8Weight` (FP8
primary weights, ``convert_to_float8_training(..., fp8_weights=True)``) knows of its master
weight, the high-precision value an optimizer updates.

The module holds its weight only quantized; the true value lives in the optimizer
(``fp8train.optim.AdamW`` keeps it as the parameter's ``master``). Between the two:

* at conversion (and at a ``load_state_dict`` while no optimizer holds the master), the
  high-precision weight is kept here once, *pending*, until an optimizer takes it
  (:meth:`take`; TE's ``preserve_high_precision_init_val``): the master starts from the
  exact weight, not its quantization. An optimizer built on a weight with nothing pending
  (a frozen weight made trainable) starts from the dequantized weight.
* once taken, only a weak reference to the optimizer's master tensor is kept (no copy, and
  it dies with the optimizer): ``state_dict`` saves that value, and ``load_state_dict``
  copies a checkpoint's weight into it, as both do with a plain parameter, which is its own
  master.
* :meth:`scale` is the weight scale the module's next forward would use (delayed scaling;
  ``None`` otherwise), with which the optimizer re-quantizes the weight after each step.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from ...spec.roles import Role

if TYPE_CHECKING:  # a type only: the link asks the module's state for its next scale
    from ..delayed.state import DelayedScalingState

__all__ = ["WeightMaster", "MasterHeldWeight", "held_weight", "requantize_held_weights"]


class WeightMaster:
    """The link between a trainable FP8 weight and its master (see the module docstring).

    Args:
        initial_hp: the high-precision weight, pending until an optimizer takes it.
        delayed_state: the module's delayed-scaling state, or ``None``.
    """

    def __init__(self, initial_hp: torch.Tensor | None, delayed_state: DelayedScalingState | None) -> None:
        self._pending_hp = initial_hp
        self._master_ref: weakref.ref | None = None
        self._weight_ref: weakref.ref | None = None
        self.delayed_state = delayed_state
        # Delayed scaling: the weight scale (or per-expert scales) the stored operands were
        # last quantized with (``Float8Weight.follow_delayed_scale_``); ``None`` otherwise.
        self.quantized_scale: torch.Tensor | None = None

    @property
    def master(self) -> torch.Tensor | None:
        """The optimizer's master tensor, while an optimizer holds it (else ``None``)."""
        return None if self._master_ref is None else self._master_ref()

    @property
    def weight(self) -> torch.Tensor | None:
        """The module's parameter (:meth:`attach`), whose operands a load re-quantizes even
        when it writes through an alias (``weight.data.copy_(...)``)."""
        if self._weight_ref is None:
            return None
        if isinstance(self._weight_ref, tuple):  # (the module, weakly; the parameter's name)
            module = self._weight_ref[0]()
            return None if module is None else getattr(module, self._weight_ref[1], None)
        return self._weight_ref()

    def attach(self, weight: torch.Tensor, module: torch.nn.Module | None = None, name: str | None = None) -> None:
        """Refer to the module's parameter ``weight``: through ``module`` (weakly) and its
        ``name`` where given, else weakly to ``weight`` itself (nothing here if it is already
        referred to). Not to the parameter where the module is known: a weak reference to
        a parameter makes ``module.to()`` fail (``torch.utils.swap_tensors`` refuses it)."""
        if module is not None:
            self._weight_ref = (weakref.ref(module), name)
        elif self.weight is not weight:
            self._weight_ref = weakref.ref(weight)

    @property
    def pending(self) -> torch.Tensor | None:
        """The high-precision value waiting for an optimizer (``None`` once taken)."""
        return self._pending_hp

    def take(self, dtype: torch.dtype, dequantized: torch.Tensor) -> torch.Tensor:
        """The new master (``dtype``): the pending value (freed here), else ``dequantized``;
        held from now on (:meth:`hold`)."""
        source = self._pending_hp if self._pending_hp is not None else dequantized
        self._pending_hp = None
        master = source.detach().to(device=dequantized.device, dtype=dtype, copy=True)  # after a module.to(device)
        self.hold(master)
        return master

    def hold(self, master: torch.Tensor) -> None:
        """Refer to ``master`` (an optimizer's state tensor) from now on; nothing is pending."""
        self._pending_hp = None
        self._master_ref = weakref.ref(master)

    def load(self, weight_hp: torch.Tensor) -> None:
        """A checkpoint's weight: into the held master, else pending for the next optimizer."""
        master = self.master
        if master is not None:
            master.copy_(weight_hp)
        else:
            self._pending_hp = weight_hp.detach().clone()

    def scale(self) -> torch.Tensor | None:
        """Delayed scaling's weight scale of the module's next forward (after a forward
        update still owed), or ``None``."""
        if self.delayed_state is None:
            return None
        return self.delayed_state.next_forward_scale(update_owed=True)[Role.WEIGHT.index]

    def __getstate__(self) -> dict:
        # A copy (deepcopy, pickle) has no optimizer yet: its master starts from this one's
        # value, pending; the weak references do not travel.
        value = self.master if self.master is not None else self._pending_hp
        return {
            "_pending_hp": value, "_master_ref": None, "_weight_ref": None, "delayed_state": self.delayed_state,
            "quantized_scale": self.quantized_scale,
        }  # fmt: skip


class MasterHeldWeight:
    """The base of a parameter held only quantized whose master an optimizer keeps: a
    :class:`~fp8train.nn.weights.float8_weight.Float8Weight` (the whole weight) and, under FSDP2,
    :class:`~fp8train.parallel.fp8_weight_shard.Float8WeightShard` (one rank's rows of it,
    the local tensor of a ``DTensor`` parameter). What ``fp8train.optim.AdamW`` and the
    modules' ``state_dict`` ask of one (each subclass defines them):

    * ``fp8_master``: its :class:`WeightMaster` (``None``: frozen, nothing to train);
    * ``dequantize()``: the value its quantization holds, a plain tensor of its shape;
    * ``checkpoint_value()``: what a ``state_dict`` saves (the master's value where one is held);
    * ``load_(weight_hp)``: set it (master and quantization) to a checkpoint's value;
    * ``requantize_from_masters_(weights, masters)`` (a classmethod): after an optimizer
      step, re-quantize each of ``weights`` from its master, all at once (a sharded weight's
      scale needs the amaxes of every rank: one collective for all).
    """


def held_weight(param: torch.Tensor) -> MasterHeldWeight | None:
    """``param`` (or, for a ``DTensor``, its local shard) where it is a trainable weight
    whose master an optimizer keeps (:class:`MasterHeldWeight` with a ``fp8_master``), else ``None``."""
    local = param._local_tensor if isinstance(param, DTensor) else param
    return local if isinstance(local, MasterHeldWeight) and local.fp8_master is not None else None


def requantize_held_weights(pairs: list[tuple[MasterHeldWeight, torch.Tensor]]) -> None:
    """Re-quantize every ``(weight, master)`` of ``pairs`` from its master, one call per
    weight type (:meth:`MasterHeldWeight.requantize_from_masters_`), in their order."""
    by_type: dict[type, list[tuple[MasterHeldWeight, torch.Tensor]]] = {}
    for weight, master in pairs:
        by_type.setdefault(type(weight), []).append((weight, master))
    for cls, group in by_type.items():
        cls.requantize_from_masters_([weight for weight, _ in group], [master for _, master in group])
