"""The random number generators a training run draws from: capture, restore, and a file
format that holds no pickle (``safetensors``: the torch CPU and CUDA states as uint8
tensors ``torch`` and ``cuda.<i>``; Python's ``random`` state as JSON in the metadata)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["RngState", "capture_rng_state", "restore_rng_state", "save_rng_state", "load_rng_state"]


@dataclass(frozen=True)
class RngState:
    """The states of the torch CPU, CUDA and Python generators."""

    torch_cpu: torch.Tensor  # uint8, torch.get_rng_state()
    cuda: tuple[torch.Tensor, ...]  # uint8, one per visible CUDA device (empty without CUDA)
    python: tuple  # random.getstate(): (version, tuple of 625 ints, gauss_next)


def capture_rng_state() -> RngState:
    """The current torch CPU, CUDA and Python RNG states (drawing nothing from them)."""
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else ()
    return RngState(torch_cpu=torch.get_rng_state(), cuda=cuda, python=random.getstate())


def restore_rng_state(state: RngState) -> None:
    """Set the generators to ``state``. CUDA states apply to the devices this process sees."""
    torch.set_rng_state(state.torch_cpu)
    random.setstate(state.python)
    if state.cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state.cuda[: torch.cuda.device_count()]))


def save_rng_state(state: RngState, path: str | Path) -> None:
    """Write ``state`` to the safetensors file ``path``."""
    version, internal, gauss_next = state.python
    tensors = {"torch": state.torch_cpu, **{f"cuda.{i}": cuda for i, cuda in enumerate(state.cuda)}}
    python = {"version": version, "internal": list(internal), "gauss_next": gauss_next}
    save_file(tensors, str(path), metadata={"python_random": json.dumps(python)})


def load_rng_state(path: str | Path) -> RngState:
    """Read a file written by :func:`save_rng_state` (safetensors and JSON: nothing runs).

    Raises:
        ValueError, TypeError, KeyError or safetensors' error: the file is not such a file.
    """
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    python = json.loads(metadata["python_random"])
    python_state = (python["version"], tuple(python["internal"]), python["gauss_next"])
    random.Random().setstate(python_state)  # raises on a malformed state, before anything is restored
    torch.Generator().set_state(tensors["torch"])  # likewise
    cuda = tuple(tensors[f"cuda.{i}"] for i in range(sum(key.startswith("cuda.") for key in tensors)))
    return RngState(torch_cpu=tensors["torch"], cuda=cuda, python=python_state)
