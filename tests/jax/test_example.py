"""``examples/jax_train.py`` trains and prints its loss table (a few steps; -m slow)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("optax")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "jax_train.py"


@pytest.mark.slow
def test_example_trains_every_recipe_and_prints_the_table(tmp_path):
    out = tmp_path / "results.json"
    args = ["--steps", "3", "--batch_size", "2", "--seq_len", "32", "--num_layers", "1", "--eval_batches", "1"]
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), *args, "--out", str(out)], capture_output=True, text=True, timeout=1800
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| recipe | train loss" in result.stdout
    for name in ("bf16", "tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8"):
        assert f"| {name} |" in result.stdout
    import json

    results = json.loads(out.read_text())["results"]
    assert all(r["finite"] for r in results)
