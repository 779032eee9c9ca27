"""The GPU suite (tests/gpu) on the CPU: its own code (the float64 references, the bounds,
the shapes it builds, the command lines it runs) must work before it reaches a GPU, where
device time is scarce. A dry run of its quick part (``--gpu-suite-device cpu``: the
emulation on both sides of each comparison); the rest (distributed, compile) runs with
``python -m pytest -m gpu --gpu-suite-device cpu`` (docs/gpu.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICK_PART = ["tests/gpu/test_cast.py", "tests/gpu/test_linear.py", "tests/gpu/test_delayed.py",
              "tests/gpu/test_gemm.py", "tests/gpu/test_compare.py"]


@pytest.mark.heavy
def test_the_gpu_suite_runs_on_the_cpu(tmp_path):
    # One K of each GEMM family (K/128 = 3: the blockwise case that needs padding on Hopper).
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "--gpu-suite-device",
               "cpu", "--basetemp", str(tmp_path), "-k", "not test_scaled_mm_matches_float64 or 384", *QUICK_PART]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-500:]
