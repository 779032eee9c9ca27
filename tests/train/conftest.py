"""Fixtures of the training-loop and command-line tests: text corpora on disk and the
datasets of the tiny Trainer runs."""

from pathlib import Path
from typing import Callable

import pytest

from fp8train.train.data import embedded_text, load_text, split_text

from ._trainer_helpers import DATA_BYTES, TINY


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Callable[[int], Path]:
    """``corpus_file(n_bytes)``: a text file holding the first ``n_bytes`` of the embedded
    corpus (written once per size, then shared; tests only read it)."""
    made: dict[int, Path] = {}

    def make(n_bytes: int) -> Path:
        if n_bytes not in made:
            path = tmp_path_factory.mktemp("data") / "corpus.txt"
            path.write_text(embedded_text()[:n_bytes], encoding="utf-8")
            made[n_bytes] = path
        return made[n_bytes]

    return make


@pytest.fixture(scope="module")
def datasets(corpus_file):
    """(train, val) datasets of the tiny Trainer runs (test_trainer*.py)."""
    return split_text(load_text(corpus_file(DATA_BYTES)), TINY["seq_len"])
