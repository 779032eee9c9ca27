"""Tests of fp8train.parallel."""
