"""Tests of fp8train.train."""
