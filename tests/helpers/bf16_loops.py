"""How the tests that train or multiply in bf16 in their own loops run their bf16 matmuls:
by the library's own decision (:mod:`fp8train.quant.gemm.bf16`), as the trainer's do and as
docs/training.md tells a user to in their own loop.

On a CPU with native bf16, and on a GPU, nothing changes: torch's own bf16 GEMMs, the same
bits. On a CPU without it (AVX2 only), the bf16 matmuls run as float32 GEMMs of their bf16
operands rounded once to bf16, bf16's numerics, instead of oneDNN's fallback, 25-35x slower:
the convergence runs that train in bf16 pinned the same behaviour there but took most of
their time in that fallback.
"""

from __future__ import annotations

import contextlib

import torch

import fp8train.quant.gemm.bf16 as bf16_gemm


def bf16_matmuls():
    """CPU bf16 matmuls as this machine runs them best with bf16's numerics: a
    :class:`~fp8train.quant.gemm.bf16.Bf16MatmulsViaFloat32` where the CPU has no native
    bf16, a null context where it has. ``NATIVE_BF16_GEMM`` is read at the call, so a test
    may set it either way."""
    return bf16_gemm.bf16_matmuls_via_float32(bf16_gemm.bf16_via_float32("cpu", bf16_gemm.NATIVE_BF16_GEMM))


@contextlib.contextmanager
def bf16_autocast():
    """``torch.autocast("cpu", dtype=torch.bfloat16)`` within :func:`bf16_matmuls`: the
    trainer's bf16 mixed precision on a CPU (``mixed_precision_autocast``)."""
    with bf16_matmuls(), torch.autocast("cpu", dtype=torch.bfloat16):
        yield
