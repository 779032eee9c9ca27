"""What precision an optimizer keeps each part of its state in, as one frozen value.

:class:`StatePrecision` is the four choices of ``fp8train.optim.AdamW`` that decide its
memory (the master weight's dtype, each moment's dtype, the FP8 first moment's block size)
and how a bfloat16 value is rounded. A param group holds them as plain entries (so
``state_dict`` carries only torch dtypes, bools and ints, which ``torch.load(weights_only=True)``
reads); the optimizer builds this value from a group, which validates it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..spec.checks import check_bool, check_int

__all__ = [
    "MASTER_WEIGHT_DTYPES",
    "EXP_AVG_DTYPES",
    "EXP_AVG_SQ_DTYPES",
    "DEFAULT_FP8_BLOCK_SIZE",
    "StatePrecision",
]

MASTER_WEIGHT_DTYPES = (None, torch.float32, torch.bfloat16)
"""``None``: each parameter is its own master (no copy)."""
EXP_AVG_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
EXP_AVG_SQ_DTYPES = (torch.float32, torch.bfloat16)
DEFAULT_FP8_BLOCK_SIZE = 128
"""Elements of the flattened first moment that share one float32 scale when it is FP8:
``benchmarks/optim_master_rounding.py`` measures 32 to 2048 and per tensor on trained
moments; 128 keeps the scales at 4/128 = 0.03 bytes per parameter."""

_SCALE_BYTES = 4  # one float32 scale_inv per block


def _check_dtype(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        names = ", ".join("None" if d is None else str(d) for d in allowed)
        kind = "" if value is None or isinstance(value, torch.dtype) else f" (a {type(value).__name__})"
        raise ValueError(f"{name}={value!r}{kind} is not supported; use one of {names}")


@dataclass(frozen=True, kw_only=True)
class StatePrecision:
    """The dtypes of an AdamW's state for one param group.

    Attributes:
        master_weight_dtype: the dtype the weight's true value lives in. ``None``: the
            parameter's own. ``torch.float32`` for a bfloat16 (or float16) parameter keeps a
            float32 copy in the optimizer's state, updated each step and written back to the
            parameter rounded to nearest. A master is never narrower than its parameter
            (``torch.bfloat16`` takes bfloat16 parameters).
        exp_avg_dtype: the first moment's storage: float32, bfloat16, or
            ``torch.float8_e4m3fn`` with one float32 scale per ``fp8_block_size`` elements.
        exp_avg_sq_dtype: the second moment's storage: float32 or bfloat16.
        stochastic_rounding: round every value stored in bfloat16 (a master or a parameter
            that is its own master, and bfloat16 moments) stochastically, from torch's
            default generator on the parameter's device; ``False`` rounds to nearest even.
        fp8_block_size: elements per scale of an FP8 first moment (>= 1).

    Raises:
        ValueError: a dtype outside the allowed ones (the message lists them); a block
            size below 1.
        TypeError: ``stochastic_rounding`` not a bool, ``fp8_block_size`` not an int.
    """

    master_weight_dtype: torch.dtype | None = None
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    stochastic_rounding: bool = True
    fp8_block_size: int = DEFAULT_FP8_BLOCK_SIZE

    def __post_init__(self) -> None:
        _check_dtype("master_weight_dtype", self.master_weight_dtype, MASTER_WEIGHT_DTYPES)
        _check_dtype("exp_avg_dtype", self.exp_avg_dtype, EXP_AVG_DTYPES)
        _check_dtype("exp_avg_sq_dtype", self.exp_avg_sq_dtype, EXP_AVG_SQ_DTYPES)
        check_bool("stochastic_rounding", self.stochastic_rounding)
        check_int("fp8_block_size", self.fp8_block_size, minimum=1)

    @classmethod
    def of_group(cls, group: dict) -> "StatePrecision":
        """The precision a param group's entries ask for."""
        return cls(**{name: group[name] for name in cls.__dataclass_fields__})

    def master_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype of the master copy a parameter of ``param_dtype`` gets (``None``: it is
        its own master).

        Raises:
            ValueError: a master narrower than the parameter, or a parameter that is not
                float32, bfloat16 or float16.
        """
        if param_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"fp8train.optim.AdamW updates float32, bfloat16 or float16 parameters, got a {param_dtype} "
                "parameter; leave it out of the optimizer or convert it"
            )
        master = self.master_weight_dtype
        if master is None or master == param_dtype:
            return None
        if master == torch.bfloat16 or param_dtype == torch.float32:
            raise ValueError(
                f"master_weight_dtype={master} is narrower than a {param_dtype} parameter (the master would "
                "lose the parameter's bits); use master_weight_dtype=None or torch.float32, or convert the "
                f"model to {master} first"
            )
        return master

    def state_bytes_per_param(self, param_dtype: torch.dtype, numel: int) -> int:
        """Bytes of optimizer state (master and moments, without the step count) for a
        parameter of ``numel`` elements: what :meth:`AdamW.state_bytes` measures."""
        master = self.master_dtype_for(param_dtype)
        total = 0 if master is None else numel * master.itemsize
        if self.exp_avg_dtype == torch.float8_e4m3fn:
            num_blocks = math.ceil(numel / self.fp8_block_size)
            total += num_blocks * (self.fp8_block_size + _SCALE_BYTES)
        else:
            total += numel * self.exp_avg_dtype.itemsize
        return total + numel * self.exp_avg_sq_dtype.itemsize
