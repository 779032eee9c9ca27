"""``Float8MultiheadAttention``: ``nn.MultiheadAttention`` with FP8 input and output projections.

``nn.MultiheadAttention`` does not call its ``out_proj`` module: it hands every weight to
``F.multi_head_attention_forward`` (or a fused kernel), so swapping ``out_proj`` for a
``Float8Linear`` changes nothing. :class:`Float8MultiheadAttention` is an
``nn.MultiheadAttention`` (same parameters, ``state_dict`` and attributes) whose forward
follows ``F.multi_head_attention_forward`` step by step, with the in-projection GEMMs run
by :meth:`~fp8train.nn.modules.linear.Float8Module.run_linear` and the out-projection by
``out_proj``, a :class:`~fp8train.nn.modules.linear.Float8Linear`. The attention itself (scores,
softmax, weighted sum) stays in high precision.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ...spec.checks import check_type
from ...spec.recipes import Recipe
from .attention_masks import attention_masks, check_attn_mask
from ..autocast import current_state
from ..config import Float8ModuleConfig
from ..gemm_observers import gemms_observed
from .base import Float8Module
from .linear import Float8Linear
from ..weights.attention import in_projection_left_reason, in_projection_weight_types, sliceable_in_proj_weight
from ..weights.float8_weight import Float8Weight

__all__ = [
    "Float8MultiheadAttention",
    "attention_alignment_skip_reason",
    "block_fused_fast_paths",
    "unblock_fused_fast_paths",
]

# Parameters nn.MultiheadAttention registers on itself (out_proj's are its submodule's).
_OWN_PARAMETERS = (
    "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k", "bias_v"
)


def attention_alignment_skip_reason(attention: nn.MultiheadAttention, dim_alignment: int) -> str | None:
    """Why ``attention``'s projections stay in high precision under ``dim_alignment``
    (``None``: they convert): ``embed_dim``, ``kdim`` and ``vdim`` must all be multiples."""
    dims = {"embed_dim": attention.embed_dim, "kdim": attention.kdim, "vdim": attention.vdim}
    if dim_alignment and any(d % dim_alignment for d in dims.values()):
        listed = ", ".join(f"{name}={d}" for name, d in dims.items())
        return f"{listed} are not all multiples of {dim_alignment}"
    return None


def _constructor_arguments(attention: nn.MultiheadAttention) -> dict[str, object]:
    """The ``nn.MultiheadAttention`` constructor's arguments that build a module like ``attention``
    (its parameters then replaced): what ``from_attention`` and ``to_attention`` build with."""
    return dict(
        embed_dim=attention.embed_dim,
        num_heads=attention.num_heads,
        dropout=attention.dropout,
        bias=attention.in_proj_bias is not None,
        add_bias_kv=attention.bias_k is not None,
        add_zero_attn=attention.add_zero_attn,
        kdim=attention.kdim,
        vdim=attention.vdim,
        batch_first=attention.batch_first,
    )


def _fast_path_guard(module: nn.Module, args: tuple) -> None:
    """A forward pre-hook that does nothing: while it is attached, ``nn.TransformerEncoderLayer``
    stays off its fused inference kernel."""


def block_fused_fast_paths(model: nn.Module, fp8_types: tuple[type, ...]) -> None:
    """Keep PyTorch's fused transformer inference paths from bypassing FP8 modules.

    In evaluation without grad, ``nn.TransformerEncoderLayer`` runs one fused kernel on its
    weights (``torch._transformer_encoder_layer_fwd``) instead of its modules' forwards,
    unless a forward hook is attached to one of its modules; ``nn.TransformerEncoder`` turns
    padded batches into nested tensors, which FP8 modules do not take. Every layer holding a
    module of ``fp8_types`` gets a no-op forward pre-hook; every such encoder stops nesting
    (``use_nested_tensor = False``).
    """
    for module in model.modules():
        if not isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerEncoder)):
            continue
        if not any(isinstance(m, fp8_types) for m in module.modules()):
            continue
        if isinstance(module, nn.TransformerEncoder):
            module.use_nested_tensor = False
        elif _fast_path_guard not in module._forward_pre_hooks.values():
            module.register_forward_pre_hook(_fast_path_guard)


def unblock_fused_fast_paths(model: nn.Module) -> None:
    """Remove the hooks :func:`block_fused_fast_paths` attached (encoders stay un-nested:
    nesting is a speed path only)."""
    for module in model.modules():
        hooks = module._forward_pre_hooks
        for key in [key for key, hook in hooks.items() if hook is _fast_path_guard]:
            del hooks[key]


class Float8MultiheadAttention(Float8Module, nn.MultiheadAttention):
    """An ``nn.MultiheadAttention`` whose input and output projections run their output,
    grad_input and grad_weight GEMMs in FP8.

    Same constructor arguments, parameters, ``state_dict`` keys and forward as
    ``nn.MultiheadAttention`` (``batch_first``, unbatched inputs, ``key_padding_mask`` and
    ``attn_mask`` boolean or float, 2-D or 3-D, ``need_weights`` and
    ``average_attn_weights``, ``is_causal``, ``add_bias_kv``, ``add_zero_attn``, ``kdim``
    and ``vdim``, dropout); ``out_proj`` is a :class:`~fp8train.nn.modules.linear.Float8Linear`.
    With delayed scaling the module holds ``fp8_scale`` and ``fp8_amax_history`` for its
    in-projection (one state for the ``q``, ``k`` and ``v`` GEMMs: one packed GEMM in
    self-attention, where ``query``, ``key`` and ``value`` are one tensor) and ``out_proj``
    its own. ``embed_dim``, ``kdim`` and ``vdim`` must meet the recipe's alignment.

    Under ``fp8train.autocast(enabled=False)`` the forward is ``nn.MultiheadAttention``'s
    own, fused fast path included. With FP8 on it never takes that path (it would skip the
    FP8 GEMMs); nested tensors are not supported.

    Args:
        embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim,
            batch_first, device, dtype: as ``nn.MultiheadAttention``.
        config, recipe: as :class:`~fp8train.nn.modules.linear.Float8Linear`.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        config: Float8ModuleConfig | None = None,
        recipe: Recipe | str | None = None,
    ) -> None:
        config = Float8ModuleConfig.build(config, recipe=recipe)
        super().__init__(
            embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first,
            device=device, dtype=dtype,
        )
        self.out_proj = Float8Linear.from_linear(self.out_proj, config=config)
        self._init_fp8(config)

    @classmethod
    def from_attention(
        cls,
        attention: nn.MultiheadAttention,
        recipe: Recipe | str | None = None,
        *,
        config: Float8ModuleConfig | None = None,
    ) -> "Float8MultiheadAttention":
        """A ``Float8MultiheadAttention`` sharing ``attention``'s parameters (no copy);
        ``config`` or ``recipe`` as in the constructor.

        Raises:
            TypeError: ``attention`` is not an ``nn.MultiheadAttention``.
        """
        check_type("attention", attention, nn.MultiheadAttention, "an nn.MultiheadAttention")
        config = Float8ModuleConfig.build(config, recipe=recipe)
        parameters = {name: getattr(attention, name) for name in _OWN_PARAMETERS}
        parameters["out_proj"] = Float8Linear.from_linear(attention.out_proj, config=config)
        build = functools.partial(cls, **_constructor_arguments(attention), config=config)
        return cls._adopt(attention, build, parameters, attention.out_proj.weight.device)

    _original_parameters = (*_OWN_PARAMETERS, "out_proj.weight", "out_proj.bias")

    def _new_original(self) -> nn.MultiheadAttention:
        return nn.MultiheadAttention(**_constructor_arguments(self))

    def to_attention(self) -> nn.MultiheadAttention:
        """:meth:`~fp8train.nn.modules.linear.Float8Module.to_original`: a new ``nn.MultiheadAttention``."""
        return self.to_original()

    @property
    def fp8_weights_left_reason(self) -> str | None:
        return in_projection_left_reason(self)

    def fp8_weight_types(self) -> dict[str, type]:
        return in_projection_weight_types(self)

    def _dims_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``nn.MultiheadAttention.forward``: ``(attn_output, attn_weights or None)``."""
        state = current_state()
        # FP8 off: nn.MultiheadAttention's own forward, unless the GEMMs are being observed
        # (fp8train.inspect) or its weights are stored in FP8 (which it would split): then this
        # forward, whose run_linear calls run F.linear (cross-attention on the master's slices).
        stored = any(isinstance(getattr(self, name), Float8Weight) for name in self.fp8_weight_types())
        if state is not None and not state.enabled and not gemms_observed() and not stored:
            return super().forward(
                query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal,
            )
        if query.is_nested or key.is_nested or value.is_nested:
            raise NotImplementedError(
                "Float8MultiheadAttention does not take nested tensors: pass padded tensors and a key_padding_mask"
            )
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                f"query, key and value must all be 3-D (batched) or 2-D (unbatched), got shapes "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        is_batched = query.dim() == 3
        if self.batch_first and is_batched:
            # One transpose per distinct tensor keeps the self-attention identity (one packed GEMM).
            if key is value:
                if query is key:
                    query = key = value = query.transpose(1, 0)
                else:
                    query, key = (x.transpose(1, 0) for x in (query, key))
                    value = key
            else:
                query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        output, weights = self._attention_seq_first(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal, is_batched
        )
        if self.batch_first and is_batched:
            output = output.transpose(1, 0)
        return output, weights

    def _attention_seq_first(
        self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal, is_batched
    ):
        """``F.multi_head_attention_forward`` on ``[L, N, E]`` inputs, with FP8 projections."""
        if not is_batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        tgt_len, bsz, embed_dim = query.shape
        if embed_dim != self.embed_dim:
            raise ValueError(f"query of shape {tuple(query.shape)} does not end in embed_dim={self.embed_dim}")
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(
                f"key's sequence and batch dims {tuple(key.shape[:2])} differ from value's {tuple(value.shape[:2])}"
            )
        key_padding_mask, attn_mask, is_causal = attention_masks(
            key_padding_mask, attn_mask, need_weights, is_causal, query.dtype
        )
        q, k, v = self._in_projection(query, key, value)
        attn_mask = check_attn_mask(attn_mask, (tgt_len, key.shape[0]), bsz * self.num_heads)
        q, k, v, attn_mask, key_padding_mask = self._heads(q, k, v, attn_mask, key_padding_mask)
        if key_padding_mask is not None:
            src_len, num_heads = k.shape[1], self.num_heads
            if tuple(key_padding_mask.shape) != (bsz, src_len):
                raise ValueError(
                    f"key_padding_mask of shape {tuple(key_padding_mask.shape)} must be (batch, source length) = "
                    f"{(bsz, src_len)}"
                )
            key_padding_mask = (
                key_padding_mask.view(bsz, 1, 1, src_len)
                .expand(-1, num_heads, -1, -1)
                .reshape(bsz * num_heads, 1, src_len)
            )
            attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
        attn_output, weights = self._attend(q, k, v, attn_mask, need_weights, average_attn_weights, is_causal)
        attn_output = self.out_proj(attn_output).view(tgt_len, bsz, -1)
        if not is_batched:
            attn_output = attn_output.squeeze(1)
            weights = weights.squeeze(0) if weights is not None else None
        return attn_output, weights

    def _heads(self, q, k, v, attn_mask, key_padding_mask):
        """``q, k, v`` ``[L, N, E]`` split into heads, ``[N * num_heads, L, head_dim]``, with
        ``bias_k``/``bias_v`` and a zero attention slot appended where asked (the masks
        padded to match)."""
        bsz, num_heads, head_dim = q.shape[1], self.num_heads, self.head_dim
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.repeat(1, bsz, 1)])
            v = torch.cat([v, self.bias_v.repeat(1, bsz, 1)])
            attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
            key_padding_mask = F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None else None
        q = q.reshape(q.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
        k = k.reshape(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
        v = v.reshape(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
        if self.add_zero_attn:
            zeros = torch.zeros((bsz * num_heads, 1, head_dim), dtype=k.dtype, device=k.device)
            k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros.to(v.dtype)], dim=1)
            attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
            key_padding_mask = F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None else None
        return q, k, v, attn_mask, key_padding_mask

    def _attend(self, q, k, v, attn_mask, need_weights, average_attn_weights, is_causal):
        """Scores, softmax and weighted sum of ``[N * num_heads, L, head_dim]`` heads, in high
        precision: ``(output [L * N, E], weights or None)``."""
        num_heads, head_dim = self.num_heads, self.head_dim
        bsz, tgt_len, src_len = q.shape[0] // num_heads, q.shape[1], k.shape[1]
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            q_scaled = q * math.sqrt(1.0 / float(head_dim))
            if attn_mask is not None:
                weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
            else:
                weights = torch.bmm(q_scaled, k.transpose(-2, -1))
            weights = F.softmax(weights, dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            attn_output = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, self.embed_dim)
            weights = weights.view(bsz, num_heads, tgt_len, src_len)
            return attn_output, weights.mean(dim=1) if average_attn_weights else weights
        if attn_mask is not None and attn_mask.size(0) == 1:
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask is not None:
            attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
        q = q.view(bsz, num_heads, tgt_len, head_dim)
        k = k.view(bsz, num_heads, src_len, head_dim)
        v = v.view(bsz, num_heads, src_len, head_dim)
        attn_output = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        return attn_output.permute(2, 0, 1, 3).reshape(bsz * tgt_len, self.embed_dim), None

    def _in_projection(self, query, key, value) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v`` ``[L, N, E]``: one packed GEMM for self-attention, two where ``key`` is
        ``value``, else three (as ``F.multi_head_attention_forward``'s in-projection)."""
        embed_dim, bias = self.embed_dim, self.in_proj_bias
        if not self._qkv_same_embed_dim:
            biases = bias.chunk(3) if bias is not None else (None, None, None)
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
            q, k, v = (self.run_linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))
            return q, k, v
        weight = self.in_proj_weight
        if query is key and key is value:
            projected = self.run_linear(query, weight, bias)
            # [..., 3E] -> [3, ..., E], contiguous, as F.multi_head_attention_forward lays it out.
            q, k, v = projected.unflatten(-1, (3, embed_dim)).movedim(-2, 0).contiguous()
            return q, k, v
        weight = sliceable_in_proj_weight(weight)  # stored in FP8: its master's value
        if key is value:
            w_q, w_kv = weight.split([embed_dim, 2 * embed_dim])
            b_q, b_kv = bias.split([embed_dim, 2 * embed_dim]) if bias is not None else (None, None)
            k, v = self.run_linear(key, w_kv, b_kv).unflatten(-1, (2, embed_dim)).movedim(-2, 0).contiguous()
            return self.run_linear(query, w_q, b_q), k, v
        biases = bias.chunk(3) if bias is not None else (None, None, None)
        q, k, v = (self.run_linear(x, w, b) for x, w, b in zip((query, key, value), weight.chunk(3), biases))
        return q, k, v
