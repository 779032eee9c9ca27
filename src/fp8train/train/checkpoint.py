"""The ``Trainer``'s checkpoints on disk: write, verify, find the newest good one, read, prune.

A checkpoint is a directory ``output_dir/checkpoint-<step>`` holding

=====================  ===================================================================
``model.safetensors``  the whole (unsharded) model ``state_dict``
``optimizer.pt``       the optimizer's ``state_dict`` (tensors and plain data only)
``scheduler.pt``       the learning-rate scheduler's ``state_dict`` (plain data only)
``scaler.pt``          the fp16 grad scaler's ``state_dict`` (plain data only)
``rng.safetensors``    RNG states: torch CPU and CUDA as uint8 tensors, Python's ``random``
                       as JSON in the metadata (:mod:`fp8train.train.rng`)
``config.json``        the run's ``TrainingArguments``
``trainer_state.json`` step, data position, losses, validation losses
``manifest.json``      written last: the size and sha256 of every other file
=====================  ===================================================================

The directory is written under a hidden staging name and renamed into place, so a crash
while saving never leaves a half-written ``checkpoint-<step>``. A checkpoint *verifies* when
its manifest is readable and every file it lists has the recorded size and sha256. Nothing
is unpickled except through ``torch.load(weights_only=True)``, which builds tensors and plain
containers and refuses everything else without running it. Checkpoints without a manifest
(incomplete, or written by an fp8train before checksums) never verify and are not resumed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .rng import RngState, load_rng_state, save_rng_state

__all__ = [
    "CheckpointContents",
    "CheckpointError",
    "latest_checkpoint",
    "list_checkpoints",
    "load_resume_checkpoint",
    "prune_checkpoints",
    "read_checkpoint",
    "verify_checkpoint",
    "write_checkpoint",
]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "fp8train-checkpoint"
MANIFEST_VERSION = 1
# The files resume reads: the manifest must list (and so vouch for) every one of them.
STATE_FILES = (
    "model.safetensors", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng.safetensors", "trainer_state.json",
)
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
_STAGING_GLOB = ".checkpoint-*.tmp-*"  # staging directories, and checkpoints being deleted
_HOW_TO_FIX = (
    "start without --resume (resume=False), point --output_dir elsewhere, or move the damaged "
    "checkpoint-* directories out of it"
)


class CheckpointError(ValueError):
    """No checkpoint of an ``output_dir`` can be resumed from (or, with
    ``resume_fallback=False``, the latest one is damaged)."""


class _Damaged(Exception):
    """One file of a checkpoint failed to read; the message is ``"<file>: <why>"``."""


@dataclass(frozen=True)
class CheckpointContents:
    """Everything a checkpoint holds, in memory (CPU tensors and plain data)."""

    model: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    scaler: dict
    rng: RngState
    config: dict
    trainer: dict  # step, data_position, losses, val_losses (keys as strings)

    @property
    def step(self) -> int:
        return self.trainer["step"]


# ---------------------------------------------------------------------------- writing


def write_checkpoint(output_dir: str | Path, contents: CheckpointContents) -> Path:
    """Write ``output_dir/checkpoint-<contents.step>`` atomically and return its path.

    The files go into a staging directory, are flushed to disk, then ``manifest.json`` (their
    sizes and sha256, computed from the files as written) is written last and the directory
    is renamed into place, replacing a checkpoint of the same step.
    """
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{contents.step}"
    for stale in output_dir.glob(_STAGING_GLOB):  # left by crashed runs
        shutil.rmtree(stale, ignore_errors=True)
    staging = output_dir / f".checkpoint-{contents.step}.tmp-{os.getpid()}"
    staging.mkdir(parents=True)
    save_file(contents.model, str(staging / "model.safetensors"))
    torch.save(contents.optimizer, staging / "optimizer.pt")
    torch.save(contents.scheduler, staging / "scheduler.pt")
    torch.save(contents.scaler, staging / "scaler.pt")
    save_rng_state(contents.rng, staging / "rng.safetensors")
    (staging / "config.json").write_text(json.dumps(contents.config, indent=2))
    (staging / "trainer_state.json").write_text(json.dumps(contents.trainer))
    files = sorted(staging.iterdir())
    for path in files:
        _fsync(path)
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "step": contents.step,
        "files": {path.name: _file_record(path) for path in files},
    }
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
    _fsync(staging / MANIFEST)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    try:
        _fsync(output_dir)  # make the rename itself durable
    except OSError:  # some file systems cannot sync a directory
        pass
    return final


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_record(path: Path) -> dict:
    size, sha256 = _size_and_sha256(path)
    return {"size": size, "sha256": sha256}


def _size_and_sha256(path: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


# ---------------------------------------------------------------------------- finding


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Every ``checkpoint-<step>`` directory of ``output_dir``, newest (highest step) first,
    complete or not."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in output_dir.iterdir()
        if (match := CHECKPOINT_NAME.match(path.name)) and path.is_dir()
    ]
    return [path for _, path in sorted(found, reverse=True)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete ``checkpoint-<step>`` directory (one with its ``manifest.json``) with the
    highest step, or None. Its files are not checked: see :func:`verify_checkpoint`."""
    return next((path for path in list_checkpoints(output_dir) if (path / MANIFEST).is_file()), None)


# ---------------------------------------------------------------------------- verifying


def verify_checkpoint(checkpoint: str | Path) -> list[str]:
    """What is wrong with ``checkpoint``, one ``"<file>: <why>"`` per bad file; empty when
    the manifest is readable, lists every file resume reads, and every file it lists has
    its recorded size and sha256. Reads each file once; unpickles nothing."""
    checkpoint = Path(checkpoint)
    try:
        files = _read_manifest(checkpoint)
    except _Damaged as problem:
        return [str(problem)]
    problems = [f"{MANIFEST}: does not list {name}" for name in STATE_FILES if name not in files]
    for name, record in files.items():
        problem = _check_file(checkpoint / name, record)
        if problem is not None:
            problems.append(f"{name}: {problem}")
    return problems


def _read_manifest(checkpoint: Path) -> dict[str, dict]:
    path = checkpoint / MANIFEST
    if not path.is_file():
        raise _Damaged(
            f"{MANIFEST}: missing (the checkpoint is incomplete, or an fp8train without checkpoint "
            "checksums wrote it; such checkpoints cannot be verified and are not resumed)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise _Damaged(f"{MANIFEST}: unreadable ({_describe(error)})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise _Damaged(f"{MANIFEST}: not an fp8train checkpoint manifest")
    if manifest.get("version") != MANIFEST_VERSION:
        raise _Damaged(
            f"{MANIFEST}: version {manifest.get('version')!r}, but this fp8train reads version "
            f"{MANIFEST_VERSION} (a newer fp8train wrote it?)"
        )
    files = manifest.get("files")
    well_formed = isinstance(files, dict) and all(
        isinstance(name, str) and name == Path(name).name and name not in ("", ".", "..", MANIFEST)
        and isinstance(record, dict) and type(record.get("size")) is int and isinstance(record.get("sha256"), str)
        for name, record in files.items()
    )
    if not well_formed:
        raise _Damaged(f"{MANIFEST}: malformed file list")
    return files


def _check_file(path: Path, record: dict) -> str | None:
    try:
        if not path.is_file():
            return "missing" if not path.exists() else "unreadable (not a regular file)"
        size = path.stat().st_size
        if size != record["size"]:
            return f"{size} bytes, but the manifest records {record['size']} (truncated or overwritten)"
        size, sha256 = _size_and_sha256(path)
    except OSError as error:
        return f"unreadable ({_describe(error)})"
    if size != record["size"]:
        return f"{size} bytes, but the manifest records {record['size']} (changed while being read)"
    if sha256 != record["sha256"]:
        return "sha256 checksum differs from the manifest's (the contents changed)"
    return None


def _describe(error: BaseException) -> str:
    """A one-line account of a load error (torch's own messages span many lines)."""
    text = str(error)
    if isinstance(error, pickle.UnpicklingError):
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        return (
            "torch.load(weights_only=True) refused it without running it: it holds Python objects "
            "fp8train never writes" + (f", such as {found.group(1)}" if found else "")
        )
    first_line = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(error).__name__}: {first_line[:200]}"


# ---------------------------------------------------------------------------- reading


def read_checkpoint(checkpoint: str | Path) -> CheckpointContents:
    """Read a checkpoint's files with safe loaders only: safetensors, JSON, and
    ``torch.load(weights_only=True)``. Call :func:`verify_checkpoint` first.

    Raises:
        CheckpointError: a file does not load (naming the file and why).
    """
    try:
        return _read_contents(Path(checkpoint))
    except _Damaged as problem:
        raise CheckpointError(f"checkpoint {checkpoint}: {problem}; {_HOW_TO_FIX}") from None


def _read_contents(checkpoint: Path) -> CheckpointContents:
    def load(name: str, loader):
        try:
            return loader(checkpoint / name)
        except Exception as error:  # any failure to load means the file is not what we wrote
            raise _Damaged(f"{name}: unreadable ({_describe(error)})") from None

    def tensors_and_plain_data(path: Path):
        return torch.load(path, map_location="cpu", weights_only=True)

    trainer = load("trainer_state.json", lambda path: json.loads(path.read_text()))
    if not isinstance(trainer, dict) or not {"step", "losses", "val_losses"} <= set(trainer):
        raise _Damaged("trainer_state.json: unreadable (it lacks step, losses or val_losses)")
    return CheckpointContents(
        model=load("model.safetensors", lambda path: load_file(str(path))),
        optimizer=load("optimizer.pt", tensors_and_plain_data),
        scheduler=load("scheduler.pt", tensors_and_plain_data),
        scaler=load("scaler.pt", tensors_and_plain_data),
        rng=load("rng.safetensors", load_rng_state),
        config=load("config.json", lambda path: json.loads(path.read_text())),
        trainer=trainer,
    )


def load_resume_checkpoint(output_dir: str | Path, *, fallback: bool = True) -> tuple[Path, CheckpointContents] | None:
    """The newest checkpoint of ``output_dir`` that verifies and reads, and its contents.

    Each checkpoint that does not is logged (WARNING: which file, and why) and, with
    ``fallback``, skipped for the next older one.

    Returns:
        ``(path, contents)``, or None when ``output_dir`` has no ``checkpoint-<step>``
        directory at all (a fresh run).

    Raises:
        CheckpointError: no checkpoint verifies, or ``fallback`` is False and the latest
            one does not; the message names each bad file.
    """
    rejected: list[tuple[Path, list[str]]] = []
    checkpoints = list_checkpoints(output_dir)
    for path in checkpoints:
        problems = verify_checkpoint(path)
        if not problems:
            try:
                return path, _read_contents(path)
            except _Damaged as problem:
                problems = [str(problem)]
        rejected.append((path, problems))
        if not fallback:
            raise CheckpointError(
                f"cannot resume: the latest checkpoint {path} is damaged ({'; '.join(problems)}) and "
                f"resume_fallback=False forbids falling back to an older one; set --resume_fallback true "
                f"to resume from the newest checkpoint that verifies, or {_HOW_TO_FIX}"
            )
        logger.warning(
            "checkpoint %s is damaged, not resuming from it: %s%s", path, "; ".join(problems),
            "; trying the next older checkpoint" if path != checkpoints[-1] else "",
        )
    if not rejected:
        return None
    details = "; ".join(f"{path.name}/{problem}" for path, problems in rejected for problem in problems)
    raise CheckpointError(f"cannot resume: no checkpoint in {Path(output_dir)} verifies ({details}); {_HOW_TO_FIX}")


# ---------------------------------------------------------------------------- pruning


def prune_checkpoints(output_dir: str | Path, keep: int, *, verified: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints of ``output_dir``, never the newest
    checkpoint that verifies (kept as one more when the newer ones are damaged).

    Only ``checkpoint-<step>`` directories this module writes are touched (real directories
    holding a ``manifest.json``, or the ``trainer_state.json`` of older fp8train versions);
    anything else in ``output_dir`` stays. ``verified`` is a checkpoint known to verify (the
    one just written): it is kept, and not read again.

    Returns:
        The deleted checkpoints, newest first.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r} must be an int >= 1")
    checkpoints = [
        path for path in list_checkpoints(output_dir)
        if not path.is_symlink() and ((path / MANIFEST).is_file() or (path / "trainer_state.json").is_file())
    ]
    kept = set(checkpoints[:keep]) | ({verified} if verified is not None else set())
    for path in checkpoints:  # newest first: the first that verifies is the one resume would take
        if path == verified or not verify_checkpoint(path):
            kept.add(path)
            break
    removed = [path for path in checkpoints if path not in kept]
    for path in removed:
        # Renamed first, so a crash mid-delete leaves no half checkpoint; the next save
        # sweeps the hidden leftover like a stale staging directory.
        doomed = path.with_name(f".{path.name}.tmp-{os.getpid()}-deleted")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        logger.info("deleted %s (keeping the newest %d checkpoints)", path, keep)
    return removed
