"""The trainer under torchrun: DDP and FSDP2 on 2 CPU processes (gloo), and on one."""

import gc
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fp8train
from fp8train.parallel.distributed import close_distributed
from fp8train.train import trainer
from fp8train.train.commands import cli
from fp8train.train.arguments import TrainingArguments
from fp8train.train.commands.compare import build_model

from ..conftest import find_free_port
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


@pytest.mark.heavy
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



# Two torchrun ranks (about 6-9 s): under -m slow. By default, test_training_memory.py counts an FSDP2
# rank's bytes after an evaluation in one process, and test_cli.py has rank 0 alone write compare's report.
@pytest.mark.slow
def test_torchrun_fsdp2_compare_reports_each_ranks_bytes(tmp_path):
    """``fp8train compare`` (no checkpoints) under FSDP2: each run's last evaluation leaves
    the root's weights gathered, tensorwise's in FP8, and the report counts what a rank
    keeps between steps: half of every float32 weight and gradient (each dim here splits
    evenly in two)."""
    data = tmp_path / "text.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    result = run_torchrun(
        ["-m", "fp8train", "compare", "--recipes", "bf16,tensorwise", "--strategy", "fsdp2", *TINY, "--steps", "2",
         "--data", str(data), "--output_dir", str(tmp_path / "compare")],
        timeout=TIMEOUT_SECONDS,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads((tmp_path / "compare" / "results.json").read_text())["runs"]
    for recipe in ("bf16", "tensorwise"):
        state = runs[recipe]["state_bytes"]
        assert state["gradients"] == 4 * state["parameters"] // 2, recipe
    assert runs["bf16"]["state_bytes"]["weights"] == 4 * runs["bf16"]["state_bytes"]["parameters"] // 2


def _count_ddp_at_destroy(monkeypatch) -> list[int]:
    """A spy on ``dist.destroy_process_group``: the number of ``DistributedDataParallel``
    objects that exist, live or garbage, at each call."""
    counts, destroy_process_group = [], dist.destroy_process_group

    def destroy_spy(*args, **kwargs):
        counts.append(sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects()))
        destroy_process_group(*args, **kwargs)

    monkeypatch.setattr(dist, "destroy_process_group", destroy_spy)
    return counts


@pytest.mark.heavy  # a subprocess, process group or JAX compile of seconds: CI's second leg runs it (default run under 6 minutes)
def test_torchrun_with_one_process_runs_ddp_and_drops_it_before_the_group(monkeypatch, tmp_path, corpus_file):
    """``torchrun --nproc-per-node 1 -m fp8train train --strategy ddp``, in this process
    (torchrun's environment): DDP on a real group of one process. When the group is
    destroyed, no ``DistributedDataParallel`` is left: a DDP ``Reducer`` that outlives the
    group holds its last reference, and freeing it later runs gloo's destructor, which
    joins gloo's threads while holding the GIL (a hang at exit, seen once)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, "1" if name == "WORLD_SIZE" else "0")
    wrapped, wrap_model = [], trainer.wrap_model

    def wrap_spy(*args, **kwargs):  # records the wrapper's type, not the wrapper
        model = wrap_model(*args, **kwargs)
        wrapped.append(type(model).__name__)
        return model

    monkeypatch.setattr(trainer, "wrap_model", wrap_spy)
    ddp_at_destroy = _count_ddp_at_destroy(monkeypatch)
    argv = ["train", "--strategy", "ddp", "--data", str(corpus_file(8000)), "--output_dir", str(tmp_path), "--steps",
            "2", "--save_checkpoints", "false", "--n_layer", "1", "--n_embd", "128", "--n_head", "2", "--seq_len", "32",
            "--batch_size", "2", "--eval_batches", "1", "--device", "cpu"]
    try:
        assert cli.main(argv) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert wrapped == ["DistributedDataParallel"]
    assert ddp_at_destroy == [0]


@pytest.mark.heavy  # a subprocess, process group or JAX compile of seconds: CI's second leg runs it (default run under 6 minutes)
def test_closing_the_group_first_frees_a_ddp_model_left_in_a_reference_cycle(monkeypatch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ddp_at_destroy = _count_ddp_at_destroy(monkeypatch)
    gc.disable()  # no collection but close_distributed's own
    try:
        model = DistributedDataParallel(nn.Linear(2, 2))
        model.cycle = [model]
        del model
        close_distributed()
    finally:
        gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert ddp_at_destroy == [0]
