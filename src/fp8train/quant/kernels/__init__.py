"""The kernels behind the quantizer doors, and the settings that choose them: on the CPU
compiled by numba, on a GPU fused by inductor (:mod:`.compiled_fp8`, the FP8 family's).

Each kernel is held bit for bit to its reference in PyTorch ops (the modules at
:mod:`fp8train.quant`'s top), which runs everywhere; a kernel only runs where
:func:`~.launch.kernels_usable` takes the tensor. The road reads one way: a door decides,
a Python module here lays out the arguments and launches, a ``numba_*`` module computes.

* :mod:`.settings`: which quantization path, which emulated-GEMM dtype (read once from the
  environment; :func:`use_quant_settings` for a block).
* :mod:`.launch`: :func:`kernels_usable`, the one decision; one launch's threads and lock;
  how a kernel reads a tensor's bits (:data:`~.launch.BITS_LIKE`: each kernel's ``*_at``
  entry point takes contiguous tensors by their addresses).
* :mod:`.fp8`, :mod:`.fp4`: each format family's CPU quantizer, which its door
  (:mod:`fp8train.quant.quantize`) calls; the amax of a tensor (:func:`try_tensor_amax`);
  :mod:`.fp8_rule`: what the FP8 kernels take of a rule, computed once per rule.
* :mod:`.operands`: the emulated GEMM's operands from their codes (:mod:`fp8train.quant.gemm`
  asks :func:`try_operand_values` and :func:`try_fp4_operand_values`).
* :mod:`.delayed`: delayed scaling's amax record (in the read that measures it) and a
  state's update in one call (:mod:`fp8train.nn.delayed` asks).
* ``numba_elements`` (one element's and one group's arithmetic), ``numba_fp8``,
  ``numba_fp8_values``, ``numba_delayed``, ``numba_fp4``, ``numba_fp4_transform``,
  ``numba_fp4_values``: the compiled kernels (cached on disk), imported only when numba is.

* :mod:`.compiled_fp8`: the FP8 family's GPU quantizer, the reference's own ops compiled by
  ``torch.compile`` into one call per tensor (amaxes, scales, the codes of both usages, the
  first-dim one column-major), and the emulated GEMM's operands from their codes.

numba installs from wheels with pip (no compiler needed).
"""

from .fp8 import try_tensor_amax
from .launch import kernels_usable
from .operands import try_fp4_operand_values, try_operand_values
from .settings import GEMM_DTYPE_ENV, KERNEL_ENV, QuantSettings, quant_settings, use_quant_settings

__all__ = [
    "kernels_usable",
    "try_tensor_amax",
    "try_operand_values",
    "try_fp4_operand_values",
    "KERNEL_ENV",
    "GEMM_DTYPE_ENV",
    "QuantSettings",
    "quant_settings",
    "use_quant_settings",
]
