"""The Linears vLLM loads as one fused layer, and what they must share in a checkpoint: one
precision (:func:`fused_group_reasons`), and in the NVFP4 formats one global weight scale
and one input scale (:func:`fused_amax`, the largest amax of the group).
"""

from __future__ import annotations

import torch

__all__ = ["VLLM_FUSED_GROUPS", "fused_group", "fused_group_reasons", "fused_amax"]

VLLM_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Linears vLLM loads as one fused layer (its ``packed_modules_mapping``: ``qkv_proj``,
``gate_up_proj``): they must share one precision, and in FP8 each part's ``out_features``
must be whole 128-row blocks (vLLM's ``validate_fp8_block_shape``)."""


def fused_group(name: str) -> tuple[str, ...]:
    """The group of ``VLLM_FUSED_GROUPS`` the Linear ``name`` belongs to, or ``()``."""
    leaf = name.rpartition(".")[2]
    return next((group for group in VLLM_FUSED_GROUPS if leaf in group), ())


def _siblings(name: str) -> list[str]:
    """The qualified names of ``name``'s fused group (``name`` included), or ``[]``."""
    parent = name.rpartition(".")[0]
    return [f"{parent}.{part}" if parent else part for part in fused_group(name)]


def fused_group_reasons(reasons: dict[str, str | None]) -> dict[str, str]:
    """The reason each FP8 candidate (reason ``None``) stays in high precision because a
    sibling in a group vLLM fuses into one layer does: vLLM refuses a fused layer whose parts
    differ in precision."""
    demoted = {}
    for name, reason in reasons.items():
        sibling = next((other for other in _siblings(name) if reasons.get(other) is not None), None)
        if reason is None and sibling is not None:
            demoted[name] = f"vLLM fuses it with {sibling}, which stays in high precision, into one layer"
    return demoted


def fused_amax(amax: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """For each name in ``amax`` whose whole fused group is in ``amax``, the largest over the
    group."""
    fused: dict[str, torch.Tensor] = {}
    for name in amax:
        group = _siblings(name)
        if group and all(part in amax for part in group):
            fused[name] = torch.stack([amax[part] for part in group]).amax()
    return fused
