"""Checkpoints that survive damage and cannot run code: the manifest of sizes and sha256,
verification on resume, falling back past a damaged checkpoint (or refusing to, with
``resume_fallback=False``), ``save_total_limit``, and files that would run code when
unpickled, which are refused without running."""

import builtins
import dataclasses
import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from fp8train.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_resume_checkpoint,
    prune_checkpoints,
    read_checkpoint,
    verify_checkpoint,
)
from fp8train.train.commands.cli import main

from ._trainer_helpers import CHECKPOINT_FILES, _args, _train, _trainer_state

STEPS = 4
SETTINGS = dict(steps=STEPS, checkpoint_interval=2, eval_interval=2)  # checkpoint-2 and checkpoint-4
CHECKPOINT_LOGGER = "fp8train.train.checkpoint"


@pytest.fixture(scope="module")
def straight_run(datasets, tmp_path_factory):
    """A 4-step run that saved checkpoint-2 and checkpoint-4, and its result."""
    args = _args(tmp_path_factory.mktemp("straight"), **SETTINGS)
    return Path(args.output_dir), _train(args, datasets)


@pytest.fixture
def run_dir(straight_run, tmp_path) -> Path:
    """A private copy of the straight run's output_dir, to damage."""
    copy = tmp_path / "run"
    shutil.copytree(straight_run[0], copy)
    return copy


def _resume(run_dir: Path, datasets, **overrides) -> dict:
    return _train(_args(run_dir, **SETTINGS, resume=True, **overrides), datasets)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _rewrite_manifest_for(checkpoint: Path, name: str) -> None:
    """What an attacker who can write the checkpoint would do: make the manifest vouch for
    a planted file."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


class _RunsCodeWhenUnpickled:
    """Unpickling this creates ``marker``: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return builtins.open, (str(self.marker), "w")


# ---------------------------------------------------------------------------- the manifest


def test_manifest_records_size_and_sha256_of_every_other_file(straight_run):
    checkpoint = straight_run[0] / "checkpoint-4"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"], manifest["step"]) == ("fp8train-checkpoint", 1, 4)
    assert set(manifest["files"]) == CHECKPOINT_FILES - {"manifest.json"}
    for name, record in manifest["files"].items():
        data = (checkpoint / name).read_bytes()
        assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert verify_checkpoint(checkpoint) == []
    assert read_checkpoint(checkpoint).step == 4


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda c: _truncate(c / "model.safetensors"), r"model\.safetensors: \d+ bytes, but the manifest records \d+"),
        (lambda c: _flip_byte(c / "optimizer.pt"), "optimizer.pt: sha256 checksum differs"),
        (lambda c: _flip_byte(c / "trainer_state.json"), "trainer_state.json: sha256 checksum differs"),
        (lambda c: (c / "rng.safetensors").unlink(), "rng.safetensors: missing"),
        (lambda c: (c / "scheduler.pt").unlink() or (c / "scheduler.pt").mkdir(), "scheduler.pt: unreadable"),
        (lambda c: (c / "manifest.json").unlink(), "manifest.json: missing"),
        (lambda c: (c / "manifest.json").write_text("{not json"), "manifest.json: unreadable"),
        (lambda c: _drop_from_manifest(c, "scaler.pt"), "manifest.json: does not list scaler.pt"),
    ],
    ids=["truncated", "flipped-byte", "flipped-state", "missing", "not-a-file", "no-manifest", "bad-manifest",
         "unlisted"],
)
def test_verify_names_the_bad_file_and_why(damage, problem, run_dir):
    checkpoint = run_dir / "checkpoint-4"
    damage(checkpoint)
    problems = verify_checkpoint(checkpoint)
    assert len(problems) == 1 and re.match(problem, problems[0]), problems


def _drop_from_manifest(checkpoint: Path, name: str) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["files"][name]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


# ---------------------------------------------------------------------------- resume


def test_truncated_weights_fall_back_to_the_older_checkpoint(run_dir, straight_run, datasets, caplog):
    _truncate(run_dir / "checkpoint-4" / "model.safetensors")
    with caplog.at_level(logging.INFO):
        result = _resume(run_dir, datasets)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == CHECKPOINT_LOGGER]
    assert len(warnings) == 1, warnings
    assert "checkpoint-4" in warnings[0] and "model.safetensors" in warnings[0] and "bytes" in warnings[0]
    assert any("resumed from" in r.getMessage() and "checkpoint-2 at step 2" in r.getMessage() for r in caplog.records)
    # Steps 3 and 4 ran again from checkpoint-2, exactly as the first time.
    assert result["losses"] == straight_run[1]["losses"]
    assert result["val_losses"] == straight_run[1]["val_losses"]
    assert verify_checkpoint(run_dir / "checkpoint-4") == []  # rewritten whole


def test_without_fallback_a_damaged_latest_checkpoint_stops_the_run(run_dir, datasets):
    _flip_byte(run_dir / "checkpoint-4" / "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"checkpoint-4 is damaged \(optimizer\.pt: sha256 checksum differs.*"
                       r"resume_fallback=False.*--resume_fallback true.*without --resume"):
        _resume(run_dir, datasets, resume_fallback=False)
    assert verify_checkpoint(run_dir / "checkpoint-2") == []  # nothing was touched


def test_no_checkpoint_that_verifies_is_a_clear_error(run_dir, datasets):
    _truncate(run_dir / "checkpoint-4" / "model.safetensors")
    (run_dir / "checkpoint-2" / "scaler.pt").unlink()
    with pytest.raises(CheckpointError) as raised:
        _resume(run_dir, datasets)
    message = str(raised.value)
    assert f"no checkpoint in {run_dir} verifies" in message
    assert "checkpoint-4/model.safetensors: " in message and "checkpoint-2/scaler.pt: missing" in message
    assert "without --resume" in message and "--output_dir elsewhere" in message
    assert isinstance(raised.value, ValueError) and "\n" not in message


def test_checkpoints_without_a_manifest_are_refused(run_dir, datasets):
    # What an fp8train before checksums wrote: no manifest.json, RNG states in rng.pt.
    for checkpoint in run_dir.glob("checkpoint-*"):
        (checkpoint / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint-4/manifest\.json: missing \(.*without checkpoint checksums"):
        _resume(run_dir, datasets)
    assert latest_checkpoint(run_dir) is None


def test_resume_in_an_empty_output_dir_starts_from_scratch(tmp_path):
    assert load_resume_checkpoint(tmp_path) is None
    assert load_resume_checkpoint(tmp_path / "missing") is None


# ---------------------------------------------------------------------------- code in a checkpoint


def test_planted_pickle_payload_is_live(tmp_path):
    """The payload the next tests plant does run when unpickled the unsafe way."""
    marker = tmp_path / "ran"
    torch.save(_RunsCodeWhenUnpickled(marker), tmp_path / "payload.pt")
    torch.load(tmp_path / "payload.pt", weights_only=False)
    assert marker.exists()


def test_a_planted_pickle_the_manifest_vouches_for_is_refused_unrun(run_dir, straight_run, datasets, caplog):
    marker = run_dir.parent / "code-ran"
    torch.save(_RunsCodeWhenUnpickled(marker), run_dir / "checkpoint-4" / "optimizer.pt")
    _rewrite_manifest_for(run_dir / "checkpoint-4", "optimizer.pt")
    assert verify_checkpoint(run_dir / "checkpoint-4") == []  # the checksums match: the loader must refuse it

    with pytest.raises(CheckpointError, match=r"optimizer\.pt: unreadable \(torch\.load\(weights_only=True\) refused"):
        read_checkpoint(run_dir / "checkpoint-4")
    with caplog.at_level(logging.WARNING):
        result = _resume(run_dir, datasets)
    assert not marker.exists()
    assert any("optimizer.pt: unreadable" in r.getMessage() for r in caplog.records)
    assert result["losses"] == straight_run[1]["losses"]  # resumed from checkpoint-2


def test_a_planted_rng_pickle_is_never_read(run_dir, datasets):
    # rng.pt is where an fp8train before this format kept RNG states as a pickle.
    marker = run_dir.parent / "code-ran"
    for checkpoint in ("checkpoint-2", "checkpoint-4"):
        torch.save(_RunsCodeWhenUnpickled(marker), run_dir / checkpoint / "rng.pt")
    _rewrite_manifest_for(run_dir / "checkpoint-4", "rng.pt")
    _resume(run_dir, datasets)
    assert not marker.exists()


def test_the_package_has_no_unsafe_loader():
    source = Path(__file__).resolve().parents[2] / "src" / "fp8train"
    for path in source.rglob("*.py"):
        text = path.read_text()
        assert "weights_only=False" not in text and "pickle.load" not in text and "Unpickler(" not in text, path
        for call in re.findall(r"torch\.load\(([^)]*)\)", text):
            assert "weights_only=True" in call, (path, call)


# ---------------------------------------------------------------------------- save_total_limit


def test_save_total_limit_keeps_the_newest_and_leaves_other_files_alone(datasets, tmp_path):
    keepsakes = [tmp_path / "checkpoint-1.bak", tmp_path / "checkpoint-notes", tmp_path / "checkpoint-0"]
    for keepsake in keepsakes:  # checkpoint-0 holds no manifest: the trainer did not write it
        keepsake.mkdir(parents=True)
        (keepsake / "notes.txt").write_text("mine")
    _train(_args(tmp_path, steps=5, checkpoint_interval=1, eval_interval=0, save_total_limit=2), datasets)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [
        "checkpoint-0", "checkpoint-1.bak", "checkpoint-4", "checkpoint-5", "checkpoint-notes",
    ]
    assert all((keepsake / "notes.txt").read_text() == "mine" for keepsake in keepsakes)
    assert not list(tmp_path.glob(".checkpoint-*"))  # nothing half-deleted left behind


def test_pruning_never_deletes_the_newest_checkpoint_that_verifies(run_dir):
    for step in (6, 8):  # newer checkpoints, both damaged
        shutil.copytree(run_dir / "checkpoint-4", run_dir / f"checkpoint-{step}")
        _flip_byte(run_dir / f"checkpoint-{step}" / "model.safetensors")
    removed = prune_checkpoints(run_dir, 1)
    assert removed == [run_dir / "checkpoint-6", run_dir / "checkpoint-2"]
    # The newest by step, and the newest that verifies: one more than the limit.
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    assert load_resume_checkpoint(run_dir)[0] == run_dir / "checkpoint-4"


def test_pruning_keeps_the_checkpoint_just_written(run_dir):
    # A checkpoint of a higher step, left in output_dir by an earlier run without --resume.
    shutil.copytree(run_dir / "checkpoint-4", run_dir / "checkpoint-10")
    removed = prune_checkpoints(run_dir, 1, verified=run_dir / "checkpoint-2")
    assert removed == [run_dir / "checkpoint-4"]


def test_pruning_takes_a_limit_of_at_least_one(tmp_path):
    with pytest.raises(ValueError, match=r"keep=0 must be an int >= 1"):
        prune_checkpoints(tmp_path, 0)


# ---------------------------------------------------------------------------- the command line

TINY_FLAGS = [
    "--n_layer", "1", "--n_embd", "128", "--n_head", "2", "--seq_len", "32", "--batch_size", "4",
    "--eval_batches", "1", "--warmup_steps", "2", "--device", "cpu", "--log_interval", "2",
    "--steps", "4", "--checkpoint_interval", "2",
]


def test_cli_resume_falls_back_past_a_damaged_checkpoint(corpus_file, tmp_path, capsys, caplog):
    argv = ["train", "--data", str(corpus_file(8_000)), "--output_dir", str(tmp_path), *TINY_FLAGS]
    assert main(argv) == 0
    straight_losses = _trainer_state(tmp_path / "checkpoint-4")["losses"]
    _truncate(tmp_path / "checkpoint-4" / "model.safetensors")

    assert main([*argv, "--resume", "true", "--resume_fallback", "false"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fp8train train: error: cannot resume"), err
    assert "checkpoint-4" in err and "model.safetensors" in err

    with caplog.at_level(logging.WARNING):
        assert main([*argv, "--resume", "true"]) == 0
    assert any("model.safetensors" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert _trainer_state(tmp_path / "checkpoint-4")["losses"] == straight_losses
