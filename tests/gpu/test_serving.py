"""The block-FP8 serving checkpoints (``fp8_block``, ``fp8_block_ue8m0``) on the device's own
block-scaled FP8 GEMM: each Linear's ``weight`` and ``weight_scale_inv`` read from the file,
as the inference engines read them (E4M3 ``[N, K]``, one float32 scale per 128x128 block,
``[N/128, K/128]``), multiplied with a 1x128-quantized activation by ``torch._scaled_mm``
(where the device runs it: Hopper and newer), against the float64 product computed by hand
from the file's bytes.

The weights' 128x128 blocks differ in magnitude and the grids are not square (``[8, 4]`` and
``[4, 8]``), so a scale read transposed, or against the wrong block, fails by orders of
magnitude. transformers' own FP8 layers and vLLM are not run: transformers fetches its FP8
kernels from the Hugging Face Hub (the ``kernels`` package) and vLLM is not installed, and
this machine has no network (docs/serving.md). The 4-bit and MX formats have no GEMM on
Hopper; their files are checked on the CPU through compressed-tensors' own decompression.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fp8train
from fp8train.quant.gemm.hardware_support import device_facts, hardware_support
from fp8train.quant.tensor import QuantizedTensor

from ._suite import assert_close, dequantize_f64, gemm_rel_err

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

FORMATS = ("fp8_block", "fp8_block_ue8m0")
ROWS = (128, 384)  # activation rows (the 1x128 quantizer takes whole 128-row tiles; fp8train pads)


def _llama() -> nn.Module:
    """A one-layer Llama, hidden 512 and MLP 1024 (K/128 = 4 and 8: the hardware's blockwise
    GEMM wants K/128 a multiple of 4), each Linear's 128x128 blocks scaled by its own factor
    (e^(2 z)) so every block scale differs."""
    config = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                n, k = module.weight.shape
                generator = torch.Generator().manual_seed(7 * n + k)
                factor = torch.exp(2 * torch.randn(math.ceil(n / 128), math.ceil(k / 128), generator=generator))
                module.weight.mul_(_per_block(factor, n, k))
    return model


def _per_block(grid: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``grid`` ``[N/128, K/128]`` spread over the ``[n, k]`` elements of its blocks."""
    return grid.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def _file_weight_f64(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The weight the file holds, by the format's definition: ``weight * weight_scale_inv``
    per 128x128 block, in float64."""
    n, k = weight.shape
    return weight.double() * _per_block(scale_inv.double(), n, k)


def _activations(rows: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device).manual_seed(seed)
    row_scale = torch.exp(torch.randn(rows, 1, generator=generator, device=device))
    return (torch.randn(rows, k, generator=generator, device=device) * row_scale).to(torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_fp8_checkpoint_runs_on_the_devices_block_scaled_gemm(fmt, device, tmp_path):
    written = fp8train.save_pretrained_quantized(_llama(), tmp_path / fmt, format=fmt)
    tensors = load_file(tmp_path / fmt / "model.safetensors")
    assert len(written.fp8_modules) == 7
    for index, name in enumerate(written.fp8_modules):
        weight, scale_inv = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"]
        n, k = weight.shape
        assert scale_inv.shape == (math.ceil(n / 128), math.ceil(k / 128))
        b = QuantizedTensor(weight.to(device), scale_inv.to(device), "block128x128")
        expected_weight = _file_weight_f64(weight, scale_inv).to(device)
        for rows in ROWS:
            a = fp8train.quant.quantize(_activations(rows, k, 100 * index + rows, device), "block1x128")
            expected = dequantize_f64(a) @ expected_weight.T
            for out_dtype in (torch.float32, torch.bfloat16):
                if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
                    supported, reason = hardware_support(a, b, out_dtype, device_facts(device))
                    assert supported, f"{name}: Hopper should run this GEMM in hardware: {reason}"
                out = fp8train.quant.scaled_mm(a, b, out_dtype)
                assert_close(
                    out, expected, rel_err=gemm_rel_err(a, b, out_dtype), roundings=1,
                    what=f"{fmt} {name} M={rows} N={n} K={k} {out_dtype}",
                )
