"""Whole training steps in one CUDA graph: ``StepGraph`` captures a step's forward, loss and
backward (every micro-batch) once, after eager warm-up steps, and replays it.

A CUDA graph replays the kernels it recorded with the tensors it recorded: nothing in
Python runs again. So a step can be captured only if, once warm, it

* reads no device value on the host, builds no tensor from Python data and copies nothing
  between devices (each would stop the capture, or be frozen into it);
* dispatches the same ops with the same shapes, dtypes and non-tensor arguments at every
  step (a Python scalar that changes, say a counter passed to an op, would be frozen at its
  captured value; a shape that changes needs another graph);
* holds no module that says it cannot be captured (``cuda_graph_blocker``: MoE routing
  reads each expert's token count on the host).

:class:`StepGraph` checks the first two on two of its warm-up steps, which it runs under a
:class:`StepTrace` (a ``TorchDispatchMode`` that records every op's signature and every such
break), and the third on the model; where one fails it names it in one log line and runs
every step eagerly. The same trace runs on a CPU, where the tests check every recipe's step
(``tests/nn/test_step_graph.py``).

What stays outside the graph: copying a batch into the graph's inputs, the optimizer step
and everything after it (gradient clipping, the host reads of the loss and the gradient
norm). Gradients live in the tensors the captured backward wrote: before each replay they
are put back on the parameters (an optimizer's ``zero_grad(set_to_none=True)`` between
steps drops only the references).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

__all__ = [
    "PYTHON_DATA", "HOST_READ", "DEVICE_COPY", "StepTrace", "StepGraph", "capture_break", "trace_difference",
    "module_blocker",
]

logger = logging.getLogger(__name__)
aten = torch.ops.aten

PYTHON_DATA = "tensor from Python data"
HOST_READ = "host read of device values"
DEVICE_COPY = "copy between devices"

BREAKING_OPS = {
    aten.lift_fresh.default: PYTHON_DATA,
    aten.lift_fresh_copy.default: PYTHON_DATA,
    aten._local_scalar_dense.default: HOST_READ,
    aten.equal.default: HOST_READ,
    aten.is_nonzero.default: HOST_READ,
    aten.nonzero.default: HOST_READ,
    aten.masked_select.default: HOST_READ,
    aten._unique2.default: HOST_READ,
    aten.unique_consecutive.default: HOST_READ,
    aten.unique_dim.default: HOST_READ,
    aten.repeat_interleave.Tensor: HOST_READ,
}
"""Ops that read device values on the host or build a tensor from Python data, whatever
their arguments (:func:`capture_break` adds the ones that do so for some arguments)."""
_INDEXING = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)


def capture_break(func, args: tuple, kwargs: dict) -> str | None:
    """What dispatching ``func(*args, **kwargs)`` does that a CUDA graph cannot hold
    (:data:`HOST_READ`, :data:`PYTHON_DATA`, :data:`DEVICE_COPY`), or ``None``."""
    kind = BREAKING_OPS.get(func)
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None:
        return None  # its output size given: nothing to read
    if kind is None and func is aten._to_copy.default and kwargs.get("device") is not None:
        if torch.device(kwargs["device"]) != args[0].device:
            return DEVICE_COPY
    if kind is None and func in _INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1]):
        return HOST_READ  # a boolean mask indexes through nonzero
    if kind is None and func is aten.copy_.default and args[0].device != args[1].device:
        return DEVICE_COPY
    return kind


class _Float(float):
    """A float argument in a signature: equal to another float with the same bits (NaN to
    NaN, -0.0 not to 0.0), shown as itself."""

    def __eq__(self, other) -> bool:
        return isinstance(other, float) and self.hex() == float(other).hex()

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = float.__hash__


def _signature_of(value):
    """What an op's argument contributes to its signature: a tensor its shape, dtype and
    device; a value that can change between steps itself; anything else its type."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, float):
        return _Float(value)
    if value is None or isinstance(value, (bool, int, float, complex, str, torch.dtype, torch.device)):
        return value
    if isinstance(value, (torch.memory_format, torch.layout)):
        return str(value)
    return type(value).__name__


class StepTrace(TorchDispatchMode):
    """Within the block, record every dispatched op's signature (``ops``) and every capture
    break (``breaks``: ``"host read of device values: aten._local_scalar_dense.default"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.breaks: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = capture_break(func, args, kwargs)
        if kind is not None:
            self.breaks.append(f"{kind}: {func}")
        self.ops.append((str(func), tree_map(_signature_of, (args, kwargs))))
        return func(*args, **kwargs)


def trace_difference(first: StepTrace, second: StepTrace) -> str | None:
    """Why the step ``second`` traced cannot be captured for replay as the step ``first``
    traced (a break of its own, or an op that differs), or ``None``."""
    if second.breaks:
        return f"the step makes a {second.breaks[0]}"
    for index, (a, b) in enumerate(zip(first.ops, second.ops)):
        if a != b:
            return f"the step changes between steps: its op {index} was {a[0]}{a[1]} and then {b[0]}{b[1]}"
    if len(first.ops) != len(second.ops):
        return f"the step changes between steps: {len(first.ops)} ops, then {len(second.ops)}"
    return None


def module_blocker(model: nn.Module) -> str | None:
    """Why a module or trainable parameter of ``model`` cannot take part in a captured step
    (its ``cuda_graph_blocker``, named), or ``None``."""
    for name, module in model.named_modules():
        reason = getattr(module, "cuda_graph_blocker", None)
        if reason is not None:
            return f"{name or type(module).__name__} ({type(module).__name__}): {reason}"
    for name, parameter in model.named_parameters():
        reason = getattr(parameter, "cuda_graph_blocker", None) if parameter.requires_grad else None
        if reason is not None:
            return f"{name}: {reason}"
    return None


class _CudaCapture:
    """A step captured in a ``torch.cuda.CUDAGraph`` on its static inputs: its outputs and the
    gradients its backward writes are the graph's own tensors."""

    def __init__(self, step: Callable, inputs: list[torch.Tensor], parameters: Sequence[torch.Tensor]) -> None:
        for parameter in parameters:
            parameter.grad = None  # the captured backward allocates them in the graph's pool
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = step(inputs)
        self.grads = [parameter.grad for parameter in parameters]

    def replay(self) -> tuple:
        self.graph.replay()
        return self.outputs


@contextlib.contextmanager
def _side_stream(inputs: Sequence[torch.Tensor]):
    """Run the block on a side stream where ``inputs`` are on CUDA (warm-up steps before a
    capture must not run on the stream being captured), joined back to the current one."""
    device = next((t.device for t in inputs if t.device.type == "cuda"), None)
    if device is None:
        yield
        return
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield
    current.wait_stream(side)


class StepGraph:
    """``step(inputs)`` run eagerly for ``warmup`` calls, the second and third traced; then,
    where the traces and ``model`` allow, captured in a CUDA graph on static copies of its
    inputs and replayed at every later call (the inputs copied in first).

    The first call builds what a step caches (constants, compiled code, optimizer-free
    state); the two traced ones are compared (:func:`trace_difference`); the calls after
    them run without the trace, so that a compiled model meets the capture as warm as it
    ran untraced.

    Args:
        step: the forward, loss and backward of one optimizer step on a list of input
            tensors; returns a tuple of tensors (the losses), which after capture are the
            graph's own.
        model: the module the step runs (asked for a ``cuda_graph_blocker``, of its modules
            and trainable parameters).
        parameters: the parameters whose gradients the step writes.
        warmup: eager calls before the capture (at least 4: one to warm, two traced, one
            more untraced).
        capture: how to capture (``_CudaCapture``); a test passes one that runs on a CPU.
    """

    def __init__(self, step, model: nn.Module, parameters, *, warmup: int = 4, capture=_CudaCapture) -> None:
        if warmup < 4:
            raise ValueError(
                f"warmup={warmup} must be at least 4: a step to warm, two compared, and one more before the capture"
            )
        self.step, self.parameters, self.warmup, self._capture = step, list(parameters), warmup, capture
        self.calls = 0
        self.captured = None
        self.reason = None
        blocker = module_blocker(model)
        if blocker is not None:
            self.stop(blocker)
        self._static: list[torch.Tensor] | None = None
        self._traces: list[StepTrace] = []

    @property
    def eager(self) -> bool:
        """Whether every step runs eagerly from now on (:attr:`reason` says why)."""
        return self.reason is not None

    def stop(self, reason: str) -> None:
        """Run every later step eagerly, saying ``reason`` once."""
        if self.reason is None:
            self.reason = reason
            logger.info("fp8train: CUDA graphs off, every step runs eagerly from now on: %s", reason)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> tuple:
        self.calls += 1
        if not self.eager and not self._fill(inputs):
            self.stop(f"a changing shape: inputs of {[tuple(t.shape) for t in inputs]} after "
                      f"{[tuple(t.shape) for t in self._static]}")
        if self.eager:
            return self.step(list(inputs))
        if self.calls > self.warmup:
            return self._replay()
        traced = self.calls in (2, 3)
        with _side_stream(self._static), StepTrace() if traced else contextlib.nullcontext() as trace:
            outputs = self.step(self._static)
        if traced:
            self._traces.append(trace)
        if self.calls == self.warmup:
            reason = trace_difference(*self._traces)
            self._traces = []
            if reason is not None:
                self.stop(reason)
        return outputs

    def _replay(self) -> tuple:
        """This step from the graph: captured first where it is not yet (at the step after the
        warm-up, whose gradients the optimizer has taken: a capture computes nothing)."""
        if self.captured is None:
            try:
                self.captured = self._capture(self.step, self._static, self.parameters)
            except Exception as error:  # noqa: BLE001 - the step runs eagerly instead, said once
                for parameter in self.parameters:
                    parameter.grad = None
                self.stop(f"capturing the step failed: {type(error).__name__}: {str(error).splitlines()[0]}")
                return self.step(self._static)
            logger.info("fp8train: CUDA graphs: every later step replays its forward, loss and backward from one graph")
        for parameter, grad in zip(self.parameters, self.captured.grads):
            parameter.grad = grad
        return self.captured.replay()

    def _fill(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Copy ``inputs`` into the static inputs (made from the first ones); ``False`` where a shape changed."""
        if self._static is None:
            self._static = [t.clone() for t in inputs]
            return True
        if len(inputs) != len(self._static) or any(a.shape != b.shape for a, b in zip(inputs, self._static)):
            return False
        for static, t in zip(self._static, inputs):
            static.copy_(t)
        return True
