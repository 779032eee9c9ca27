"""The device whose tensors a process group's collectives take: CUDA for ``nccl``, the CPU
for ``gloo``.

``nccl`` refuses CPU tensors ("No backend type associated with device type cpu") and
``gloo`` is run here on CPU tensors, so every collective of fp8train puts its tensor on
:func:`collective_device` first (a no-op where it lives there already). Shared by the amax
reductions (this layer) and the ``parallel`` and ``train`` layers above.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["collective_device", "backend_device"]

_CPU = torch.device("cpu")


def backend_device(backend: str, cuda_index: int) -> torch.device:
    """The device a ``backend`` process group reduces on: ``cuda:cuda_index`` where ``nccl``
    serves it (``"nccl"``, or a per-device string such as ``"cpu:gloo,cuda:nccl"``), else
    the CPU (``gloo``, ``mpi``).

    ``cuda_index`` is the rank's own GPU: ``torch.cuda.current_device()`` once
    ``init_distributed`` has set it to ``LOCAL_RANK``, which is also the device nccl
    itself picks for an object collective or a barrier.
    """
    return torch.device("cuda", cuda_index) if _served_by_nccl(backend) else _CPU


def _served_by_nccl(backend: str) -> bool:
    return "nccl" in {part.rpartition(":")[2].strip().lower() for part in str(backend).split(",")}


def collective_device(group: object | None = None) -> torch.device:
    """The device the collectives of ``group`` (default: the world) take tensors on
    (:func:`backend_device` of its backend); the CPU without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return _CPU
    backend = dist.get_backend(group)
    return backend_device(backend, torch.cuda.current_device()) if _served_by_nccl(backend) else _CPU
