"""Fixtures shared by the whole suite: free TCP ports, gloo process groups bounded by a
timeout, small ``nn.Sequential`` models and SQNR; and the compile of the CPU kernels,
started beside the suite.

Each fixture returns a plain module-level function (session scope: they hold no state).
Functions handed to spawned processes (a model builder, say) are pickled by reference to
this module, ``tests.conftest``, which the children import like any other module.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fp8train

GLOO_WORLD_SIZE = 2
GLOO_TIMEOUT_SECONDS = 120
ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh}


# ---------------------------------------------------------------------------- kernels

# numba compiles each CPU kernel once per input dtype (about 2.5 s each, some 30 in all) and
# caches it on disk beside its source, where every later process of the run (spawned ranks,
# CLI subprocesses) loads it. On a fresh checkout that compile would fall on whichever test
# first quantizes; a low-priority process compiles them all at the start instead, on the
# core the (mostly single-threaded) suite leaves idle. A test that gets there first compiles
# its kernel itself, exactly as without this.
_COMPILE_KERNELS = """
import torch
import fp8train
from fp8train.quant.kernels import try_operand_values, try_tensor_amax
from fp8train.quant.quantize import quantize_both
from fp8train.spec.rule import QuantRule

for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(256, 256, dtype=dtype)
    for granularity in ("row", "block1x128", "mx"):
        quantize_both(x, QuantRule(granularity=granularity))
    for granularity in fp8train.spec.granularities.FP8_GRANULARITIES:
        for axis in (-1, 0):
            fp8train.quant.quantize(x, granularity, axis=axis)
    fp8train.quant.quantize(x, "tensor", scale=torch.tensor(1.0))
    for axis in (-1, 0):  # the 4-bit kernels (one compiled variant per dtype and kernel)
        fp8train.quant.quantize(x, "nvfp4", axis=axis)
        fp8train.quant.quantize(x, "nvfp4", axis=axis, rht=True)  # the transform's two kernels
    fp8train.quant.quantize(x, "nvfp4_2d")
    try_tensor_amax(x)
    try_operand_values(fp8train.quant.quantize(x, "mx"), True, dtype)  # the emulated GEMM's operand
    fp8train.quant.scaled_mm(fp8train.quant.quantize(x, "mxfp4"), fp8train.quant.quantize(x, "mxfp4"), dtype)  # 4-bit operands
"""


def _lower_priority() -> None:
    os.nice(10)


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_KERNEL_COMPILE] = subprocess.Popen(
        [sys.executable, "-c", _COMPILE_KERNELS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_lower_priority,
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    process = session.config.stash.get(_KERNEL_COMPILE, None)
    if process is not None and process.poll() is None:
        process.kill()
        process.wait()


_KERNEL_COMPILE = pytest.StashKey[subprocess.Popen]()


# ---------------------------------------------------------------------------- options


def pytest_addoption(parser: pytest.Parser) -> None:
    # Here, not in tests/gpu/conftest.py: pytest reads options only from the conftest files
    # it loads before collecting (the root's), and `pytest -m gpu` starts from the root.
    parser.addoption(
        "--gpu-suite-device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="device of the GPU suite (tests/gpu, marker gpu): cuda (default; skipped without one), or cpu "
        "for a dry run of its logic at small sizes (docs/gpu.md)",
    )


_GPU_SUITE = Path(__file__).parent / "gpu"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # `pytest -m gpu` selects the GPU suite alone: no other test module is imported, so that
    # a GPU machine without the test extra's packages (ml_dtypes, jax, ...) runs it, and
    # collection takes a second.
    if config.getoption("markexpr") != "gpu" or collection_path.is_dir() or collection_path.suffix != ".py":
        return None
    return True if _GPU_SUITE not in collection_path.parents else None


# ---------------------------------------------------------------------------- ports


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """``free_port()``: a TCP port on 127.0.0.1 that was free a moment ago."""
    return find_free_port


# ---------------------------------------------------------------------------- gloo


def _spawn_entry(rank: int, world_size: int, port: int, worker, results, args: tuple, init_group: bool) -> None:
    """Runs in each spawned process. ``init_group``: join a gloo group, run ``worker``, leave
    the group; else set torchrun's environment and let ``worker`` start the group itself."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not init_group:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
        worker(rank, results, *args)
        return
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        worker(rank, results, *args)
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class RankRun:
    """How the ranks of one spawned run ended.

    Attributes:
        exitcodes: per rank; negative for a signal, None for a process still alive at the
            run's timeout (then killed).
        results: what the workers wrote, ``{key: value}``.
        exited_at: per rank, the ``time.monotonic()`` at which its process ended.
    """

    exitcodes: list[int | None]
    results: dict
    exited_at: list[float]

    def seconds_to_exit(self, rank: int) -> float:
        """From the moment a rank failed (``results["failed_at"]``) to ``rank``'s exit."""
        return self.exited_at[rank] - self.results["failed_at"]


def spawn_ranks(worker, *args, world_size: int, timeout: float, init_group: bool) -> RankRun:
    """Run ``worker(rank, results, *args)`` in ``world_size`` spawned CPU processes, wait
    for all of them (at most ``timeout`` seconds together, then kill the rest), and report
    how and when each ended. ``init_group``: see :func:`_spawn_entry`.

    ``worker`` and ``args`` must pickle: module-level functions of an importable module.
    """
    # The results dict's server process comes from a forkserver (a clean, single-threaded
    # process): forked from this one, it could start while another thread (tqdm's monitor,
    # started by an earlier test) held a lock, and hang for good.
    manager = mp.get_context("forkserver").Manager()
    try:
        results = manager.dict()
        context = mp.start_processes(
            _spawn_entry,
            args=(world_size, find_free_port(), worker, results, args, init_group),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        processes = context.processes
        exited_at = [0.0] * world_size
        running = {process.sentinel: rank for rank, process in enumerate(processes)}
        deadline = time.monotonic() + timeout
        while running and time.monotonic() < deadline:
            for sentinel in wait(list(running), timeout=deadline - time.monotonic()):
                exited_at[running.pop(sentinel)] = time.monotonic()
        for rank in running.values():
            processes[rank].kill()
        for process in processes:
            process.join()
        exitcodes = [None if rank in running.values() else p.exitcode for rank, p in enumerate(processes)]
        return RankRun(exitcodes, dict(results), exited_at)
    finally:
        manager.shutdown()


def run_gloo(worker, *args, world_size: int = GLOO_WORLD_SIZE, timeout: float = GLOO_TIMEOUT_SECONDS) -> dict:
    """Run ``worker(rank, results, *args)`` in ``world_size`` spawned CPU processes that
    share a gloo process group, and return ``results`` (a dict the workers fill, e.g.
    ``results[rank] = ...``) once every process has exited with code 0.

    The processes are bounded by ``timeout`` seconds all together, so a hang (a
    collective one rank never enters, say) fails the test instead of stalling the suite.
    """
    run = spawn_ranks(worker, *args, world_size=world_size, timeout=timeout, init_group=True)
    assert None not in run.exitcodes, f"distributed workers did not finish in {timeout} s (a collective hung?)"
    assert all(code == 0 for code in run.exitcodes), run.exitcodes
    return run.results


@pytest.fixture(scope="session")
def spawn_gloo() -> Callable[..., dict]:
    """``spawn_gloo(worker, *args, world_size=2, timeout=120)``: see :func:`run_gloo`."""
    return run_gloo


@pytest.fixture
def one_rank_group():
    """A gloo process group of this process alone (an in-memory store, no ports), for the
    test's duration."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- models


def build_small_model(
    *layers,
    seed: int | None = 0,
    dtype: torch.dtype | None = None,
    recipe=None,
    backend: str = "emulated",
) -> nn.Sequential:
    """A small ``nn.Sequential`` from a compact spec.

    Each of ``layers`` is ``(in_features, out_features)`` or ``(in_features, out_features,
    bias)`` for an ``nn.Linear``, or an activation name (``"gelu"``, ``"relu"``,
    ``"tanh"``). ``torch.manual_seed(seed)`` runs first unless ``seed`` is None (then the
    caller's RNG state decides the weights); ``dtype`` converts the built model; a
    ``recipe`` converts it to FP8 training with ``backend``.
    """
    if seed is not None:
        torch.manual_seed(seed)
    modules = []
    for layer in layers:
        if isinstance(layer, str):
            modules.append(ACTIVATIONS[layer]())
        else:
            in_features, out_features, *bias = layer
            modules.append(nn.Linear(in_features, out_features, bias=bias[0] if bias else True))
    model = nn.Sequential(*modules)
    if dtype is not None:
        model = model.to(dtype)
    if recipe is not None:
        model = fp8train.convert_to_float8_training(model, recipe, backend=backend)
    return model


@pytest.fixture(scope="session")
def small_model() -> Callable[..., nn.Sequential]:
    """``small_model((128, 256), "gelu", (256, 128), seed=0, dtype=None, recipe=None,
    backend="emulated")``: see :func:`build_small_model`."""
    return build_small_model


# ---------------------------------------------------------------------------- SQNR


def signal_to_quantization_noise_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """10 log10(sum ref^2 / sum (ref - out)^2), in float64."""
    ref, out = ref.detach().to(torch.float64), out.detach().to(torch.float64)
    noise = ((ref - out) ** 2).sum().item()
    signal = (ref**2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


@pytest.fixture(scope="session")
def sqnr_db() -> Callable[[torch.Tensor, torch.Tensor], float]:
    """``sqnr_db(ref, out)``: SQNR of ``out`` against ``ref`` in dB (inf when equal)."""
    return signal_to_quantization_noise_db
