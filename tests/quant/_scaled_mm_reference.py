"""An independent float64 ``torch._scaled_mm`` for FP8 operands: what PyTorch's CUDA build
computes with given arguments, read from how PyTorch checks them and cuBLAS documents them.
It shares no code with fp8train.

PyTorch (``_scaled_mm`` v1, torch 2.10 to 2.14, aten/src/ATen/native/cuda/ScaledBlas.cpp)
requires ``mat_a`` row-major, ``mat_b`` column-major, K and N multiples of 16, and picks the
scaling mode from the scales' dtypes, shapes and strides, first match wins, in the order
tensorwise, rowwise, (128x128, 1x128), (1x128, 128x128), (1x128, 1x128); ``b``'s scales are
checked as ``scale_b.t()`` against ``mat_b.t()`` (``[N, K]``). With ``kb = ceil(K/128)``:

* 1x128 scales of a ``[R, K]`` operand: ``(R, kb)``, strides ``(1, R)`` (a dim of size 1
  takes any stride).
* 128x128 scales: ``(ceil(R/128), kb)``, strides ``(kb, 1)``.

cuBLAS (VEC128_32F, BLK128x128_32F) reads the scale memory from the pointer alone: 1x128
scales with the outer dim fastest and a leading dimension of R (PyTorch's check, and
Transformer Engine's reference layout ``[kb, R]``) or of R padded to 4 (TE's allocation;
the same where 4 divides R), 128x128 scales with the K blocks fastest and a leading dimension
of ``kb`` padded to 4 (TE's layout, and what an H200 did: the stride-``kb`` layout PyTorch
accepts gave wrong results where 4 does not divide ``kb``). The reference reads the scales
through every one of these readings and requires them to agree.
"""

from __future__ import annotations

import math

import torch

BLOCK = 128


class Refused(ValueError):
    """PyTorch would refuse these arguments."""


def _check_size_stride(scale: torch.Tensor, dim: int, size: int, stride: int) -> bool:
    return scale.shape[dim] == size and (size <= 1 or scale.stride(dim) == stride)


def _mode(t: torch.Tensor, scale: torch.Tensor, mode: str) -> bool:
    """PyTorch's is_tensorwise_scaling / is_rowwise_scaling / is_blockwise_*_scaling for an
    operand ``t`` of shape ``[R, K]`` (K last)."""
    if scale.dtype != torch.float32:
        return False
    rows, k = t.shape
    kb = math.ceil(k / BLOCK)
    if mode == "tensor":
        return scale.numel() == 1
    if scale.dim() != 2:
        return False
    if mode == "row":
        return tuple(scale.shape) == (rows, 1) and scale.is_contiguous()
    if mode == "1x128":
        return _check_size_stride(scale, 0, rows, 1) and _check_size_stride(scale, 1, kb, rows)
    return _check_size_stride(scale, 0, math.ceil(rows / BLOCK), kb) and _check_size_stride(scale, 1, kb, 1)


PAIRS = (("tensor", "tensor"), ("row", "row"), ("128x128", "1x128"), ("1x128", "128x128"), ("1x128", "1x128"))


def scaling_modes(mat_a, mat_b, scale_a, scale_b) -> tuple[str, str]:
    """The scaling pair PyTorch picks; ``Refused`` where none matches or a shape rule fails."""
    if mat_a.stride(1) != 1 or mat_b.stride(0) != 1:
        raise Refused(f"mat_a must be row-major and mat_b column-major; strides {mat_a.stride()}, {mat_b.stride()}")
    if mat_a.shape[1] % 16 or mat_b.shape[0] % 16 or mat_b.shape[1] % 16:
        raise Refused(f"K and N must be multiples of 16: {tuple(mat_a.shape)} x {tuple(mat_b.shape)}")
    for mode_a, mode_b in PAIRS:
        if _mode(mat_a, scale_a, mode_a) and _mode(mat_b.t(), scale_b.t(), mode_b):
            return mode_a, mode_b
    raise Refused(
        f"Invalid scaling configuration: scale_a {tuple(scale_a.shape)} strides {scale_a.stride()}, "
        f"scale_b {tuple(scale_b.shape)} strides {scale_b.stride()}"
    )


def _read(scale: torch.Tensor, size: tuple[int, int], stride: tuple[int, int]) -> torch.Tensor:
    """The memory cuBLAS reads from ``scale``'s pointer with ``stride``, float64 (raises if
    that reads past the scale's storage)."""
    storage = torch.empty(0, dtype=scale.dtype).set_(scale.untyped_storage())
    return torch.as_strided(storage, size, stride, scale.storage_offset()).to(torch.float64)


def _readings(scale: torch.Tensor, rows: int, k: int, mode: str) -> list[torch.Tensor]:
    """Every documented cuBLAS reading of an operand's scales, each expanded to ``[rows, k]``."""
    kb = math.ceil(k / BLOCK)
    if mode == "tensor":
        return [scale.reshape(()).to(torch.float64).expand(rows, k)]
    if mode == "row":
        return [scale.reshape(rows, 1).to(torch.float64).expand(rows, k)]
    if mode == "1x128":
        grids = [_read(scale, (rows, kb), (1, ld)) for ld in sorted({rows, -(-rows // 4) * 4})]
        return [g.repeat_interleave(BLOCK, dim=1)[:, :k] for g in grids]
    grid = _read(scale, (math.ceil(rows / BLOCK), kb), (-(-kb // 4) * 4, 1))
    return [grid.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:rows, :k]]


def reference_scaled_mm(mat_a, mat_b, scale_a, scale_b) -> torch.Tensor:
    """``torch._scaled_mm(mat_a, mat_b, scale_a, scale_b)`` in float64 (``[M, N]``), as the
    CUDA build computes it. Raises ``Refused`` where PyTorch would refuse, and
    ``AssertionError`` where cuBLAS's documented readings of the scales disagree."""
    mode_a, mode_b = scaling_modes(mat_a, mat_b, scale_a, scale_b)
    (m, k), n = mat_a.shape, mat_b.shape[1]
    values_a = mat_a.to(torch.float32).to(torch.float64)
    values_b = mat_b.t().to(torch.float32).to(torch.float64)  # [N, K]
    results = [
        (values_a * grid_a) @ (values_b * grid_b).T
        for grid_a in _readings(scale_a, m, k, mode_a)
        for grid_b in _readings(scale_b.t(), n, k, mode_b)
    ]
    for other in results[1:]:
        assert torch.equal(other, results[0]), "cuBLAS's documented readings of these scales differ"
    return results[0]
