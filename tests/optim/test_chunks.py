"""How fp8train.optim.AdamW cuts a parameter's update: 2**18-element spans on the CPU (its
caches), 2**24 on any other device (a GPU's launches: each span costs some 20-60 of them),
ending on the FP8 moment's blocks; the bits do not depend on it (test_adamw.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8train.optim.adamw
from fp8train.optim import AdamW
from fp8train.optim.chunks import ACCELERATOR_CHUNK_ELEMENTS, CHUNK_ELEMENTS, chunk_elements, update_spans


def test_the_cpu_takes_cache_sized_spans_and_every_other_device_launch_sized_ones():
    assert (CHUNK_ELEMENTS, ACCELERATOR_CHUNK_ELEMENTS) == (1 << 18, 1 << 24)
    assert chunk_elements(torch.device("cpu")) == CHUNK_ELEMENTS
    for device in ("cuda", "cuda:1", "meta", "xpu"):
        assert chunk_elements(torch.device(device)) == ACCELERATOR_CHUNK_ELEMENTS


@pytest.mark.parametrize(
    "numel, block, whole, elements, spans",
    [
        (1 << 20, 128, False, 1 << 18, [(0, 1 << 18), (1 << 18, 2 << 18), (2 << 18, 3 << 18), (3 << 18, 1 << 20)]),
        (1 << 20, 128, False, 1 << 24, [None]),  # one span: fits
        (1 << 20, 128, True, 1 << 18, [None]),  # no flat view: whole
        (1000, 384, False, 400, [(0, 384), (384, 768), (768, 1000)]),  # rounded down to whole blocks
        (1000, 512, False, 400, [(0, 512), (512, 1000)]),  # never below one block
    ],
)
def test_spans(numel, block, whole, elements, spans):
    got = [None if s is None else (s.start, s.stop) for s in update_spans(numel, block, whole, elements)]
    assert got == spans


def test_a_step_asks_for_the_spans_of_its_parameters_device(monkeypatch):
    """On a device other than the CPU (``meta`` here: no data, the same calls), the step
    updates a 2**20-element parameter in one span; on the CPU in four."""
    asked = []
    spans = update_spans

    def spy(numel, block_size, whole, elements):
        asked.append(elements)
        return list(spans(numel, block_size, whole, elements))

    monkeypatch.setattr(fp8train.optim.adamw, "update_spans", spy)
    for device in ("cpu", "meta"):
        param = nn.Parameter(torch.zeros(1024, 1024, device=device))
        param.grad = torch.ones_like(param)
        AdamW([param], lr=1e-3, stochastic_rounding=False).step()
    assert asked == [CHUNK_ELEMENTS, ACCELERATOR_CHUNK_ELEMENTS]
