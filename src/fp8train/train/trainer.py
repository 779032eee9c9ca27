"""``Trainer``: a readable training loop with FP8 as one argument.

What a trainer is built from (device, model, optimizer) is :mod:`.trainer_setup`; what it
records each step is :mod:`.metrics`; what it does with a non-finite step is
:mod:`.nonfinite_step`. This file is the loop: a step's micro-batches, the optimizer step,
evaluation, and the checkpoints it saves and resumes from.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from ..nn.autocast import autocast as fp8_autocast
from ..nn.modules.base import Float8Module
from ..nn.step_graph import StepGraph
from ..diagnostics.gemm_capture import capture_linear_calls
from ..diagnostics.nonfinite import NonFiniteError, detect_nonfinite
from ..parallel.distributed import (
    after_optimizer_step,
    full_model_state_dict,
    full_optimizer_state_dict,
    init_distributed,
    is_main_process,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
    mean_over_ranks,
    report_rank_failures,
    resolve_strategy,
    wrap_model,
)
from .arguments import TrainingArguments
from .checkpoint import (
    CheckpointContents, CheckpointError, latest_checkpoint, load_resume_checkpoint, prune_checkpoints,
    write_checkpoint,
)
from .metrics import MetricsLog, fp8_statistics
from .nonfinite_step import RerunReport, StepState, gather_reports, is_nonfinite_step, nonfinite_message
from .rng import capture_rng_state, restore_rng_state
from .memory import training_state_bytes
from .trainer_setup import (
    build_optimizer, build_training_model, check_trainer_arguments, compile_model, local_rank_from_env,
    mixed_precision_autocast, sample_batch, training_device, use_cuda_graphs,
)

__all__ = ["Trainer", "TrainResult", "latest_checkpoint"]

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _default_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(inputs, targets)


class TrainResult(dict):
    """What :meth:`Trainer.train` returns: ``losses`` (per step), ``val_losses`` (step ->
    loss), ``final_train_loss``, ``final_val_loss``, ``tokens_per_second``,
    ``converted_layers`` and ``total_linear_layers`` (matmul modules in FP8, and in all,
    as :func:`fp8train.conversion_report` counts them), ``elapsed_seconds``, and
    ``state_bytes`` (weights, gradients and optimizer state at the end:
    :func:`~fp8train.train.memory.training_state_bytes`)."""


class Trainer:
    """Train a model on ``(inputs, targets)`` datasets with the settings of ``args``.

    Args:
        model: an ``nn.Module``, or a zero-argument factory that builds one (built after
            seeding, so every run with the same seed starts from the same weights).
        args: the :class:`TrainingArguments`.
        train_dataset: map-style dataset of ``(inputs, targets)`` pairs.
        eval_dataset: the same for validation (optional).
        loss_fn: ``(model, inputs, targets) -> loss``; default ``model(inputs, targets)``.

    Batches are drawn by a generator seeded from ``(seed, step)``, so a resumed run sees
    the batches an uninterrupted run sees.
    """

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        args: TrainingArguments,
        train_dataset: Dataset,
        eval_dataset: Dataset | None = None,
        *,
        loss_fn: LossFn = _default_loss,
    ) -> None:
        check_trainer_arguments(model, args, train_dataset, eval_dataset, loss_fn)
        self.args = args
        self.train_dataset, self.eval_dataset, self.loss_fn = train_dataset, eval_dataset, loss_fn
        self.device = training_device(args, local_rank_from_env())
        self.rank, self.world_size = init_distributed(self.device, timeout_seconds=args.dist_timeout)
        self.strategy = resolve_strategy(args.strategy, self.world_size, args.tp)
        # Tensor-parallel ranks (consecutive) share their batches: data is drawn per data-parallel rank.
        self.data_rank, self.data_world_size = self.rank // args.tp, max(1, self.world_size // args.tp)
        self.is_main = is_main_process()
        if args.tp > 1 and args.fp8_recipe is not None and args.fp8_stats_interval and self.is_main:
            logger.warning(
                "fp8train: fp8_stats_interval=%d records nothing under tp=%d: the statistics quantize whole "
                "tensors, and each rank holds slices; measure the model in one process (fp8train inspect "
                "--checkpoint) instead", args.fp8_stats_interval, args.tp,
            )
        torch.manual_seed(args.seed)
        random.seed(args.seed)
        model, self.converted_layers, self.total_linear_layers = build_training_model(model, args, self.device)
        # FSDP2 shards `model` in place; DDP wraps it. `self.model` is what is saved.
        wrapped = wrap_model(model, self.strategy, self.device, tp=args.tp)
        self.model = model
        self.eager_model = wrapped  # hooks (telemetry, the sentinel) need eager calls
        # Its own recompile limit where this torch can give one (compile_model).
        self.forward_model = compile_model(wrapped) if args.torch_compile else wrapped
        self.optimizer, self.scheduler = build_optimizer(self.model, args)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=args.mixed_precision == "fp16")
        self._step_state = StepState(self.model)  # RNG and FP8 state before each step (on_nonfinite)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        graphs = use_cuda_graphs(args, self.device, self.strategy)
        self.step_graph = StepGraph(self._static_step, wrapped, trainable) if graphs else None
        self.step = 0
        self.output_dir = Path(args.output_dir)

    def _autocast(self):
        return mixed_precision_autocast(self.args, self.device)

    def _batch(self, dataset: Dataset, step: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = sample_batch(dataset, self.args.seed, step, self.args.batch_size, stream, self.data_rank)
        return inputs.to(self.device), targets.to(self.device)

    # ------------------------------------------------------------------ the loop
    def train(self) -> TrainResult:
        """Run ``args.steps`` optimizer steps (continuing from a checkpoint with ``resume``).

        Raises:
            RankFailedError: under torchrun, another rank failed, or did not join a
                collective within ``args.dist_timeout`` seconds.
        """
        with report_rank_failures(self.args.dist_timeout):
            return self._train()

    def _train(self) -> TrainResult:
        args = self.args
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.json").write_text(json.dumps(args.to_dict(), indent=2))
        history = {"losses": [], "val_losses": {}}
        if args.resume:
            history = self._resume() or history
        # Only rank 0 writes metrics and shows progress.
        metrics = (
            MetricsLog(self.output_dir, start_step=self.step, steps=args.steps, log_interval=args.log_interval)
            if self.is_main else contextlib.nullcontext()
        )
        # tokens/s leaves out the first steps, which pay one-time kernel setup.
        timing_starts_after = self.step + min(5, max(0, (args.steps - self.step) // 5))
        tokens_seen, start, train_seconds = 0, time.perf_counter(), 0.0
        with metrics:
            while self.step < args.steps:
                step_start = time.perf_counter()
                stats_modules = self._fp8_stats_modules()
                # A compiled model runs no hooks: a statistics step runs the same
                # arithmetic eagerly.
                model = self.forward_model if stats_modules is None else self.eager_model
                loss, grad_norm, tokens, learning_rate, skipped, fp8_calls = self._train_step(model, stats_modules)
                step_seconds = time.perf_counter() - step_start
                if self.step >= timing_starts_after:
                    train_seconds += step_seconds
                    tokens_seen += tokens
                self.step += 1
                history["losses"].append(loss)
                record = {
                    "step": self.step,
                    "loss": loss,
                    "lr": learning_rate,
                    "grad_norm": grad_norm,
                    "tokens_per_second": tokens / step_seconds,
                    "elapsed_seconds": time.perf_counter() - start,
                }
                self._complete_record(record, history, skipped, fp8_calls, stats_modules)
                if self.is_main:
                    metrics.write(record)
                if args.save_checkpoints and self._is_due(args.checkpoint_interval):
                    self.save_checkpoint(history)
        return self._result(history, tokens_seen, train_seconds, start)

    def _complete_record(self, record: dict, history: dict, skipped: bool, fp8_calls, stats_modules) -> None:
        """Add to a step's ``record`` what its step has: ``skipped`` (a non-finite step,
        ``on_nonfinite="skip"``), ``fp8_stats`` (``fp8_stats_interval``) and ``val_loss``
        (``eval_interval``, which also goes into ``history``)."""
        if skipped:
            record["skipped"] = True
        if fp8_calls:
            record["fp8_stats"] = fp8_statistics(fp8_calls, stats_modules, self.args.fp8_backend)
        if self.eval_dataset is not None and self._is_due(self.args.eval_interval):
            record["val_loss"] = history["val_losses"][self.step] = self.evaluate()

    def _is_due(self, interval: int) -> bool:
        """Whether an every-``interval``-steps action runs now (always at the last step)."""
        return self.step == self.args.steps or bool(interval and self.step % interval == 0)

    def _fp8_stats_modules(self) -> dict[str, nn.Module] | None:
        """The FP8 modules whose GEMMs the step about to run measures, if its statistics are
        due (``fp8_stats_interval``); else ``None``."""
        interval = self.args.fp8_stats_interval
        if not interval or self.args.fp8_recipe is None or (self.step + 1) % interval:
            return None
        if self.args.tp > 1:  # the statistics quantize whole tensors; a rank holds slices
            return None
        return {name: m for name, m in self.model.named_modules() if isinstance(m, Float8Module)}

    def _result(self, history: dict, tokens_seen: int, train_seconds: float, start: float) -> TrainResult:
        tail = [loss for loss in history["losses"][-max(1, self.args.log_interval):] if math.isfinite(loss)]
        return TrainResult(
            losses=history["losses"],
            val_losses=history["val_losses"],
            final_train_loss=sum(tail) / len(tail) if tail else math.nan,
            final_val_loss=history["val_losses"].get(self.args.steps, math.nan),
            tokens_per_second=tokens_seen / train_seconds if train_seconds else math.nan,
            converted_layers=self.converted_layers,
            total_linear_layers=self.total_linear_layers,
            elapsed_seconds=time.perf_counter() - start,
            state_bytes=training_state_bytes(self.model, self.optimizer),
        )

    def _train_step(self, model: nn.Module, stats_modules: dict | None = None) -> tuple:
        """One optimizer step through ``model`` (compiled or eager): ``(loss, grad_norm,
        tokens, learning_rate, skipped, fp8_calls)``, the last the GEMM calls of
        ``stats_modules`` in the first micro-batch (``None`` without)."""
        args = self.args
        learning_rate = self.scheduler.get_last_lr()[0]  # the rate this step uses
        model.train()
        self._step_state.capture()  # to re-run this step if it goes non-finite
        if stats_modules is None and self.step_graph is not None:  # a statistics step runs eagerly, hooked
            total_loss, tokens, fp8_calls = self._run_graphed()
        else:
            total_loss, tokens, fp8_calls = self._run_micro_batches(model, stats_modules)
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), args.max_grad_norm if args.max_grad_norm > 0 else math.inf
        )
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2
        # The mean over ranks (on the group's device): logged, and every rank decides alike on it.
        total_loss = mean_over_ranks(total_loss)
        grad_norm = grad_norm.item()  # global (DDP all-reduced gradients, FSDP2 full_tensor)
        skipped = is_nonfinite_step(total_loss, grad_norm, grad_scaler=self.scaler.is_enabled())
        if skipped:
            self._on_nonfinite(total_loss, grad_norm)  # raises with on_nonfinite="stop"
        else:
            self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        after_optimizer_step(self.model, self.strategy)
        return total_loss, grad_norm, tokens * self.data_world_size, learning_rate, skipped, fp8_calls

    def _run_micro_batches(self, model: nn.Module, stats_modules: dict | None = None) -> tuple:
        """Forward and backward of this step's micro-batches through ``model``: ``(loss,
        tokens, fp8_calls)``, the last the GEMM calls of ``stats_modules`` in the first
        micro-batch (``None`` without)."""
        args = self.args
        total_loss, tokens, fp8_calls = 0.0, 0, None
        for micro in range(args.grad_accumulation_steps):
            inputs, targets = self._batch(self.train_dataset, self.step * args.grad_accumulation_steps + micro, 0)
            measure = stats_modules is not None and micro == 0
            with capture_linear_calls(stats_modules) if measure else contextlib.nullcontext() as captured:
                loss = self._micro_batch(model, inputs, targets)
            fp8_calls = captured if measure else fp8_calls
            total_loss += loss.item()
            tokens += targets.numel()
        return total_loss, tokens, fp8_calls

    def _micro_batch(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch's forward, loss and backward; its loss (divided by the micro-batches)."""
        # fp8train.autocast: delayed scaling updates its forward scales at the exit.
        with self._autocast(), fp8_autocast(enabled=self.args.fp8_recipe is not None):
            loss = self.loss_fn(model, inputs, targets) / self.args.grad_accumulation_steps
        self.scaler.scale(loss).backward()
        return loss

    def _static_step(self, batches: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The step :attr:`step_graph` runs, and captures: every micro-batch of ``batches``
        (inputs and targets, flattened)."""
        pairs = zip(batches[0::2], batches[1::2])
        return tuple(self._micro_batch(self.forward_model, inputs, targets) for inputs, targets in pairs)

    def _run_graphed(self) -> tuple:
        """This step's micro-batches through :attr:`step_graph` (eager warm-up, then replays),
        as :meth:`_run_micro_batches` returns them."""
        n = self.args.grad_accumulation_steps
        batches = [self._batch(self.train_dataset, self.step * n + micro, 0) for micro in range(n)]
        total_loss = 0.0
        for loss in self.step_graph([t for batch in batches for t in batch]):
            total_loss += loss.item()
        return total_loss, sum(targets.numel() for _, targets in batches), None

    def _on_nonfinite(self, loss: float, grad_norm: float) -> None:
        """Re-run the step from its start under the detector to name where a value first
        went non-finite, put the state back as before the step, then stop (raise) or skip.

        Every rank takes this path together (the loss is all-reduced, the gradient norm
        global), so the re-run's collectives match.
        """
        rng_after_step = capture_rng_state()
        self.optimizer.zero_grad(set_to_none=True)
        self._step_state.restore()
        with detect_nonfinite(self.model, raise_on_first=False) as detector:
            rerun_loss, _, _ = self._run_micro_batches(self.eager_model)
        self.optimizer.zero_grad(set_to_none=True)
        self._step_state.restore(rng=False)  # the re-run recorded its amaxes too
        restore_rng_state(rng_after_step)  # the step drew what it drew, skipped or not
        reports = gather_reports(RerunReport.of(detector, rerun_loss))
        args = self.args
        message = nonfinite_message(
            self.step + 1, loss, grad_norm, recipe=args.fp8_recipe, mixed_precision=args.mixed_precision,
            reports=reports, action=args.on_nonfinite, output_dir=self.output_dir,
        )
        if args.on_nonfinite == "stop":
            first = next((r for r in reports if r.finding is not None or r.origin is not None), reports[0])
            raise NonFiniteError(message, first.finding, first.origin, step=self.step + 1)
        if self.is_main:
            logger.warning("%s", message)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over ``args.eval_batches`` fixed validation batches."""
        self.forward_model.eval()
        losses = []
        for index in range(self.args.eval_batches):
            inputs, targets = self._batch(self.eval_dataset, index, 1)
            with self._autocast(), fp8_autocast(enabled=self.args.fp8_recipe is not None):
                losses.append(self.loss_fn(self.forward_model, inputs, targets).item())
        self.forward_model.train()
        return sum(losses) / len(losses)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, history: dict) -> Path:
        """Write ``output_dir/checkpoint-<step>`` atomically, with a manifest of its files'
        sizes and sha256 written last (see :mod:`fp8train.train.checkpoint`); then, with
        ``save_total_limit``, delete the oldest checkpoints past the limit."""
        final = self.output_dir / f"checkpoint-{self.step}"
        # Every rank takes part in gathering the full state (FSDP2); rank 0 writes it.
        contents = CheckpointContents(
            model=full_model_state_dict(self.model, self.strategy),
            optimizer=full_optimizer_state_dict(self.model, self.optimizer, self.strategy),
            scheduler=self.scheduler.state_dict(),
            scaler=self.scaler.state_dict(),
            rng=capture_rng_state(),
            config=self.args.to_dict(),
            trainer={
                "step": self.step,
                "data_position": self.step * self.args.grad_accumulation_steps,
                "losses": history["losses"],
                "val_losses": {str(k): v for k, v in history["val_losses"].items()},
            },
        )
        if not self.is_main:
            dist.barrier()
            return final
        final = write_checkpoint(self.output_dir, contents)
        logger.info("saved %s", final)
        if self.args.save_total_limit is not None:  # only rank 0 deletes
            prune_checkpoints(self.output_dir, self.args.save_total_limit, verified=final)
        if self.world_size > 1:
            dist.barrier()  # the other ranks wait until the checkpoint is whole
        return final

    def _resume(self) -> dict | None:
        # Verifies checksums and falls back past damaged checkpoints (resume_fallback).
        found = load_resume_checkpoint(self.output_dir, fallback=self.args.resume_fallback)
        if found is None:
            logger.info("resume: no checkpoint in %s; starting from scratch", self.output_dir)
            return None
        checkpoint, contents = found
        try:
            load_full_model_state_dict(self.model, contents.model, self.strategy)
            load_full_optimizer_state_dict(self.model, self.optimizer, contents.optimizer, self.strategy)
        except (RuntimeError, KeyError, ValueError) as error:  # missing keys, other shapes
            detail = next((line.strip() for line in str(error).splitlines()[1:] if line.strip()), str(error))
            raise CheckpointError(
                f"{checkpoint} holds another model's training state ({detail}): resume with the settings it was "
                f"saved with (its config.json), or choose another --output_dir"
            ) from error
        self.scheduler.load_state_dict(contents.scheduler)
        self.scaler.load_state_dict(contents.scaler)
        restore_rng_state(contents.rng)
        self.step = contents.step
        logger.info("resumed from %s at step %d", checkpoint, self.step)
        val_losses = contents.trainer["val_losses"]
        return {"losses": contents.trainer["losses"], "val_losses": {int(k): v for k, v in val_losses.items()}}
