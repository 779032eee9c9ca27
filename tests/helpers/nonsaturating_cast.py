"""PyTorch's E4M3 conversion as CUDA (and every device before torch 2.12) does it: no
saturation, so a finite value that rounds past 448, and an infinity, become NaN.

The suite runs on torch 2.13's CPU build, whose ``x.to(torch.float8_e4m3fn)`` saturates
(pytorch#178817). An H200 with torch 2.11 gave 448 for 447 and 449 but NaN for 470, 480,
500, 1e6 and inf, and delayed scaling trained to NaN there. Under
:class:`NonSaturatingFP8Conversion` every conversion of a high-precision tensor to
``float8_e4m3fn`` behaves like that device's, so a CPU test sees what a GPU would.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

E4M3_NAN_CODE = 0x7F
E4M3_LARGEST_ROUNDING_TO_MAX = 464.0
"""Half-way between 448 and the next E4M3 step (480), a tie that rounds to even: 448.
Anything larger in magnitude rounds past the largest finite value."""

_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _overflow_to_nan(source: torch.Tensor, converted: torch.Tensor) -> torch.Tensor:
    overflow = source.to(torch.float64).abs() > E4M3_LARGEST_ROUNDING_TO_MAX  # inf included
    codes = converted.view(torch.uint8)
    return torch.where(overflow, torch.full_like(codes, E4M3_NAN_CODE), codes).view(converted.dtype)


class NonSaturatingFP8Conversion(TorchDispatchMode):
    """Conversions to ``float8_e4m3fn`` (``Tensor.to``, ``copy_`` into an FP8 tensor) give
    NaN wherever the source's magnitude rounds past 448, as CUDA's do; the counts of
    conversions seen and of values turned to NaN are kept for the tests' own checks."""

    def __init__(self) -> None:
        super().__init__()
        self.num_conversions = 0
        self.num_nan_made = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is aten._to_copy.default:
            source, target = args[0], out
        elif func is aten.copy_.default:
            target, source = args[0], args[1]
        else:
            return out
        if target.dtype != torch.float8_e4m3fn or source.dtype not in _HIGH_PRECISION:
            return out
        self.num_conversions += 1
        nan_made = _overflow_to_nan(source.expand(target.shape), target)
        self.num_nan_made += int((nan_made.view(torch.uint8) != target.view(torch.uint8)).sum())
        if func is aten.copy_.default:
            target.copy_(nan_made)
            return target
        return nan_made
