"""Tests of fp8train.quant."""
