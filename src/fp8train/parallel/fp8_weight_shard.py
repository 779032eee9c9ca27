"""``Float8WeightShard``: FSDP2's shard of an FP8 primary weight (``fp8_weights=True``), one
rank's rows of the weight held only quantized, whose bytes FSDP2 all-gathers as they are.

``enable_fp8_all_gather(model)`` (before ``fully_shard``) replaces each trainable
:class:`~fp8train.nn.weights.float8_weight.Float8Weight` by a whole-weight ``Float8WeightShard``
(:meth:`Float8WeightShard.of_weight`); ``fully_shard`` cuts it into rows (its ``split``), and
each rank keeps its rows as the local tensor of its ``DTensor`` parameter. For rows
``W[r0:r1, :]`` of the weight and the recipe's :class:`~.gather.GatherPlan`, a shard holds:

* the bytes :func:`~.gather.quantize_shard` makes of those rows under the whole weight's
  scale (what FSDP2's FP8 all-gather of a high-precision shard gathers): the rowwise data
  and its scales, and the columnwise copy, in the shard's orientation (``axis=0``), where
  the plan quantizes it on its own (MXFP8, 1-D NVFP4, MXFP4); no high-precision copy;
* for delayed scaling, the rows' amax, which the module records (the step's amax
  all-reduce makes it the whole weight's), as FSDP2's FP8 all-gather does;
* its :class:`~fp8train.nn.weights.master.WeightMaster`: the rows of the high-precision
  weight, pending until ``fp8train.optim.AdamW`` takes them as the shard's master.

``fsdp_pre_all_gather`` hands FSDP2 those stored bytes (uint8 views: nothing is cast per
step); ``fsdp_post_all_gather`` makes the whole weight a ``PrequantizedTensor``, which
``Float8Linear`` feeds to its GEMMs. A ``MixedPrecisionPolicy(param_dtype=...)`` sets only
the gathered weight's face dtype: the bytes are quantized from the master cast to the
weight's own dtype, as a one-process FP8 weight's are. After each step the optimizer re-quantizes every shard
from its master (:meth:`Float8WeightShard.requantize_from_masters_`) under the whole
weight's scale: tensorwise from the MAX of the shards' amaxes and NVFP4 under the MAX of
their global amaxes (one all-reduce for all the weights each), delayed under the module's
next delayed scale; block scales are local to a shard (whole blocks per shard).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from ..nn.delayed.amax import tensor_amax
from ..nn.weights.float8_weight import OPTIMIZER_HINT, Float8Weight
from ..nn.weights.master import MasterHeldWeight, WeightMaster
from ..quant.tensor import QuantizedTensor
from ..spec.recipes import recipe_label
from .gather import (
    GatherPlan,
    active_recipe,
    gather_inputs,
    gather_plan,
    global_amaxes,
    per_tensor_scales,
    quantize_shard,
    scale_bytes,
    unshard_gathered_weight,
)

__all__ = ["Float8WeightShard"]

aten = torch.ops.aten
_ALIASES = (aten.detach.default, aten.alias.default)
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_NEW = (aten.new_zeros.default, aten.new_empty.default)
_PARTS = ("rowwise", "columnwise")
_FIELDS = ("data", "scale_inv", "global_amax")
_INNER = {f"{part}__{field}": (part, field) for part in _PARTS for field in _FIELDS}


class _ShardState:
    """The quantized rows and their master, shared by a shard and its aliases as a storage
    is by its views: FSDP2 and ``DTensor`` hand out aliases of the parameter, and what the
    optimizer writes through one, every one reads."""

    __slots__ = ("rows_shape", "rowwise", "columnwise", "shard_amax", "quantize_args", "master", "group")

    def __init__(self, rows_shape: tuple[int, ...], master: WeightMaster | None) -> None:
        self.rows_shape = rows_shape  # [rows, K]: the rows quantized (an alias may face 1-D)
        self.rowwise: QuantizedTensor | None = None
        self.columnwise: QuantizedTensor | None = None
        self.shard_amax: torch.Tensor | None = None
        self.quantize_args: tuple = (None, None)  # the whole weight's (scale, global_amax) used
        self.master = master
        self.group = None  # FSDP2's shard group, from its first all-gather


class Float8WeightShard(torch.Tensor, MasterHeldWeight):
    """Rows of a trainable FP8 weight, quantized for FSDP2's all-gather (module docstring).

    Its face (shape, dtype, device) is the high-precision rows'; any op other than FSDP2's
    sharding, aliasing and copies sees them dequantized; in-place writes but ``copy_``
    (which sets it: :meth:`load_`) are refused.

    Attributes:
        fp8_gather: the recipe's :class:`~.gather.GatherPlan` it was quantized for.
    """

    fp8_gather: GatherPlan
    _state: _ShardState

    @staticmethod
    def __new__(cls, state: _ShardState, gather: GatherPlan, shape, dtype: torch.dtype, device):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)

    def __init__(self, state: _ShardState, gather: GatherPlan, shape, dtype: torch.dtype, device) -> None:
        self._state = state
        self.fp8_gather = gather

    @classmethod
    def of_weight(cls, weight: Float8Weight, gather: GatherPlan) -> Float8WeightShard:
        """The whole of a trainable ``weight`` as one shard (which ``fully_shard`` then
        splits): quantized from its pending high-precision value (else its dequantized
        one) under its own scale, with a master link of its own."""
        source = weight.fp8_master
        weight_hp = source.pending if source.pending is not None else weight.dequantize()
        master = WeightMaster(weight_hp, source.delayed_state)
        scale, global_amax = _whole_weight_args([weight_hp], [gather], [master], None)[0]
        return cls._quantized(weight_hp, gather, master, scale, global_amax)

    @classmethod
    def _quantized(cls, weight_hp, gather: GatherPlan, master, scale, global_amax) -> Float8WeightShard:
        state = _ShardState(tuple(weight_hp.shape), master)
        shard = cls(state, gather, weight_hp.shape, weight_hp.dtype, weight_hp.device)
        shard._set_quantized(weight_hp, scale, global_amax)
        return shard

    def _set_quantized(self, weight_hp: torch.Tensor, scale, global_amax) -> None:
        state = self._state
        state.rowwise, state.columnwise = quantize_shard(self.fp8_gather, weight_hp, scale, global_amax)
        state.shard_amax = tensor_amax(weight_hp) if self.fp8_gather.delayed else None
        state.quantize_args = (scale, global_amax)

    @property
    def fp8_master(self) -> WeightMaster | None:
        """The link to this shard's master (:class:`~fp8train.nn.weights.master.WeightMaster`)."""
        return self._state.master

    @property
    def storage_nbytes(self) -> int:
        """Bytes of every tensor held (data, scales, amaxes), the pending master excluded."""
        return sum(t.numel() * t.element_size() for t in self._inner_tensors().values())

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The rows the stored rowwise bytes hold, a plain tensor of this shape in ``dtype``."""
        return self._state.rowwise.dequantize(dtype or self.dtype).reshape(self.shape)

    def checkpoint_value(self) -> torch.Tensor:
        """What a ``state_dict`` saves for these rows: the master's value where an optimizer
        holds it (or it is pending), else the dequantized rows."""
        master = self.fp8_master
        value = None if master is None else master.master if master.master is not None else master.pending
        return self.dequantize() if value is None else value.detach().to(self.dtype, copy=True).reshape(self.shape)

    def load_(self, weight_hp: torch.Tensor) -> Float8WeightShard:
        """Set these rows to ``weight_hp`` (a checkpoint's, of this shape): the master takes
        it and the bytes are re-quantized (a collective where the scale is the whole
        weight's: every rank loads its shard). Returns ``self``."""
        weight_hp = weight_hp.detach().to(device=self.device, dtype=self.dtype).reshape(self._state.rows_shape)
        self.fp8_master.load(weight_hp)
        type(self).requantize_from_masters_([self], [weight_hp])
        return self

    @classmethod
    def requantize_from_masters_(cls, shards: list[Float8WeightShard], masters: list[torch.Tensor]) -> None:
        """After an optimizer step: re-quantize each shard from its master (cast to the
        shard's dtype first) under the whole weight's scale (module docstring), one
        all-reduce per kind of scale for all the shards of one FSDP2 group."""
        by_group: dict = {}
        for index, shard in enumerate(shards):
            by_group.setdefault(shard._state.group, []).append(index)
        for group, indices in by_group.items():
            chosen = [shards[i] for i in indices]
            weights_hp = [masters[i].detach().to(shards[i].dtype).reshape(shards[i]._state.rows_shape) for i in indices]
            args = _whole_weight_args(weights_hp, [s.fp8_gather for s in chosen], [s.fp8_master for s in chosen], group)
            for shard, weight_hp, (scale, global_amax) in zip(chosen, weights_hp, args):
                shard._set_quantized(weight_hp, scale, global_amax)

    # ------------------------------------------------------------------ FSDP2 hooks
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        gather = gather_plan(active_recipe(module))
        if gather != self.fp8_gather:
            raise ValueError(
                f"the weight of {module} is stored in FP8 for its module's recipe ({recipe_label(module.recipe)}), but this "
                "forward runs another recipe (an fp8train.autocast override): run the module's own recipe, or "
                "convert without fp8_weights=True"
            )
        state = self._state
        state.group = mesh.get_group() if mesh is not None else None
        rowwise, columnwise = state.rowwise, state.columnwise
        inputs = [rowwise.data.view(torch.uint8)]
        if not gather.per_tensor:
            inputs.append(scale_bytes(rowwise.scale_inv))
        if columnwise is not None:  # its own quantization, gathered compact (axis 0)
            inputs += [columnwise.data.view(torch.uint8), scale_bytes(columnwise.scale_inv)]
        scale_inv = rowwise.scale_inv if gather.per_tensor else None
        global_amax = rowwise.global_amax, None if columnwise is None else columnwise.global_amax
        metadata = (gather, rowwise.dtype, scale_inv, rowwise.power_2_scales, state.shard_amax, global_amax)
        return gather_inputs(inputs, metadata, mesh)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return unshard_gathered_weight(all_gather_outputs, metadata, param_dtype, out)

    # ------------------------------------------------------------------ what FSDP2 does to it
    def _alias(self, shape) -> Float8WeightShard:
        return Float8WeightShard(self._state, self.fp8_gather, shape, self.dtype, self.device)

    def _rows(self, start: int, stop: int) -> Float8WeightShard:
        """Rows ``start:stop`` as a shard of their own (``fully_shard``'s split), quantized
        from this shard's pending high-precision rows under the same (whole weight's) scale."""
        master = self.fp8_master
        source = master.pending if master is not None and master.pending is not None else self.dequantize()
        weight_hp = source.reshape(self._state.rows_shape)[start:stop].clone()
        rows_master = WeightMaster(weight_hp, master.delayed_state if master is not None else None)
        return Float8WeightShard._quantized(weight_hp, self.fp8_gather, rows_master, *self._state.quantize_args)

    def _split(self, sizes: list[int]) -> list[Float8WeightShard]:
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        return [self._rows(start, stop) for start, stop in zip(bounds, bounds[1:])]

    def _copy_from(self, source: torch.Tensor) -> Float8WeightShard:
        """``self.copy_(source)``: another shard's bytes and master (``fully_shard`` fills
        its padded shard so), else a high-precision value (:meth:`load_`)."""
        if not isinstance(source, Float8WeightShard):
            return self.load_(source)
        if tuple(source.shape) != tuple(self.shape):
            raise ValueError(f"cannot copy FP8 weight rows of shape {tuple(source.shape)} into {tuple(self.shape)}")
        for name in _ShardState.__slots__:
            setattr(self._state, name, getattr(source._state, name))
        return self

    def __repr__(self) -> str:
        return f"Float8WeightShard({self._state.rowwise!r}, dtype={self.dtype})"

    # A traceable wrapper subclass: its inner tensors are the stored bytes (what memory
    # accounting counts); one rebuilt from them has no master.
    def _inner_tensors(self) -> dict[str, torch.Tensor]:
        state = self._state
        inner = {
            name: getattr(getattr(state, part), field)
            for name, (part, field) in _INNER.items()
            if getattr(state, part) is not None and getattr(getattr(state, part), field) is not None
        }
        if state.shard_amax is not None:
            inner["shard_amax"] = state.shard_amax
        return inner

    def __getattr__(self, name: str):
        if name not in _INNER and name != "shard_amax":
            raise AttributeError(name)
        return self._inner_tensors()[name]

    def __tensor_flatten__(self):
        parts = (getattr(self._state, part) for part in _PARTS)
        layouts = tuple(None if qt is None else qt.prepare_for_saving()[1] for qt in parts)
        return list(self._inner_tensors()), (self.fp8_gather, self._state.rows_shape, self.dtype, layouts)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride) -> Float8WeightShard:
        gather, rows_shape, dtype, layouts = ctx
        state = _ShardState(rows_shape, None)
        state.rowwise, state.columnwise = (
            None if layout is None
            else QuantizedTensor.restore_from_saved(layout, *(inner.get(f"{part}__{field}") for field in _FIELDS))
            for part, layout in zip(_PARTS, layouts)
        )
        state.shard_amax = inner.get("shard_amax")
        device = next(iter(inner.values())).device
        return Float8WeightShard(state, gather, outer_size, dtype, device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shard = args[0]
        if isinstance(shard, Float8WeightShard):
            handled = shard._dispatch_own(func, args, kwargs)
            if handled is not None:
                return handled
        for position, argument in enumerate(func._schema.arguments):
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            written = argument.alias_info is not None and argument.alias_info.is_write
            if isinstance(value, Float8WeightShard) and written:
                raise RuntimeError(
                    f"{func._schema.name} would change a weight stored in FP8 (fp8_weights=True): {OPTIMIZER_HINT}"
                )
        args, kwargs = tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)

    def _dispatch_own(self, func, args, kwargs):
        """FSDP2's sharding ops on this shard (``None``: not one of them)."""
        if func in _ALIASES:
            return self._alias(self.shape)
        if func in _VIEWS:
            return self._alias(torch.empty(self.shape, device="meta").view(args[1]).shape)
        if func in _NEW:
            empty = _ShardState(tuple(args[1]), None)  # filled by copy_ (fully_shard's padded shard)
            return Float8WeightShard(empty, self.fp8_gather, args[1], self.dtype, self.device)
        if func is aten.copy_.default:
            return self._copy_from(args[1])
        if func in (aten.split.Tensor, aten.split_with_sizes.default):
            return self._split(_split_sizes(func, args, kwargs, self.shape[0]))
        if func is aten.slice.Tensor:
            dim, start, end, step = (
                args[i] if i < len(args) else kwargs.get(name, default)
                for i, (name, default) in enumerate((("dim", 0), ("start", None), ("end", None), ("step", 1)), start=1)
            )
            if dim == 0 and (start or 0) == 0 and (end is None or end >= self.shape[0]) and step == 1:
                return self._alias(self.shape)
            raise NotImplementedError(
                f"FSDP2 shards of a weight stored in FP8 are whole rows of it, cut once: slicing rows {start}:{end} "
                f"of a shard of shape {tuple(self.shape)} is not supported"
            )
        return None


def _split_sizes(func, args, kwargs, rows: int) -> list[int]:
    """The row counts of ``split`` / ``split_with_sizes`` along dim 0 of ``rows`` rows.

    Raises:
        NotImplementedError: a split along another dim (FSDP2 shards dim 0 of a weight stored in FP8).
    """
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if dim != 0:
        raise NotImplementedError(
            f"a weight stored in FP8 is sharded along dim 0 only (FSDP2's default), not dim {dim}: drop the "
            "shard_placement_fn for it, or convert without fp8_weights=True"
        )
    if func is aten.split_with_sizes.default:
        return list(args[1])
    size = args[1]
    return [min(size, rows - start) for start in range(0, rows, size)]


def _whole_weight_args(weights_hp, gathers, links: list[WeightMaster], group) -> list[tuple]:
    """Per shard, ``(scale, global_amax)`` of the whole weight it is part of: delayed
    scaling's next weight scale, tensorwise's scale from the MAX of the shards' amaxes,
    NVFP4's global amaxes (one all-reduce over ``group`` for each kind, for all the shards)."""
    current = [i for i, gather in enumerate(gathers) if gather.per_tensor and not gather.delayed]
    two_level = [i for i, gather in enumerate(gathers) if gather.global_amax]
    scales, amaxes = {}, {}
    if current:
        found = per_tensor_scales([weights_hp[i] for i in current], [gathers[i] for i in current], group)
        scales = dict(zip(current, found))
    if two_level:
        found = global_amaxes([weights_hp[i] for i in two_level], [gathers[i] for i in two_level], group)
        amaxes = dict(zip(two_level, found))
    return [
        (links[i].scale() if gather.delayed else scales.get(i), amaxes.get(i))
        for i, gather in enumerate(gathers)
    ]
