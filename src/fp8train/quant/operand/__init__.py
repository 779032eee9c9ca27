"""The quantization of an operand slot, and who quantizes and multiplies a plan's operands
(:mod:`.role`, :mod:`.linear`): a high-precision tensor quantized as a recipe's
:class:`~fp8train.spec.plan.OperandPlan` says for one slot (:class:`~fp8train.spec.roles.Usage`),
as the K-last operand its GEMM takes.

A slot's last-dim usage is quantized with ``axis=-1``, its first-dim usage with ``axis=0`` and transposed, or, where
the plan allows (symmetric granularities), as the transpose of the last-dim quantization. The autograd of the FP8
modules (:mod:`fp8train.nn.function`) and the weights stored in FP8 (:mod:`fp8train.nn.weights`) quantize their slots
through these, so a stored weight holds the bits a forward would make.

:class:`RoleQuantizer` holds those choices for one role's two usages, made once per plan (issue 38: a layer asks on
every forward and backward): which rule each usage takes, whether the first-dim usage is the last-dim one transposed,
whether one read gives both, and who quantizes. :func:`quantize_usage` and :func:`quantize_both_usages` ask one
through the checked door (:func:`~fp8train.quant.quantize.quantize`); a layer that has checked its tensors once per
call asks one bound to a device's kernel (:func:`bound_role_quantizers`).

A :class:`LinearKernels` holds, for one plan, GEMM backend and device type under the current quantization settings,
each role's :class:`RoleQuantizer`, the scaled GEMM and the block that holds the CPU kernels for a whole forward or
backward of a Linear layer (:mod:`fp8train.nn.function`). Two kinds:

* **bound** (:func:`bound_kernels`), for a call whose tensors the layer checked once
  (:func:`takes_bound_path`: plain tensors of a high-precision dtype, on one device, not
  empty, outside ``torch.compile``; :func:`check_shapes` once per shape): each quantization
  goes straight to its format family's kernel on that device, each GEMM to the emulation
  or to ``scaled_mm``, with no per-call argument checks or choices, and the CPU kernels are
  held once per direction;
* **checked** (:func:`checked_kernels`), for anything else (a DTensor, a tensor gathered in
  FP8, a traced call): every quantization and GEMM through its checked door, as a user's
  own call takes it.

Both give the same bits (``tests/quant/test_linear_kernels.py`` holds the bound kind to the checked one for every
recipe and quantize path). """

from .linear import LinearKernels, bound_kernels, check_shapes, checked_kernels, takes_bound_path
from .role import (
    ROLE_USAGES,
    RoleQuantizer,
    bound_role_quantizers,
    checked_role_quantizer,
    quantize_both_usages,
    quantize_operand,
    quantize_usage,
)

__all__ = [
    "quantize_operand", "quantize_usage", "quantize_both_usages", "RoleQuantizer", "ROLE_USAGES",
    "checked_role_quantizer", "bound_role_quantizers", "LinearKernels", "bound_kernels", "checked_kernels",
    "takes_bound_path", "check_shapes",
]
