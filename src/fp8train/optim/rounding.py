"""Rounding an optimizer's float32 results into the dtype they are stored in.

Why a bfloat16 master (and a bfloat16 moment) rounds stochastically: bfloat16 keeps 8
significant bits, so a value ``w`` moves only when its change exceeds half a unit in the
last place, ``|w| * 2**-9`` at best. An AdamW update is about ``lr`` in size; with a weight
of 0.02 and ``lr = 3e-5`` it is 0.15% of the weight, under half an ulp, and round to nearest
even drops it, every step: the weight stops training. The second moment is worse: with
``beta2 = 0.999`` its decay ``0.999 * v`` rounds back to ``v``, so a bfloat16 ``v`` can only
grow. Stochastic rounding rounds up with probability equal to the distance from the value
below (in units of its ulp), so the stored value is unbiased: the expected weight follows
the float32 one, and small updates accumulate on average. ``benchmarks/optim_master_rounding.py``
measures both (loss and weight drift after N steps, round to nearest versus stochastic
versus a float32 master).
"""

from __future__ import annotations

import torch

__all__ = ["round_to_bfloat16_stochastically", "store_rounded"]

_LOW_BITS = 1 << 16  # float32 bits below bfloat16's last mantissa bit
_HIGH_BITS_MASK = -_LOW_BITS  # 0xFFFF0000 as a signed int32


def round_to_bfloat16_stochastically(x: torch.Tensor) -> torch.Tensor:
    """Round float32 ``x`` to bfloat16 stochastically, from torch's default generator on
    ``x``'s device (so ``torch.manual_seed`` reproduces the bits).

    Each value rounds away from zero with probability ``low / 2**16``, ``low`` being the 16
    float32 mantissa bits bfloat16 drops, else toward zero: one uniform integer in
    ``[0, 2**16)`` per element is added to the float32 bits, which are then truncated.
    Values that bfloat16 holds exactly are unchanged; NaN stays NaN; a value beyond
    bfloat16's largest finite one may round to inf, as the carry into the exponent says.

    Args:
        x: float32 tensor of any shape.

    Returns:
        bfloat16 tensor of ``x``'s shape.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"round_to_bfloat16_stochastically takes float32, got {x.dtype}")
    noise = torch.randint(0, _LOW_BITS, x.shape, dtype=torch.int32, device=x.device)
    bits = (x.contiguous().view(torch.int32) + noise).bitwise_and_(_HIGH_BITS_MASK)
    # The low bits are now zero, so this conversion is exact.
    rounded = bits.view(torch.float32).to(torch.bfloat16)
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), rounded)


def store_rounded(dst: torch.Tensor, value: torch.Tensor, *, stochastic: bool) -> None:
    """Write float32 ``value`` into ``dst`` (float32, bfloat16 or float16) in place: nothing
    to do when ``dst`` is ``value``, stochastically into bfloat16 when ``stochastic``, else
    rounded to nearest even."""
    if dst is value:
        return
    if stochastic and dst.dtype == torch.bfloat16:
        dst.copy_(round_to_bfloat16_stochastically(value))
    else:
        dst.copy_(value)
