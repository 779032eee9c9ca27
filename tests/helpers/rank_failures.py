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

from ..conftest import RankRun, spawn_ranks

# A rank that fails, fails in this step (0-based): the group has run collectives by then.
FAILING_STEP = 2
# Backend errors reach the survivors within milliseconds of a peer's exit; this bounds the
# time from the failure to a survivor's exit, Python start-up not included.
MAX_EXIT_SECONDS = 10.0


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


def run_ranks(worker, *args, world_size: int = 2, timeout: float = 30.0) -> RankRun:
    """Spawn ``worker(rank, results, *args)`` on ``world_size`` ranks with torchrun's
    environment (each starts its own process group) and report how each ended."""
    return spawn_ranks(worker, *args, world_size=world_size, timeout=timeout, init_group=False)
