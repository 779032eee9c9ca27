"""What ``backend="auto"`` runs on each GPU family (issue 40): one table, recipe x GPU
family -> hardware or emulated, decided on made-up devices (no GPU needed) and the same
table docs/gpu.md shows. A layout no GPU has run in the suite (MXFP8's, NVFP4's and
MXFP4's swizzled block scales on Blackwell) stays emulated under ``auto`` and says why,
once; ``backend="hardware"`` still asks for it where the device has it."""

from __future__ import annotations

import logging

import pytest
import torch

from fp8train.quant import gemm as gemm_module
from fp8train.quant.gemm import scaled_mm
from fp8train.quant.gemm.hardware_support import DeviceFacts, auto_support, hardware_support
from fp8train.quant.quantize import quantize
from fp8train.spec.rule import QuantRule

CUDA = (12, 9)
GPUS = {
    "SM 8.9": DeviceFacts("cuda", (8, 9), CUDA, "NVIDIA L4"),
    "SM 9.0": DeviceFacts("cuda", (9, 0), CUDA, "NVIDIA H200"),
    "SM 10.0": DeviceFacts("cuda", (10, 0), CUDA, "NVIDIA B200"),
    "SM 12.0": DeviceFacts("cuda", (12, 0), CUDA, "NVIDIA RTX PRO 6000"),
}
# The recipe's output GEMM: (input granularity, weight granularity).
RECIPES = {
    "tensorwise": ("tensor", "tensor"),
    "rowwise": ("row", "row"),
    "blockwise": ("block1x128", "block128x128"),
    "mxfp8": ("mx", "mx"),
    "nvfp4": ("nvfp4", "nvfp4_2d"),
    "mxfp4": ("mxfp4", "mxfp4"),
}
H, E = "hardware", "emulated"
AUTO_TABLE = {
    #              SM 8.9 SM 9.0 SM 10.0 SM 12.0
    "tensorwise": (H, H, H, H),
    "rowwise": (H, H, H, E),  # SM 12.x: cuBLAS fails (pytorch#192707)
    "blockwise": (E, H, E, E),  # SM 9.0 only
    "mxfp8": (E, E, E, E),  # SM 10.x has it; its swizzled scales have not run in the suite
    "nvfp4": (E, E, E, E),  # likewise
    "mxfp4": (E, E, E, E),  # likewise
}
"""docs/gpu.md's table (bfloat16 output, aligned dims, a CUDA 12.9 build)."""


def _operands(recipe: str):
    a_granularity, b_granularity = RECIPES[recipe]
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(128, 256, generator=generator), torch.randn(128, 256, generator=generator)
    return quantize(x, QuantRule(granularity=a_granularity)), quantize(w, QuantRule(granularity=b_granularity))


@pytest.mark.parametrize("recipe", list(AUTO_TABLE))
def test_every_recipe_on_every_gpu_family(recipe):
    a, b = _operands(recipe)
    for gpu, expected in zip(GPUS, AUTO_TABLE[recipe]):
        uses_hardware, reason = auto_support(a, b, torch.bfloat16, GPUS[gpu])
        assert (H if uses_hardware else E) == expected, (recipe, gpu, reason)
        assert uses_hardware or reason  # every emulated GEMM says why


def test_unproven_layouts_stay_emulated_where_the_device_has_them():
    for recipe in ("mxfp8", "nvfp4", "mxfp4"):
        a, b = _operands(recipe)
        assert hardware_support(a, b, torch.bfloat16, GPUS["SM 10.0"]) == (True, "")
        uses_hardware, reason = auto_support(a, b, torch.bfloat16, GPUS["SM 10.0"])
        assert not uses_hardware and "have not run on a GPU" in reason


def test_auto_logs_the_choice_once(monkeypatch, caplog):
    gemm_module.backend_log.forget()
    monkeypatch.setattr(gemm_module, "device_facts", lambda device: GPUS["SM 10.0"])
    a, b = _operands("mxfp4")
    try:
        with caplog.at_level(logging.INFO, logger="fp8train.quant.gemm"):
            for _ in range(3):
                scaled_mm(a, b, torch.bfloat16, backend="auto")  # emulated: runs on the CPU
    finally:
        gemm_module.backend_log.forget()
    messages = [r.getMessage() for r in caplog.records if r.name == "fp8train.quant.gemm"]
    assert len(messages) == 1 and "emulated" in messages[0] and "swizzled E8M0 block scales" in messages[0]
