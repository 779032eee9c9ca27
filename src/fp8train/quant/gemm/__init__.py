"""Scaled FP8 GEMMs: ``out = dequant(a) @ dequant(b)^T``, emulated on any device
(:mod:`fp8train.quant.gemm.emulated`) or on FP8 hardware through ``torch._scaled_mm``
(:mod:`fp8train.quant.gemm.hardware`).

Both operands are in "K-last" orientation: ``a`` is ``[M, K]``, ``b`` is ``[N, K]``, and any
per-group scales run along K (``axis=-1``). Use :func:`~fp8train.quant.tensor.transpose`
to feed a tensor quantized along its first dim (``axis=0``) as the K-last operand of a
grad GEMM.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch

from ...spec.checks import UnsupportedHardwareError, check_type
from ...spec.granularities import GemmFamily, Granularity, check_gemm_operands
from ..cast import HIGH_PRECISION_DTYPES, check_tensor
from ...log_once import OnceLogger
from ..tensor import QuantizedTensor
from ..kernels.launch import kernels_enabled
from .emulated import emulated_gemm_dtype, emulated_mm
from .hardware import hardware_mm
from .hardware_support import device_facts, hardware_support, off_cuda_reason, unproven_reason

__all__ = ["BACKENDS", "scaled_mm", "bound_scaled_mm", "checked_scaled_mm", "hardware_support", "backend_log"]

BACKENDS = ("auto", "emulated", "hardware")

backend_log = OnceLogger(__name__)
"""Says once per process which backend runs each GEMM family on each device."""


def _check_operands(a: QuantizedTensor, b: QuantizedTensor, bias: torch.Tensor | None) -> GemmFamily:
    """The GEMM family of valid operands (type tests first: they cost no call when they pass)."""
    if type(a) is not QuantizedTensor or type(b) is not QuantizedTensor:
        for name, qt in (("a", a), ("b", b)):
            check_type(name, qt, QuantizedTensor, "a QuantizedTensor (from fp8train.quant.quantize)")
    # The family first: 4-bit data is packed, so a mixed pair's K would compare wrongly.
    family = GemmFamily.of(a.granularity, b.granularity)
    if bias is not None and not isinstance(bias, torch.Tensor):
        check_tensor("bias", bias)
    check_gemm_operands(a, b, None if bias is None else bias.shape, "a tensor")
    return family


@functools.cache
def _backend_message(
    family: GemmFamily, device_type: str, gemm_dtype: torch.dtype, use_hardware: bool, reason: str
) -> str:
    """The backend log's line, built once per distinct choice (not per GEMM)."""
    gemm = str(gemm_dtype).removeprefix("torch.")
    where = "hardware (torch._scaled_mm)" if use_hardware else f"emulated ({reason}; exact GEMMs in {gemm})"
    return f"fp8train: {family.label} GEMMs on {device_type} run {where}"


def scaled_mm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str = "auto",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b)^T (+ bias)`` as ``out_dtype``.

    Args:
        a: ``[M, K]`` operand, scaling groups along K (``axis=-1``) where it matters (4-bit:
            data ``[M, K/2]``, packed along K).
        b: ``[N, K]`` operand, likewise; of ``a``'s family (two NVFP4 operands, ``nvfp4``
            or ``nvfp4_2d``, or two MXFP4 ones).
        out_dtype: float32, bfloat16 or float16.
        backend: ``"emulated"`` (any device), ``"hardware"`` (``torch._scaled_mm`` on a
            CUDA device that supports the recipe, for GEMMs whose layout is proven: see
            :func:`~fp8train.quant.gemm.hardware_support.hardware_support`) or ``"auto"``
            (hardware where supported, else emulated; the choice and its reason are logged
            once, by an eager call: not while ``torch.compile`` traces).
        bias: optional ``[N]`` tensor added to the output.

    Returns:
        ``[M, N]`` tensor of ``out_dtype``.

    Raises:
        ValueError: mismatched shapes, operands not K-last, bad dtype or backend.
        NotImplementedError: operands of different recipe families (FP8 with 4-bit, NVFP4
            with MXFP4, ...).
        UnsupportedHardwareError: ``backend="hardware"`` for a GEMM the device does not run
            on the hardware (the message says why; ``backend="emulated"`` or ``"auto"`` runs it).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {', '.join(BACKENDS)}")
    if out_dtype not in HIGH_PRECISION_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} must be float32, bfloat16 or float16")
    use_hardware, gemm_dtype = _decide(a, b, out_dtype, backend, _check_operands(a, b, bias))
    if use_hardware:
        return hardware_mm(a, b, out_dtype, bias)
    return emulated_mm(a, b, out_dtype, bias, gemm_dtype)


def _hardware_refusal(reason: str) -> UnsupportedHardwareError:
    return UnsupportedHardwareError(f"no FP8 GEMM on this device: {reason}. Use backend='emulated'")


def _decide(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, backend: str, family: GemmFamily
) -> tuple[bool, torch.dtype | None]:
    """``(use_hardware, gemm_dtype)`` for checked operands of ``family``: the hardware where
    the device runs the GEMM and ``backend`` allows it; the backend line logged under
    ``"auto"`` (``gemm_dtype``: the emulation's, where it was chosen for the line, else
    ``None``: ``emulated_mm`` picks it).

    Raises:
        UnsupportedHardwareError: ``backend="hardware"`` for a GEMM the device does not run.
    """
    device_type = a.data.device.type
    facts = device_facts(a.data.device)
    supported, reason = hardware_support(a, b, out_dtype, facts)
    if backend == "hardware" and not supported:
        raise _hardware_refusal(reason)
    if backend == "auto" and supported:  # a layout no GPU has run in the suite stays emulated
        unproven = unproven_reason(family, facts)
        supported, reason = (False, unproven) if unproven else (True, reason)
    use_hardware = supported and backend != "emulated"
    # Not while torch.compile traces: a logging call is a graph break in every GEMM (the
    # choice depends only on the device and the family, so the eager calls log it).
    gemm_dtype = None
    if backend == "auto" and not torch.compiler.is_compiling():
        gemm_dtype = emulated_gemm_dtype(device_type)
        backend_log.info(_backend_message(family, device_type, gemm_dtype, use_hardware, reason))
    return use_hardware, gemm_dtype


def bound_scaled_mm(
    backend: str, device_type: str, operand_pairs: Iterable[tuple[Granularity, Granularity]] = ()
) -> Callable[..., torch.Tensor]:
    """:func:`scaled_mm` with ``backend``, for the operands of a layer that has checked its
    tensors once per call (plain, non-empty, of ``device_type``, outside ``torch.compile``),
    its choices made once under the current settings: ``mm(a, b, out_dtype, bias=None,
    rows=None, depth=None)``, ``rows`` and ``depth`` the extent of the operands that holds
    data (:func:`~.emulated.emulated_mm`; a hint: the output may have more rows).

    Off CUDA every GEMM is emulated, so the bound function is the emulation itself, with
    its GEMM dtype and the CPU kernels chosen here; the backend line of each GEMM family in
    ``operand_pairs`` (the layer's ``(a, b)`` granularities) is logged here, as
    :func:`scaled_mm` logs it at its first GEMM. On CUDA the hardware's support depends on
    each GEMM's layouts and shapes: there it is a :class:`BoundCudaGemm`, which decides once
    per distinct operand layout.

    Raises:
        ValueError: an unknown ``backend``.
        UnsupportedHardwareError: ``backend="hardware"`` off CUDA.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {', '.join(BACKENDS)}")
    if device_type == "cuda":
        return BoundCudaGemm(backend)
    pairs = list(operand_pairs)
    families = {GemmFamily.of(a, b): a.fp4 for a, b in pairs}
    if backend == "hardware" and families:
        family, fp4 = next(iter(families.items()))
        raise _hardware_refusal(off_cuda_reason(family, fp4, device_type))
    gemm_dtype = emulated_gemm_dtype(device_type)
    if backend == "auto":
        for family, fp4 in families.items():
            reason = off_cuda_reason(family, fp4, device_type)
            backend_log.info(_backend_message(family, device_type, gemm_dtype, False, reason))
    kernels = device_type == "cpu" and kernels_enabled()
    return functools.partial(emulated_mm, gemm_dtype=gemm_dtype, kernels=kernels)


def checked_scaled_mm(backend: str) -> Callable[..., torch.Tensor]:
    """:func:`scaled_mm` with ``backend`` for a layer's checked kernels (any tensor, any
    trace), called as :func:`bound_scaled_mm`'s: ``mm(a, b, out_dtype, bias=None, rows=None,
    depth=None)``. It multiplies the whole operands: the extent hint is the bound emulation's."""
    return functools.partial(_whole_scaled_mm, backend=backend)


def _whole_scaled_mm(a, b, out_dtype, bias=None, rows=None, depth=None, *, backend: str) -> torch.Tensor:
    return scaled_mm(a, b, out_dtype, backend=backend, bias=bias)


class BoundCudaGemm:
    """:func:`scaled_mm` with ``backend`` on CUDA for checked operands, its decision (hardware
    or emulated, and why) made once per distinct operand layout: granularities, dtypes,
    shapes, output dtype and device (a model has a handful), then a dictionary lookup.
    What it decides, logs and raises is :func:`scaled_mm`'s."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._hardware: dict[tuple, bool] = {}

    def __call__(
        self, a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias=None, rows=None, depth=None
    ) -> torch.Tensor:
        """``rows`` and ``depth``: the emulation's extent (:func:`~.emulated.emulated_mm`); the
        hardware multiplies the whole operands (its padding costs the GPU little), so its output
        may have more rows than ``rows``."""
        a_data, b_data = a.data, b.data
        key = (a.granularity, b.granularity, a_data.dtype, b_data.dtype, a_data.shape, b_data.shape, out_dtype, a_data.device)
        use_hardware = self._hardware.get(key)
        if use_hardware is None:
            use_hardware = self._hardware[key] = self._decide(a, b, out_dtype)
        if use_hardware:
            return hardware_mm(a, b, out_dtype, bias)
        return emulated_mm(a, b, out_dtype, bias, emulated_gemm_dtype("cuda"), False, rows, depth)

    def _decide(self, a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> bool:
        """Whether this layout runs on the hardware, as :func:`scaled_mm` decides (and logs,
        and raises for ``backend="hardware"``) at its first GEMM of it."""
        return _decide(a, b, out_dtype, self.backend, _check_operands(a, b, None))[0]
