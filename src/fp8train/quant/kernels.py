"""Fused CPU quantization kernels, compiled by numba: bit-identical to the reference path.

:func:`fp8train.quant.quantize.quantize` is written in PyTorch ops, one pass over the data
per op; that is the reference, and it runs everywhere. On CPU these kernels do the same
arithmetic in one or two reads of the input: per scaling group, the amax (as the maximum
of the magnitude bits), the scale (NUMERICS.md section 2, or the E8M0 rule), and the
round-to-nearest-even saturating cast, computed from the float32 bits:

* normal FP8 values: add half an FP8 ulp minus one, plus the bit that breaks ties to even,
  and shift the float32 exponent and mantissa fields down;
* FP8 subnormals: add ``smallest subnormal * 2^23`` in float32, whose rounding puts the
  value on the FP8 subnormal grid (8 is the smallest normal's code, so the codes join);
* ``|v| >= max`` saturates; NaN becomes the positive NaN code. (NUMERICS.md leaves a NaN's
  sign open, and the reference's own depends on which PyTorch vector path ran.)

numba installs from wheels with pip (no compiler needed). Whether a tensor goes through the
kernels is decided here, once, by :func:`kernels_usable` (the settings of
:mod:`fp8train.quant.settings`, numba, the tensor); the rest of the library calls the
``try_*`` entry points, which return ``None`` where the reference path must run. The tests
hold every kernel to the reference on every granularity, axis, format, input dtype and input
class (zeros, subnormals, infinities, NaN, saturation, ties).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch

from ..spec.formats import FloatFormat
from ..spec.granularities import view_2d_shape
from ..spec.rule import QuantRule
from .cast import HIGH_PRECISION_DTYPES
from .scaling import FLOAT32_MAX
from .settings import KERNEL_ENV, quant_settings
from .tensor import QuantizedTensor

__all__ = [
    "kernels_usable",
    "try_quantize",
    "try_quantize_both",
    "try_tensor_amax",
    "try_operand_values",
    "quantize_groups",
    "quantize_both_usages",
    "quantize_tensor",
    "tensor_amax",
    "cast_with_scale",
    "scaled_fp8_values",
]

STRIPE_BYTES = 1 << 18
"""Bytes of input one task of the strided-group kernel covers, so its second read hits cache."""

_NUMPY_VIEW = {torch.bfloat16: torch.uint16, torch.float32: torch.uint32}
_LOCK = threading.Lock()  # one parallel launch at a time (numba's workqueue layer needs it)
_state = {"launched": False, "forked_after_launch": False}


def _after_fork_in_child() -> None:
    # numba's OpenMP layer aborts a forked child's first parallel launch if the parent had
    # launched one ("fork() called from a process already using GNU OpenMP"): such a child
    # quantizes on the reference path instead.
    _state["forked_after_launch"] = _state["launched"]


os.register_at_fork(after_in_child=_after_fork_in_child)


@functools.cache
def _compiled():
    """The compiled kernels, or ``None`` where numba cannot be imported."""
    try:
        from . import numba_kernels
    except ImportError:
        return None
    return numba_kernels


def kernels_usable(x: torch.Tensor) -> bool:
    """Whether ``x`` goes through these kernels: the one decision, which every ``try_*``
    entry point asks. Yes for a plain CPU tensor (not a subclass such as a DTensor, whose
    ops must dispatch), not empty, not traced, in a process that may launch them, where the
    settings allow it and numba imports.

    Raises:
        RuntimeError: the settings ask for ``numba`` and it cannot be imported.
    """
    if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.device.type != "cpu":
        return False
    if x.numel() == 0 or torch.compiler.is_compiling() or _state["forked_after_launch"]:
        return False
    choice = quant_settings().quantize_kernel
    if choice == "reference":
        return False
    if _compiled() is None:
        if choice == "numba":
            raise RuntimeError(
                f"quantize_kernel='numba' ({KERNEL_ENV}=numba, or use_quant_settings) but numba cannot be "
                f"imported; `pip install numba`, or unset {KERNEL_ENV}"
            )
        return False
    return True


def try_quantize(
    x: torch.Tensor, rule: QuantRule, axis: int, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(codes, scale_inv)`` of ``x`` quantized by ``rule`` along ``axis`` (``scale``: a
    precomputed per-tensor scale), as :func:`fp8train.quant.quantize.quantize`'s reference
    path computes them; ``None`` where the kernels do not apply. ``codes`` are uint8 of
    ``x``'s 2-D view; ``scale_inv`` as :func:`quantize_groups` (a float32 scalar tensor for
    a per-tensor rule). 4-bit rules: ``None`` (their kernel is :mod:`fp8train.quant.fp4_kernels`)."""
    if rule.granularity.fp4 or not kernels_usable(x):
        return None
    m, k = view_2d_shape(x.shape)
    x2d = x.reshape(m, k).contiguous()
    granularity = rule.granularity
    if granularity.per_tensor and scale is None:
        return quantize_tensor(x2d, rule)
    if granularity.per_tensor:
        scale = scale.to(dtype=torch.float32)
        return cast_with_scale(x2d, float(scale), rule.format), 1.0 / scale
    rows, cols = granularity.group_shape(axis, (m, k))
    return quantize_groups(x2d, rows, cols, rule)


def try_quantize_both(x: torch.Tensor, rule: QuantRule) -> tuple[tuple, tuple] | None:
    """Both usages of ``x`` (axis -1, then axis 0) from one read, as :func:`quantize_both_usages`;
    ``None`` where the kernels do not apply or no fused kernel takes ``rule`` (groups one
    value across: ``row``, ``block1x128``, ``mx``; none for 4-bit rules yet)."""
    granularity = rule.granularity
    if granularity.fp4 or granularity.symmetric or granularity.across != 1 or not kernels_usable(x):
        return None
    return quantize_both_usages(x.reshape(view_2d_shape(x.shape)).contiguous(), rule)


def try_tensor_amax(x: torch.Tensor) -> torch.Tensor | None:
    """``max |x|`` as a float32 scalar (as :func:`tensor_amax`), or ``None`` where the
    kernels do not apply (or do not read ``x``'s dtype)."""
    if x.dtype not in HIGH_PRECISION_DTYPES or not kernels_usable(x):
        return None
    return tensor_amax(x.detach().reshape(-1, x.shape[-1] if x.dim() else 1).contiguous())


def try_operand_values(qt: QuantizedTensor, power_2: bool, out_dtype: torch.dtype) -> torch.Tensor | None:
    """The emulated GEMM's operand of the 2-D ``qt`` as ``out_dtype``: its FP8 values times
    its scales where they are powers of two (``power_2``), else the bare values (as
    :func:`scaled_fp8_values`); ``None`` where the kernels do not apply (4-bit data too)."""
    if qt.granularity.fp4 or not kernels_usable(qt.data):
        return None
    rows, k = qt.data.shape
    group_rows, group_cols = qt.group_shape if power_2 else (rows, k)
    scale_inv = qt.scale_inv_float32() if power_2 else torch.ones(())
    scale_inv = scale_inv.reshape(rows // group_rows, k // group_cols)
    return scaled_fp8_values(qt.data, scale_inv, (group_rows, group_cols), out_dtype)


@functools.cache
def rule_scale_args(rule: QuantRule, x_dtype: torch.dtype) -> tuple:
    """How a group's amax becomes its scale under ``rule`` for an input of ``x_dtype``, as
    the kernels take it; computed once per rule and dtype. E8M0 groups store their biased
    exponent (as float32), the others ``1 / scale``."""
    granularity = rule.granularity
    kind = (1 if rule.mx_scale_rule == "ceil" else 2) if granularity.e8m0_scales else 0
    emax = int(float32_scalar(rule.fp8_max).view("uint32") >> 23) - 127
    # Block scales that overflow take the input dtype's largest value (NUMERICS.md).
    inf_scale_value = torch.finfo(x_dtype).max if granularity.block else FLOAT32_MAX
    return (
        kind,
        float32_scalar(rule.fp8_max),
        float32_scalar(1.0 / rule.fp8_max),
        emax,
        bool(rule.power_2_scales),
        float32_scalar(rule.amax_epsilon),
        float32_scalar(inf_scale_value),
    )


def float32_scalar(value: float):
    import numpy as np

    return np.float32(value)


@functools.cache
def cast_encoding(fmt: FloatFormat) -> tuple:
    """The cast's constants for ``fmt``: field shift, exponent rebias, the bits of the largest
    finite value and its code, the bits of the smallest normal, the subnormal rounding
    addend and its bits."""
    import numpy as np

    shift = 23 - fmt.mantissa_bits
    rebias = (127 - fmt.bias) << fmt.mantissa_bits
    max_bits = int(np.float32(fmt.max).view(np.uint32))
    max_code = ((max_bits >> shift) - rebias) & 0xFF
    min_normal_bits = int(np.float32(fmt.smallest_normal).view(np.uint32))
    magic = np.float32(fmt.smallest_subnormal * 2.0**23)
    return tuple(np.uint32(v) for v in (shift, rebias, max_bits, max_code, min_normal_bits)) + (
        magic,
        np.uint32(magic.view(np.uint32)),
    )


def numpy_view(t: torch.Tensor, bits: bool = False):
    """A NumPy array over contiguous ``t``'s memory; with ``bits``, a float input's
    memory as integers (the kernels read float16, bfloat16 and float32 as their bits).

    Not ``Tensor.numpy()``: that marks the storage non-resizable for good, and FSDP2 frees
    and restores an unsharded parameter's storage by resizing it.
    """
    import ctypes

    import numpy as np

    assert t.is_contiguous()
    dtype = np.dtype(str(_NUMPY_VIEW[t.dtype] if bits else t.dtype).removeprefix("torch."))
    buffer = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    buffer.tensor = t  # the array keeps the buffer alive, and the buffer the memory's owner
    return np.frombuffer(buffer, dtype=dtype).reshape(t.shape)


@contextlib.contextmanager
def launch_kernels():
    """The compiled kernels, held for one parallel launch with PyTorch's thread count.

    PyTorch's count is put back afterwards: numba's OpenMP threading layer, started by the
    first launch, sets the OpenMP thread count PyTorch shares to numba's (every core), which
    would silently undo a ``torch.set_num_threads(1)`` (or torchrun's ``OMP_NUM_THREADS=1``)
    and oversubscribe the cores from then on.
    """
    k = _compiled()
    with _LOCK:
        _state["launched"] = True
        threads = max(1, torch.get_num_threads())
        k.set_threads(threads)
        try:
            yield k
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)


def kernel_input(x2d: torch.Tensor) -> torch.Tensor:
    """``x2d`` as the kernels read it: bfloat16 and float32 as they are, float16 as float32
    (exact, and one compiled variant fewer per kernel: numba takes ~5 s to compile one)."""
    return x2d.to(torch.float32) if x2d.dtype == torch.float16 else x2d


def quantize_groups(
    x2d: torch.Tensor, rows: int, cols: int, rule: QuantRule
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the contiguous 2-D ``x2d`` (M, K) by ``rule`` with one scale per
    ``rows x cols`` group.

    Returns:
        ``(codes, scales)``: uint8 codes of shape (M, K), and float32 ``1 / scale`` (or uint8
        E8M0 exponents for E8M0 scales) of shape ``(M // rows, K // cols)``.
    """
    m, n = x2d.shape
    codes = torch.empty((m, n), dtype=torch.uint8)
    scales = torch.empty((m // rows, n // cols), dtype=torch.float32)  # E8M0: exponents, exact
    args = (numpy_view(kernel_input(x2d.detach()), bits=True), numpy_view(codes), numpy_view(scales))
    scale_args, encoding = rule_scale_args(rule, x2d.dtype), cast_encoding(rule.format)
    with launch_kernels() as k:
        if rows == 1:
            k.quantize_row_groups(*args, cols, scale_args, encoding)
        elif rows == m and cols == 1:
            k.quantize_column_groups(*args, 4 * torch.get_num_threads(), scale_args, encoding)
        else:
            width = _stripe_width(rows, cols, n, x2d.element_size())
            k.quantize_stripe_groups(*args, rows, cols, width, scale_args, encoding)
    return codes, _stored_scales(scales, rule)


def _stored_scales(scales: torch.Tensor, rule: QuantRule) -> torch.Tensor:
    """The kernels write every group's stored scale as float32 (one compiled variant per
    input dtype, not two): E8M0 exponents (integers 0-255) convert exactly to uint8."""
    return scales.to(torch.uint8) if rule.granularity.e8m0_scales else scales


def quantize_both_usages(
    x2d: torch.Tensor, rule: QuantRule
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Both usages of the contiguous ``x2d`` (M, K) by ``rule`` from one read: groups of
    1 x ``block`` (axis -1) and ``block`` x 1 (axis 0), ``block`` the granularity's length
    along the axis (``None`` for ``row``: whole rows, whole columns).

    Returns:
        ``((codes, scales) for axis -1, (codes, scales) for axis 0)``, as :func:`quantize_groups`.
    """
    block = rule.granularity.along
    m, n = x2d.shape
    scale_dtype = torch.float32  # see _stored_scales
    codes_last, codes_first = torch.empty((m, n), dtype=torch.uint8), torch.empty((m, n), dtype=torch.uint8)
    if block is None:
        scales_last, scales_first = torch.empty((m, 1), dtype=scale_dtype), torch.empty((1, n), dtype=scale_dtype)
    else:
        scales_last = torch.empty((m, n // block), dtype=scale_dtype)
        scales_first = torch.empty((m // block, n), dtype=scale_dtype)
    outputs = (codes_last, codes_first, scales_last, scales_first)
    args = (numpy_view(kernel_input(x2d.detach()), bits=True), *(numpy_view(t) for t in outputs))
    scale_args, encoding = rule_scale_args(rule, x2d.dtype), cast_encoding(rule.format)
    with launch_kernels() as k:
        if block is None:
            k.quantize_both_rows(*args, 4 * torch.get_num_threads(), scale_args, encoding)
        else:
            width = _stripe_width(block, block, n, x2d.element_size())
            k.quantize_both_blocks(*args, block, width, scale_args, encoding)
    return (codes_last, _stored_scales(scales_last, rule)), (codes_first, _stored_scales(scales_first, rule))


def scaled_fp8_values(
    data: torch.Tensor, scale_inv: torch.Tensor, group: tuple[int, int], out_dtype: torch.dtype
) -> torch.Tensor:
    """``value(data) * scale_inv`` per ``group`` (rows, cols) as ``out_dtype`` (bfloat16 or
    float32), in one pass: the emulated GEMM's operand, for power-of-two ``scale_inv``
    (float32, one per group, in ``data``'s orientation). A transposed ``data`` (a first-dim
    operand) is converted in memory order and comes back transposed.

    Equal, bit for bit, to ``fp8_to_hp(data, out_dtype) * scale_inv.to(out_dtype)`` per
    group (a NaN's sign aside).
    """
    if not data.is_contiguous() and data.t().is_contiguous():
        return scaled_fp8_values(data.t(), scale_inv.t(), group[::-1], out_dtype).t()
    data = data.contiguous()
    out = torch.empty(data.shape, dtype=out_dtype)
    scales = scale_inv.to(torch.float32).contiguous()
    with launch_kernels() as k:
        k.scaled_fp8_values(
            numpy_view(data.view(torch.uint8)),
            numpy_view(out, bits=out_dtype == torch.bfloat16),
            numpy_view(scales),
            group[0],
            group[1],
            data.dtype == torch.float8_e4m3fn,
        )
    return out


def _stripe_width(rows: int, cols: int, n: int, itemsize: int) -> int:
    """Columns per task of the strided-group kernel: a whole number of groups, about
    :data:`STRIPE_BYTES` of input, at least 16 columns (one vector) where there are that many."""
    width = max(16, STRIPE_BYTES // (rows * itemsize))
    width = max(cols, width // cols * cols)
    return min(width, n)


def quantize_tensor(x2d: torch.Tensor, rule: QuantRule) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for all of the contiguous 2-D ``x2d`` by the per-tensor ``rule``, in one
    kernel call (amax, scale, cast: two reads). Returns ``(codes, scale_inv)``,
    ``scale_inv`` a float32 scalar."""
    codes = torch.empty(x2d.shape, dtype=torch.uint8)
    source, scale_args = numpy_view(kernel_input(x2d.detach()), bits=True), rule_scale_args(rule, x2d.dtype)
    with launch_kernels() as k:
        _, stored = k.quantize_tensor(source, numpy_view(codes), scale_args, cast_encoding(rule.format))
    return codes, torch.tensor(float(stored), dtype=torch.float32)


def tensor_amax(x2d: torch.Tensor) -> torch.Tensor:
    """``max |x2d|`` as a float32 scalar tensor (NaN if any element is NaN), one read."""
    source = kernel_input(x2d.detach())
    with launch_kernels() as k:
        bits = k.max_magnitude(numpy_view(source, bits=True))
    return torch.tensor(int(bits), dtype=_NUMPY_VIEW[source.dtype]).view(source.dtype).to(torch.float32)


def cast_with_scale(x2d: torch.Tensor, scale: float, fmt: FloatFormat) -> torch.Tensor:
    """``cast_to_fp8(x2d * scale)`` as uint8 codes, the product rounded as float32 rounds it."""
    codes = torch.empty(x2d.shape, dtype=torch.uint8)
    with launch_kernels() as k:
        source = numpy_view(kernel_input(x2d.detach()), bits=True)
        k.cast_scaled(source, numpy_view(codes), float32_scalar(scale), cast_encoding(fmt))
    return codes
