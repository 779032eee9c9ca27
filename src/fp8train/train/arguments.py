"""``TrainingArguments``: every knob of a training run, validated before any work starts."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from ..parallel.distributed import DEFAULT_TIMEOUT_SECONDS, STRATEGIES
from ..parallel.gather import supports_fp8_all_gather
from ..quant.gemm import BACKENDS
from ..spec.checks import ArgumentTypeError, check_bool, check_choice, check_int, check_number, check_type
from ..spec.recipe_map import recipe_or_map, recipes_of
from ..spec.recipes import RECIPE_NAMES, Recipe, from_name
from .high_precision import AUTO, parse_patterns

__all__ = ["TrainingArguments", "MIXED_PRECISION", "ON_NONFINITE"]

MIXED_PRECISION = ("bf16", "fp16", "no")
ON_NONFINITE = ("stop", "skip")
MASTER_DTYPES = ("float32", "bf16")
STATE_DTYPES = ("float32", "bf16", "fp8")
DEVICES = ("auto", "cpu", "cuda")
CUDA_GRAPHS = ("auto", "true", "false")

# field: (minimum, exclusive). Ints are checked as ints, floats as finite numbers.
_RANGES = {
    **dict.fromkeys(
        ("steps", "batch_size", "seq_len", "grad_accumulation_steps", "eval_batches", "log_interval"), (1, False)
    ),
    **dict.fromkeys(("n_layer", "n_head", "n_embd", "save_total_limit", "tp"), (1, False)),
    **dict.fromkeys(
        ("warmup_steps", "eval_interval", "checkpoint_interval", "seed", "fp8_dim_alignment", "fp8_stats_interval"),
        (0, False),
    ),
    **dict.fromkeys(("learning_rate", "weight_decay", "max_grad_norm", "min_lr_ratio"), (0, False)),
    "dist_timeout": (0, True),
}
_KIND_CHECKS = {
    "int": lambda name, value: check_int(name, value),
    "float": lambda name, value: _check_real(name, value),
    "bool": check_bool,
    "str": lambda name, value: check_type(name, value, str, "a string"),
}


def _check_real(name: str, value) -> None:
    # Finiteness and range come with _RANGES, which covers every float field.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name}={value!r} must be a number")


def _check_kind(name: str, value, annotation: str) -> None:
    """Type-check one field from its annotation (``"int"``, ``"str | None"``, ...)."""
    optional = annotation.endswith("| None")
    if optional and value is None:
        return
    _KIND_CHECKS[annotation.removesuffix("| None").strip()](name, value)


def _check_model_spec(spec: str) -> None:
    """``spec`` has the shape ``module:function`` (dotted names); importing is later."""
    module, colon, function = spec.partition(":")
    if colon and (module.endswith(".py") or "/" in module or "\\" in module):
        raise ValueError(
            f"model={spec!r} names a file; give its module's dotted name and run from the directory that holds "
            "it, e.g. model='models:build' for ./models.py"
        )
    if not colon or not all(part.isidentifier() for part in (*module.split("."), *function.split("."))):
        raise ValueError(
            f"model={spec!r} must be module:function, e.g. model='mypkg.models:build' (a module importable from "
            "the current directory or installed, and a zero-argument function in it)"
        )


def _arg(default, help: str, **kwargs):
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass(frozen=True, kw_only=True)
class TrainingArguments:
    """Settings of a training run. Every field is a ``--key value`` of ``fp8train train``."""

    output_dir: str = _arg("runs/train", "directory for checkpoints, metrics.jsonl and the resolved config")
    seed: int = _arg(0, "seed of the initialization and of the data order")
    steps: int = _arg(150, "optimizer steps")
    batch_size: int = _arg(16, "sequences per micro-batch")
    seq_len: int = _arg(128, "tokens per sequence (also the model's block size)")
    learning_rate: float = _arg(3e-3, "peak learning rate")
    warmup_steps: int = _arg(15, "steps of linear warmup before the cosine decay")
    min_lr_ratio: float = _arg(0.1, "the cosine decays to learning_rate * min_lr_ratio")
    weight_decay: float = _arg(0.1, "AdamW weight decay (matrices only)")
    max_grad_norm: float = _arg(1.0, "clip the gradient norm to this (0 turns clipping off)")
    on_nonfinite: str = _arg(
        "stop",
        "on a NaN or inf loss or gradient norm, re-run the step to name where it started, then stop (no checkpoint "
        "of it) or skip it (discard its gradients and go on)",
    )
    grad_accumulation_steps: int = _arg(1, "micro-batches per optimizer step")
    mixed_precision: str = _arg("bf16", "autocast dtype around the model: bf16, fp16 (with a grad scaler) or no")
    fp8_recipe: str | None = _arg(
        None,
        f"FP8 recipe for the Linear layers: {', '.join(RECIPE_NAMES)} (or current), hybrid(forward=NAME,backward=NAME), "
        "or a recipe per module, 'PATTERN=NAME;...' (the first matching pattern wins; bf16: high precision); none for no FP8",
    )
    fp8_dim_alignment: int | None = _arg(
        None, "skip Linear layers whose dims are not multiples of this (default: the recipe's; 0: no check)"
    )
    fp8_backend: str = _arg("auto", "FP8 GEMM backend: auto, emulated or hardware")
    high_precision_modules: str = _arg(
        AUTO,
        "matmul modules to keep in high precision under any recipe: comma-separated fnmatch patterns, each matched "
        "against a qualified module name or a run of its dot-separated parts (lm_head, layers.11, blocks.*.fc); "
        "auto: the model's head under a 4-bit recipe (nvfp4, mxfp4), nothing under FP8, and an item of a list "
        "(auto,layers.11); none (or ''): nothing, the 4-bit head included",
    )
    fp8_weights: bool = _arg(
        False,
        "keep each FP8 Linear's weight only in FP8 between steps (1-2 bytes per weight, by recipe); "
        "fp8train.optim.AdamW keeps its master in optimizer_master_dtype and re-quantizes it after each step "
        "(no effect without an fp8_recipe: compare's bf16 baseline keeps its weights)",
    )
    optimizer_master_dtype: str = _arg(
        "float32",
        "the master weights AdamW updates: float32 (float32 parameters, as torch.optim.AdamW), or bf16 "
        "(parameters stored in bfloat16 and their own master, rounded stochastically by fp8train.optim.AdamW: "
        "half the bytes of weights and gradients)",
    )
    optimizer_state_dtype: str = _arg(
        "float32",
        "AdamW's moments: float32 (torch.optim.AdamW), bf16 (both bfloat16), or fp8 (the first E4M3 with a "
        "float32 scale per 128 values, the second bfloat16), the last two by fp8train.optim.AdamW",
    )
    torch_compile: bool = _arg(False, "torch.compile the model (after FP8 conversion)")
    cuda_graphs: str = _arg(
        "auto",
        "capture each step's forward, loss and backward in a CUDA graph after 4 eager steps and replay it: auto "
        "(on CUDA, in one process, where the step allows it; what does not is logged and runs eagerly), true "
        "(the same, and an error where it cannot), or false",
    )
    eval_interval: int = _arg(50, "evaluate every this many steps (0: only at the end)")
    fp8_stats_interval: int = _arg(
        100,
        "every this many steps, record each FP8 layer's quantization statistics (SQNR, underflow, saturation, "
        "amax, scales, NaN/inf per GEMM operand) in metrics.jsonl and TensorBoard (0: off)",
    )
    eval_batches: int = _arg(8, "validation batches per evaluation")
    log_interval: int = _arg(10, "log metrics every this many steps")
    checkpoint_interval: int = _arg(0, "save a checkpoint every this many steps (0: only at the end)")
    save_checkpoints: bool = _arg(True, "write checkpoints at all")
    resume: bool = _arg(False, "resume from the latest complete checkpoint in output_dir")
    save_total_limit: int | None = _arg(
        None, "keep only the newest N checkpoints (never deleting the newest one that verifies); none keeps all"
    )
    resume_fallback: bool = _arg(
        True, "on resume, fall back to the newest checkpoint that verifies when the latest is damaged (false: stop)"
    )
    data: str | None = _arg(None, "UTF-8 text file to train on (default: embedded English text)")
    model: str | None = _arg(
        None,
        "model factory module:function returning an nn.Module or a dict with model, loss_fn and datasets "
        "(default: the embedded GPT); see docs/diagnosing.md",
    )
    n_layer: int = _arg(2, "default model: transformer blocks")
    n_head: int = _arg(4, "default model: attention heads")
    n_embd: int = _arg(128, "default model: width (a multiple of 128 lets every recipe convert every layer)")
    device: str = _arg("auto", "cpu, cuda, or auto (cuda when available)")
    dist_timeout: float = _arg(
        DEFAULT_TIMEOUT_SECONDS, "seconds a rank waits on the others in a collective before the run fails (PyTorch's default: 1800)"
    )
    strategy: str = _arg(
        "auto",
        "distributed strategy: none, ddp, fsdp2 (FP8 all-gather), or auto (ddp under torchrun with >1 process); ddp "
        "and fsdp2 run under torchrun, --nproc-per-node 1 included",
    )
    tp: int = _arg(
        1,
        "tensor-parallel size: split the model over groups of this many processes with sequence parallelism, "
        "activations all-gathered in FP8 (with strategy fsdp2: data parallel x tensor parallel on a 2-D mesh)",
    )

    def __post_init__(self) -> None:
        for name in ("output_dir", "data"):  # paths may be given as pathlib.Path
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check_kind(f.name, value, f.type)
            if f.name in _RANGES and value is not None:
                minimum, exclusive = _RANGES[f.name]
                if f.type.startswith("int"):
                    check_int(f.name, value, minimum=minimum)
                else:
                    check_number(f.name, value, minimum=minimum, exclusive=exclusive)
        if self.min_lr_ratio > 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio!r} must be at most 1")
        for name, choices in (
            ("mixed_precision", MIXED_PRECISION),
            ("device", DEVICES),
            ("strategy", STRATEGIES),
            ("fp8_backend", BACKENDS),
            ("on_nonfinite", ON_NONFINITE),
            ("optimizer_master_dtype", MASTER_DTYPES),
            ("optimizer_state_dtype", STATE_DTYPES),
            ("cuda_graphs", CUDA_GRAPHS),
        ):
            check_choice(name, getattr(self, name), choices)
        for name in ("output_dir", "data"):
            if getattr(self, name) == "":
                raise ValueError(f"{name}='' is empty; give a path")
        if self.tp > 1 and self.strategy == "ddp":
            raise ValueError(
                f"tp={self.tp} with strategy='ddp' is not supported: use strategy='fsdp2' (data parallel x tensor "
                "parallel) or 'none'/'auto'"
            )
        if self.tp > 1 and self.seq_len % self.tp:
            raise ValueError(f"seq_len={self.seq_len} must be a multiple of tp={self.tp} (sequence parallelism splits it)")
        if self.tp > 1 and self.model is None and self.n_embd % self.tp:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of tp={self.tp} (tensor parallelism splits it)")
        self._check_weights_and_optimizer()
        if self.strategy == "fsdp2" and self.mixed_precision == "fp16":
            raise ValueError("mixed_precision='fp16' with strategy='fsdp2' is not supported: use bf16")
        if self.model is not None:
            _check_model_spec(self.model)
        parse_patterns(self.high_precision_modules)  # its form; the model's names are checked where it is built
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide n_embd={self.n_embd}")
        if self.fp8_recipe is not None:
            self._check_fp8_recipe()

    def _check_fp8_recipe(self) -> None:
        """``fp8_recipe``: ``none``/``bf16`` for none; else a name (``hybrid(...)`` too) or a
        recipe per module (raises, listing the valid names), each recipe of it suiting the
        strategy and the default model's dims."""
        if self.fp8_recipe.lower() in ("none", "bf16", ""):
            object.__setattr__(self, "fp8_recipe", None)
            return
        for recipe in recipes_of(recipe_or_map(self.fp8_recipe)):
            if self.fp8_weights and self.strategy == "fsdp2" and not supports_fp8_all_gather(recipe):
                raise ValueError(
                    f"fp8_weights=True with strategy='fsdp2' and fp8_recipe={self.fp8_recipe!r} is not supported: "
                    "FSDP2 shards FP8 weights only where the recipe gathers them in FP8; use another recipe "
                    "(tensorwise, delayed, blockwise, mxfp8, nvfp4, mxfp4), strategy='ddp', or fp8_weights=False"
                )
            if self.model is None:  # a user's model has its own dims; the Trainer checks what converts
                self._check_model_dims(recipe)

    def _check_weights_and_optimizer(self) -> None:
        """Combinations of the weights' and the optimizer's precision that do not work."""
        if self.optimizer_master_dtype == "bf16" and self.mixed_precision == "fp16":
            raise ValueError(
                "optimizer_master_dtype='bf16' with mixed_precision='fp16' is not supported (bfloat16 parameters "
                "under a float16 autocast): use mixed_precision='bf16'"
            )
        if self.fp8_weights and self.tp > 1:
            raise ValueError(
                f"fp8_weights=True with tp={self.tp} is not supported: tensor parallelism does not shard weights "
                "stored in FP8; use tp=1 (strategy='fsdp2' shards them, or 'ddp'), or fp8_weights=False"
            )

    def _check_model_dims(self, recipe: Recipe) -> None:
        """The default model's dims must suit the recipe, or nothing useful would convert."""
        alignment = recipe.alignment if self.fp8_dim_alignment is None else self.fp8_dim_alignment
        block = recipe.operand_plan.block  # what quantization itself needs: 128 blockwise, 32 MXFP8
        needed = max(alignment, block)
        if self.tp > 1 and needed > 1 and self.n_embd % (needed * self.tp):  # each rank's slice meets it
            raise ValueError(
                f"n_embd={self.n_embd} split over tp={self.tp} ranks is not a multiple of {needed}, which "
                f"fp8_recipe={recipe.name!r} needs for each rank's slice of a Linear; use n_embd a multiple of "
                f"{needed * self.tp}, or a smaller tp"
            )
        if needed > 1 and self.n_embd % needed:
            raise ValueError(
                f"n_embd={self.n_embd} is not a multiple of {needed}, which fp8_recipe={recipe.name!r} "
                f"needs for its Linear dims; use n_embd={needed * max(1, round(self.n_embd / needed))}"
                + ("" if block > 1 else " or fp8_dim_alignment=0")
            )

    def to_dict(self) -> dict:
        """The resolved settings as a plain dict (for the saved config)."""
        return dataclasses.asdict(self)

    @classmethod
    def help(cls) -> dict[str, str]:
        """``{field: help}`` for every field."""
        return {f.name: f.metadata["help"] for f in dataclasses.fields(cls)}
