"""What the trainer does with a non-finite step (``on_nonfinite``): what a step keeps so
that it can be re-run under the detector (:func:`fp8train.detect_nonfinite`), what the
ranks found on the re-run, and the message that names it before the trainer stops or
skips the step.

A good step pays only for :meth:`StepState.capture` (the RNG states and copies of the
delayed-scaling buffers, a few small tensors): the trigger, a non-finite loss or gradient
norm, uses numbers the trainer computes anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..nn.convert import FP8_STATE_NAMES
from ..diagnostics.nonfinite import FORWARD, NonFiniteDetector, NonFiniteFinding, describe_findings
from .checkpoint import list_checkpoints, verify_checkpoint
from .rng import RngState, capture_rng_state, restore_rng_state

__all__ = ["StepState", "RerunReport", "gather_reports", "nonfinite_message", "is_nonfinite_step"]


class StepState:
    """What a training step changes besides parameters, gradients and optimizer state, so
    that it can be re-run from its start: the RNG states and delayed scaling's buffers
    (``fp8_scale``, ``fp8_amax_history``; a NaN recorded there would poison later steps)."""

    def __init__(self, model: nn.Module) -> None:
        # (module, buffer name): read at each capture, so a re-registered buffer is followed.
        self._owners = [
            (module, name)
            for module in model.modules()
            for name, _ in module.named_buffers(recurse=False)
            if name in FP8_STATE_NAMES
        ]
        self._fp8_state: list[torch.Tensor] = []
        self._rng: RngState | None = None

    def capture(self) -> None:
        """Remember the current state (before a step)."""
        self._rng = capture_rng_state()
        self._fp8_state = [getattr(module, name).clone() for module, name in self._owners]

    def restore(self, *, rng: bool = True) -> None:
        """Set the FP8 state, and with ``rng`` the RNG states, to the captured ones."""
        with torch.no_grad():
            for (module, name), saved in zip(self._owners, self._fp8_state):
                getattr(module, name).copy_(saved)
        if rng:
            restore_rng_state(self._rng)


def is_nonfinite_step(loss: float, grad_norm: float, *, grad_scaler: bool) -> bool:
    """Whether a step's (all-reduced) loss or global gradient norm is non-finite. With a
    gradient scaler (fp16), overflowing gradients are the scaler's to skip: only the loss."""
    return not math.isfinite(loss) or (not grad_scaler and not math.isfinite(grad_norm))


@dataclass(frozen=True)
class RerunReport:
    """One rank's re-run of a step under the detector."""

    finding: NonFiniteFinding | None
    origin: NonFiniteFinding | None
    loss: float

    @classmethod
    def of(cls, detector: NonFiniteDetector, loss: float) -> "RerunReport":
        return cls(detector.finding, detector.origin, loss)


def gather_reports(report: RerunReport) -> list[RerunReport]:
    """Every rank's report, by rank (a collective under torch.distributed: every rank calls it)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [report]
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return reports


def _newest_loadable_checkpoint(output_dir: Path) -> Path | None:
    """The newest ``checkpoint-<step>`` whose files verify (read only when a step fails)."""
    return next((path for path in list_checkpoints(output_dir) if not verify_checkpoint(path)), None)


def _what_went_nonfinite(loss: float, grad_norm: float) -> str:
    if not math.isfinite(loss):
        return f"loss ({loss})"
    return f"gradient norm ({grad_norm}; loss {loss:.4f})"


def _describe_rerun(report: RerunReport) -> str | None:
    """Where the re-run on one rank first saw a non-finite value, or ``None``."""
    if report.origin is not None or (report.finding is not None and report.finding.phase == FORWARD):
        return f"first non-finite value: {describe_findings(report.finding, report.origin)}"
    if not math.isfinite(report.loss):  # the backward's non-finite values follow from the loss
        return f"every module's forward was finite, but loss_fn made the loss non-finite ({report.loss})"
    if report.finding is not None:
        return f"first non-finite value: {report.finding}"
    return None


def _where(reports: list[RerunReport]) -> str:
    """The first non-finite value, from the lowest rank that saw one; or why none is named."""
    found = [(rank, text) for rank, text in enumerate(map(_describe_rerun, reports)) if text is not None]
    if found:
        rank, text = found[0]
        return text if len(reports) == 1 else f"on rank {rank} of {len(reports)}, {text}"
    return (
        "a re-run of the step under fp8train.detect_nonfinite found no non-finite value, so no place is "
        "named (not reproducible: nondeterministic kernels, torch_compile, or a fault outside the model)"
    )


def nonfinite_message(
    step: int,
    loss: float,
    grad_norm: float,
    *,
    recipe: str | None,
    mixed_precision: str,
    reports: list[RerunReport],
    action: str,
    output_dir: Path | None = None,
) -> str:
    """One line naming the step, the recipe, where the value first went non-finite, and
    what happens now: ``action="stop"`` names the newest checkpoint that verifies (read
    from ``output_dir``), ``"skip"`` says the step was skipped."""
    setting = f"fp8_recipe={recipe or 'none'}, mixed_precision={mixed_precision}"
    text = f"step {step} ({setting}): non-finite {_what_went_nonfinite(loss, grad_norm)}; {_where(reports)}"
    if action == "skip":
        return text + "; skipped the step: gradients discarded, FP8 scaling state restored (on_nonfinite='skip')"
    checkpoint = _newest_loadable_checkpoint(output_dir) if output_dir is not None else None
    if checkpoint is None:
        return text + "; no checkpoint was written before it"
    return text + f"; the newest checkpoint, {checkpoint}, verifies: resume from it with resume=True (--resume true)"
