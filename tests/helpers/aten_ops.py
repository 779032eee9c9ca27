"""Count the aten ops one Float8Linear forward+backward runs: on the CPU, a stand-in for the
kernels a GPU launches (issue 31; docs/gpu.md, "Launches counted on the CPU").

The rule (:func:`count_linear_ops`):

* Every aten op that reaches the dispatcher counts once, except those that launch nothing on
  a GPU: views and aliases (any op whose schema returns an alias of an input:
  ``view``, ``t``, ``transpose``, ``permute``, ``as_strided``, ``expand``, ``slice``,
  ``select``, ``unsqueeze``, ``squeeze``, ``split``, ``detach``, ``alias``, ``lift_fresh``;
  ``torch.Tensor.reshape`` counts only where it copies, as its ``clone``), the view-like
  ``_unsafe_view``, allocations that fill nothing (``empty``, ``empty_like``,
  ``empty_strided``, ``new_empty``) and shape queries (``sym_size`` ...). Ops on one-element
  tensors count like any other: on a GPU each is a launch.
* The quantization runs the reference path (``use_quant_settings(quantize_kernel=
  "reference")``), the PyTorch ops every GPU quantizer is held to.
* Each GEMM counts as the hardware would run it: the emulated GEMM that gives the CPU its
  result is not counted; :func:`~fp8train.quant.gemm.hardware.hardware_mm` is run on the same
  operands instead, counting its layout work (the transposing copies of the FP8 operands, the
  scale layouts, the bias add of a float32 output) and 1 for ``torch._scaled_mm``. For MXFP8
  and the 4-bit recipes that is SM 10.x's hardware GEMM (a Hopper emulates them, at more).
* One step is counted after a first, uncounted one (delayed scaling's owed forward update and
  the history roll of the previous step land in it, as in training); grads are set to None
  before it, the input needs a grad, grad_output is given.

What a CPU count cannot see: host-to-device copies of Python constants (``torch.tensor(...,
device=cuda)`` is ``lift_fresh`` here; the host-sync counts of GPU-HAZARDS.md S2 cover them),
and the GPU's fused or split kernels (a copy between dtypes and layouts is one op here).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8train.nn.modules.base import forget_linear_calls
from fp8train.nn.modules.linear import Float8Linear
from fp8train.nn.function import call as linear_function
from fp8train.quant.operand import linear as linear_kernels
from fp8train.quant.operand import role as role_quantizers
from fp8train.quant.gemm import scaled_mm as scaled_mm_door
from fp8train.quant.gemm import hardware as gemm_hardware
from fp8train.quant.kernels import use_quant_settings
from fp8train.diagnostics.markdown import markdown_table

HARNESS_SHAPE = (256, 512, 768)
"""``(M, K, N)`` of the counted Linear: 256 tokens, 512 in, 768 out (GPU-HAZARDS.md S2)."""

_LAUNCHLESS = frozenset(
    {"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
    | {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size"}
)


def launches(func) -> bool:
    """Whether the aten op ``func`` counts as a launch under the module's rule."""
    return not func.is_view and func._schema.name.removeprefix("aten::") not in _LAUNCHLESS


class OpCounter(TorchDispatchMode):
    """Counts the launching aten ops (:func:`launches`) run under it, by op name, while not
    :meth:`paused`."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused and launches(func):
            self.counts[func._schema.name.removeprefix("aten::")] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _hardware_gemm_counted(counter: OpCounter):
    """A stand-in for the Linear's GEMM (its bound kernels' ``mm``): the emulated GEMM's
    result, uncounted, with the hardware GEMM's launches counted (its ``torch._scaled_mm``
    as one)."""
    real_scaled_mm = scaled_mm_door

    def fake_scaled_mm(a_data, b_data, scale_a, scale_b, *, out_dtype, **kwargs):
        counter.counts["_scaled_mm"] += 1
        with counter.paused():
            return torch.empty(a_data.shape[0], b_data.shape[1], dtype=out_dtype)

    def scaled_mm(a, b, out_dtype=torch.bfloat16, bias=None, rows=None, depth=None):  # (the hardware's whole)
        with counter.paused():
            out = real_scaled_mm(a, b, out_dtype, backend="emulated", bias=bias)
        with mock.patch.object(torch, "_scaled_mm", fake_scaled_mm):
            gemm_hardware.hardware_mm(a, b, out_dtype, bias)
        return out

    return scaled_mm


@contextlib.contextmanager
def _linear_gemms(mm):
    """The layers' bound kernels multiply with ``mm`` in the block, their quantizers writing
    no emulated GEMM's operand values (as on a GPU: on the CPU the reference writes them for
    its emulated GEMM, issue 38, the emulation's work) (their caches emptied before and
    after, so no call value outlives it)."""
    caches = (linear_function._linear_call, linear_kernels._bound_kernels)
    for cache in caches:
        cache.cache_clear()
    forget_linear_calls()  # the call values the modules keep too
    try:
        with mock.patch.object(linear_kernels, "bound_scaled_mm", lambda *args: mm), mock.patch.object(
            role_quantizers, "_operand_values", lambda plan, usage: None
        ):
            yield
    finally:
        for cache in caches:
            cache.cache_clear()
        forget_linear_calls()


def count_linear_ops(recipe: str, shape=HARNESS_SHAPE, dtype=torch.bfloat16, bias: bool = True) -> OpCounter:
    """The launching aten ops of one ``Float8Linear(recipe)`` forward+backward (the module's
    rule), on ``[M, K]`` input of ``dtype`` for ``shape = (M, K, N)``."""
    m, k, n = shape
    generator = torch.Generator().manual_seed(0)
    layer = Float8Linear(k, n, bias=bias, dtype=dtype, recipe=recipe)
    input_hp = torch.randn(m, k, generator=generator).to(dtype).requires_grad_()
    grad_output = torch.randn(m, n, generator=generator).to(dtype)
    counter = OpCounter()
    with use_quant_settings(quantize_kernel="reference"):
        layer(input_hp).backward(grad_output)  # the first step, uncounted
        layer.zero_grad(set_to_none=True)
        input_hp.grad = None
        with _linear_gemms(_hardware_gemm_counted(counter)), counter:
            layer(input_hp).backward(grad_output)
    return counter


def format_table(counts: dict[str, int], limits: dict[str, int] | None = None) -> str:
    """A Markdown table of ``{recipe: count}`` (beside ``limits`` where given)."""
    headers = ["recipe", "aten ops"] + (["limit"] if limits else [])
    rows = [[recipe, count] + ([limits[recipe]] if limits else []) for recipe, count in counts.items()]
    return markdown_table(headers, rows, align="l" + "r" * (len(headers) - 1))
