"""How a parameter's optimizer update is cut into spans: small chunks on the CPU (its
caches bound the float32 temporaries), large ones elsewhere (a GPU's launches bound the
step). Every operation of the update is elementwise, so any chunking gives the same bits,
rounded to nearest."""

from __future__ import annotations

import torch

__all__ = ["CHUNK_ELEMENTS", "ACCELERATOR_CHUNK_ELEMENTS", "chunk_elements", "update_spans"]


CHUNK_ELEMENTS = 1 << 18
"""Elements of a parameter updated at once. A step reads the weight, gradient and moments
as float32 and makes a few float32 intermediates, some 40 bytes an element: over a whole
embedding table at once that would be the largest temporary of training (hundreds of MiB
for a 50k x 4096 table); a chunk of 2**18 keeps it near 10 MiB. Every operation is
elementwise, so rounded to nearest the chunks give the whole tensor's bits
(``tests/optim/test_adamw.py``); stochastic rounding draws its noise chunk by chunk (a
chunk's first moment, second moment, master, then the next chunk), as reproducible from
the seed."""

ACCELERATOR_CHUNK_ELEMENTS = 1 << 24
"""Elements updated at once on a GPU (any device but the CPU): a chunk there costs some 20
to 60 kernel launches whatever its size, so 2**18-element chunks would make a step
launch-bound (about 10**5 launches at 1B parameters); 2**24 makes it about 64 times fewer,
for a float32 temporary near 640 MiB. The same bits as any other chunking, rounded to
nearest; stochastic rounding draws by the chunks of the device it runs on."""


def chunk_elements(device: torch.device) -> int:
    """How many elements of a parameter one update takes on ``device``:
    :data:`CHUNK_ELEMENTS` on the CPU (its caches), :data:`ACCELERATOR_CHUNK_ELEMENTS`
    elsewhere (its launches)."""
    return CHUNK_ELEMENTS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS


def update_spans(numel: int, block_size: int, whole: bool, elements: int):
    """The spans of the flattened parameter to update in turn: ``None`` (all of it, in its
    shape) where ``whole`` (a non-contiguous tensor has no flat view) or it fits in one
    chunk, else slices of ``elements`` (:func:`chunk_elements`) rounded down to a multiple
    of the FP8 moment's ``block_size`` (so a chunk's blocks are whole blocks of the tensor's)."""
    chunk = max(block_size, elements // block_size * block_size)
    if whole or numel <= chunk:
        yield None
        return
    for start in range(0, numel, chunk):
        yield slice(start, min(start + chunk, numel))
