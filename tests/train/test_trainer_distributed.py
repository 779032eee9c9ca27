"""The trainer under torchrun: DDP and FSDP2 on 2 CPU processes (gloo)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

import fp8train
from fp8train.train.arguments import TrainingArguments
from fp8train.train.compare import build_model

from .torchrun import run_torchrun

TIMEOUT_SECONDS = 300
TINY = ["--steps", "6", "--n_layer", "1", "--n_embd", "256", "--n_head", "2", "--seq_len", "32",
        "--batch_size", "4", "--eval_interval", "3", "--eval_batches", "1", "--log_interval", "1",
        "--warmup_steps", "2", "--learning_rate", "0.003"]


def _torchrun(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """``fp8train train`` under torchrun on the tiny settings and a small corpus."""
    data = tmp_path / "text.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    return run_torchrun(["-m", "fp8train", "train", *TINY, "--data", str(data), *args], timeout=TIMEOUT_SECONDS)


@pytest.mark.parametrize(
    "strategy, recipe",
    # ddp-delayed under -m slow: DDP with delayed scaling under torchrun runs by default in
    # tests/integrations/test_ddp_any_loop.py (transformers' Trainer, accelerate) and the
    # trainer's own torchrun path in fsdp2-mxfp8 here.
    [pytest.param("ddp", "delayed", marks=pytest.mark.slow), ("fsdp2", "mxfp8"),
     pytest.param("fsdp2", "blockwise", marks=pytest.mark.slow), pytest.param("fsdp2", "tensorwise", marks=pytest.mark.slow),
     # FSDP2 sharding FP8 primary weights (fp8_weights): tests/parallel/test_fsdp_fp8_weights.py by default.
     pytest.param("fsdp2", "delayed --fp8_weights true", marks=pytest.mark.slow)],
)
def test_torchrun_trains_and_rank_0_alone_logs_and_saves(strategy, recipe, tmp_path):
    output_dir = tmp_path / "run"
    recipe, *options = recipe.split()
    result = _torchrun(
        ["--strategy", strategy, "--fp8_recipe", recipe, *options, "--output_dir", str(output_dir)], tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("final train loss") == 1  # rank 0 only
    assert result.stderr.count("step 6/6") == 1
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))  # written once, by rank 0
    assert records[-1]["loss"] < records[0]["loss"]
    # The checkpoint holds the whole model and loads into a single-process run, plain or FP8.
    state = load_file(str(output_dir / "checkpoint-6" / "model.safetensors"))
    args = TrainingArguments(n_layer=1, n_embd=256, n_head=2, seq_len=32)
    build_model(args).load_state_dict(fp8train.drop_fp8_state(state), strict=True)
    fp8train.convert_to_float8_training(build_model(args), recipe).load_state_dict(state, strict=True)


@pytest.mark.slow  # two torchrun launches (~16 s); the trainer's resume runs by default in one process
# fp8_weights: fp8train.optim.AdamW's local rows, gathered whole into the checkpoint and cut again.
@pytest.mark.parametrize("options", [["--fp8_recipe", "blockwise"], ["--fp8_recipe", "delayed", "--fp8_weights", "true"]])
def test_torchrun_fsdp2_resumes_from_its_checkpoint(options, tmp_path):
    output_dir = tmp_path / "run"
    first = _torchrun(["--strategy", "fsdp2", *options, "--output_dir", str(output_dir),
                       "--checkpoint_interval", "3"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(output_dir / "checkpoint-6")
    resumed = _torchrun(["--strategy", "fsdp2", *options, "--output_dir", str(output_dir),
                         "--resume", "true"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "checkpoint-3 at step 3" in resumed.stderr
    assert (output_dir / "checkpoint-6" / "trainer_state.json").is_file()
