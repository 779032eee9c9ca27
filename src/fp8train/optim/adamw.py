"""AdamW with low-precision state: bfloat16 or float32 masters, float32, bfloat16 or FP8
(blockwise E4M3) first moments, float32 or bfloat16 second moments.

Every step works in float32: each stored value is read as float32, the update is
``torch.optim.AdamW``'s (decoupled weight decay, bias correction, the same operations in the
same order), and each result is rounded back into its storage. With every dtype float32
and float32 parameters nothing is converted and the operations run in place on the state,
so the results equal ``torch.optim.AdamW(foreach=False)``'s bit for bit.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..nn.weights.master import MasterHeldWeight, held_weight, requantize_held_weights
from ..spec.checks import check_number
from .chunks import chunk_elements, update_spans
from .fp8_moment import dequantize_blocks, quantize_blocks, zero_blocks
from .precision import DEFAULT_FP8_BLOCK_SIZE, StatePrecision
from .rounding import store_rounded

__all__ = ["AdamW", "adamw_update"]

_MOMENTS = (("exp_avg", "exp_avg_dtype"), ("exp_avg_sq", "exp_avg_sq_dtype"))


def adamw_update(
    weight: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step on float32 tensors, in place: ``torch.optim.AdamW``'s single-tensor
    update (torch 2.x ``_single_tensor_adam`` with ``decoupled_weight_decay=True``), the
    same operations in the same order, so the same float32 roundings::

        w = w * (1 - lr * wd);   m = lerp(m, g, 1 - beta1);   v = v * beta2 + (1 - beta2) g^2
        w = w - (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
    """
    if weight_decay != 0:
        weight.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    weight.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters; AdamW is elementwise), else ``tensor``."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) whose master weights and
    moments may be stored in low precision.

    Args:
        params: parameters or param groups (any of the keywords below may be set per group).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (``weight_decay`` default 1e-2).
        master_weight_dtype: ``None`` (each parameter is its own master), ``torch.float32``
            (a float32 copy in the state for bfloat16/float16 parameters, written back to the
            parameter rounded to nearest after each step) or ``torch.bfloat16`` (for bfloat16
            parameters: they are their own master, rounded stochastically).
        exp_avg_dtype: ``torch.float32``, ``torch.bfloat16`` or ``torch.float8_e4m3fn``
            (one float32 scale per ``fp8_block_size`` elements: ``fp8_moment.py``).
        exp_avg_sq_dtype: ``torch.float32`` or ``torch.bfloat16``.
        stochastic_rounding: round every value stored in bfloat16 stochastically from
            torch's default generator (``torch.manual_seed`` reproduces it; a resumed run
            needs the generator's state restored too); ``False``: to nearest even.
        fp8_block_size: elements per scale of an FP8 first moment (default 128).

    State per parameter: ``step`` (float32 scalar, as torch's), ``exp_avg`` (of its dtype;
    FP8: ``(num_blocks, fp8_block_size)`` codes and ``exp_avg_scale_inv`` ``(num_blocks, 1)``),
    ``exp_avg_sq``, and ``master`` where the master is a copy. Bytes per parameter:
    :meth:`StatePrecision.state_bytes_per_param`; the whole state: :meth:`state_bytes`.

    Where the weight lives: every step reads the weight from :meth:`_master_for` and writes
    it back with :meth:`_write_back`; :meth:`_update_param` takes ``(param, grad, state,
    precision, group)`` and knows nothing else. An FP8 weight
    (:class:`~fp8train.nn.weights.float8_weight.Float8Weight`, ``fp8_weights=True``) always has a
    master in the state, of ``master_weight_dtype`` (``None``: its face dtype), taken when
    the parameter joins the optimizer (:meth:`_take_fp8_master`); after each step the
    module's weight is re-quantized from it, all FP8 weights at once
    (:func:`~fp8train.nn.weights.master.requantize_held_weights`). Under FSDP2 such a weight
    is a ``DTensor`` whose local shard is a
    :class:`~fp8train.parallel.fp8_weight_shard.Float8WeightShard`: the master is the
    shard's rows, and the re-quantization reduces the amaxes its scales need across the
    ranks in one collective for all the weights.

    Raises:
        ValueError: a negative ``lr``, ``eps`` or ``weight_decay``, a beta outside
            ``[0, 1)``, a dtype outside the allowed ones, a master narrower than a
            parameter, a complex or integer parameter; at :meth:`step`, a sparse gradient.
        TypeError: a hyperparameter that is not a number, ``stochastic_rounding`` not a
            bool, ``fp8_block_size`` not an int.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        master_weight_dtype: torch.dtype | None = None,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        stochastic_rounding: bool = True,
        fp8_block_size: int = DEFAULT_FP8_BLOCK_SIZE,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            master_weight_dtype=master_weight_dtype,
            exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype,
            stochastic_rounding=stochastic_rounding,
            fp8_block_size=fp8_block_size,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (as ``torch.optim.Optimizer``), checking its hyperparameters, its
        precision and that every parameter can take it."""
        group = {**self.defaults, **param_group}
        _check_hyperparameters(group)
        precision = StatePrecision.of_group(group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else params if isinstance(params, set) else list(params)
        for param in params:
            if isinstance(param, torch.Tensor):  # torch's own check names anything else
                self._check_param(param, precision)
        param_group = {**param_group, "params": params}
        super().add_param_group(param_group)
        for param in params:
            if isinstance(param, torch.Tensor) and held_weight(param) is not None:
                self._take_fp8_master(param, precision)

    def _take_fp8_master(self, param: torch.Tensor, precision: StatePrecision) -> None:
        """Hold the master of an FP8 weight (or of an FSDP2 shard of one) from now on: the
        high-precision value its module kept pending (at conversion, or a
        ``load_state_dict``), which is freed there, else its dequantized value; of
        ``master_weight_dtype``, or the weight's dtype for ``None``."""
        weight = held_weight(param)
        dtype = precision.master_dtype_for(param.dtype) or param.dtype
        weight.fp8_master.attach(weight)
        self.state[param]["master"] = weight.fp8_master.take(dtype, weight.dequantize())

    def _check_param(self, param: torch.Tensor, precision: StatePrecision) -> None:
        """Refuse a parameter this optimizer cannot update with ``precision``.

        Raises:
            ValueError: a complex or integer parameter; a master narrower than it.
        """
        if param.is_complex() or not param.is_floating_point():
            raise ValueError(
                f"fp8train.optim.AdamW updates real floating-point parameters, got a {param.dtype} "
                "parameter; leave it out of the optimizer"
            )
        precision.master_dtype_for(param.dtype)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a gradient (the others are skipped).

        Raises:
            ValueError: a parameter's gradient is sparse.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        quantized = []  # (FP8 weight, master): re-quantized together after the updates
        for group_index, group in enumerate(self.param_groups):
            precision = StatePrecision.of_group(group)
            for param_index, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise ValueError(
                        f"fp8train.optim.AdamW does not take sparse gradients (parameter {param_index} of group "
                        f"{group_index}, shape {tuple(param.shape)}); use torch.optim.SparseAdam for it, or "
                        "nn.Embedding(sparse=False)"
                    )
                state = self.state[param]
                if "step" not in state:
                    self._init_state(param, state, precision)
                master = self._update_param(param, param.grad, state, precision, group)
                weight = held_weight(param)
                if weight is not None:
                    quantized.append((weight, master))
                else:
                    self._write_back(param, master)
        requantize_held_weights(quantized)
        return loss

    def _init_state(self, param: torch.Tensor, state: dict, precision: StatePrecision) -> None:
        """Zero moments in their storage dtypes, and the master where it is a copy."""
        local = _local(param)
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key, dtype_name in _MOMENTS:
            dtype = getattr(precision, dtype_name)
            if dtype == torch.float8_e4m3fn:
                state[key], state[f"{key}_scale_inv"] = zero_blocks(local.numel(), precision.fp8_block_size, local.device)
            elif isinstance(local, MasterHeldWeight):  # its zeros_like would dequantize it first
                state[key] = torch.zeros(local.shape, dtype=dtype, device=local.device)
            else:
                state[key] = torch.zeros_like(local, dtype=dtype, memory_format=torch.preserve_format)
        master_dtype = precision.master_dtype_for(param.dtype)
        if master_dtype is not None and "master" not in state:
            state["master"] = local.detach().to(master_dtype, copy=True)

    def _update_param(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict, precision: StatePrecision, group: dict
    ) -> torch.Tensor:
        """One step of one parameter's master, chunk by chunk (:func:`~fp8train.optim.chunks.update_spans`). Returns the
        master, which :meth:`step` writes back (:meth:`_write_back`), or re-quantizes an
        FP8 weight from."""
        state["step"] += 1
        master = self._master_for(param, state)
        grad = _local(grad)
        dense = [master, grad, *(state[key] for key, _ in _MOMENTS if f"{key}_scale_inv" not in state)]
        whole = not all(t.is_contiguous() for t in dense)
        for span in update_spans(master.numel(), precision.fp8_block_size, whole, chunk_elements(master.device)):
            _update_span(master, grad, state, precision, group, span)
        return master

    def _master_for(self, param: torch.Tensor, state: dict) -> torch.Tensor:
        """The tensor that holds ``param``'s true value: the state's master copy, or the
        parameter's own (local) data."""
        return state["master"] if "master" in state else _local(param)

    def _write_back(self, param: torch.Tensor, master: torch.Tensor) -> None:
        """After a step, give a high-precision ``param`` the value of its master (rounded to
        nearest). FP8 weights are re-quantized from theirs by :meth:`step`, all at once."""
        local = _local(param)
        if master is not local:
            local.copy_(master)

    def state_bytes(self) -> int:
        """Bytes of every state tensor but the step counts (masters, moments, FP8 scales)."""
        return sum(
            value.numel() * value.element_size()
            for state in self.state.values()
            for key, value in state.items()
            if key != "step" and isinstance(value, torch.Tensor)
        )

    def load_state_dict(self, state_dict: dict) -> None:
        """Load as ``torch.optim.Optimizer`` does, but keep each state tensor's dtype (torch
        casts every floating-point state tensor to its parameter's dtype, which would turn
        FP8 codes, bfloat16 moments and float32 scales into float32 or bfloat16). The
        groups' settings come from ``state_dict``; a ``torch.optim.AdamW`` state dict (float32
        moments, no precision entries) takes this optimizer's defaults for them.

        Raises:
            ValueError: a group of ``state_dict`` asks for ``amsgrad`` or ``maximize``.
        """
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # a torch.optim.AdamW checkpoint has no precision entries
            for option in ("amsgrad", "maximize"):
                if group.get(option):
                    raise ValueError(f"the state dict's group has {option}=True, which fp8train.optim.AdamW does not do")
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                # A copy, so that two optimizers never share a state tensor (not even the step).
                device = value.device if key == "step" else _local(param).device
                self.state[param][key] = value.to(device=device, copy=True)
        self._relink_fp8_masters()

    def _relink_fp8_masters(self) -> None:
        """After a load: each FP8 weight refers to its loaded master and is re-quantized from
        it, all at once (a state without one, a ``torch.optim.AdamW`` checkpoint's, takes it
        as a new parameter would)."""
        quantized = []
        for group in self.param_groups:
            precision = StatePrecision.of_group(group)
            for param in group["params"]:
                weight = held_weight(param)
                if weight is None:
                    continue
                if "master" not in self.state[param]:
                    self._take_fp8_master(param, precision)
                weight.fp8_master.hold(self.state[param]["master"])
                quantized.append((weight, self.state[param]["master"]))
        requantize_held_weights(quantized)


def _check_hyperparameters(group: dict) -> None:
    check_number("lr", group["lr"], minimum=0)
    check_number("eps", group["eps"], minimum=0)
    check_number("weight_decay", group["weight_decay"], minimum=0)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas={betas!r} must be a pair (beta1, beta2)")
    for name, beta in zip(("betas[0]", "betas[1]"), betas):
        check_number(name, beta, minimum=0)
        if beta >= 1:
            raise ValueError(f"{name}={beta!r} must be in [0, 1)")


def _update_span(master, grad, state: dict, precision: StatePrecision, group: dict, span: slice | None) -> None:
    """Update ``span`` of the flattened master and moments (``None``: all of them, in their
    shape): read as float32, :func:`adamw_update`, store rounded."""
    view = (lambda t: t) if span is None else (lambda t: t.view(-1)[span])
    master_part, grad_part = view(master), view(grad)
    weight = master_part if master_part.dtype == torch.float32 else master_part.float()
    grad_part = grad_part if grad_part.dtype == torch.float32 else grad_part.float()
    exp_avg = _load_moment(state, "exp_avg", weight.shape, span)
    exp_avg_sq = _load_moment(state, "exp_avg_sq", weight.shape, span)
    beta1, beta2 = group["betas"]
    adamw_update(
        weight, grad_part, exp_avg, exp_avg_sq, step=state["step"].item(), lr=group["lr"], beta1=beta1,
        beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
    )  # fmt: skip
    _store_moment(state, "exp_avg", exp_avg, precision, span)
    _store_moment(state, "exp_avg_sq", exp_avg_sq, precision, span)
    store_rounded(master_part, weight, stochastic=precision.stochastic_rounding)


def _block_rows(span: slice, block_size: int) -> slice:
    """The rows of an FP8 moment's ``(num_blocks, block_size)`` codes that hold ``span``."""
    return slice(span.start // block_size, -(-span.stop // block_size))


def _load_moment(state: dict, key: str, shape: torch.Size, span: slice | None) -> torch.Tensor:
    """The moment (``span`` of it flattened, or all of it) as float32 of ``shape``: the
    stored tensor itself when it is float32 (updated in place), else a float32 copy."""
    stored = state[key]
    if f"{key}_scale_inv" in state:
        codes, scale_inv = stored, state[f"{key}_scale_inv"]
        if span is not None:
            rows = _block_rows(span, codes.shape[1])
            codes, scale_inv = codes[rows], scale_inv[rows]
        return dequantize_blocks(codes, scale_inv, shape)
    stored = stored if span is None else stored.view(-1)[span]
    return stored if stored.dtype == torch.float32 else stored.float()


def _store_moment(state: dict, key: str, value: torch.Tensor, precision: StatePrecision, span: slice | None) -> None:
    """Store the float32 moment ``value`` back into its storage (``span`` of it flattened,
    or all of it; nothing to do when updated in place)."""
    if f"{key}_scale_inv" in state:
        codes, scale_inv = quantize_blocks(value, precision.fp8_block_size)
        rows = slice(None) if span is None else _block_rows(span, precision.fp8_block_size)
        state[key][rows].copy_(codes)
        state[f"{key}_scale_inv"][rows].copy_(scale_inv)
    else:
        stored = state[key] if span is None else state[key].view(-1)[span]
        if stored.dtype != torch.float32:  # a float32 moment was updated in place
            store_rounded(stored, value, stochastic=precision.stochastic_rounding)
