"""Tests of fp8train.nn.delayed: delayed scaling's state, amaxes and a step's updates across ranks."""
