"""A small GPT (nanoGPT-like) whose every Linear dim is a multiple of 128 by default, so
every recipe applies to every layer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

from ..parallel.tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
from .data import VOCAB_SIZE

__all__ = ["GPTConfig", "GPT"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the default model.

    Attributes:
        n_layer: Transformer blocks.
        n_head: Attention heads (must divide ``n_embd``).
        n_embd: Width; every Linear is ``n_embd x {1,3,4} n_embd`` or ``n_embd x 256``.
        block_size: Longest sequence (positions).
        vocab_size: Tokens (256 bytes).
    """

    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    vocab_size: int = VOCAB_SIZE

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide n_embd={self.n_embd}")


class _CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under sequence parallelism x holds this rank's tokens, qkv's output all of them.
        qkv = self.qkv(x)
        batch, seq, width = qkv.shape[0], qkv.shape[1], x.shape[-1]
        q, k, v = qkv.split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class _Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = _CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.fc_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` pre-norm blocks, a final LayerNorm and an
    LM head. ``forward(idx, targets=None)`` returns logits, or the mean cross-entropy loss
    when ``targets`` is given."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that add into the residual stream.
        for name, parameter in self.named_parameters():
            if name.endswith(("proj.weight", "fc_proj.weight")):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def tensor_parallel_plan(self) -> dict:
        """The plan for ``torch.distributed.tensor.parallel.parallelize_module`` on a 1-D
        tensor-parallel mesh: sequence parallel (the residual stream split along the
        sequence between the blocks' norms), the MLP and the LM head split as in Megatron,
        FP8 layers through :mod:`fp8train.parallel`'s styles (others through PyTorch's).

        The fused ``qkv`` projection is split by output features, which do not fall on head
        boundaries, so its output is all-gathered (high precision) and every rank runs the
        attention itself; ``proj`` takes its slice of that and reduce-scatters. The input
        of ``qkv``, ``fc`` and ``lm_head`` is gathered in FP8, and ``proj``'s and
        ``fc_proj``'s grad_output in the backward, where the recipe allows. The logits are
        gathered whole, so the loss is the same on every rank of the group.
        """
        # Embeddings split by rows (summed back whole), so that every parameter is a DTensor
        # (clip_grad_norm_ and FSDP2 on a 2-D mesh take them together); the residual stream
        # is split along the sequence from the first block on.
        plan = {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "blocks.0": PrepareModuleInput(
                input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True
            ),
        }
        for index in range(len(self.blocks)):
            prefix = f"blocks.{index}."
            plan.update({
                prefix + "ln_1": SequenceParallel(use_local_output=True),
                prefix + "attn.qkv": Float8ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
                prefix + "attn.proj": Float8RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                prefix + "ln_2": SequenceParallel(use_local_output=True),
                prefix + "fc": Float8ColwiseParallel(input_layouts=Shard(1)),
                prefix + "fc_proj": Float8RowwiseParallel(output_layouts=Shard(1)),
            })
        plan["ln_f"] = SequenceParallel(use_local_output=True)
        plan["lm_head"] = Float8ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
        return plan

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence of {seq} tokens is longer than block_size={self.config.block_size}")
        positions = torch.arange(seq, device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
