"""Find where a NaN or an infinity first appears in a model's forward and backward.

:func:`detect_nonfinite` hooks a model's modules for the duration of a ``with`` block and
records, in execution order, the first non-finite value (NaN, +inf or -inf):

* at every ``nn.Linear`` (``Float8Linear`` included), the operands of its GEMMs as the GEMM
  gets them (names as in :mod:`fp8train.spec.roles`): in the forward, ``input``, ``weight``
  and ``bias`` of the ``output`` GEMM, cast to the ``torch.autocast`` dtype where one is
  active (an overflow to inf in that cast counts), then the GEMM's ``result``; in the
  backward, ``grad_output`` (operand of the ``grad_input`` and ``grad_weight`` GEMMs), then
  the ``result`` of the ``grad_input`` GEMM (the layer's gradient of its input) and of the
  ``grad_weight`` GEMM (the weight's gradient, summed over the layers that share it);
* at every other module, its forward output, where its inputs are finite, and the model's
  own inputs: the *origin*, where a value went non-finite outside any GEMM (a LayerNorm,
  attention, the loss). Of several, the last one before the first Linear finding (a mask
  of ``-inf`` built earlier is legitimate), or else the innermost module that encloses a
  Linear whose input went non-finite inside it (code between its submodules).

FP8 operands are checked in high precision, before quantization; a non-finite value that
quantization or the FP8 GEMM makes shows as the GEMM's ``result``.

A debugging tool: each checked tensor costs an ``isfinite`` reduction and a host
synchronization, and, under ``torch.autocast``, a cast of input and weight (a training
step of the trainer's default model takes 1.3x-1.9x as long on a CPU:
``benchmarks/bench_sentinel.py``). The trainer runs a step under it only to explain a
non-finite loss or gradient norm (``on_nonfinite``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Iterable, Iterator

import torch
from torch import nn

from ..quant.cast import HIGH_PRECISION_DTYPES
from ..spec.checks import check_bool, check_type
from ..spec.roles import Gemm, Role
from ..nn.autocast import current_state
from ..nn.modules.linear import Float8Linear

__all__ = ["detect_nonfinite", "NonFiniteDetector", "NonFiniteFinding", "NonFiniteError", "FORWARD", "BACKWARD"]

FORWARD, BACKWARD = "forward", "backward"
RESULT = "result"
"""The operand name of a GEMM's own output."""
_CHECKED_DTYPES = (*HIGH_PRECISION_DTYPES, torch.float64)


@dataclass(frozen=True)
class NonFiniteFinding:
    """Where a non-finite value was seen.

    Attributes:
        module: fully qualified name of the module (``""``: the model itself).
        module_type: its class name (``"Float8Linear"``, ``"LayerNorm"``).
        gemm: ``"output"``, ``"grad_input"`` or ``"grad_weight"``; ``None`` for the output
            (or the model's input) of a module that is not a Linear.
        operand: ``"input"``, ``"weight"``, ``"bias"``, ``"grad_output"`` or ``"result"``
            (the GEMM's own output); ``"output"`` or ``"input"`` where ``gemm`` is ``None``.
        phase: ``"forward"`` or ``"backward"``.
        num_nan, num_inf: NaN and infinite elements of the tensor.
        recipe: the recipe's name where the module is a ``Float8Linear`` running in FP8.
    """

    module: str
    module_type: str
    gemm: str | None
    operand: str
    phase: str
    num_nan: int
    num_inf: int
    recipe: str | None = None

    def __str__(self) -> str:
        """E.g. ``input of the output GEMM of blocks.0.fc (Float8Linear, recipe tensorwise)
        in the forward: 12 NaN``."""
        where = f"{self.module} ({self.module_type}" if self.module else f"the model ({self.module_type}"
        where += f", recipe {self.recipe})" if self.recipe else ")"
        if self.gemm is not None:
            text = f"{self.operand} of the {self.gemm} GEMM of {where} in the {self.phase}"
        else:
            text = f"{self.operand} of {where} in the {self.phase}"
            text += ", from finite inputs" if self.operand == "output" else ""
        counts = ", ".join(f"{n} {kind}" for n, kind in ((self.num_nan, "NaN"), (self.num_inf, "inf")) if n)
        return f"{text}: {counts}"


class NonFiniteError(FloatingPointError):
    """A NaN or an infinity where a training step needs finite values.

    Raised by :func:`detect_nonfinite` (``raise_on_first``) and by the trainer
    (``on_nonfinite="stop"``); the message is one line.

    Attributes:
        finding: the first non-finite GEMM operand or result of a Linear layer
            (:class:`NonFiniteFinding`), or ``None``.
        origin: the module output (or model input) where it started, or ``None``.
        step: the trainer's step (1-based, as in ``metrics.jsonl``), or ``None``.
    """

    def __init__(
        self,
        message: str,
        finding: NonFiniteFinding | None = None,
        origin: NonFiniteFinding | None = None,
        step: int | None = None,
    ) -> None:
        super().__init__(message)
        self.finding, self.origin, self.step = finding, origin, step

    def __reduce__(self):
        return type(self), (str(self), self.finding, self.origin, self.step)


def describe_findings(finding: NonFiniteFinding | None, origin: NonFiniteFinding | None) -> str:
    """One line for a finding and its origin (either may be ``None``)."""
    if finding is None and origin is None:
        return "no non-finite value"
    if finding is None:
        return f"{origin} (no Linear layer's GEMM saw a non-finite value)"
    if origin is None:
        return str(finding)
    if origin.operand == "output" and _encloses(origin.module, finding.module):
        where = f"{origin.module} ({origin.module_type})" if origin.module else f"the model ({origin.module_type})"
        return f"{finding}; it started inside {where}, in its own code: its inputs are finite"
    return f"{finding}; it started at the {origin}"


class NonFiniteDetector:
    """What :func:`detect_nonfinite` found; it yields this object.

    Attributes:
        finding: the first non-finite GEMM operand or result of a Linear layer, or ``None``.
        origin: where the value first went non-finite outside a GEMM (see the module
            docstring), or ``None``.
    """

    def __init__(self, model: nn.Module, raise_on_first: bool) -> None:
        self.model, self.raise_on_first = model, raise_on_first
        self.finding: NonFiniteFinding | None = None
        self.origin: NonFiniteFinding | None = None
        self._active = False
        self._handles: list = []
        self._hooked_weights: dict[int, torch.Tensor] = {}

    def describe(self) -> str:
        """One line: the finding, and the origin where there is one."""
        return describe_findings(self.finding, self.origin)

    # ------------------------------------------------------------------ installing
    def _install(self) -> None:
        for fqn, module in self.model.named_modules():
            if isinstance(module, nn.Linear):
                pre = module.register_forward_pre_hook(partial(self._linear_pre_hook, fqn), with_kwargs=True)
                post = module.register_forward_hook(partial(self._linear_hook, fqn), with_kwargs=True)
                self._handles += [pre, post]
            else:
                self._handles.append(module.register_forward_hook(partial(self._module_hook, fqn), with_kwargs=True))
        self._handles.append(self.model.register_forward_pre_hook(self._model_input_hook, with_kwargs=True))
        self._active = True

    def _remove(self) -> None:
        # Hooks left on tensors of an unfinished backward see _active and do nothing.
        self._active = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked_weights.clear()

    # ------------------------------------------------------------------ recording
    def _record(self, finding: NonFiniteFinding) -> None:
        self.finding = finding
        if self.raise_on_first:
            raise NonFiniteError(f"non-finite value: {self.describe()}", self.finding, self.origin)

    def _consider_origin(self, candidate: NonFiniteFinding) -> None:
        """Before the first finding the latest candidate wins, except a module enclosing the
        current origin (it ends after it); after, only a module enclosing a Linear whose
        input went non-finite, if there is no origin yet."""
        if self.finding is None:
            if self.origin is None or not _encloses(candidate.module, self.origin.module):
                self.origin = candidate
        elif self.origin is None and _input_went_nonfinite_inside(self.finding, candidate.module):
            self.origin = candidate

    def _wants_origin(self, fqn: str) -> bool:
        if self.finding is None:
            return True
        return self.origin is None and _input_went_nonfinite_inside(self.finding, fqn)

    # ------------------------------------------------------------------ hooks
    def _linear_pre_hook(self, fqn: str, module: nn.Linear, args: tuple, kwargs: dict):
        input = args[0] if args else kwargs.get("input")
        if not (self._active and isinstance(input, torch.Tensor)):
            return None
        recipe = _fp8_recipe_name(module)
        found = partial(NonFiniteFinding, fqn, type(module).__name__, Gemm.OUTPUT.value, phase=FORWARD, recipe=recipe)
        if self.finding is None:
            device_type = input.device.type
            operands = ((Role.INPUT.value, input), (Role.WEIGHT.value, module.weight), ("bias", module.bias))
            for operand, tensor in operands:
                counts = _nonfinite_counts([_as_gemm_operand(tensor, device_type)] if tensor is not None else [])
                if counts is not None:
                    self._record(found(operand, num_nan=counts[0], num_inf=counts[1]))
                    break
        if self.finding is not None or not torch.is_grad_enabled():
            return None
        self._hook_weight_grad(fqn, module, recipe)
        if not input.requires_grad:
            return None
        # This layer's own gradient of its input (not summed with other users of the tensor).
        alias = input.view_as(input)
        alias.register_hook(partial(self._grad_hook, fqn, type(module).__name__, Gemm.GRAD_INPUT, RESULT, recipe))
        return ((alias, *args[1:]), kwargs) if args else (args, {**kwargs, "input": alias})

    def _hook_weight_grad(self, fqn: str, module: nn.Linear, recipe: str | None) -> None:
        weight = module.weight
        if not weight.requires_grad or id(weight) in self._hooked_weights:
            return
        self._hooked_weights[id(weight)] = weight  # held, so the id stays this tensor's
        hook = partial(self._grad_hook, fqn, type(module).__name__, Gemm.GRAD_WEIGHT, RESULT, recipe)
        self._handles.append(weight.register_hook(hook))

    def _linear_hook(self, fqn: str, module: nn.Linear, args: tuple, kwargs: dict, output):
        if not (self._active and self.finding is None and isinstance(output, torch.Tensor)):
            return
        recipe = _fp8_recipe_name(module)
        counts = _nonfinite_counts([output])
        if counts is not None:
            name = type(module).__name__
            self._record(NonFiniteFinding(fqn, name, Gemm.OUTPUT.value, RESULT, FORWARD, *counts, recipe=recipe))
            return
        if torch.is_grad_enabled() and output.requires_grad:
            input = args[0] if args else kwargs.get("input")
            input_grad = isinstance(input, torch.Tensor) and input.requires_grad
            gemm = Gemm.GRAD_INPUT if input_grad else Gemm.GRAD_WEIGHT  # the first to use grad_output
            hook = partial(self._grad_hook, fqn, type(module).__name__, gemm, Role.GRAD_OUTPUT.value, recipe)
            output.register_hook(hook)

    def _grad_hook(self, fqn: str, module_type: str, gemm: Gemm, operand: str, recipe: str | None, grad):
        if not (self._active and self.finding is None and isinstance(grad, torch.Tensor)):
            return
        counts = _nonfinite_counts([grad])
        if counts is not None:
            self._record(NonFiniteFinding(fqn, module_type, gemm.value, operand, BACKWARD, *counts, recipe=recipe))

    def _module_hook(self, fqn: str, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        if not (self._active and self._wants_origin(fqn)):
            return
        counts = _nonfinite_counts(_tensors(output))
        if counts is None or _nonfinite_counts(_tensors((args, kwargs))) is not None:
            return
        self._consider_origin(NonFiniteFinding(fqn, type(module).__name__, None, "output", FORWARD, *counts))

    def _model_input_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (self._active and self.finding is None):
            return
        counts = _nonfinite_counts(_tensors((args, kwargs)))
        if counts is not None:
            self._consider_origin(NonFiniteFinding("", type(module).__name__, None, "input", FORWARD, *counts))


@contextlib.contextmanager
def detect_nonfinite(model: nn.Module, *, raise_on_first: bool = True) -> Iterator[NonFiniteDetector]:
    """Find the first NaN or infinity in the forward and backward run inside the block.

    Hooks ``model``'s modules on entry (a fresh record) and removes every hook on exit,
    also when the block raises; changes no value. Run the backward inside the block too.
    A debugging tool: it costs a reduction and a host synchronization per checked tensor.
    What is checked: see :mod:`fp8train.diagnostics.nonfinite`.

    ::

        with fp8train.detect_nonfinite(model) as detector:
            model(x).sum().backward()    # raises NonFiniteError at the first finding

    Args:
        model: the module to watch (every submodule is hooked; for a wrapped model, such as
            ``DistributedDataParallel``, pass the inner module and run the wrapper).
        raise_on_first: raise :class:`NonFiniteError` at the first non-finite GEMM operand
            or result of a Linear layer; ``False`` only records (read ``detector.finding``,
            ``detector.origin``, ``detector.describe()`` after the block).

    Yields:
        the :class:`NonFiniteDetector` holding what was found.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``raise_on_first`` not a bool.
        NonFiniteError: with ``raise_on_first``, at the first finding.
    """
    check_type("model", model, nn.Module, "an nn.Module")
    check_bool("raise_on_first", raise_on_first)
    detector = NonFiniteDetector(model, raise_on_first)
    detector._install()
    try:
        yield detector
    finally:
        detector._remove()


# ---------------------------------------------------------------------------- helpers


def _nonfinite_counts(tensors: Iterable[torch.Tensor]) -> tuple[int, int] | None:
    """``(NaN elements, infinite elements)`` over ``tensors``, or ``None`` when all are finite."""
    num_nan = num_inf = 0
    with torch.no_grad():
        for tensor in tensors:
            if tensor.dtype not in _CHECKED_DTYPES or bool(torch.isfinite(tensor).all()):
                continue
            num_nan += int(torch.isnan(tensor).sum())
            num_inf += int(torch.isinf(tensor).sum())
    return (num_nan, num_inf) if num_nan or num_inf else None


def _as_gemm_operand(tensor: torch.Tensor, device_type: str) -> torch.Tensor:
    """``tensor`` as a Linear's GEMM gets it: cast to the autocast dtype where one is on."""
    tensor = tensor.detach()
    if torch.is_autocast_enabled(device_type) and tensor.dtype in HIGH_PRECISION_DTYPES:
        return tensor.to(torch.get_autocast_dtype(device_type))
    return tensor


def _tensors(value) -> Iterator[torch.Tensor]:
    """The tensors in a module's (nested tuple, list or dict) inputs or output."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _fp8_recipe_name(module: nn.Module) -> str | None:
    """The recipe a ``Float8Linear`` runs now (an autocast may override it), or ``None``."""
    if not isinstance(module, Float8Linear):
        return None
    state = current_state()
    if state is not None and not state.enabled:
        return None
    return (state.recipe if state is not None and state.recipe is not None else module.recipe).name


def _encloses(outer: str, inner: str) -> bool:
    """Whether module ``outer`` (a qualified name; ``""`` the model) encloses ``inner``."""
    return outer == "" or inner.startswith(outer + ".")


def _input_went_nonfinite_inside(finding: NonFiniteFinding, fqn: str) -> bool:
    """Whether ``finding`` is a Linear's forward input and module ``fqn`` encloses it."""
    return finding.gemm == Gemm.OUTPUT.value and finding.operand == Role.INPUT.value and _encloses(fqn, finding.module)
