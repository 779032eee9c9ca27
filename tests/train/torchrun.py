"""Launch ``torchrun`` from a test: 2 CPU processes on a free port, bounded by a timeout."""

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


def run_torchrun(
    program: list[str], *, timeout: float = TIMEOUT_SECONDS, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 --master-port <free port> *program``, once more on a
    fresh port if that port was taken meanwhile; fails the test if it outlives ``timeout``
    seconds. ``env`` adds to the environment."""
    result = _run_once(program, timeout, env)
    if result.returncode != 0 and any(marker in result.stderr for marker in _PORT_TAKEN):
        result = _run_once(program, timeout, env)
    return result


def _run_once(program: list[str], timeout: float, env: dict | None) -> subprocess.CompletedProcess:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    command = [torchrun, "--nproc-per-node", "2", "--master-port", str(find_free_port()), *program]
    # start_new_session: on a timeout the whole process group (torchrun and its workers) goes.
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s (a collective hung?):\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
