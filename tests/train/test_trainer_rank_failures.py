"""A rank of a distributed Trainer run raises, is killed or hangs mid-step: the other rank
ends, fast, with an error naming it (and the run within ``--dist_timeout`` at worst)."""

import itertools
import re
import time
from pathlib import Path

import pytest

from fp8train.train.arguments import TrainingArguments
from fp8train.train.commands.compare import build_model
from fp8train.train.data import embedded_text, split_text
from fp8train.train.trainer import Trainer

from ..helpers.rank_failures import FAILING_STEP, MAX_EXIT_SECONDS, fail, run_ranks
from ._trainer_helpers import DATA_BYTES, TINY
from .torchrun import run_torchrun

DIST_TIMEOUT_SECONDS = 2.0
# torchrun: the failing rank's own exit (traceback, interpreter shutdown) and torchrun's
# report come on top of the survivor's exit.
MAX_TORCHRUN_EXIT_SECONDS = 20.0


def _train_failing_on_rank_1(
    rank: int, results, mode: str, strategy: str, recipe: str, dist_timeout: float, output_dir: str
) -> None:
    """A tiny Trainer run whose loss function fails on rank 1 in step ``FAILING_STEP``;
    each rank writes what it raised to ``results[rank]``."""
    args = TrainingArguments(**{**TINY, "n_embd": 256}, steps=6, strategy=strategy, fp8_recipe=recipe,
                             dist_timeout=dist_timeout, save_checkpoints=False, output_dir=output_dir)
    train, val = split_text(embedded_text()[:DATA_BYTES], args.seq_len)
    calls = itertools.count()

    def loss_fn(model, inputs, targets):
        if rank == 1 and next(calls) == FAILING_STEP:
            fail(mode, results, hang_seconds=dist_timeout + 2)
        return model(inputs, targets)

    try:
        Trainer(lambda: build_model(args), args, train, val, loss_fn=loss_fn).train()
    except Exception as error:
        results[rank] = {"type": type(error).__name__, "message": str(error),
                         "failed_ranks": getattr(error, "failed_ranks", None)}
        raise


@pytest.mark.slow  # the torchrun case below (raise) runs by default and checks the same naming
def test_a_trainer_rank_that_raises_mid_step_is_named_by_the_other(tmp_path):
    run = run_ranks(_train_failing_on_rank_1, "raise", "ddp", "delayed", 60.0, str(tmp_path))
    assert run.exitcodes == [1, 1]
    assert run.results[1]["type"] == "RuntimeError"
    assert run.results[0]["type"] == "RankFailedError"
    assert run.results[0]["failed_ranks"] == (1,)
    assert "because rank 1 failed with RuntimeError: injected failure" in run.results[0]["message"]
    assert run.seconds_to_exit(0) < MAX_EXIT_SECONDS


@pytest.mark.slow  # waits out the timeout (~10 s)
def test_the_trainer_bounds_a_collective_by_dist_timeout(tmp_path):
    # FSDP2: rank 0 waits in an all-gather that rank 1, asleep, never joins.
    run = run_ranks(_train_failing_on_rank_1, "hang", "fsdp2", "tensorwise", DIST_TIMEOUT_SECONDS, str(tmp_path))
    assert run.exitcodes[0] == 1
    assert run.results[0]["failed_ranks"] == (1,)
    message = run.results[0]["message"]
    assert f"rank 1 did not join a collective within --dist_timeout={DIST_TIMEOUT_SECONDS:g} s" in message
    assert DIST_TIMEOUT_SECONDS <= run.seconds_to_exit(0) < DIST_TIMEOUT_SECONDS + MAX_EXIT_SECONDS


# Run by torchrun's workers: `fp8train train`, where rank 1 fails in its FAILING_STEP-th
# forward of the model (a global forward pre-hook; the CLI itself is untouched).
_FAILING_WORKER = f"""
import os, signal, sys, time
import torch
from fp8train.train.commands.cli import main
from fp8train.train.model import GPT

forwards = 0

def fail_on_rank_1(module, args):
    global forwards
    if not isinstance(module, GPT) or os.environ["RANK"] != "1":
        return
    forwards += 1
    if forwards == {FAILING_STEP + 1}:
        with open(os.environ["FAILED_AT_FILE"], "w") as f:
            f.write(repr(time.time()))
        if os.environ["FAIL_MODE"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("injected failure")

torch.nn.modules.module.register_module_forward_pre_hook(fail_on_rank_1)
sys.exit(main(sys.argv[1:]))
"""
_TORCHRUN_TINY = ["--steps", "6", "--n_layer", "1", "--n_embd", "256", "--n_head", "2", "--seq_len", "32",
                  "--batch_size", "4", "--eval_interval", "0", "--eval_batches", "1", "--warmup_steps", "2",
                  "--save_checkpoints", "false", "--strategy", "ddp", "--fp8_recipe", "delayed", "--dist_timeout", "30"]


@pytest.mark.heavy
@pytest.mark.parametrize("mode, exitcode", [("raise", 1), pytest.param("kill", -9, marks=pytest.mark.slow)])
def test_under_torchrun_a_failed_rank_ends_the_run_at_once_and_is_named(mode, exitcode, tmp_path: Path):
    script, data, failed_at = tmp_path / "failing_worker.py", tmp_path / "text.txt", tmp_path / "failed_at"
    script.write_text(_FAILING_WORKER)
    data.write_text(embedded_text()[:DATA_BYTES])
    result = run_torchrun(
        [str(script), "train", *_TORCHRUN_TINY, "--data", str(data), "--output_dir", str(tmp_path / "run")],
        timeout=120, env={"FAIL_MODE": mode, "FAILED_AT_FILE": str(failed_at)},
    )
    ended_at = time.time()
    assert result.returncode != 0
    assert ended_at - float(failed_at.read_text()) < MAX_TORCHRUN_EXIT_SECONDS
    # torchrun's report names rank 1 as the root cause ...
    root_cause = result.stderr[result.stderr.index("Root Cause"):]
    assert re.search(rf"rank\s*: 1 \(local_rank: 1\)\s*exitcode\s*: {exitcode}\b", root_cause), root_cause
    # ... and rank 0 either raised a RankFailedError naming rank 1, or torchrun stopped it
    # (SIGTERM) before it could: the two race by milliseconds once rank 1 is gone.
    if "RankFailedError" in result.stderr:
        assert "RankFailedError: rank 0: a collective failed because rank 1" in result.stderr
    else:
        assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s*exitcode\s*: -15\b", result.stderr), result.stderr[-3000:]
