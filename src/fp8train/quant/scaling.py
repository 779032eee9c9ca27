"""From amax to scale: the per-tensor/row/block rule, delayed scaling's history update, and
the E8M0 exponent of MXFP8.

The scale convention, defined once for the whole library::

    data = cast_to_fp8(x * scale)        x ~= data * scale_inv,   scale_inv = 1 / scale

``scale`` and ``scale_inv`` are float32, except MXFP8 whose ``scale_inv`` is a power of
two stored as E8M0.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Union

import torch

from ..spec.checks import check_bool, check_int, check_number
from .cast import check_tensor, e8m0_to_float32, exp2_int
from .constants import ConstantMemo, device_constant

__all__ = [
    "amax_to_scale",
    "delayed_scaling_update",
    "update_scale_and_history",
    "floor_to_power_of_2",
    "mx_scale_exponent",
    "exp2_int",
    "e8m0_to_float32",
    "nvfp4_global_scales",
    "nvfp4_block_scales",
    "ceil_e8m0_exponent",
    "ScaleConstants",
    "SCALE_CONSTANTS",
]

FLOAT32_MAX = torch.finfo(torch.float32).max
_EXPONENT_MASK = 0x7F800000
_MANTISSA_MASK = 0x007FFFFF
_HALF_MANTISSA = 0x00400000  # mantissa bits of 2^-127 as a float32 subnormal
_EXACT_IN_FLOAT32 = (torch.float32, torch.bfloat16, torch.float16)


def floor_to_power_of_2(scale: torch.Tensor) -> torch.Tensor:
    """Zero the mantissa bits of float32 ``scale``, keeping sign and exponent.

    For a positive normal value this is ``2**floor(log2(scale))``. Subnormal values become 0.
    """
    bits = scale.to(torch.float32).view(torch.int32)
    # 0xFF800000 as a signed int32: keep sign and exponent.
    return (bits & -0x800000).view(torch.float32)


def amax_to_scale(
    amax: torch.Tensor,
    fp8_max: float,
    *,
    power_2_scales: bool = False,
    amax_epsilon: float = 0.0,
    inf_scale_value: float = FLOAT32_MAX,
    divide_in: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Compute the float32 scale(s) that map ``amax`` onto ``fp8_max``.

    Elementwise over ``amax`` (one value per tensor, row or block)::

        amax = max(amax, amax_epsilon)
        scale = 1                       if amax == 0, inf or NaN
        scale = fp8_max / amax          otherwise (float32)
        scale = inf_scale_value         if that overflowed to inf
        scale = 2**floor(log2(scale))   if power_2_scales

    Args:
        amax: float tensor of any shape (taken as float32: bfloat16 and float16 exactly).
        fp8_max: largest finite value of the target format (448 for E4M3, 57344 for E5M2).
        power_2_scales: round every scale down to a power of two.
        amax_epsilon: lower bound applied to ``amax`` first.
        inf_scale_value: replacement for a scale that overflows (largest finite float32;
            block recipes pass the largest finite value of the input's dtype).
        divide_in: the dtype the quotient is computed in before its rounding to float32:
            ``torch.float32`` (PyTorch's division, correctly rounded), or
            ``torch.float64``, which gives the same bits (a float64 quotient of float32
            operands rounds to the correctly rounded float32 one) where float32 division
            is not correctly rounded (Triton's, inside a compiled kernel).

    Returns:
        float32 tensor of the shape of ``amax``.
    """
    if not torch.compiler.is_compiling():  # traced (the GPU quantizer's kernel): checked by its caller
        _check_scale_arguments(amax, fp8_max, power_2_scales, amax_epsilon, inf_scale_value)
    return checked_amax_to_scale(amax, fp8_max, power_2_scales, amax_epsilon, inf_scale_value, divide_in)


def checked_amax_to_scale(
    amax: torch.Tensor,
    fp8_max: float,
    power_2_scales: bool,
    amax_epsilon: float,
    inf_scale_value: float,
    divide_in: torch.dtype = torch.float32,
    numerator: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`amax_to_scale` for arguments already checked (a quantization's, from its checked
    rule and its own amax): the same bits, without the ~17 calls of the checks (issue 38).
    ``numerator``: ``fp8_max`` as a float32 tensor of one element and at least one dim on
    ``amax``'s device, built once (:data:`SCALE_CONSTANTS`), for a caller that takes the
    scales in the broadcast shape (a quantization's); ``None`` builds it in ``amax``'s shape."""
    if amax.dtype not in _EXACT_IN_FLOAT32 or amax_epsilon > 0:
        amax = amax.to(torch.float32)
    if amax_epsilon > 0:
        amax = amax.clamp(min=amax_epsilon)  # NaN stays NaN, as max(NaN, eps) should
    # Four ops, each a GPU launch on a one-element tensor for tensorwise (issue 31). A 16-bit
    # amax is promoted exactly, so the float32 arithmetic is the same without converting it
    # (a numerator with a dim is float32 in the promotion, also beside a 0-dim amax).
    if divide_in != torch.float32:
        scale = (torch.full_like(amax, fp8_max, dtype=divide_in) / amax.to(divide_in)).to(torch.float32)
    elif numerator is None:
        scale = torch.full_like(amax, fp8_max, dtype=torch.float32) / amax
    else:
        scale = numerator / amax
    # amax / amax is NaN exactly where amax is 0, +-inf or NaN (unusable), else exactly 1: the
    # product is the quotient where usable (an overflow stays inf) and NaN where not, so one
    # nan_to_num gives both rules' values (issue 38: no mask, no masked_fill call).
    scale = (scale * (amax / amax)).nan_to_num(nan=1.0, posinf=inf_scale_value, neginf=inf_scale_value)
    if power_2_scales:  # floor_to_power_of_2 of a float32 scale
        scale = (scale.view(torch.int32) & -0x800000).view(torch.float32)
    return scale


def _check_scale_arguments(amax, fp8_max, power_2_scales, amax_epsilon, inf_scale_value) -> None:
    check_tensor("amax", amax)
    check_number("fp8_max", fp8_max, minimum=0, exclusive=True)
    check_bool("power_2_scales", power_2_scales)
    check_number("amax_epsilon", amax_epsilon, minimum=0)
    check_number("inf_scale_value", inf_scale_value, minimum=0, exclusive=True)


def delayed_scaling_update(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    fp8_max: Union[float, torch.Tensor],
    *,
    margin: int = 0,
    algo: Union[str, Callable[[torch.Tensor], torch.Tensor]] = "max",
) -> torch.Tensor:
    """Update delayed-scaling state in place after a step: rescale, then roll the history.

    ``amax_history[0]`` holds the amax recorded during the step (already all-reduced
    when amax reduction is on). For every tensor whose current amax is non-zero::

        amax = max(amax_history)  ("max") | amax_history[0]  ("most_recent") | algo(amax_history)
        scale = (fp8_max / amax) / 2**margin   if amax is finite and > 0, else unchanged
        (an infinite scale becomes the largest finite float32)
        amax_history = roll(amax_history, -1);  amax_history[0] = 0

    A tensor whose current amax is 0 (its module did not run on any rank) is neither
    rescaled nor rolled.

    Args:
        amax_history: float32 ``(L,)`` for one tensor, or ``(L, *S)`` for a batch of
            tensors; modified in place.
        scale: float32 of shape ``S`` (``()`` for one tensor); modified in place.
        fp8_max: largest finite value of each tensor's format, a float or a tensor
            broadcastable to ``S``.
        margin: the scale is divided by ``2**margin``.
        algo: ``"max"``, ``"most_recent"``, or a callable mapping ``amax_history`` to an
            amax of shape ``S``.

    Returns:
        ``scale`` (the same tensor, updated).

    Raises:
        ValueError: on mismatched shapes or an unknown ``algo``.
    """
    _check_delayed_state(amax_history, scale, fp8_max, margin)
    return update_scale_and_history(amax_history, scale, fp8_max, margin, algo)


def update_scale_and_history(
    amax_history: torch.Tensor, scale: torch.Tensor, fp8_max, margin: int, algo, by_out: bool = False
) -> torch.Tensor:
    """:func:`delayed_scaling_update` for arguments the caller built valid (the layer's own
    state, every step: issue 38), unchecked. ``by_out``: write the results by ``out=`` (two
    calls less), for an eager caller: ``torch.compile`` breaks its graph on an ``out=`` view
    that is not contiguous (a column of the state)."""
    amax = amax_history.amax(dim=0) if algo == "max" else _history_amax(amax_history, algo)
    ran = amax_history[0] != 0
    if type(fp8_max) is not torch.Tensor and not isinstance(fp8_max, torch.Tensor):
        fp8_max = device_constant(float(fp8_max), torch.float32, scale.device)
    if fp8_max.dtype != torch.float32 or fp8_max.device != scale.device:
        fp8_max = fp8_max.to(dtype=torch.float32, device=scale.device)
    new_scale = fp8_max / amax
    if margin:  # dividing by 2**0 changes no value: one launch fewer
        new_scale = new_scale / (2.0**margin)
    # One op for each step (GPU launches, issue 31). A NaN scale (a NaN amax) is not usable
    # and so never kept; 0 < amax < inf is isfinite(amax) & (amax > 0) without isfinite's four ops.
    new_scale = new_scale.nan_to_num(posinf=FLOAT32_MAX, neginf=FLOAT32_MAX)
    usable = ran & (amax > 0) & (amax < math.inf)
    # Where by_out, the results by out= (two calls less, issue 38), except into tensors in an
    # autograd graph (a public caller's), which copy_ writes as before.
    graph = not by_out or scale.requires_grad or amax_history.requires_grad
    kept = torch.where(usable, new_scale, scale, out=None if graph else scale)
    if graph:
        scale.copy_(kept)
    rolled = torch.roll(amax_history, -1, dims=0)
    rolled[0].zero_()  # (not by assignment: a tensor from Python data, a copy to the device)
    kept = torch.where(ran, rolled, amax_history, out=None if graph else amax_history)
    if graph:
        amax_history.copy_(kept)
    return scale


def _check_delayed_state(amax_history, scale, fp8_max, margin) -> None:
    check_tensor("amax_history", amax_history)
    check_tensor("scale", scale)
    check_int("margin", margin, minimum=0)
    if not isinstance(fp8_max, torch.Tensor):
        check_number("fp8_max", fp8_max, minimum=0, exclusive=True)
    if amax_history.dim() < 1 or amax_history.shape[1:] != scale.shape:
        raise ValueError(
            f"amax_history of shape {tuple(amax_history.shape)} does not match scale of shape "
            f"{tuple(scale.shape)}; expected amax_history.shape == (L, *scale.shape)"
        )


def _history_amax(amax_history: torch.Tensor, algo) -> torch.Tensor:
    """The amax a delayed-scaling update scales by, per tensor, as ``algo`` reads the history."""
    if algo == "max":
        return amax_history.amax(dim=0)
    if algo == "most_recent":
        return amax_history[0].clone()
    if callable(algo):
        return algo(amax_history).to(torch.float32)
    raise ValueError(f"algo={algo!r} must be 'max', 'most_recent' or a callable")


def mx_scale_exponent(amax: torch.Tensor, fp8_max: float, rule: str = "ceil") -> torch.Tensor:
    """Biased E8M0 exponent ``e`` of each MXFP8 block, as uint8 bits (``scale_inv = 2**(e-127)``).

    ``"ceil"`` (default)::

        t = amax * float32(1 / fp8_max)           (multiply by the reciprocal)
        e = exponent bits of t, + 1 if t's mantissa bits are non-zero
        a float32-subnormal t: e = 0 if its mantissa bits are <= 0x400000
            (t <= 2^-127), else 1   (the smallest power of two >= t)
        NaN -> 0xFF, inf -> 0xFE, t == 0 -> 0

    so ``e = ceil(log2(amax / fp8_max)) + 127`` and a block never saturates (the
    hardware's round-toward-+inf conversion, ``cvt.rp.satfinite.ue8m0x2.f32``).

    ``"ocp"``: the OCP MX spec's ``e = floor(log2(amax)) - emax + 127`` with ``emax`` the
    exponent of ``fp8_max`` (8 for E4M3, 15 for E5M2), clamped to ``[0, 254]``; values may
    saturate. NaN -> 0xFF, inf -> 0xFE, amax == 0 -> 0.

    Args:
        amax: float32 tensor of block amaxes (non-negative or NaN).
        fp8_max: largest finite value of the data format (at least 1, as every format's).
        rule: ``"ceil"`` or ``"ocp"``.

    Returns:
        uint8 tensor of the shape of ``amax``; ``.view(torch.float8_e8m0fnu)`` gives the scales.
    """
    amax = amax if amax.dtype == torch.float32 else amax.to(torch.float32)
    if rule == "ceil":
        reciprocal = device_constant(1.0 / fp8_max, torch.float32, None)  # a CPU scalar operand
        exponent = ceil_e8m0_exponent(amax * reciprocal)
    elif rule == "ocp":
        exponent = _ocp_e8m0_exponent(amax, fp8_max)
    else:
        raise ValueError(f"rule={rule!r} must be 'ceil' or 'ocp'")
    return exponent.to(torch.uint8)


def ceil_e8m0_exponent(t: torch.Tensor) -> torch.Tensor:
    """The ``"ceil"`` rule's biased E8M0 exponent of float32 ``t = amax * float32(1 / fp8_max)``
    (:func:`mx_scale_exponent`), as int32 in ``[0, 255]``: in operators only, no Python call
    but the bits' view (issue 38). ``t`` is inf or NaN exactly where ``amax`` is (``fp8_max >= 1``)."""
    bits = t.view(torch.int32)
    exponent = (bits & _EXPONENT_MASK) >> 23
    mantissa = bits & _MANTISSA_MASK
    # Round up to the smallest power of two >= t: a normal t with mantissa bits; a subnormal
    # t (exponent bits 0) past 2^-127 = E8M0's smallest value (mantissa above 0x400000).
    # t == 0 stays 0. The all-ones exponent (inf, NaN) counts as 254: inf -> 0xFE, NaN (its
    # mantissa bits, rounded up) -> 0xFF.
    round_up = (mantissa > _HALF_MANTISSA) | ((exponent != 0) & (mantissa != 0))
    return exponent - ((exponent + 1) >> 8) + round_up


def _ocp_e8m0_exponent(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """The ``"ocp"`` rule's biased E8M0 exponent of float32 ``amax`` (:func:`mx_scale_exponent`), int32."""
    emax = math.frexp(fp8_max)[1] - 1  # floor(log2(fp8_max)): fp8_max is a positive normal float32
    bits = amax.view(torch.int32)
    biased = (bits & _EXPONENT_MASK) >> 23
    # floor(log2) of a subnormal amax: position of its top mantissa bit.
    sub_mantissa = (bits & _MANTISSA_MASK).to(torch.float32)
    sub_exponent = torch.where(
        sub_mantissa > 0, torch.floor(torch.log2(sub_mantissa.clamp(min=1))) - 149, 0.0
    ).to(torch.int32)
    floor_log2 = torch.where(biased > 0, biased - 127, sub_exponent)
    exponent = (floor_log2 - emax + 127).clamp(0, 254)
    exponent = torch.where(amax == 0, torch.zeros_like(exponent), exponent)
    exponent = torch.where(torch.isinf(amax), torch.full_like(exponent, 0xFE), exponent)
    return torch.where(torch.isnan(amax), torch.full_like(exponent, 0xFF), exponent)


class ScaleConstants(NamedTuple):
    """The constant tensors of the scale rules for one format maximum on one device, built
    once (:data:`SCALE_CONSTANTS`): a quantization looks them up instead of building them
    (issue 38: each ``full_like`` or ``device_constant`` is a call, on a GPU a launch).

    Attributes:
        fp8_max: the format's largest finite value.
        numerator: ``fp8_max`` as float32 ``[1]`` on the device (amax -> scale's dividend).
        mx_reciprocal: ``float32(1 / fp8_max)``, a 0-dim CPU scalar operand (the E8M0 rule's ``t``).
        float32_max: the largest float32, 0-dim on the device.
        nvfp4_range: NVFP4's ``2688``, 0-dim on the device.
        sixth: ``float32(1 / 6)``, a 0-dim CPU scalar operand.
    """

    fp8_max: float
    numerator: torch.Tensor
    mx_reciprocal: torch.Tensor
    float32_max: torch.Tensor
    nvfp4_range: torch.Tensor
    sixth: torch.Tensor


def _build_scale_constants(fp8_max: float, device: torch.device) -> ScaleConstants:
    return ScaleConstants(
        fp8_max=fp8_max,
        numerator=device_constant((fp8_max,), torch.float32, device),
        mx_reciprocal=device_constant(1.0 / fp8_max, torch.float32, None),
        float32_max=device_constant(FLOAT32_MAX, torch.float32, device),
        nvfp4_range=device_constant(NVFP4_GLOBAL_RANGE, torch.float32, device),
        sixth=device_constant(1.0 / 6.0, torch.float32, None),
    )


SCALE_CONSTANTS = ConstantMemo(_build_scale_constants)
"""``SCALE_CONSTANTS[fp8_max, device]``: the :class:`ScaleConstants` of a format maximum on a
device (``SCALE_CONSTANTS.build(fp8_max, device)`` while ``torch.compile`` traces)."""


NVFP4_GLOBAL_RANGE = 2688.0
"""``448 * 6``: E4M3's largest block scale times E2M1's largest value (NUMERICS.md 6)."""


def nvfp4_global_scales(
    global_amax: torch.Tensor, constants: ScaleConstants | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's float32 global encode and decode scales ``(ge, gd)`` from a tensor's amax::

        ge = min(2688 / global_amax, FLT_MAX);  if ge == 0: ge = 1;   gd = 1 / ge

    ``min`` propagates NaN (a NaN amax gives NaN scales). ``ge == 0`` is an infinite amax.
    ``constants``: :data:`SCALE_CONSTANTS` on ``global_amax``'s device, where the caller has them.
    """
    global_amax = global_amax if global_amax.dtype == torch.float32 else global_amax.to(torch.float32)
    if constants is None:
        largest = torch.full_like(global_amax, FLOAT32_MAX)
        ge = torch.minimum(torch.full_like(global_amax, NVFP4_GLOBAL_RANGE) / global_amax, largest)
    else:
        ge = torch.minimum(constants.nvfp4_range / global_amax, constants.float32_max)
    ge = ge.masked_fill(ge == 0, 1.0)
    return ge, torch.reciprocal(ge)  # 1 / ge: PyTorch's 1.0 / t is reciprocal(t) * 1.0


def nvfp4_block_scales(
    group_amax: torch.Tensor, global_amax: torch.Tensor, constants: ScaleConstants | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's per-block ``(dec, enc)`` from the blocks' float32 amax and the tensor's::

        m   = ge * float32(1/6)
        dec = e4m3(clamp(min(group_amax * m, FLT_MAX), -448, 448))     (RNE cast to E4M3)
        enc = min(1 / (float32(dec) * gd), FLT_MAX)

    so that ``code = cast_e2m1(clamp(x * enc, -6, 6))`` and ``x ~= (e2m1(code) * dec) * gd``.
    ``constants``: :data:`SCALE_CONSTANTS` on the tensors' device, where the caller has them.

    Returns:
        ``dec`` as ``float8_e4m3fn`` (the stored ``scale_inv``) and ``enc`` as float32, both
        of ``group_amax``'s shape.
    """
    ge, gd = nvfp4_global_scales(global_amax, constants)
    if constants is None:
        sixth = device_constant(1.0 / 6.0, torch.float32, None)  # a CPU scalar operand
        largest = device_constant(FLOAT32_MAX, torch.float32, group_amax.device)
    else:
        sixth, largest = constants.sixth, constants.float32_max
    group_amax = group_amax if group_amax.dtype == torch.float32 else group_amax.to(torch.float32)
    # min(v, FLT_MAX) stays, though the clamp would lower +inf too: PyTorch's vectorized
    # minimum returns a NaN of its own (all bits set), and a NaN's sign picks its E4M3 code.
    dec = torch.minimum(group_amax * (ge * sixth), largest).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    enc = torch.minimum(torch.reciprocal(dec.to(torch.float32) * gd), largest)
    return dec, enc
