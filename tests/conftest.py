"""Fixtures shared by the whole suite: free TCP ports, gloo process groups bounded by a
timeout, small ``nn.Sequential`` models and SQNR.

Each fixture returns a plain module-level function (session scope: they hold no state).
Functions handed to spawned processes (a model builder, say) are pickled by reference to
this module, ``tests.conftest``, which the children import like any other module.
"""

from __future__ import annotations

import math
import os
import socket
import time
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


def _gloo_entry(rank: int, world_size: int, port: int, worker, results, args: tuple) -> None:
    """Runs in each spawned process: join the gloo group, run ``worker``, leave the group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        worker(rank, results, *args)
    finally:
        dist.destroy_process_group()


def run_gloo(worker, *args, world_size: int = GLOO_WORLD_SIZE, timeout: float = GLOO_TIMEOUT_SECONDS) -> dict:
    """Run ``worker(rank, results, *args)`` in ``world_size`` spawned CPU processes that
    share a gloo process group, and return ``results`` (a dict the workers fill, e.g.
    ``results[rank] = ...``) once every process has exited with code 0.

    ``worker`` and ``args`` must pickle: module-level functions of an importable module.
    The processes are bounded by ``timeout`` seconds all together, so a hang (a
    collective one rank never enters, say) fails the test instead of stalling the suite.
    """
    manager = mp.Manager()
    try:
        results = manager.dict()
        context = mp.start_processes(
            _gloo_entry,
            args=(world_size, find_free_port(), worker, results, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        for process in context.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        hung = [process for process in context.processes if process.is_alive()]
        for process in hung:
            process.terminate()
            process.join()
        assert not hung, f"distributed workers did not finish in {timeout} s (a collective hung?)"
        assert all(p.exitcode == 0 for p in context.processes), [p.exitcode for p in context.processes]
        return dict(results)
    finally:
        manager.shutdown()


@pytest.fixture(scope="session")
def spawn_gloo() -> Callable[..., dict]:
    """``spawn_gloo(worker, *args, world_size=2, timeout=120)``: see :func:`run_gloo`."""
    return run_gloo


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
