"""What a training run records, on rank 0: one line of ``metrics.jsonl`` per step,
TensorBoard scalars (where tensorboard is installed), a progress bar on a terminal or a log
line every ``log_interval`` steps; and the FP8 statistics of a step's GEMMs
(``fp8_stats_interval``) that go into its record."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from torch import nn

from ..diagnostics.gemm_capture import linear_call_statistics

__all__ = ["MetricsLog", "FP8_STATS_FIELDS", "fp8_statistics", "truncate_metrics"]

logger = logging.getLogger(__name__)

FP8_STATS_FIELDS = ("layer", "call", "gemm", "operand", "sqnr_db", "underflow_pct", "saturation_pct", "amax",
                    "nonfinite", "scale_min", "scale_max")
"""The fields of one ``fp8_stats`` entry of a step's record."""


def fp8_statistics(calls: list, modules: dict[str, nn.Module], backend: str) -> list[dict]:
    """Per GEMM call, GEMM and operand (and result): what the module's recipe did
    (:func:`~fp8train.diagnostics.gemm_capture.linear_call_statistics`), as ``FP8_STATS_FIELDS`` dicts."""
    stats = []
    for call in calls:
        records = linear_call_statistics(call, modules[call.layer].recipe, backend=backend)
        stats += [{key: getattr(record, key) for key in FP8_STATS_FIELDS} for record in records]
    return stats


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the records of ``path`` past ``step``, the step a run (re)starts from: after a
    crash and a resume, the steps that are run again must not appear twice."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        path.write_text("".join(line + "\n" for line in kept))


class MetricsLog:
    """Rank 0's sinks for a run's step records, open from ``start_step`` to ``steps``:
    ``output_dir/metrics.jsonl`` (appended to, past records beyond ``start_step``
    dropped), ``output_dir/tensorboard``, and the progress bar (on a terminal) or a log
    line every ``log_interval`` steps, at an evaluation and at the last step. A context
    manager: leaving it closes all three."""

    def __init__(self, output_dir: Path, *, start_step: int, steps: int, log_interval: int) -> None:
        self._steps, self._log_interval = steps, log_interval
        truncate_metrics(output_dir / "metrics.jsonl", start_step)
        self._file = open(output_dir / "metrics.jsonl", "a")
        self._tensorboard = _tensorboard(output_dir)
        self._progress = _progress_bar(steps, start_step)

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for sink in (self._file, self._progress, self._tensorboard):
            if sink is not None:
                sink.close()

    def write(self, record: dict) -> None:
        """One step's ``record`` (``step``, ``loss``, ``lr``, ... and, on its steps,
        ``val_loss`` and ``fp8_stats``): a line of ``metrics.jsonl``, TensorBoard scalars,
        and the log/progress."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = record["step"]
        if self._tensorboard is not None:
            for key, value in record.items():
                if key not in ("step", "fp8_stats"):
                    self._tensorboard.add_scalar(key, value, step)
            for stats in record.get("fp8_stats", ()):
                prefix = f"fp8/{stats['layer']}/{stats['gemm']}.{stats['operand']}"
                for key in ("sqnr_db", "underflow_pct", "saturation_pct", "amax"):
                    if stats[key] is not None:
                        self._tensorboard.add_scalar(f"{prefix}/{key}", stats[key], step)
        self._report(record)

    def _report(self, record: dict) -> None:
        step = record["step"]
        if self._progress is not None:
            self._progress.update(1)
            self._progress.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if step % self._log_interval == 0 or "val_loss" in record or step == self._steps:
            message = (
                f"step {step}/{self._steps} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                f"grad_norm {record['grad_norm']:.3f} tokens/s {record['tokens_per_second']:.0f}"
                + (f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else "")
            )
            if self._progress is not None:
                self._progress.write(message)
            else:
                logger.info(message)


def _progress_bar(steps: int, start_step: int):
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=steps, initial=start_step, desc="train", unit="step")


def _tensorboard(output_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(output_dir / "tensorboard"))
