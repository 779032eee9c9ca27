"""Launch ``torchrun`` from a test: 2 processes (by default) on a free port, bounded by a timeout."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import find_free_port

TIMEOUT_SECONDS = 300
_PORT_TAKEN = ("Address already in use", "EADDRINUSE", "DistNetworkError")
_STOP_SECONDS = 45


def run_torchrun(
    program: list[str], *, timeout: float = TIMEOUT_SECONDS, env: dict | None = None, nproc: int = 2
) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node <nproc> --master-port <free port> *program``, once more on
    a fresh port if that port was taken meanwhile; fails the test if it outlives ``timeout``
    seconds. ``env`` adds to the environment."""
    result = _run_once(program, timeout, env, nproc)
    if result.returncode != 0 and any(marker in result.stderr for marker in _PORT_TAKEN):
        result = _run_once(program, timeout, env, nproc)
    return result


def _run_once(program: list[str], timeout: float, env: dict | None, nproc: int) -> subprocess.CompletedProcess:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    command = [torchrun, "--nproc-per-node", str(nproc), "--master-port", str(find_free_port()), *program]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun did not finish in {timeout} s (a collective hung?):\n{_stop(process)[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _stop(process: subprocess.Popen) -> str:
    """Stop torchrun and its workers; what it wrote to stderr. torchrun starts each worker in
    a session of its own, so killing torchrun's process group would leave them running (and
    holding the pipes open): SIGTERM lets torchrun stop them first (its own grace period is
    30 s), SIGKILL ends whatever is left of torchrun's group."""
    process.terminate()
    try:
        return process.communicate(timeout=_STOP_SECONDS)[1]
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return "(torchrun did not stop on SIGTERM; killed without reading its output)"
