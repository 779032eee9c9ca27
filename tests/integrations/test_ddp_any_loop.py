"""Delayed scaling under DDP in loops fp8train does not own: the stock transformers
``Trainer`` and accelerate, under torchrun, without ``fp8train.autocast``. Every rank's
scales and amax histories stay identical (before, the forward amaxes were never reduced
there: 13 of 30 buffers differed after 10 steps)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..train.torchrun import run_torchrun

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = Path(__file__).with_name("ddp_any_loop_script.py")
NUM_STATE_BUFFERS = 2 * 15  # fp8_scale and fp8_amax_history of 15 Linears


@pytest.mark.heavy
def test_trainer_and_accelerate_keep_every_ranks_delayed_state_identical():
    result = run_torchrun([str(SCRIPT)], env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"trainer": [0, NUM_STATE_BUFFERS], "accelerate": [0, NUM_STATE_BUFFERS]}
