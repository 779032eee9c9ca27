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

__all__ = ["ConstantCache", "ConstantMemo", "device_constant"]


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


class ConstantMemo(dict):
    """``memo[key]``: ``build(*key)`` (a value derived from a hashable ``key``, the constant
    tensors it needs included), built at its first lookup and kept, so that a lookup that
    finds it makes no Python call at all (issue 38: a quantization looks up its rule's and
    shape's facts on every call). A value holding a tensor that is not a plain one (a trace's
    fake tensor) is not kept; past ``max_entries`` keys (shapes of a model with changing
    sequence lengths) the memo starts afresh.

    While ``torch.compile`` traces, call ``memo.build(*key)`` instead, as
    :class:`ConstantCache` does: each trace builds its constants into its graph.
    """

    def __init__(self, build: Callable[..., object], max_entries: int = 256) -> None:
        super().__init__()
        self.build = build
        self._max_entries = max_entries

    def __missing__(self, key: tuple) -> object:
        with torch.inference_mode(False), torch.no_grad():
            value = self.build(*key)
        if _holds_plain_tensors(value):
            if len(self) >= self._max_entries:
                self.clear()
            self[key] = value
        return value


def _holds_plain_tensors(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return type(value) is torch.Tensor
    if isinstance(value, tuple):
        return all(_holds_plain_tensors(item) for item in value)
    return True
