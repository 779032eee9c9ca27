"""Whether ``torch._scaled_mm`` runs a GEMM on a device: a decision on facts, testable on CPU.

The device's facts (compute capability, the CUDA toolkit PyTorch was built with, its name)
are read at the edge (:func:`device_facts`, once per device and process) into a frozen
:class:`DeviceFacts`; :func:`hardware_support` decides from them, the operands'
granularities, dtypes and shapes, and the output dtype. The tests feed it made-up devices.

Only calls whose layout a test has proven against the emulation go to the hardware
(docs/numerics.md, "Hardware GEMMs"). The rest run emulated, for these reasons:

* the device: not CUDA; a PyTorch without ``torch.version.cuda`` (ROCm); a compute
  capability outside the family's; a CUDA toolkit older than the family's cuBLAS mode.
* rowwise scales: SM 12.x fails in cuBLAS (pytorch#192707); a float32 or float16 output
  runs only through cuBLAS on SM 9.0 with CUDA >= 12.9 (elsewhere PyTorch's CUTLASS
  ``f8f8bf16_rowwise`` kernel, which takes bfloat16 output only in the releases users have).
* blockwise: the 128x128 x 1x128 pair and float16 output have not run on the hardware.
* dtypes: cuBLAS multiplies no two ``float8_e5m2`` operands.
* shapes: ``torch._scaled_mm`` needs K and N multiples of 16 (K in stored bytes); block
  operands must tile their blocks; an empty GEMM (a zero dim) has nothing to gain.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...spec.granularities import GemmFamily
from ..tensor import QuantizedTensor

__all__ = ["DeviceFacts", "device_facts", "hardware_support", "auto_support", "unproven_reason", "UNPROVEN_LAYOUTS", "off_cuda_reason", "parse_cuda_version"]

SCALED_MM_MULTIPLE = 16  # torch._scaled_mm: K and N multiples of 16
CUBLAS_ROWWISE = ((9, 0), (12, 9))  # any rowwise output dtype: cuBLAS on SM 9.0, CUDA >= 12.9
ROWWISE_FAILS_MAJOR = 12  # SM 12.x: rowwise _scaled_mm fails with CUBLAS_STATUS_NOT_SUPPORTED
PROVEN_BLOCK_PAIRS = (("block1x128", "block128x128"), ("block1x128", "block1x128"))
PROVEN_BLOCK_OUT_DTYPES = (torch.bfloat16, torch.float32)

UNPROVEN_LAYOUTS = {
    GemmFamily.MXFP8: "MXFP8's swizzled E8M0 block scales",
    GemmFamily.NVFP4: "NVFP4's swizzled E4M3 block scales",
    GemmFamily.MXFP4: "MXFP4's swizzled E8M0 block scales",
}
"""The GEMM families whose hardware layout no GPU has run in the suite (issue 40): ``auto``
keeps them emulated on every GPU until one has (then delete the entry). The tensorwise,
rowwise and blockwise layouts ran on an H200 and are not here. ``backend="hardware"`` still
runs them where the device supports them, which is how the GPU suite proves one."""


@dataclass(frozen=True)
class DeviceFacts:
    """What the hardware GEMM decision needs to know about a device.

    Attributes:
        device_type: ``"cuda"``, ``"cpu"``, ...
        capability: CUDA compute capability ``(major, minor)``; ``None`` off CUDA.
        cuda_version: the CUDA toolkit PyTorch was built with, ``(major, minor)`` from
            ``torch.version.cuda`` (its cuBLAS decides the scale modes); ``None`` off CUDA
            and on ROCm builds.
        name: the device's name, for messages.
    """

    device_type: str
    capability: tuple[int, int] | None = None
    cuda_version: tuple[int, int] | None = None
    name: str = ""

    def describe(self) -> str:
        """``"NVIDIA H100 (SM 9.0, CUDA 12.8)"``."""
        major, minor = self.capability or (0, 0)
        cuda = "no CUDA" if self.cuda_version is None else "CUDA {}.{}".format(*self.cuda_version)
        return f"{self.name or self.device_type} (SM {major}.{minor}, {cuda})"


def parse_cuda_version(text: str | None) -> tuple[int, int] | None:
    """``(major, minor)`` of a ``torch.version.cuda`` string such as ``"12.8"``; ``None``
    for ``None`` (a CPU or ROCm build)."""
    if not text:
        return None
    major, minor = (text.split(".") + ["0"])[:2]
    return int(major), int(minor)


def _read_cuda_facts(index: int) -> DeviceFacts:
    # get_device_properties is one of the functions torch.compile folds to a constant.
    properties = torch.cuda.get_device_properties(index)
    return DeviceFacts(
        device_type="cuda",
        capability=(properties.major, properties.minor),
        cuda_version=parse_cuda_version(torch.version.cuda),
        name=properties.name,
    )


_cached_cuda_facts = functools.cache(_read_cuda_facts)

_CPU_FACTS = DeviceFacts(device_type="cpu")


def device_facts(device: torch.device) -> DeviceFacts:
    """The facts of ``device``, read once per CUDA device and process (while
    ``torch.compile`` traces, read into the graph as constants, without the cache)."""
    if device.type == "cpu":
        return _CPU_FACTS  # one frozen value, not one per GEMM
    if device.type != "cuda":
        return DeviceFacts(device_type=device.type)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.compiler.is_compiling():
        return _read_cuda_facts(index)
    return _cached_cuda_facts(index)


@functools.cache
def off_cuda_reason(family: GemmFamily, fp4: bool, device_type: str) -> str:
    """Why no GEMM of ``family`` runs on the hardware of a ``device_type`` other than CUDA
    (built once per family and device type, not per GEMM)."""
    what = f"{family.label} {'4-bit' if fp4 else 'FP8'} GEMMs"
    return f"{what} need a CUDA device with {family.needs}; the operands are on {device_type}"


def hardware_support(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, facts: DeviceFacts
) -> tuple[bool, str]:
    """Whether ``torch._scaled_mm`` runs ``a @ b^T`` as ``out_dtype`` on the device of
    ``facts`` with a proven layout, and if not, why (the empty string when it does).

    Raises:
        NotImplementedError: operands of different GEMM families.
    """
    family = GemmFamily.of(a.granularity, b.granularity)
    if facts.device_type != "cuda":
        # Traced, the cache's wrapper would make Dynamo warn; the string is built at trace time anyway.
        reason = off_cuda_reason.__wrapped__ if torch.compiler.is_compiling() else off_cuda_reason
        return False, reason(family, a.granularity.fp4, facts.device_type)
    what = f"{family.label} {'4-bit' if a.granularity.fp4 else 'FP8'} GEMMs"
    for rule in (_device_reason, _scale_mode_reason, _dtype_reason, _shape_reason):
        reason = rule(a, b, out_dtype, facts, family, what)
        if reason:
            return False, reason
    return True, ""


def auto_support(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, facts: DeviceFacts
) -> tuple[bool, str]:
    """What ``backend="auto"`` runs: :func:`hardware_support`'s answer, except that a family
    of :data:`UNPROVEN_LAYOUTS` stays emulated (:func:`unproven_reason`) where the device would run it."""
    supported, reason = hardware_support(a, b, out_dtype, facts)
    unproven = unproven_reason(a.granularity.family, facts) if supported else ""
    return (False, unproven) if unproven else (supported, reason)


def unproven_reason(family: GemmFamily, facts: DeviceFacts) -> str:
    """Why ``auto`` keeps ``family``'s GEMMs emulated on a device that runs them (its layout
    has not run on a GPU in the suite); the empty string for a proven family."""
    what = UNPROVEN_LAYOUTS.get(family)
    if what is None:
        return ""
    return f"{what} have not run on a GPU in fp8train's suite; backend='hardware' runs them on {facts.describe()}"


def _device_reason(a, b, out_dtype, facts: DeviceFacts, family: GemmFamily, what: str) -> str:
    if facts.cuda_version is None:
        return f"{what} run on NVIDIA CUDA builds of PyTorch only; {facts.describe()} has no torch.version.cuda (ROCm?)"
    if not family.supports(facts.capability):
        return f"{what} need {family.needs}; {facts.describe()} is not one"
    if family.min_cuda is not None and facts.cuda_version < family.min_cuda:
        return (
            f"{what} need {family.needs}; {facts.describe()} has an older cuBLAS. "
            "Install a PyTorch built with a newer CUDA"
        )
    return ""


def _scale_mode_reason(a, b, out_dtype, facts: DeviceFacts, family: GemmFamily, what: str) -> str:
    out = str(out_dtype).removeprefix("torch.")
    rowwise = family is GemmFamily.TENSORWISE_ROWWISE and not (a.granularity.per_tensor and b.granularity.per_tensor)
    if rowwise and facts.capability[0] == ROWWISE_FAILS_MAJOR:
        return f"rowwise FP8 GEMMs fail in cuBLAS on SM 12.x (pytorch#192707); {facts.describe()}"
    capability, cuda = CUBLAS_ROWWISE
    if rowwise and out_dtype != torch.bfloat16 and (facts.capability != capability or facts.cuda_version < cuda):
        return (
            f"rowwise FP8 GEMMs with {out} output run only through cuBLAS on SM 9.0 with CUDA >= 12.9 "
            f"(elsewhere PyTorch's CUTLASS kernel takes bfloat16 output only); {facts.describe()}. "
            "A bfloat16 model or autocast to bfloat16 runs them on the hardware"
        )
    if family is GemmFamily.BLOCKWISE:
        pair = (str(a.granularity), str(b.granularity))
        if pair not in PROVEN_BLOCK_PAIRS:
            proven = ", ".join(" x ".join(p) for p in PROVEN_BLOCK_PAIRS)
            return f"the blockwise pair {' x '.join(pair)} has not been proven on the hardware (proven: {proven})"
        if out_dtype not in PROVEN_BLOCK_OUT_DTYPES:
            return (
                f"blockwise FP8 GEMMs with {out} output have not been proven on the hardware "
                "(bfloat16 and float32 have)"
            )
    return ""


def _dtype_reason(a, b, out_dtype, facts, family, what: str) -> str:
    if a.data.dtype == b.data.dtype == torch.float8_e5m2:
        return "cuBLAS multiplies no two float8_e5m2 operands"
    return ""


def _shape_reason(a, b, out_dtype, facts, family, what: str) -> str:
    m, k_bytes = a.data.shape
    n = b.data.shape[0]
    if 0 in (m, k_bytes, n):
        return f"an empty GEMM (M={m}, K={k_bytes}, N={n}) needs no tensor cores"
    if k_bytes % SCALED_MM_MULTIPLE or n % SCALED_MM_MULTIPLE:
        return (
            f"torch._scaled_mm needs K and N to be multiples of {SCALED_MM_MULTIPLE} (K in stored bytes); "
            f"this GEMM is M={m}, K={k_bytes}, N={n}. Pad the layer's dims, or leave it unconverted"
        )
    for name, operand in (("a", a), ("b", b)):
        rows, k = operand.unpacked_shape_2d
        along, across = operand.granularity.along, operand.granularity.across
        if (along and k % along) or (across and across > 1 and rows % across):
            return f"{name} ({operand.granularity}, {rows} x {k}) does not tile its scaling blocks"
    return ""
