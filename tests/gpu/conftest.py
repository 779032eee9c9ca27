"""The GPU suite's device, its sizes, and the ``gpu`` marker on every test here.

``python -m pytest -m gpu`` runs this directory on CUDA (docs/gpu.md); without a CUDA
device every test is skipped, saying so. ``--gpu-suite-device cpu`` runs the same checks
on the CPU at small sizes (a dry run: the code paths, shapes and command lines, with the
CPU's emulation on both sides of each comparison).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8train.quant.kernels import launch

from ._suite import SuiteSizes, sizes_for

_HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Before `-m` selects (tryfirst), so `-m gpu` keeps every test here and `-m 'not gpu'`
    # none. The hook sees the whole session's items: mark only this directory's.
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device under test: ``cuda`` (the current CUDA device), or ``cpu`` for a dry run."""
    name = request.config.getoption("--gpu-suite-device")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip(
            "GPU suite: no CUDA device (torch.cuda.is_available() is False); "
            "`--gpu-suite-device cpu` runs its logic on the CPU"
        )
    return torch.device(name, torch.cuda.current_device()) if name == "cuda" else torch.device(name)


@pytest.fixture(autouse=True)
def _on_the_suite_device(device: torch.device) -> None:
    """Every test here needs the device, whether or not it names the fixture (skip otherwise)."""


@pytest.fixture(autouse=True, scope="module")
def _cpu_side_without_numba():
    """The CPU side of each comparison quantizes by the pure-PyTorch reference path, which
    the CPU suite holds bit-identical to the fused numba kernels: a fresh checkout would
    otherwise spend a minute compiling them. The device keeps its own kernels (the fused
    GPU quantizer is what the comparisons check), so numba alone is switched off."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "compiled_elements", lambda: None)
        yield


@pytest.fixture(scope="session")
def sizes(device: torch.device) -> SuiteSizes:
    """The suite's sizes on ``device`` (full on CUDA, small for the CPU dry run)."""
    return sizes_for(device)
