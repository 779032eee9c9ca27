"""``fp8train train --tp N``: its settings, and the trainer under torchrun with tensor
parallelism (2 CPU processes) against one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fp8train
from fp8train.parallel.distributed import resolve_strategy
from fp8train.train.arguments import TrainingArguments
from fp8train.train.user_model import build_model

from ..train.torchrun import run_torchrun

TINY = ["--steps", "6", "--n_layer", "1", "--seq_len", "64", "--batch_size", "4", "--eval_interval", "3",
        "--eval_batches", "1", "--log_interval", "1", "--fp8_stats_interval", "0"]
# Loss per step, TP=2 vs one process: the same batches; mxfp8's codes and scales are the
# same (blocks whole on every rank), only float32 summation order and bfloat16 rounding
# of the partial sums of row-parallel layers differ.
LOSS_RTOL = 2e-3


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(tp=2, strategy="ddp"), "tp=2 with strategy='ddp' is not supported"),
        (dict(tp=2, seq_len=127), "seq_len=127 must be a multiple of tp=2"),
        (dict(tp=3, n_embd=128, n_head=4, seq_len=129), "n_embd=128 must be a multiple of tp=3"),
        (dict(tp=2, fp8_recipe="blockwise"), "n_embd=128 split over tp=2 ranks is not a multiple of 128"),
        (dict(tp=0), "tp=0 must be an int >= 1"),
    ],
)
def test_tp_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainingArguments(**settings)


def test_auto_strategy_with_tensor_parallelism():
    assert resolve_strategy("auto", 2, tp=2) == "none"  # tensor parallel alone
    assert resolve_strategy("auto", 4, tp=2) == "fsdp2"  # data x tensor parallel
    assert resolve_strategy("auto", 2) == "ddp"
    with pytest.raises(ValueError, match="strategy='ddp' with tp=2"):
        resolve_strategy("ddp", 4, tp=2)


def _losses(output_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # torchrun plus a one-process run (~12 s); tensor parallel itself runs by default (test_tensor_parallel.py)
def test_torchrun_tp_2_trains_like_one_process(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    common = [*TINY, "--data", str(data), "--fp8_recipe", "mxfp8"]
    result = run_torchrun(["-m", "fp8train", "train", *common, "--tp", "2", "--output_dir", str(tmp_path / "tp"),
                           "--fp8_stats_interval", "5"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tensor parallel over groups of 2 ranks" in result.stderr
    assert "fp8_stats_interval=5 records nothing under tp=2" in result.stderr  # said, not silently dropped
    single = subprocess.run(
        [sys.executable, "-m", "fp8train", "train", *common, "--output_dir", str(tmp_path / "one")],
        capture_output=True, text=True,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    torch.testing.assert_close(
        torch.tensor(_losses(tmp_path / "tp")), torch.tensor(_losses(tmp_path / "one")), rtol=LOSS_RTOL, atol=0
    )
    # The checkpoint holds the whole model, which a single process loads.
    state = load_file(str(tmp_path / "tp" / "checkpoint-6" / "model.safetensors"))
    args = TrainingArguments(n_layer=1, seq_len=64)
    fp8train.convert_to_float8_training(build_model(args), "mxfp8").load_state_dict(state, strict=True)
