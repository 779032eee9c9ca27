"""The masks of ``Float8MultiheadAttention``'s forward, as ``F.multi_head_attention_forward``
takes them: boolean or float, 2-D or 3-D, merged with the causal hint where it can be."""

from __future__ import annotations

import torch

__all__ = ["additive_mask", "attention_masks", "check_attn_mask"]


def additive_mask(mask: torch.Tensor | None, name: str, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (``True``: not attended) as ``-inf``/0 in ``dtype``; a float mask as it is."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise TypeError(f"{name} has dtype {mask.dtype}: only bool and floating-point masks are supported")
    return mask


def attention_masks(key_padding_mask, attn_mask, need_weights: bool, is_causal: bool, dtype: torch.dtype):
    """``(key_padding_mask, attn_mask, is_causal)`` as the attention takes them: additive
    masks in ``dtype``, the causal hint kept only where no mask merges with it."""
    key_padding_mask = additive_mask(key_padding_mask, "key_padding_mask", dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        return key_padding_mask, None, is_causal  # scaled_dot_product_attention takes the causal hint itself
    attn_mask = additive_mask(attn_mask, "attn_mask", dtype)
    if key_padding_mask is not None:
        is_causal = False  # the merged mask is no longer causal
    return key_padding_mask, attn_mask, is_causal


def check_attn_mask(attn_mask, lengths: tuple[int, int], num_batch_heads: int):
    """``attn_mask`` ``[L, S]`` or ``[N * num_heads, L, S]`` (``lengths`` ``(L, S)``) as
    ``[1 or N * num_heads, L, S]``; ``None`` stays ``None``."""
    if attn_mask is None:
        return None
    expected = lengths if attn_mask.dim() == 2 else (num_batch_heads, *lengths)
    if attn_mask.dim() not in (2, 3) or tuple(attn_mask.shape) != expected:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} must be {expected}")
    return attn_mask.unsqueeze(0) if attn_mask.dim() == 2 else attn_mask
