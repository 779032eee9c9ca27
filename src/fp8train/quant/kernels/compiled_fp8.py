"""The FP8 family's GPU quantizer: the reference's own arithmetic, fused by inductor.

The reference (:mod:`fp8train.quant.fp8_quantize`) in eager PyTorch launches a dozen kernels
per tensor and writes a float32 temporary of it; a GEMM then copies each first-dim operand
into the column-major layout ``torch._scaled_mm`` takes. Here the same functions
(:func:`~fp8train.quant.fp8_quantize.group_amax`,
:func:`~fp8train.quant.fp8_quantize.group_scales`, the scaled cast) run in one call compiled
by ``torch.compile`` (inductor): the groups' amaxes, their scales, and the codes of every
usage asked for, both usages from one read where the autograd wants both, each in the
layout its GEMM takes:

* the last-dim usage (``axis=-1``) row-major, as the reference;
* the first-dim usage (``axis=0``) column-major: ``data`` is the ``.t()`` view of a
  contiguous ``[K, M]`` tensor, so its transpose, the K-last operand, is contiguous and the
  GEMM copies nothing. (A tensor of rank > 2 keeps the reference's layout.)

The bits are the reference's. The divisions (``fp8_max / amax``, ``1 / scale``) run in
float64 and round once to float32: the correctly rounded float32 quotient, which PyTorch's
float32 division gives and Triton's ``/`` need not. The codes are
``cast(clamp(float32(x) * scale))``, the reference's product: exact conversion, one float32
rounding (the reference's bfloat16 product by a power-of-two scale is exact, so the same
value), saturation, then the device's round-to-nearest-even cast. The GPU suite
(``tests/gpu/test_quantize_kernel.py``, ``tests/gpu/test_linear.py``) holds the bytes to the
CPU's; ``tests/quant/kernels/test_compiled_fp8.py`` runs the same code through inductor's
CPU backend against the reference.

Each variant (rule, usages, layouts) is compiled for each input shape it meets, up to
:data:`SHAPES_COMPILED_EACH` of them (a model has a handful: a few seconds each, at its
first step), then once for any shape; each compiled function has its own dynamo cache.
Inside a graph ``torch.compile`` traces, the door leaves the tensor to the reference,
which that compile fuses itself.
"""

from __future__ import annotations

import functools
import types
import warnings
from dataclasses import dataclass

import torch

from ...spec.granularities import view_2d_shape
from ...spec.rule import QuantRule
from ..cast import torch_dtype
from ..fp8_quantize import fp8_tensor, group_amax, group_scales, reciprocal
from ..tensor import QuantizedTensor
from .settings import quant_settings

__all__ = [
    "SERVED_GRANULARITIES", "SHAPES_COMPILED_EACH", "CompiledKernel", "compiled_usable", "compiled_enabled", "quantize",
    "quantize_both", "quantize_usages", "operand_values",
]


SERVED_GRANULARITIES = frozenset({"tensor", "row", "block1x128", "block128x128", "mx"})
"""The granularities the door hands this quantizer: where it measured faster than the
reference (H200, bf16 16384 x 8192, both usages, kernels compiled for the shape: ``tensor``
0.45 ms against 2.07, ``row`` 0.53 against 1.45, ``block1x128`` 0.86 against 1.65,
``block128x128`` 0.69 against 1.87, ``mx`` 1.93 against 2.95). Compiled for any shape
(``dynamic=True``), the block and ``mx`` kernels were slower than the reference (2.0 to 3.7
ms), so each shape has its own."""


def compiled_usable(x: torch.Tensor) -> bool:
    """Whether the compiled quantizer takes ``x``: a plain tensor (not a subclass such as a
    DTensor, whose ops must dispatch), not empty, not being traced (the enclosing compile
    fuses the reference), where the settings do not ask for the reference."""
    if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.numel() == 0:
        return False
    return not torch.compiler.is_compiling() and compiled_enabled()


def compiled_enabled() -> bool:
    """Whether the compiled quantizer serves any tensor now: the settings do not ask for
    the reference (the part of :func:`compiled_usable` that does not look at the tensor)."""
    return quant_settings().quantize_kernel != "reference"


@dataclass(frozen=True)
class _Groups:
    """One usage's scaling groups on the 2-D view ``(M, K)``: ``rows`` x ``cols`` (``None``:
    the whole dim), and whether its codes are written column-major."""

    rows: int | None
    cols: int | None
    column_major: bool = False

    def view(self, x2d: torch.Tensor) -> torch.Tensor:
        m, k = x2d.shape
        rows, cols = self.rows or m, self.cols or k
        return x2d.reshape(m // rows, rows, k // cols, cols)


def _own_code(fn):
    """A copy of ``fn`` with its own code object. Dynamo keeps compiled graphs, and counts
    recompiles against its limit, per code object; each compiled function gets its own."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


SHAPES_COMPILED_EACH = 8
"""How many input shapes (and dtypes) a kernel variant compiles for alone; every further
one shares a kernel compiled for any shape. A model has a handful (measured faster, see
:data:`SERVED_GRANULARITIES`); inputs whose length changes at every step compile no more
than this many times, a few seconds each."""


class CompiledKernel:
    """One variant's compiled function, by the input's shape and dtype: its own compile for
    each of the first :data:`SHAPES_COMPILED_EACH`, then one for any shape (``options``:
    inductor's, for every compile of it; the 4-bit family's quantizer asks for some).

    A compile that fails (an inductor or Triton release that cannot lower an op) turns the
    variant off, the first one with a :class:`RuntimeWarning` naming the error: the
    reference quantizes instead, with the same bits, slower. Out-of-memory errors propagate.
    """

    warned = False  # class-wide: one warning per process

    def __init__(self, fn, options: dict | None = None) -> None:
        self._fn = fn
        self._options = options
        self._by_shape: dict = {}
        self._any_shape = None
        self.failed = False

    def __call__(self, x2d: torch.Tensor, *args):
        """The compiled function's outputs, or ``None`` where this variant failed to compile."""
        if self.failed:
            return None
        try:
            return self._compiled_for(x2d)(x2d, *args)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # noqa: BLE001 - the reference serves instead, said once
            self.failed = True
            if CompiledKernel.warned:
                return None
            CompiledKernel.warned = True
            warnings.warn(
                f"fp8train's fused GPU quantizer failed to compile ({type(error).__name__}: "
                f"{str(error)[:300]}); the reference PyTorch ops quantize these tensors instead (the "
                f"same bits, slower). Please report it; FP8TRAIN_QUANTIZE_KERNEL=reference chooses "
                f"the reference from the start.",
                RuntimeWarning,
                stacklevel=2,
            )
            return None

    def _compiled_for(self, x2d: torch.Tensor):
        key = (tuple(x2d.shape), x2d.dtype)
        compiled = self._by_shape.get(key)
        if compiled is None and len(self._by_shape) < SHAPES_COMPILED_EACH:
            compiled = self._by_shape[key] = self._compile(dynamic=False)
        if compiled is None:
            if self._any_shape is None:
                self._any_shape = self._compile(dynamic=True)
            compiled = self._any_shape
        return compiled

    def _compile(self, dynamic: bool):
        options = {} if self._options is None else {"options": self._options}
        return torch.compile(_own_code(self._fn), dynamic=dynamic, fullgraph=True, **options)


@functools.cache
def _quantize_kernel(usages: tuple[_Groups, ...], rule: QuantRule, given_scale: bool) -> CompiledKernel:
    """Every usage's ``(codes, scale_inv)`` of a 2-D tensor by ``rule``, in one compiled
    function: the groups' amaxes, their scales (or the given per-tensor scale), the codes.
    A symmetric granularity's usages share their groups, so their amaxes and scales."""
    shared = rule.granularity.symmetric
    dtype, fp8_max = torch_dtype(rule.format), float(rule.fp8_max)

    def quantize(x2d: torch.Tensor, scale: torch.Tensor | None):
        if given_scale:
            scale = scale.to(torch.float32).reshape(1, 1, 1, 1)
            scales = [(scale, reciprocal(scale, torch.float64))] * len(usages)
        else:
            amaxes = [group_amax(groups.view(x2d)) for groups in (usages[:1] if shared else usages)]
            scales = [group_scales(amax, rule, x2d.dtype, divide_in=torch.float64) for amax in amaxes]
            scales = scales * (len(usages) if shared else 1)
        m, k = x2d.shape
        codes = []
        for groups, (group_scale, _) in zip(usages, scales):
            scaled = groups.view(x2d).to(torch.float32) * group_scale
            usage_codes = scaled.clamp(-fp8_max, fp8_max).to(dtype).reshape(m, k)
            codes.append(usage_codes.t().contiguous() if groups.column_major else usage_codes)
        return tuple(codes), tuple(scale_inv for _, scale_inv in scales)

    return CompiledKernel(quantize)


def _usage_groups(rule: QuantRule, axis: int, x: torch.Tensor) -> _Groups:
    granularity = rule.granularity
    rows, cols = (granularity.across, granularity.along) if axis == -1 else (granularity.along, granularity.across)
    return _Groups(rows, cols, column_major=axis == 0 and x.dim() == 2)


def quantize_usages(
    x: torch.Tensor, rule: QuantRule, axes: tuple[int, ...], scale: torch.Tensor | None
) -> tuple[QuantizedTensor, ...] | None:
    """``x``'s quantization along each of ``axes`` (``scale``: a given per-tensor one, or
    ``None``), from one compiled call; ``None`` where its kernel failed to compile."""
    usages = tuple(_usage_groups(rule, axis, x) for axis in axes)
    x2d = x.reshape(view_2d_shape(x.shape))
    if scale is not None:
        scale = scale.to(device=x.device)
    quantized = _quantize_kernel(usages, rule, scale is not None)(x2d, scale)
    if quantized is None:
        return None
    codes, scale_invs = quantized
    computed_power_2 = rule.power_2_scales and scale is None
    return tuple(
        fp8_tensor(x, data.t() if groups.column_major else data, scale_inv, rule.granularity, axis, computed_power_2, None, False)
        for groups, data, scale_inv, axis in zip(usages, codes, scale_invs, axes)
    )


def _serves(x: torch.Tensor, rule: QuantRule) -> bool:
    """Whether this quantizer takes ``x`` by ``rule``: a granularity it serves, a tensor it takes."""
    return str(rule.granularity) in SERVED_GRANULARITIES and compiled_usable(x)


def quantize(
    x: torch.Tensor, rule: QuantRule, axis: int, scale: torch.Tensor | None, generator=None, global_amax=None
) -> QuantizedTensor | None:
    """:func:`fp8train.quant.fp8_quantize.quantize_fp8`'s bits from one compiled call
    (arguments checked by the door); ``None`` where it leaves ``x`` to the reference."""
    if not _serves(x, rule):
        return None
    quantized = quantize_usages(x, rule, (axis,), scale)
    return None if quantized is None else quantized[0]


def quantize_both(
    x: torch.Tensor, rule: QuantRule, scale: torch.Tensor | None = None
) -> tuple[QuantizedTensor, QuantizedTensor] | None:
    """Both usages (axis -1 row-major, axis 0 column-major) from one read of ``x`` for the
    codes, as two :func:`quantize` calls give them; ``None`` where it leaves ``x`` to them.
    A symmetric granularity's (``tensor``, ``block128x128``) two usages share their scales
    and differ only in layout."""
    if not _serves(x, rule):
        return None
    return quantize_usages(x, rule, (-1, 0), scale)


@functools.cache
def _values_kernel(groups: _Groups, out_dtype: torch.dtype) -> CompiledKernel:
    """An FP8 operand's values times its groups' scales, as ``out_dtype``, in one kernel."""

    def values(data: torch.Tensor, scale_inv: torch.Tensor):
        view = groups.view(data)
        scales = scale_inv.reshape(view.shape[0], 1, view.shape[2], 1)
        return (view.to(torch.float32) * scales).to(out_dtype).reshape(data.shape)

    return CompiledKernel(values)


def operand_values(qt: QuantizedTensor, power_2: bool, out_dtype: torch.dtype) -> torch.Tensor | None:
    """The emulated GEMM's operand of the 2-D FP8 ``qt`` on a GPU, as
    :func:`fp8train.quant.kernels.operands.try_operand_values` gives it on the CPU (its
    values times its power-of-two scales, else the bare values), in one fused kernel;
    ``None`` where it leaves ``qt`` to the PyTorch ops (4-bit data, a trace). (The CPU
    has its own kernel; the tests run this one there too.)"""
    data = qt.data
    if qt.granularity.fp4 or not compiled_usable(data):
        return None
    rows, cols = data.shape
    group_rows, group_cols = qt.group_shape if power_2 else (rows, cols)
    groups = _Groups(None if group_rows == rows else group_rows, None if group_cols == cols else group_cols)
    scale_inv = qt.scale_inv_float32() if power_2 else torch.ones((), device=data.device)
    return _values_kernel(groups, out_dtype)(data, scale_inv)
