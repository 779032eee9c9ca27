"""Fixtures of the diagnostics tests: the inspector's command and the trainer's telemetry
train on the same tiny corpora and datasets as the training tests."""

from ..train.conftest import corpus_file, datasets  # noqa: F401 (fixtures, found by name)
