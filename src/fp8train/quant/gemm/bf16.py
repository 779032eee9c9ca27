"""bfloat16 GEMMs at float32 speed on a CPU without native bf16, with bf16's numerics.

A native bf16 GEMM (AVX512-BF16, AMX, every GPU) takes bfloat16 operands, accumulates in
float32 and rounds the result once to bfloat16. A CPU without native bf16 (AVX2 only: most
laptops, many cloud CPUs) runs the same GEMM through a slow fallback, 5-25x slower than a
float32 GEMM of the same shape. Here the GEMM is computed as it is defined: the bfloat16
operands upcast to float32 (exactly), a float32 GEMM, one rounding to bfloat16. The result
equals the native one up to float32 accumulation order (``tests/quant/gemm/test_bf16.py``
pins where it is bit-equal), and the backward, through the casts' own autograd, is the same:
each gradient GEMM takes bfloat16 operands and rounds its float32 result once to bfloat16.

Where it applies is one value decided at the edge (:func:`bf16_via_float32`, from
:data:`NATIVE_BF16_GEMM` read once at import): CPUs with native bf16 and GPUs keep torch's
own bf16 GEMMs, the same bits at the same speed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "NATIVE_BF16_GEMM", "Bf16MatmulsViaFloat32", "bf16_matmul_line", "bf16_matmuls_via_float32",
    "bf16_via_float32", "cpu_has_native_bf16", "matmul_bf16_via_float32", "matmul_via_float32_active",
]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU's bf16 GEMMs run natively: what oneDNN, which runs them, reports (it
    follows ``ONEDNN_MAX_CPU_ISA``, so a capped ISA reads as the CPU it imitates). A build
    without the probe counts as native: nothing changes there."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return True if probe is None else bool(probe())


NATIVE_BF16_GEMM = cpu_has_native_bf16()
"""This CPU multiplies bfloat16 natively, read once at import (the edge passes it down)."""


def bf16_via_float32(device_type: str, native_bf16: bool) -> bool:
    """Whether bf16 GEMMs on ``device_type`` run as float32 GEMMs of their bfloat16 operands,
    rounded once: on a CPU without native bf16 (``native_bf16``: :data:`NATIVE_BF16_GEMM`)."""
    return device_type == "cpu" and not native_bf16


def bf16_matmul_line(via_float32: bool) -> str:
    """One line for a report or a log: how bf16 matmuls ran, and why."""
    if via_float32:
        return (
            "this CPU has no native bf16: bf16 matmuls ran as float32 matmuls of bf16 operands, rounded once "
            "to bf16 (the same numerics as a native bf16 GEMM, at float32 speed)"
        )
    return "bf16 matmuls ran natively (this device multiplies bf16 in hardware)"


def matmul_bf16_via_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bfloat16 ``a`` and ``b``: a float32 GEMM, rounded once to bfloat16."""
    with torch.autocast(a.device.type, enabled=False):
        return torch.matmul(a.float(), b.float()).to(torch.bfloat16)


def _operand_dtype(*tensors) -> torch.dtype | None:
    """The dtype a matmul of ``tensors`` runs in: bf16 autocast's, or the tensors' own."""
    first = tensors[0]
    # Autocast casts every floating dtype but float64 (torch's ``is_eligible``).
    if torch.is_autocast_enabled("cpu") and first.is_floating_point() and first.dtype != torch.float64:
        return torch.get_autocast_dtype("cpu")
    return first.dtype


def _linear(input, weight, bias=None):
    args = [t.to(torch.bfloat16).float() if t is not None else None for t in (input, weight, bias)]
    with torch.autocast("cpu", enabled=False):
        return F.linear(*args).to(torch.bfloat16)


def _matmul(a, b):
    with torch.autocast("cpu", enabled=False):
        return torch.matmul(a.to(torch.bfloat16).float(), b.to(torch.bfloat16).float()).to(torch.bfloat16)


def _addmm(input, mat1, mat2, *, beta=1, alpha=1):
    args = [t.to(torch.bfloat16).float() for t in (input, mat1, mat2)]
    with torch.autocast("cpu", enabled=False):
        return torch.addmm(*args, beta=beta, alpha=alpha).to(torch.bfloat16)


# Each matmul's route, and the position of its first operand (addmm's input is its bias).
_MATMULS = {
    F.linear: (_linear, 0),
    torch.matmul: (_matmul, 0), torch.Tensor.matmul: (_matmul, 0), torch.Tensor.__matmul__: (_matmul, 0),
    torch.mm: (_matmul, 0), torch.Tensor.mm: (_matmul, 0), torch.bmm: (_matmul, 0), torch.Tensor.bmm: (_matmul, 0),
    torch.addmm: (_addmm, 1), torch.Tensor.addmm: (_addmm, 1),  # transformers' Conv1D (GPT-2)
}


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class Bf16MatmulsViaFloat32(TorchFunctionMode):
    """While active, every CPU matmul that runs in bfloat16 (under bf16 autocast, or of
    bfloat16 tensors, plain tensors or parameters) runs as a float32 matmul of its bfloat16
    operands, rounded once to bfloat16 (``F.linear``'s bias and ``addmm``'s input are added
    in the float32 accumulation, as a native bf16 GEMM adds them). Autograd follows the casts,
    so the backward's GEMMs take the same route whether or not the mode is active then. Every
    other call, and a matmul whose operands are passed by keyword, passes through untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        entry = _MATMULS.get(func)
        if entry is not None and _takes_the_route(entry[1], args, kwargs):
            return entry[0](*args, **kwargs)
        return func(*args, **kwargs)


def _takes_the_route(first: int, args: tuple, kwargs: dict) -> bool:
    """Whether a matmul whose operands are ``args[first]`` and ``args[first + 1]`` runs on the
    route: plain CPU tensors multiplied in bfloat16, no ``out=``. Tensor subclasses (a stored
    FP8 weight, a DTensor) keep their own matmul."""
    tensors = args[first:first + 2]
    if len(tensors) < 2 or kwargs.get("out") is not None or any(type(t) not in _PLAIN for t in args[:first + 2]):
        return False
    return all(t.device.type == "cpu" for t in tensors) and _operand_dtype(*tensors) == torch.bfloat16


def matmul_via_float32_active() -> bool:
    """Whether a :class:`Bf16MatmulsViaFloat32` is active (a forward decides its backward's
    bf16 GEMMs by it)."""
    # torch has no public reader of its mode stack (torch 2.10-2.14 have these two).
    if not torch._C._is_torch_function_mode_enabled():  # the common case, in one C call
        return False
    return any(isinstance(mode, Bf16MatmulsViaFloat32) for mode in torch.overrides._get_current_function_mode_stack())


def bf16_matmuls_via_float32(enabled: bool):
    """A context in which CPU bf16 matmuls run as :class:`Bf16MatmulsViaFloat32` says, where
    ``enabled`` (:func:`bf16_via_float32`); a null context otherwise."""
    return Bf16MatmulsViaFloat32() if enabled else contextlib.nullcontext()
