"""``Trainer``: a readable training loop with FP8 as one argument.

Order of setup (it matters): build the model, move it to its device, convert it to FP8,
compile it, then build the optimizer over the (shared) parameters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from ..nn.autocast import autocast as fp8_autocast
from ..nn.convert import conversion_report, convert_to_float8_training, matmul_modules
from ..nn.linear import Float8Module
from ..nn.numerics import capture_linear_calls, linear_call_statistics
from ..nn.sentinel import NonFiniteError, detect_nonfinite
from ..parallel.distributed import (
    after_optimizer_step,
    full_model_state_dict,
    full_optimizer_state_dict,
    init_distributed,
    is_main_process,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
    report_rank_failures,
    resolve_strategy,
    wrap_model,
)
from ..spec.checks import ArgumentTypeError, UnsupportedHardwareError, check_callable, check_type
from .arguments import TrainingArguments
from .checkpoint import (
    CheckpointContents, CheckpointError, latest_checkpoint, load_resume_checkpoint, prune_checkpoints,
    write_checkpoint,
)
from .nonfinite import RerunReport, StepState, gather_reports, is_nonfinite_step, nonfinite_message
from .rng import capture_rng_state, restore_rng_state

__all__ = ["Trainer", "TrainResult", "latest_checkpoint"]

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _default_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(inputs, targets)


def _check_trainer_arguments(model, args, train_dataset, eval_dataset, loss_fn) -> None:
    """Types of :class:`Trainer`'s arguments, and a device that exists, before any work."""
    check_type("args", args, TrainingArguments, "a TrainingArguments")
    if not isinstance(model, nn.Module):
        check_callable("model", model, signature="returning an nn.Module, or an nn.Module")
    for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        if dataset is None and name == "eval_dataset":
            continue
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ArgumentTypeError(
                f"{name} must be a map-style dataset of (inputs, targets) pairs (with __len__ and __getitem__), "
                f"got {type(dataset).__name__}"
            )
    if len(train_dataset) == 0:
        raise ValueError("train_dataset is empty")
    check_callable("loss_fn", loss_fn, signature="(model, inputs, targets) -> loss")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UnsupportedHardwareError("device='cuda' but this machine has no CUDA device: use device='cpu' (or 'auto')")


def training_device(args: TrainingArguments) -> torch.device:
    """The device ``args.device`` names (``auto``: CUDA where there is one), this process's
    GPU under torchrun (``LOCAL_RANK``)."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")


def mixed_precision_autocast(args: TrainingArguments, device: torch.device):
    """The ``torch.autocast`` a training step runs its forward under (``args.mixed_precision``)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mixed_precision)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def sample_batch(
    dataset: Dataset, seed: int, step: int, batch_size: int, stream: int = 0, rank: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(inputs, targets)`` batch the trainer draws for micro-batch ``step`` of
    ``stream`` (0: training, 1: validation), stacked. Drawn by a generator seeded from
    ``(seed, step, stream)``, so a resumed run sees the batches an uninterrupted one sees;
    training batches differ per rank, validation batches are the same on all."""
    rank_offset = (rank << 32) if stream == 0 else 0
    generator = torch.Generator().manual_seed(seed * 1_000_003 + 4 * step + stream + rank_offset)
    indices = torch.randint(0, len(dataset), (batch_size,), generator=generator).tolist()
    inputs, targets = zip(*(dataset[i] for i in indices))
    return torch.stack(inputs), torch.stack(targets)


class TrainResult(dict):
    """What :meth:`Trainer.train` returns: ``losses`` (per step), ``val_losses`` (step ->
    loss), ``final_train_loss``, ``final_val_loss``, ``tokens_per_second``,
    ``converted_layers`` and ``total_linear_layers`` (matmul modules in FP8, and in all,
    as :func:`fp8train.conversion_report` counts them), ``elapsed_seconds``."""


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
        _check_trainer_arguments(model, args, train_dataset, eval_dataset, loss_fn)
        self.args = args
        self.train_dataset, self.eval_dataset, self.loss_fn = train_dataset, eval_dataset, loss_fn
        self.device = training_device(args)
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
        model = model() if not isinstance(model, nn.Module) else model
        check_type("model()", model, nn.Module, "an nn.Module (the model factory's result)")
        model = model.to(self.device)
        # Counted in matmul modules (Linear, Conv1D, attention, experts), as the conversion
        # report counts them; its summary line is logged by the conversion (WARNING with skips).
        self.converted_layers, self.total_linear_layers = 0, len(matmul_modules(model))
        if args.fp8_recipe is not None:
            model = convert_to_float8_training(
                model, args.fp8_recipe, dim_alignment=args.fp8_dim_alignment, backend=args.fp8_backend
            )
            report = conversion_report(model)
            self.converted_layers, self.total_linear_layers = report.num_converted, report.num_matmul_modules
            if self.converted_layers == 0:
                reasons = "; ".join(f"{m.name} ({m.reason})" for m in report.modules) or "it has none"
                raise ValueError(
                    f"fp8_recipe={args.fp8_recipe!r} converted none of the model's {self.total_linear_layers} "
                    f"matmul modules: {reasons}"
                )
        # FSDP2 shards `model` in place; DDP wraps it. `self.model` is what is saved.
        wrapped = wrap_model(model, self.strategy, self.device, tp=args.tp)
        self.model = model
        # Dynamo's recompile limit (8) counts per code object, and every compiled module
        # runs through the same wrapper: without isolation, the models a process compiles
        # (`compare --torch_compile true` compiles seven) share the 8, and the ones past it
        # silently run eager.
        self.eager_model = wrapped  # hooks (telemetry, the sentinel) need eager calls
        self.forward_model = torch.compile(wrapped, isolate_recompiles=True) if args.torch_compile else wrapped
        self.optimizer = torch.optim.AdamW(self._param_groups(), lr=args.learning_rate, betas=(0.9, 0.95))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=args.mixed_precision == "fp16")
        self._step_state = StepState(self.model)  # RNG and FP8 state before each step (on_nonfinite)
        self.step = 0
        self.output_dir = Path(args.output_dir)

    # ------------------------------------------------------------------ setup helpers
    def _param_groups(self) -> list[dict]:
        # Decay matrices, not biases, norms or embeddings' position vectors alike (nanoGPT).
        decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() < 2]
        return [
            {"params": decay, "weight_decay": self.args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    def _lr_factor(self, step: int) -> float:
        """Linear warmup, then cosine decay to ``min_lr_ratio``."""
        args = self.args
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

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
        metrics_file = tensorboard = progress = None
        if self.is_main:
            self._truncate_metrics()
            metrics_file = open(self.output_dir / "metrics.jsonl", "a")
            tensorboard = self._tensorboard()
            progress = self._progress_bar()
        # tokens/s leaves out the first steps, which pay one-time kernel setup.
        timing_starts_after = self.step + min(5, max(0, (args.steps - self.step) // 5))
        tokens_seen, start, train_seconds = 0, time.perf_counter(), 0.0
        try:
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
                if skipped:  # a non-finite step skipped (on_nonfinite="skip")
                    record["skipped"] = True
                if fp8_calls:
                    record["fp8_stats"] = self._fp8_statistics(fp8_calls, stats_modules)
                if self.eval_dataset is not None and self._is_due(args.eval_interval):
                    record["val_loss"] = history["val_losses"][self.step] = self.evaluate()
                if self.is_main:
                    self._write_record(record, metrics_file, tensorboard, progress)
                if args.save_checkpoints and self._is_due(args.checkpoint_interval):
                    self.save_checkpoint(history)
        finally:
            for sink in (metrics_file, progress, tensorboard):
                if sink is not None:
                    sink.close()
        return self._result(history, tokens_seen, train_seconds, start)

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

    def _fp8_statistics(self, calls: list, modules: dict[str, nn.Module]) -> list[dict]:
        """Per GEMM call of the step's first micro-batch, GEMM and operand (and result):
        what the module's recipe did (:func:`~fp8train.nn.numerics.linear_call_statistics`)."""
        fields = ("layer", "call", "gemm", "operand", "sqnr_db", "underflow_pct", "saturation_pct", "amax",
                  "nonfinite", "scale_min", "scale_max")
        stats = []
        for call in calls:
            records = linear_call_statistics(call, modules[call.layer].recipe, backend=self.args.fp8_backend)
            stats += [{key: getattr(record, key) for key in fields} for record in records]
        return stats

    def _write_record(self, record: dict, metrics_file, tensorboard, progress) -> None:
        """Rank 0: one line of ``metrics.jsonl``, TensorBoard scalars, and the log/progress."""
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        if tensorboard is not None:
            for key, value in record.items():
                if key not in ("step", "fp8_stats"):
                    tensorboard.add_scalar(key, value, self.step)
            for stats in record.get("fp8_stats", ()):
                prefix = f"fp8/{stats['layer']}/{stats['gemm']}.{stats['operand']}"
                for key in ("sqnr_db", "underflow_pct", "saturation_pct", "amax"):
                    if stats[key] is not None:
                        tensorboard.add_scalar(f"{prefix}/{key}", stats[key], self.step)
        self._report(record, progress)

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
        )

    def _train_step(self, model: nn.Module, stats_modules: dict | None = None) -> tuple:
        """One optimizer step through ``model`` (compiled or eager): ``(loss, grad_norm,
        tokens, learning_rate, skipped, fp8_calls)``, the last the GEMM calls of
        ``stats_modules`` in the first micro-batch (``None`` without)."""
        args = self.args
        learning_rate = self.scheduler.get_last_lr()[0]  # the rate this step uses
        model.train()
        self._step_state.capture()  # to re-run this step if it goes non-finite
        total_loss, tokens, fp8_calls = self._run_micro_batches(model, stats_modules)
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), args.max_grad_norm if args.max_grad_norm > 0 else math.inf
        )
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2
        if self.world_size > 1:  # the mean over ranks: logged, and every rank decides alike on it
            mean_loss = torch.tensor(total_loss, dtype=torch.float64)
            dist.all_reduce(mean_loss)
            total_loss = mean_loss.item() / self.world_size
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
                # fp8train.autocast: delayed scaling updates its forward scales at the exit.
                with self._autocast(), fp8_autocast(enabled=args.fp8_recipe is not None):
                    loss = self.loss_fn(model, inputs, targets) / args.grad_accumulation_steps
                self.scaler.scale(loss).backward()
            fp8_calls = captured if measure else fp8_calls
            total_loss += loss.item()
            tokens += targets.numel()
        return total_loss, tokens, fp8_calls

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

    # ------------------------------------------------------------------ logging
    def _truncate_metrics(self) -> None:
        """Drop records past the step we (re)start from: after a crash and a resume, the
        steps that are run again must not appear twice."""
        path = self.output_dir / "metrics.jsonl"
        if not path.is_file():
            return
        lines = path.read_text().splitlines()
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= self.step]
        if len(kept) != len(lines):
            path.write_text("".join(line + "\n" for line in kept))

    def _progress_bar(self):
        if not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        return tqdm(total=self.args.steps, initial=self.step, desc="train", unit="step")

    def _report(self, record: dict, progress) -> None:
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if self.step % self.args.log_interval == 0 or "val_loss" in record or self.step == self.args.steps:
            message = (
                f"step {self.step}/{self.args.steps} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                f"grad_norm {record['grad_norm']:.3f} tokens/s {record['tokens_per_second']:.0f}"
                + (f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else "")
            )
            if progress is not None:
                progress.write(message)
            else:
                logger.info(message)

    def _tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            return None
        return SummaryWriter(str(self.output_dir / "tensorboard"))

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
