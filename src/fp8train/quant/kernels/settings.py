"""How the quant layer runs on this machine: which quantization path, which emulated-GEMM
dtype. Read once from the environment, when fp8train is imported; changed for a block of
code only with :func:`use_quant_settings`.

Neither choice changes a result: every quantization path gives the same bits, and the two
emulated-GEMM dtypes agree up to float32 accumulation order (``docs/numerics.md``).

* ``FP8TRAIN_QUANTIZE_KERNEL``: :attr:`QuantSettings.quantize_kernel`, ``auto`` (default),
  ``numba`` or ``reference``;
* ``FP8TRAIN_EMULATED_GEMM``: :attr:`QuantSettings.emulated_gemm`, ``auto`` (default),
  ``bfloat16`` or ``float32``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Iterator, Mapping

from ...spec.checks import check_choice
from ...spec.hash_once import hash_once, state_without_hash

__all__ = [
    "KERNEL_ENV",
    "GEMM_DTYPE_ENV",
    "KERNEL_CHOICES",
    "GEMM_DTYPE_CHOICES",
    "QuantSettings",
    "ACTIVE_SETTINGS",
    "quant_settings",
    "use_quant_settings",
]

KERNEL_ENV = "FP8TRAIN_QUANTIZE_KERNEL"
GEMM_DTYPE_ENV = "FP8TRAIN_EMULATED_GEMM"
KERNEL_CHOICES = ("auto", "numba", "reference")
GEMM_DTYPE_CHOICES = ("auto", "bfloat16", "float32")


@dataclass(frozen=True, kw_only=True)
class QuantSettings:
    """How the quant layer runs here.

    Attributes:
        quantize_kernel: ``"auto"`` (the fused kernels of :mod:`fp8train.quant.kernels`
            where usable: numba's on the CPU, inductor's for FP8 on a GPU), ``"numba"``
            (the same, and an error where numba cannot be imported) or ``"reference"``
            (always the PyTorch-ops path, on every device).
        emulated_gemm: dtype of the emulated GEMM whose operands are exact in both
            bfloat16 and float32: ``"auto"`` (bfloat16 on GPUs and on CPUs with native
            bf16, float32 elsewhere), ``"bfloat16"`` or ``"float32"``.

    Raises:
        ValueError: a value not among the choices.
    """

    quantize_kernel: str = "auto"
    emulated_gemm: str = "auto"

    __hash__ = hash_once  # a layer's calls are cached per settings (issue 38)
    __getstate__ = state_without_hash

    def __post_init__(self) -> None:
        check_choice("quantize_kernel", self.quantize_kernel, KERNEL_CHOICES)
        check_choice("emulated_gemm", self.emulated_gemm, GEMM_DTYPE_CHOICES)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> "QuantSettings":
        """The settings ``environ`` asks for (unset variables take the defaults).

        Raises:
            ValueError: an unknown value, naming the variable.
        """
        kernel = environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
        if kernel not in KERNEL_CHOICES:
            raise ValueError(f"{KERNEL_ENV}={kernel!r} is not one of {', '.join(KERNEL_CHOICES)}")
        gemm = environ.get(GEMM_DTYPE_ENV, "auto")
        if gemm not in GEMM_DTYPE_CHOICES:
            raise ValueError(f"{GEMM_DTYPE_ENV}={gemm!r} must be bfloat16, float32 or auto")
        return cls(quantize_kernel=kernel, emulated_gemm=gemm)


class _Active:
    """The one holder of the settings in force (process-wide): the environment's at
    import, replaced only inside :func:`use_quant_settings`."""

    def __init__(self, settings: QuantSettings) -> None:
        self.settings = settings


ACTIVE_SETTINGS = _Active(QuantSettings.from_environment(os.environ))
"""The holder of the settings in force (``.settings``): read by the hot paths of this
package as an attribute; everything else calls :func:`quant_settings`."""


def quant_settings() -> QuantSettings:
    """The settings in force."""
    return ACTIVE_SETTINGS.settings


@contextlib.contextmanager
def use_quant_settings(**changes: str) -> Iterator[QuantSettings]:
    """Run a block with some settings changed (process-wide), restoring the previous ones
    on exit, e.g. ``with use_quant_settings(quantize_kernel="reference"): ...``.

    Args:
        changes: fields of :class:`QuantSettings` and their values for the block.

    Raises:
        ValueError: a value not among a field's choices.
        TypeError: an unknown field.
    """
    previous = ACTIVE_SETTINGS.settings
    settings = dataclasses.replace(previous, **changes)
    ACTIVE_SETTINGS.settings = settings
    try:
        yield settings
    finally:
        ACTIVE_SETTINGS.settings = previous
