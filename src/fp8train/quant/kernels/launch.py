"""Whether a tensor goes through the CPU kernels, and how one launch of them runs.

:func:`kernels_usable` is the one decision (the settings of :mod:`.settings`, numba, the
tensor), which the quantizers' door (:func:`fp8train.quant.quantize.quantizers_for`) and
the ``try_*`` entry points of the GEMM operands and the amax ask. :func:`launch_kernels`
holds one parallel launch; a kernel takes a contiguous tensor's memory by its address
(:data:`BITS_LIKE`, :func:`.numba_elements.at`).
"""

from __future__ import annotations

import functools
import os
import threading

import numpy as np
import torch

from .settings import ACTIVE_SETTINGS, KERNEL_ENV

__all__ = [
    "STRIPE_BYTES", "BITS_DTYPE", "kernels_enabled", "kernels_usable", "launch_kernels", "BITS_LIKE", "kernel_input",
    "float32_scalar", "LAUNCH_STATE", "compiled_elements",
]

STRIPE_BYTES = 1 << 18
"""Bytes of input one task of a striped kernel covers, so its second read hits cache."""

BITS_DTYPE = {torch.bfloat16: torch.uint16, torch.float32: torch.uint32}
"""The integer dtype whose values are a float dtype's bits, as the kernels read them."""

BITS_LIKE = {torch.bfloat16: np.uint16(0), torch.float32: np.uint32(0)}
"""A NumPy scalar of :data:`BITS_DTYPE`'s dtype per float dtype: what the kernels' ``*_at``
entry points take beside an input's address to read it as its bits
(:func:`.numba_elements.at`)."""

_LOCK = threading.Lock()  # one parallel launch at a time (numba's workqueue layer needs it)
LAUNCH_STATE = {"launched": False, "forked_after_launch": False}
"""Whether this process has launched a parallel kernel, and whether it is a child forked after
one (read by the kernels' ``kernels_enabled`` and by those that test it inline)."""


def _after_fork_in_child() -> None:
    # numba's OpenMP layer aborts a forked child's first parallel launch if the parent had
    # launched one ("fork() called from a process already using GNU OpenMP"): such a child
    # quantizes on the reference path instead.
    LAUNCH_STATE["forked_after_launch"] = LAUNCH_STATE["launched"]


os.register_at_fork(after_in_child=_after_fork_in_child)


@functools.cache
def compiled_elements():
    """The kernels' shared numba module, or ``None`` where numba cannot be imported."""
    try:
        from . import numba_elements
    except ImportError:
        return None
    return numba_elements


def kernels_enabled() -> bool:
    """Whether the CPU kernels run at all here, whatever the tensor: the settings allow
    them, numba imports, and this process may launch them (not a child forked after a
    launch). The part of :func:`kernels_usable` a layer asks once per call.

    Raises:
        RuntimeError: the settings ask for ``numba`` and it cannot be imported.
    """
    choice = ACTIVE_SETTINGS.settings.quantize_kernel
    if choice == "reference" or LAUNCH_STATE["forked_after_launch"]:
        return False
    if compiled_elements() is None:
        if choice == "numba":
            raise RuntimeError(
                f"quantize_kernel='numba' ({KERNEL_ENV}=numba, or use_quant_settings) but numba cannot be "
                f"imported; `pip install numba`, or unset {KERNEL_ENV}"
            )
        return False
    return True


def kernels_usable(x: torch.Tensor) -> bool:
    """Whether ``x`` goes through these kernels: the one decision. Yes for a plain CPU
    tensor (not a subclass such as a DTensor, whose ops must dispatch), not empty, not
    traced, where :func:`kernels_enabled` says the kernels run.

    Raises:
        RuntimeError: the settings ask for ``numba`` and it cannot be imported.
    """
    if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.device.type != "cpu":
        return False
    if torch.compiler.is_compiling() or 0 in x.shape:
        return False
    return kernels_enabled()


def float32_scalar(value: float):
    import numpy as np

    return np.float32(value)


class _Launch(threading.local):
    """One parallel launch of the kernels at a time, with PyTorch's thread count: the
    context manager :func:`launch_kernels` returns.

    PyTorch's count is put back afterwards: numba's OpenMP threading layer, started by the
    first launch, sets the OpenMP thread count PyTorch shares to numba's (every core), which
    would silently undo a ``torch.set_num_threads(1)`` (or torchrun's ``OMP_NUM_THREADS=1``)
    and oversubscribe the cores from then on. numba's own count is thread-local, as this
    object is: it is set only when PyTorch's has changed since this thread last set it.

    Reentrant: a block inside another (a layer holds the kernels for its whole forward or
    backward, :func:`launch_kernels`) only counts its depth, two calls instead of six per
    launch (issue 38); the outermost takes the lock, sets the count and puts it back.
    """

    def __init__(self) -> None:
        self.numba_threads = 0  # numba's count as this thread last set it (0: never)
        self.threads = 0
        self.depth = 0  # blocks this thread is inside

    def __enter__(self) -> None:
        if self.depth:
            self.depth += 1
            return
        _LOCK.acquire()
        self.depth = 1
        LAUNCH_STATE["launched"] = True
        self.threads = threads = torch.get_num_threads() or 1  # at least 1, without max()
        if threads != self.numba_threads:
            compiled_elements().set_threads(threads)
            self.numba_threads = threads

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if self.depth:
            return
        try:
            if torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
        finally:
            _LOCK.release()


_LAUNCH = _Launch()

KERNEL_LAUNCH = _LAUNCH
"""What :func:`launch_kernels` returns, for ``with KERNEL_LAUNCH:`` where a launch's host
calls count (issue 38): the same object, without the function call."""


def launch_kernels() -> _Launch:
    """Hold the kernels for one parallel launch, or for a block of several, with PyTorch's
    thread count (``with launch_kernels(): ...``; :class:`_Launch` says why the count is put
    back). Another thread's launches wait for the block's end."""
    return _LAUNCH


def kernel_input(x2d: torch.Tensor) -> torch.Tensor:
    """``x2d`` as the kernels read it: bfloat16 and float32 as they are, float16 as float32
    (exact, and one compiled variant fewer per kernel: numba takes ~5 s to compile one),
    outside autograd (a kernel reads the memory; only the float16 copy is a new tensor)."""
    return x2d.detach().to(torch.float32) if x2d.dtype == torch.float16 else x2d
