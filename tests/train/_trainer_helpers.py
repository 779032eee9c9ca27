"""Settings and helpers shared by the Trainer tests (test_trainer*.py): tiny runs of the
default GPT, and readers for the files a run writes."""

import json
from pathlib import Path

from fp8train.train.arguments import TrainingArguments
from fp8train.train.commands.compare import build_model
from fp8train.train.trainer import Trainer

# Tiny settings: every run here takes well under a second or two on a slow CPU.
TINY = dict(
    n_layer=1, n_embd=128, n_head=2, seq_len=32, batch_size=4, eval_batches=1,
    learning_rate=3e-3, warmup_steps=2, device="cpu", log_interval=4,
)
NUM_LINEAR_LAYERS = 5  # n_layer=1: qkv, proj, fc, fc_proj, and lm_head
DATA_BYTES = 12_000
# Over 12 steps at lr 3e-3 the byte-level loss falls from ~5.6 (ln 256 = 5.5) to ~3.4;
# the mean of the last 4 steps is ~1.5 nats under the mean of the first 4 for every recipe.
TRAIN_STEPS = 12
MIN_LOSS_DROP = 0.5
CHECKPOINT_FILES = {
    "model.safetensors", "optimizer.pt", "scheduler.pt", "rng.safetensors", "scaler.pt", "config.json",
    "trainer_state.json", "manifest.json",
}
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_second", "elapsed_seconds"}
RESULT_KEYS = {
    "losses", "val_losses", "final_train_loss", "final_val_loss", "tokens_per_second",
    "converted_layers", "total_linear_layers",
}


def _args(output_dir: Path, **overrides) -> TrainingArguments:
    return TrainingArguments(output_dir=str(output_dir), **{**TINY, **overrides})


def _train(args: TrainingArguments, datasets, **kwargs) -> dict:
    train, val = datasets
    return Trainer(lambda: build_model(args), args, train, val, **kwargs).train()


def _metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def _trainer_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def _mean(values) -> float:
    return sum(values) / len(values)
