"""Tests of fp8train.nn."""
