"""Fixtures of the quant tests."""

from __future__ import annotations

import contextlib

import pytest

from fp8train.quant.kernels import use_quant_settings


@pytest.fixture
def kernel_choice():
    """``kernel_choice("numba")`` sets the quantization path for the rest of the test (each
    call inside the previous one's block, :func:`~fp8train.quant.kernels.use_quant_settings`);
    the settings before the test come back at its end."""
    with contextlib.ExitStack() as stack:
        yield lambda choice: stack.enter_context(use_quant_settings(quantize_kernel=choice))
