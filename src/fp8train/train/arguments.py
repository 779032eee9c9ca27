"""``TrainingArguments``: every knob of a training run, validated before any work starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..parallel.distributed import STRATEGIES
from ..quant.gemm import BACKENDS
from ..spec.recipes import RECIPE_NAMES, Recipe, from_name

__all__ = ["TrainingArguments", "MIXED_PRECISION"]

MIXED_PRECISION = ("bf16", "fp16", "no")


def _arg(default, help: str, **kwargs):
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass(frozen=True, kw_only=True)
class TrainingArguments:
    """Settings of a training run. Every field is a ``--key value`` of ``fp8train train``."""

    output_dir: str = _arg("runs/train", "directory for checkpoints, metrics.jsonl and the resolved config")
    seed: int = _arg(0, "seed of the initialization and of the data order")
    steps: int = _arg(300, "optimizer steps")
    batch_size: int = _arg(16, "sequences per micro-batch")
    seq_len: int = _arg(128, "tokens per sequence (also the model's block size)")
    learning_rate: float = _arg(3e-3, "peak learning rate")
    warmup_steps: int = _arg(30, "steps of linear warmup before the cosine decay")
    min_lr_ratio: float = _arg(0.1, "the cosine decays to learning_rate * min_lr_ratio")
    weight_decay: float = _arg(0.1, "AdamW weight decay (matrices only)")
    max_grad_norm: float = _arg(1.0, "clip the gradient norm to this (0 turns clipping off)")
    grad_accumulation_steps: int = _arg(1, "micro-batches per optimizer step")
    mixed_precision: str = _arg("bf16", "autocast dtype around the model: bf16, fp16 (with a grad scaler) or no")
    fp8_recipe: str | None = _arg(
        None, f"FP8 recipe for the Linear layers: {', '.join(RECIPE_NAMES)} (or current); none for no FP8"
    )
    fp8_dim_alignment: int | None = _arg(
        None, "skip Linear layers whose dims are not multiples of this (default: the recipe's; 0: no check)"
    )
    fp8_backend: str = _arg("auto", "FP8 GEMM backend: auto, emulated or hardware")
    torch_compile: bool = _arg(False, "torch.compile the model (after FP8 conversion)")
    eval_interval: int = _arg(100, "evaluate every this many steps (0: only at the end)")
    eval_batches: int = _arg(8, "validation batches per evaluation")
    log_interval: int = _arg(10, "log metrics every this many steps")
    checkpoint_interval: int = _arg(0, "save a checkpoint every this many steps (0: only at the end)")
    save_checkpoints: bool = _arg(True, "write checkpoints at all")
    resume: bool = _arg(False, "resume from the latest complete checkpoint in output_dir")
    data: str | None = _arg(None, "UTF-8 text file to train on (default: embedded English text)")
    n_layer: int = _arg(2, "default model: transformer blocks")
    n_head: int = _arg(4, "default model: attention heads")
    n_embd: int = _arg(128, "default model: width (a multiple of 128 lets every recipe convert every layer)")
    device: str = _arg("auto", "cpu, cuda, or auto (cuda when available)")
    strategy: str = _arg(
        "auto", "distributed strategy: none, ddp, fsdp2 (FP8 all-gather), or auto (ddp under torchrun with >1 process)"
    )

    def __post_init__(self) -> None:
        positive = ("steps", "batch_size", "seq_len", "grad_accumulation_steps", "eval_batches", "log_interval")
        non_negative = ("warmup_steps", "eval_interval", "checkpoint_interval", "seed")
        for name in positive + non_negative + ("n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            low = 1 if name in positive or name.startswith("n_") else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        for name in ("learning_rate", "weight_decay", "max_grad_norm", "min_lr_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name}={value!r} must be a number >= 0")
        if self.min_lr_ratio > 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio!r} must be at most 1")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision={self.mixed_precision!r} must be one of {', '.join(MIXED_PRECISION)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={self.device!r} must be cpu, cuda or auto")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} must be {', '.join(STRATEGIES[:-1])} or {STRATEGIES[-1]}")
        if self.strategy == "fsdp2" and self.mixed_precision == "fp16":
            raise ValueError("mixed_precision='fp16' with strategy='fsdp2' is not supported: use bf16")
        if self.fp8_backend not in BACKENDS:
            raise ValueError(f"fp8_backend={self.fp8_backend!r} must be {', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide n_embd={self.n_embd}")
        if self.fp8_dim_alignment is not None and (
            isinstance(self.fp8_dim_alignment, bool)
            or not isinstance(self.fp8_dim_alignment, int)
            or self.fp8_dim_alignment < 0
        ):
            raise ValueError(f"fp8_dim_alignment={self.fp8_dim_alignment!r} must be an int >= 0")
        if self.fp8_recipe is not None:
            if self.fp8_recipe.lower() in ("none", "bf16", ""):
                object.__setattr__(self, "fp8_recipe", None)
            else:
                recipe = from_name(self.fp8_recipe)  # raises, listing the valid names
                self._check_model_dims(recipe)

    def _check_model_dims(self, recipe: Recipe) -> None:
        """The default model's dims must suit the recipe, or nothing useful would convert."""
        alignment = recipe.alignment if self.fp8_dim_alignment is None else self.fp8_dim_alignment
        block = recipe.operand_plan.block  # what quantization itself needs: 128 blockwise, 32 MXFP8
        needed = max(alignment, block)
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
