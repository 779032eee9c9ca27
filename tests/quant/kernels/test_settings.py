"""The quant layer's settings: read from the environment once, at import, with errors that
name the variable; changed for a block only by use_quant_settings, which restores them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fp8train.quant.kernels import GEMM_DTYPE_ENV, KERNEL_ENV, QuantSettings, quant_settings, use_quant_settings


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, QuantSettings()),
        ({KERNEL_ENV: " Reference "}, QuantSettings(quantize_kernel="reference")),
        ({KERNEL_ENV: ""}, QuantSettings(quantize_kernel="auto")),
        ({KERNEL_ENV: "numba", GEMM_DTYPE_ENV: "float32"}, QuantSettings(quantize_kernel="numba", emulated_gemm="float32")),
        ({GEMM_DTYPE_ENV: "bfloat16"}, QuantSettings(emulated_gemm="bfloat16")),
    ],
)
def test_settings_from_the_environment(environ, expected):
    assert QuantSettings.from_environment(environ) == expected


def test_the_environment_is_read_once_at_import(monkeypatch):
    before = quant_settings()
    monkeypatch.setenv(KERNEL_ENV, "reference" if before.quantize_kernel != "reference" else "auto")
    assert quant_settings() is before


def test_use_quant_settings_restores_even_on_error():
    before = quant_settings()
    with pytest.raises(KeyError):
        with use_quant_settings(quantize_kernel="reference", emulated_gemm="float32") as inside:
            assert quant_settings() is inside and inside.quantize_kernel == "reference"
            with use_quant_settings(quantize_kernel="numba"):
                assert quant_settings() == QuantSettings(quantize_kernel="numba", emulated_gemm="float32")
            assert quant_settings() is inside
            raise KeyError("boom")
    assert quant_settings() is before


def test_bad_settings_name_the_field():
    with pytest.raises(TypeError, match="quantize_path"):
        with use_quant_settings(quantize_path="numba"):
            pass
    with pytest.raises(ValueError, match=r"quantize_kernel='fast' must be one of auto, numba, reference"):
        QuantSettings(quantize_kernel="fast")


@pytest.mark.heavy  # a subprocess, process group or JAX compile of seconds: CI's second leg runs it (default run under 6 minutes)
def test_a_bad_variable_fails_the_import_naming_it():
    env = {**os.environ, KERNEL_ENV: "fast"}
    done = subprocess.run(
        [sys.executable, "-c", "import fp8train"], capture_output=True, text=True, env=env, timeout=300,
        cwd="/", check=False,
    )
    assert done.returncode != 0
    assert "FP8TRAIN_QUANTIZE_KERNEL='fast' is not one of auto, numba, reference" in done.stderr
