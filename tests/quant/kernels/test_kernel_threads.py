"""The CPU kernels use PyTorch's thread count and leave it as it was: numba's OpenMP layer,
started by the first launch, would otherwise reset the OpenMP thread count PyTorch shares
to every core, undoing ``torch.set_num_threads(1)`` (torchrun's ``OMP_NUM_THREADS=1``) for
the rest of the process. In a subprocess: the thread counts are process-wide."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import numba, torch, fp8train
    torch.set_num_threads(1)
    x = torch.randn(256, 256, dtype=torch.bfloat16)
    counts = []
    for granularity in ("mx", "nvfp4", "nvfp4"):  # the first launch starts numba's threading layer
        q = fp8train.quant.quantize(x, granularity)
        counts.append((torch.get_num_threads(), numba.get_num_threads()))
    fp8train.quant.scaled_mm(q, q, torch.bfloat16)  # the folded 4-bit operands' kernel
    counts.append((torch.get_num_threads(), numba.get_num_threads()))
    torch.set_num_threads(2)  # and the kernels follow a change
    fp8train.quant.quantize(x, "mx")
    counts.append((torch.get_num_threads(), numba.get_num_threads()))
    print(counts)
    """
)


@pytest.mark.heavy
def test_kernels_keep_and_follow_torchs_thread_count():
    env = {**os.environ, "NUMBA_NUM_THREADS": "2", "FP8TRAIN_QUANTIZE_KERNEL": "numba"}
    env.pop("OMP_NUM_THREADS", None)
    result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str([(1, 1)] * 4 + [(2, 2)])
