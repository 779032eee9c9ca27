"""Constant tensors built once per device, so that a training step builds none.

On a GPU, ``torch.tensor(python_values, device=cuda)`` is a host-to-device copy that waits
for the host, each time it runs: a table or a scale constant built in every quantization
is a synchronization in every step. Built once here (per key, which names the device) and
reused, it costs one copy per process. ``tests/helpers/host_syncs.py`` pins that a step builds none.

While ``torch.compile`` traces, each call builds its constant afresh (it becomes a constant
of the graph, with no copy per step); so does a trace's fake tensor mode, whose tensors
are never kept.

A cached tensor is shared: read it, never write into it.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

__all__ = ["ConstantCache", "device_constant"]


class ConstantCache:
    """``build(*key)``, called once per ``key`` (compared by ``repr``, so ``-0.0`` is not
    ``0.0``) outside a trace, and its tensor returned on every later call.

    Args:
        build: a function of hashable arguments (one of them the device) returning a tensor.
    """

    def __init__(self, build: Callable[..., torch.Tensor]) -> None:
        self._build = build
        self._tensors: dict[tuple[str, ...], torch.Tensor] = {}

    def __call__(self, *key: Hashable) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._build(*key)
        name = tuple(map(repr, key))
        tensor = self._tensors.get(name)
        if tensor is None:
            # A plain tensor, whatever mode the first caller runs in (no graph, no inference flag).
            with torch.inference_mode(False), torch.no_grad():
                tensor = self._build(*key)
            if type(tensor) is not torch.Tensor:  # a fake or functional tensor of a trace
                return tensor
            self._tensors[name] = tensor
        return tensor


device_constant = ConstantCache(
    lambda values, dtype, device: torch.tensor(values, dtype=dtype, device=device)
)
"""``device_constant(values, dtype, device)``: ``torch.tensor(values, dtype=dtype,
device=device)`` (``values`` a float or a tuple of them), built once per
``(values, dtype, device)``."""
