"""Tests of fp8train.quant.kernels: the CPU kernels against their references, and the settings."""
