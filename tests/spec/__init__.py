"""Tests of fp8train.spec."""
