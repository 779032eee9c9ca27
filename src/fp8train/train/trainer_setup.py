"""What a :class:`~fp8train.train.trainer.Trainer` is built from: its arguments checked, its
device, the model (built, moved, converted to FP8), the optimizer and learning-rate
schedule, the mixed-precision autocast, and the batches it draws.

Order of setup (it matters): build the model, move it to its device, convert it to FP8,
wrap and compile it, then build the optimizer over the (shared) parameters.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os

import torch
from torch import nn
from torch.utils.data import Dataset

from ..quant.gemm import bf16 as bf16_gemm
from ..quant.gemm.bf16 import bf16_matmul_line, bf16_matmuls_via_float32, bf16_via_float32
from ..nn.convert import conversion_report, convert_to_float8_training, matmul_modules
from ..nn.head import head_names
from ..optim import AdamW
from ..spec.checks import ArgumentTypeError, UnsupportedHardwareError, check_callable, check_type
from ..spec.recipe_map import RecipeMap, recipe_or_map
from ..spec.recipes import Recipe, from_name
from .arguments import TrainingArguments
from .high_precision import select_high_precision, summary

__all__ = [
    "check_trainer_arguments",
    "local_rank_from_env",
    "training_device",
    "describe_bf16_matmuls",
    "mixed_precision_autocast",
    "sample_batch",
    "cuda_graphs_reason",
    "use_cuda_graphs",
    "build_training_model",
    "convert_for_training",
    "compile_model",
    "build_optimizer",
    "lr_factor",
]

logger = logging.getLogger(__name__)


def check_trainer_arguments(model, args, train_dataset, eval_dataset, loss_fn) -> None:
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


def local_rank_from_env() -> int:
    """This process's GPU index under ``torchrun`` (``LOCAL_RANK``; 0 without a launcher):
    read where a run starts (the ``Trainer``, the ``inspect`` command) and passed down."""
    return int(os.environ.get("LOCAL_RANK", 0))


def training_device(args: TrainingArguments, local_rank: int = 0) -> torch.device:
    """The device ``args.device`` names (``auto``: CUDA where there is one); on CUDA, GPU
    ``local_rank`` (:func:`local_rank_from_env` under torchrun)."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")


def mixed_precision_autocast(args: TrainingArguments, device: torch.device, native_bf16: bool | None = None):
    """The ``torch.autocast`` a training step runs its forward under (``args.mixed_precision``).

    On a CPU without native bf16 (``native_bf16``; ``None``: this machine's,
    :data:`~fp8train.quant.gemm.bf16.NATIVE_BF16_GEMM`) the forward's bf16 matmuls, and through
    autograd its backward's, run as float32 GEMMs of their bf16 operands rounded once to bf16
    (:mod:`fp8train.quant.gemm.bf16`): bf16's numerics without its 5-25x slower fallback.
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mixed_precision)
    mixed = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
    if not bf16_via_float32(device.type, bf16_gemm.NATIVE_BF16_GEMM if native_bf16 is None else native_bf16):
        return mixed
    return _within(bf16_matmuls_via_float32(True), mixed)  # bf16 masters multiply in bf16 without autocast too


def describe_bf16_matmuls(args: TrainingArguments, native_bf16: bool | None = None) -> str:
    """The line the log and the report give on how this run's bf16 matmuls run, and why
    (``native_bf16``: ``None`` for this machine's
    :data:`~fp8train.quant.gemm.bf16.NATIVE_BF16_GEMM`, as the trainer's autocast decides)."""
    native = bf16_gemm.NATIVE_BF16_GEMM if native_bf16 is None else native_bf16
    return bf16_matmul_line(bf16_via_float32(training_device(args).type, native))


@contextlib.contextmanager
def _within(outer, inner):
    with outer, inner:
        yield


def cuda_graphs_reason(args: TrainingArguments, device: torch.device, strategy: str) -> str | None:
    """Why this run's steps are not captured in CUDA graphs whatever the model (``None``:
    they are, where the model and the step allow it: :class:`~fp8train.nn.step_graph.StepGraph`)."""
    if args.cuda_graphs == "false":
        return "cuda_graphs='false'"
    if device.type != "cuda":
        return f"the run is on {device.type}, not CUDA"
    if strategy != "none" or args.tp > 1:
        return f"strategy={strategy!r}, tp={args.tp}: a distributed step's collectives run from Python hooks"
    return None


def use_cuda_graphs(args: TrainingArguments, device: torch.device, strategy: str) -> bool:
    """Whether the trainer builds a :class:`~fp8train.nn.step_graph.StepGraph` (``args.cuda_graphs``).

    Raises:
        ValueError: ``cuda_graphs='true'`` where the run cannot capture its steps.
    """
    reason = cuda_graphs_reason(args, device, strategy)
    if reason is not None and args.cuda_graphs == "true":
        raise ValueError(f"cuda_graphs='true' cannot be honoured: {reason}; use cuda_graphs='auto' or 'false'")
    if reason is not None and device.type == "cuda" and args.cuda_graphs == "auto":
        logger.info("fp8train: CUDA graphs off, every step runs eagerly: %s", reason)
    return reason is None


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


def build_training_model(model, args: TrainingArguments, device: torch.device) -> tuple[nn.Module, int, int]:
    """``model`` (or what the factory ``model`` builds) on ``device``, converted with
    ``args.fp8_recipe`` if set (:func:`convert_for_training`): ``(model, converted, total)``,
    the matmul modules the recipe runs and all of them, as :func:`fp8train.conversion_report`
    counts them (Linear, Conv1D, attention, experts).

    Raises:
        TypeError: the factory returns something other than an ``nn.Module``.
        ValueError: the recipe converts none of the model's matmul modules, or a
            ``high_precision_modules`` pattern names none of them.
    """
    model = model() if not isinstance(model, nn.Module) else model
    check_type("model()", model, nn.Module, "an nn.Module (the model factory's result)")
    # bf16 masters: the parameters themselves are stored in bfloat16 (before conversion, so
    # delayed scaling's state is made in float32).
    model = model.to(device, torch.bfloat16 if args.optimizer_master_dtype == "bf16" else None)
    if args.fp8_recipe is None:
        return model, 0, len(matmul_modules(model))
    model = convert_for_training(model, args)
    report = conversion_report(model)
    return model, report.num_converted, report.num_matmul_modules


def convert_for_training(model: nn.Module, args: TrainingArguments) -> nn.Module:
    """``model`` converted with ``args.fp8_recipe``, the modules ``args.high_precision_modules``
    names (and, under a 4-bit recipe by default, the head) left in high precision, as the
    trainer and ``fp8train inspect`` convert it. Logs which modules stay in high precision
    and why (:func:`~fp8train.train.high_precision.summary`); the conversion logs its own line.

    Raises:
        ValueError: the recipe converts none of the model's matmul modules, or a
            ``high_precision_modules`` pattern names none of them.
    """
    recipe = recipe_or_map(args.fp8_recipe)
    chosen = select_high_precision(model, args.high_precision_modules, _head_recipe(model, recipe))
    model = convert_to_float8_training(
        model, recipe, module_filter_fn=chosen.converts, dim_alignment=args.fp8_dim_alignment,
        backend=args.fp8_backend, fp8_weights=args.fp8_weights, keep_head=chosen.keep_head,
    )
    report = conversion_report(model)
    if report.num_converted == 0:
        reasons = "; ".join(f"{m.name} ({chosen.reasons.get(m.fqn, m.reason)})" for m in report.modules)
        raise ValueError(
            f"fp8_recipe={args.fp8_recipe!r} converted none of the model's {report.num_matmul_modules} "
            f"matmul modules: {reasons or 'it has none'}"
        )
    logger.info("%s", summary(report, chosen))
    return model


def _head_recipe(model: nn.Module, recipe: "Recipe | RecipeMap") -> Recipe:
    """The recipe whose rule keeps the model's head in high precision (``high_precision_modules``'
    ``auto``): ``recipe``, or the recipe a per-module map gives the head (its first recipe
    where the head gets none)."""
    if not isinstance(recipe, RecipeMap):
        return recipe
    for name in head_names(model):
        matched = recipe.match(name)
        if matched is not None and matched[1] is not None:
            return matched[1]
    return recipe.recipes[0] if recipe.recipes else from_name("tensorwise")


def compile_model(model: nn.Module) -> nn.Module:
    """``torch.compile(model)``, with a recompile limit of its own where this torch gives one.

    Dynamo's recompile limit (8) counts per code object, and every compiled module runs
    through the same wrapper: without isolation, the models a process compiles
    (``compare --torch_compile true`` compiles seven) share the 8, and the ones past it
    silently run eager. ``isolate_recompiles=True`` gives each call its own limit; torch
    2.10 and 2.11 have no such argument (passing it raises ``TypeError``), so it is passed
    where ``torch.compile``'s signature has it, and its absence is logged.
    """
    if _takes_keyword(torch.compile, "isolate_recompiles"):
        return torch.compile(model, isolate_recompiles=True)
    logger.warning(
        "fp8train: this torch (%s) has no torch.compile(isolate_recompiles=...): the models compiled in this "
        "process share Dynamo's recompile limit (torch._dynamo.config.recompile_limit), and one past it runs "
        "eager; raise the limit when compiling many", torch.__version__,
    )
    return torch.compile(model)


def _takes_keyword(function, name: str) -> bool:
    """Whether ``function`` takes the keyword argument ``name``."""
    return name in inspect.signature(function).parameters


def build_optimizer(model: nn.Module, args: TrainingArguments):
    """AdamW over ``model``'s parameters and its learning-rate schedule (:func:`lr_factor`):
    ``(optimizer, scheduler)``. Matrices decay, biases, norms and embeddings' position
    vectors alike do not (nanoGPT)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = _adamw(groups, args)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, args))
    return optimizer, scheduler


_STATE_DTYPES = {  # optimizer_state_dtype: (exp_avg_dtype, exp_avg_sq_dtype)
    "float32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp8": (torch.float8_e4m3fn, torch.bfloat16),
}


def _adamw(groups: list[dict], args: TrainingArguments) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` where the masters and moments are float32 and the weights are
    not held in FP8 (the default), else ``fp8train.optim.AdamW`` with ``args``' precisions
    (the same update; it keeps the masters of FP8 weights)."""
    fp8_weights = args.fp8_weights and args.fp8_recipe is not None
    if args.optimizer_master_dtype == "float32" and args.optimizer_state_dtype == "float32" and not fp8_weights:
        return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95))
    exp_avg_dtype, exp_avg_sq_dtype = _STATE_DTYPES[args.optimizer_state_dtype]
    return AdamW(
        groups, lr=args.learning_rate, betas=(0.9, 0.95), exp_avg_dtype=exp_avg_dtype,
        exp_avg_sq_dtype=exp_avg_sq_dtype,
        master_weight_dtype=torch.bfloat16 if args.optimizer_master_dtype == "bf16" else None,
    )


def lr_factor(args: TrainingArguments, step: int) -> float:
    """The learning rate of ``step`` in units of ``args.learning_rate``: linear warmup, then
    cosine decay to ``min_lr_ratio``."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
