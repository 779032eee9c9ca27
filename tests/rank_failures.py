"""Helpers of the tests where a rank fails: spawn ranks that may raise, be killed or hang,
and see how, and when, each one ended.

Unlike ``spawn_gloo`` (tests/conftest.py), the workers start the process group themselves
from torchrun's environment (fp8train's ``init_distributed``, or the ``Trainer``), so the
timeout under test is fp8train's, and a process may die: its exit code and the moment it
exited are returned instead of failing the run.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from .conftest import find_free_port

# A rank that fails, fails in this step (0-based): the group has run collectives by then.
FAILING_STEP = 2
# Backend errors reach the survivors within milliseconds of a peer's exit; this bounds the
# time from the failure to a survivor's exit, Python start-up not included.
MAX_EXIT_SECONDS = 10.0


@dataclass(frozen=True)
class RankRun:
    """How the ranks of one run ended.

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


def fail(mode: str, results, hang_seconds: float = 0.0) -> None:
    """Fail the calling rank: ``raise`` a RuntimeError, ``kill`` itself (SIGKILL), or
    ``hang`` (sleep ``hang_seconds`` without joining the next collective, then go on)."""
    results["failed_at"] = time.monotonic()
    if mode == "raise":
        raise RuntimeError("injected failure")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode != "hang":
        raise ValueError(f"mode={mode!r} must be raise, kill or hang")
    time.sleep(hang_seconds)


def _entry(rank: int, world_size: int, port: int, worker, results, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    worker(rank, results, *args)


def run_ranks(worker, *args, world_size: int = 2, timeout: float = 30.0) -> RankRun:
    """Run ``worker(rank, results, *args)`` in ``world_size`` spawned processes with
    torchrun's environment variables, wait for all of them (at most ``timeout`` seconds,
    then kill the rest), and report how each ended.

    ``worker`` and ``args`` must pickle: module-level functions of an importable module.
    """
    manager = mp.Manager()
    try:
        results = manager.dict()
        context = mp.start_processes(
            _entry,
            args=(world_size, find_free_port(), worker, results, args),
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
