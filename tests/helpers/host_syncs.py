"""What a step would synchronize on a GPU, seen on CPU.

On CUDA a training step that never waits for the device keeps its kernels queued ahead of
the host. Three kinds of call break that, and each is visible on CPU too:

* a tensor built from Python data (``torch.tensor(list)``, ``torch.as_tensor(scalar)``,
  ``Tensor.new_tensor``, all ``aten::lift_fresh``): on a GPU, a host-to-device copy that
  waits (``cudaMemcpy``, or a pinned staging copy) each time it runs;
* a read of device values on the host: ``.item()``, ``float()``/``int()``/``bool()`` of a
  tensor (``aten::_local_scalar_dense``), ``torch.equal``, ``.tolist()``, ``.numpy()``,
  and ops whose output shape depends on the values (``nonzero``, ``unique``,
  ``masked_select``, indexing with a boolean mask, ``repeat_interleave`` without
  ``output_size``);
* a copy between devices: ``.cpu()``, ``.to(device)`` or ``copy_`` across devices.

:class:`HostSyncRecorder` records every such event while it is active, with the line of
the library (``src/fp8train``) that caused it. A test runs one warm-up step (which may
build and cache constants), then records a second step and asserts that nothing was
recorded (:func:`assert_no_host_syncs`). The CPU numba kernels go through NumPy by design
(they are not the GPU path): such a test runs the reference path,
``use_quant_settings(quantize_kernel="reference")``.

A 0-dim CPU tensor built without a device is recorded too, though a CUDA op takes it as a
scalar without a copy: on CPU it cannot be told from one that ``.to(device)`` moves.

Not recorded (kept apart in ``cpu_only``): events inside the library functions of
:data:`CPU_ONLY`, whose host reads sit in a branch only CPU tensors take.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fp8train.nn.step_graph import DEVICE_COPY, HOST_READ, PYTHON_DATA, capture_break

# What a dispatched op does that a GPU would wait or copy for is the library's own rule
# (fp8train.nn.step_graph.capture_break, which decides what a CUDA graph cannot hold).

# Host reads that dispatch nothing on CPU (NumPy and lists share or read the memory).
_FUNCTION_READS = {torch.Tensor.tolist, torch.Tensor.numpy}
_LIBRARY_PATH = "/src/fp8train/"
CPU_ONLY = {
    ("fp8train/quant/cast.py", "checked_fp8_to_hp"),
    ("fp8train/quant/cast.py", "_chunked_values"),
    ("fp8train/quant/gemm/emulated.py", "_lowest_bit_exponent"),
    ("fp8train/quant/gemm/emulated.py", "cpu_bf16_gemm_keeps_every_bit"),
    ("fp8train/quant/gemm/emulated.py", "_smallest_lowest_bit"),
}
"""``(file, function)``: a CPU tensor's fast conversion checks for NaN codes on the host
(``fp8_to_hp``'s bit path); a GPU tensor returns ``data.to(dtype)`` before it. The CPU's bfloat16 GEMM reads its
operands' smallest scales first (it flushes subnormals); a GPU's GEMM is not read."""
_TORCH = os.path.dirname(torch.__file__) + os.sep


@dataclass(frozen=True)
class HostSync:
    """One recorded event: its kind, the op or function, and the library line behind it."""

    kind: str
    op: str
    where: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.op} at {self.where}"


def _record(kind: str, op: str, recorder: "HostSyncRecorder") -> None:
    """Add the event, located at the innermost library frame (else the innermost outside
    torch and this file), to the recorder's events or, from :data:`CPU_ONLY`, to ``cpu_only``."""
    frames = [f for f in traceback.extract_stack() if f.filename != __file__ and _TORCH not in f.filename]
    library = [f for f in frames if _LIBRARY_PATH in f.filename]
    frame = (library or frames)[-1]
    path = frame.filename.rsplit("/src/", 1)[-1]
    event = HostSync(kind, op, f"{path}:{frame.lineno} ({frame.name})")
    (recorder.cpu_only if (path, frame.name) in CPU_ONLY else recorder.events).append(event)


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self, recorder: "HostSyncRecorder") -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = capture_break(func, args, kwargs)
        if kind is not None:
            _record(kind, str(func), self.recorder)
        return func(*args, **kwargs)


class _FunctionRecorder(TorchFunctionMode):
    def __init__(self, recorder: "HostSyncRecorder") -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = None
        if func in _FUNCTION_READS:
            kind = HOST_READ
        elif func is torch.Tensor.cpu:
            kind = DEVICE_COPY
        elif func is torch.Tensor.to and isinstance(args[0], torch.Tensor) and _moves(args, kwargs):
            kind = DEVICE_COPY
        if kind is not None:
            _record(kind, getattr(func, "__name__", str(func)), self.recorder)
        return func(*args, **kwargs)


def _moves(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` copies between devices: to another device, or
    to one named ``"cpu"`` as a string (on a GPU, a move to the host; one CPU dispatches
    nothing for it). A ``torch.device`` taken from another tensor names that tensor's device."""
    value = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(value, torch.Tensor):
        value = value.device
    if isinstance(value, str):
        return value.startswith("cpu") or torch.device(value) != args[0].device
    return isinstance(value, torch.device) and value != args[0].device


class HostSyncRecorder:
    """Record, while active, every event a GPU would synchronize or copy from the host for.

    ``with HostSyncRecorder() as recorder: step()``; then ``recorder.events`` lists
    :class:`HostSync` values in the order they happened (``cpu_only``: those of
    :data:`CPU_ONLY`).
    """

    def __init__(self) -> None:
        self.events: list[HostSync] = []
        self.cpu_only: list[HostSync] = []
        self._modes = (_FunctionRecorder(self), _DispatchRecorder(self))

    def __enter__(self) -> "HostSyncRecorder":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def assert_no_host_syncs(step) -> None:
    """Run ``step()`` under a :class:`HostSyncRecorder`; fail listing every event seen."""
    with HostSyncRecorder() as recorder:
        step()
    events = "\n  ".join(map(str, recorder.events))
    assert not recorder.events, f"{len(recorder.events)} host syncs or copies in the step:\n  {events}"
