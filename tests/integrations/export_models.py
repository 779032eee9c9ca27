"""What the export tests share: the tiny transformers Llama they write, its batches, loss
and two training steps, an input-amax calibration, and the small weight whose 1x16 groups
hold every E2M1 edge case with the NVFP4 hand reference of its bytes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
import transformers

import fp8train

E2M1_MAX, E4M3_MAX = np.float32(6.0), np.float32(448.0)


def llama(hidden_size: int = 128, intermediate_size: int = 256, num_key_value_heads: int = 4, tie: bool = False):
    """Every Linear dim a multiple of 128 by default."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=num_key_value_heads,
        vocab_size=256,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(config)


def batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))


def loss(model, tokens) -> float:
    with torch.no_grad():
        return model(input_ids=tokens, labels=tokens).loss.item()


def train(model, steps: int = 2):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        tokens = batch(seed=10 + step)
        with fp8train.autocast():
            step_loss = model(input_ids=tokens, labels=tokens).loss
        step_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def calibrated_input_amax(model, batches) -> dict[str, torch.Tensor]:
    """``fp8train.calibrate_input_amax`` on ``batches`` (token tensors), each amax a float32 tensor."""
    return {name: torch.tensor(value) for name, value in fp8train.calibrate_input_amax(model, batches).items()}


def edge_weight(rows: int = 48, cols: int = 64) -> torch.Tensor:
    """Rows of every kind of group: E2M1 ties (0.25, 0.75, ..., 5 times a power of two), an
    all-zero group, zeros of both signs, the tensor's extremes, tiny and huge magnitudes."""
    torch.manual_seed(0)
    weight = torch.randn(rows, cols) * torch.logspace(-2, 1, cols)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -2.5, -5.0, -6.0, 0.1, -0.1, 3.0])
    weight[0, :16], weight[0, 16:32] = ties, ties * 2.0**-3
    weight[1, :32] = 0.0
    weight[2, :32] = -0.0
    weight[3, :4] = torch.tensor([1e-30, -1e-30, 0.0, -0.0])
    weight[4, 0], weight[5, 33] = 20.0, -20.0
    return weight


def e2m1_codes(scaled: np.ndarray) -> np.ndarray:
    """ml_dtypes' round-to-nearest-even E2M1 codes of float32 values clamped to +-6; -0.0
    gives code 0 (NUMERICS.md 6: only a value below zero sets the sign bit)."""
    codes = np.clip(scaled, -E2M1_MAX, E2M1_MAX).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    return np.where(scaled == 0, 0, codes).astype(np.uint8)


def pack(codes: np.ndarray) -> np.ndarray:
    """Two codes a byte, element ``2j`` in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def hand_nvfp4(weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """numpy float32 (each operation correctly rounded) and ml_dtypes: packed codes, E4M3
    scale bytes per 1x16 group, and the global encode scale 2688/amax."""
    w = weight.float().numpy()
    encode = np.float32(2688.0) / np.abs(w).max()
    decode = np.float32(1.0) / encode
    multiplier = encode * (np.float32(1.0) / E2M1_MAX)
    groups = w.reshape(w.shape[0], -1, 16)
    group_amax = np.abs(groups).max(axis=2, keepdims=True)
    scale = np.clip(group_amax * multiplier, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    with np.errstate(divide="ignore"):
        enc = np.minimum(np.float32(1.0) / (scale.astype(np.float32) * decode), np.finfo(np.float32).max)
    codes = e2m1_codes(groups * enc).reshape(w.shape)
    return pack(codes), scale[..., 0].view(np.uint8), encode
