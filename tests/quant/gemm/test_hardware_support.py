"""Which GEMMs run on the hardware: ``hardware_support`` on made-up devices (a table of
capability x CUDA version x granularity x output dtype x shape -> hardware, or emulated
and why), and ``scaled_mm``'s ``auto`` and ``hardware`` backends acting on the decision,
with the CPU's ``torch._scaled_mm`` standing in for a GPU's where it runs."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from fp8train.quant import quantize
from fp8train.quant import gemm as gemm_module
from fp8train.quant.gemm import scaled_mm
from fp8train.quant.gemm.hardware_support import DeviceFacts, device_facts, hardware_support, parse_cuda_version
from fp8train.spec.checks import UnsupportedHardwareError

from .._gemm_reference import _random

H100 = DeviceFacts("cuda", (9, 0), (13, 0), "NVIDIA H100")
H100_CU126 = DeviceFacts("cuda", (9, 0), (12, 6), "NVIDIA H100")
H100_CU128 = DeviceFacts("cuda", (9, 0), (12, 8), "NVIDIA H100")
L4 = DeviceFacts("cuda", (8, 9), (12, 8), "NVIDIA L4")
A100 = DeviceFacts("cuda", (8, 0), (12, 8), "NVIDIA A100")
B200 = DeviceFacts("cuda", (10, 0), (12, 8), "NVIDIA B200")
RTX5090 = DeviceFacts("cuda", (12, 0), (12, 8), "NVIDIA GeForce RTX 5090")
MI300 = DeviceFacts("cuda", (9, 4), None, "AMD Instinct MI300X")
CPU = DeviceFacts("cpu")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SMALL = (128, 128, 256)  # (M, N, K)
HARDWARE = ""  # the expected reason of a GEMM that runs on the hardware

ROWWISE_CUBLAS_ONLY = r"rowwise FP8 GEMMs with {} output run only through cuBLAS on SM 9\.0 with CUDA >= 12\.9"
CASES = [
    # facts, a, b, out_dtype, (M, N, K), reason (regex; HARDWARE: runs on the hardware)
    (H100, "tensor", "tensor", F32, SMALL, HARDWARE),
    (H100, "row", "row", F32, SMALL, HARDWARE),
    (H100, "row", "row", F16, SMALL, HARDWARE),
    (H100, "row", "tensor", F32, SMALL, HARDWARE),
    (H100, "tensor", "row", BF16, SMALL, HARDWARE),
    (H100_CU128, "row", "row", F32, SMALL, ROWWISE_CUBLAS_ONLY.format("float32")),
    (H100_CU128, "row", "row", BF16, SMALL, HARDWARE),
    (L4, "tensor", "tensor", F32, SMALL, HARDWARE),
    (L4, "row", "row", BF16, SMALL, HARDWARE),
    (L4, "row", "row", F32, SMALL, ROWWISE_CUBLAS_ONLY.format("float32")),
    (L4, "row", "tensor", F16, SMALL, ROWWISE_CUBLAS_ONLY.format("float16")),
    (B200, "row", "row", BF16, SMALL, HARDWARE),
    (B200, "row", "row", F32, SMALL, ROWWISE_CUBLAS_ONLY.format("float32")),
    (RTX5090, "tensor", "tensor", F32, SMALL, HARDWARE),
    (RTX5090, "row", "row", BF16, SMALL, r"rowwise FP8 GEMMs fail in cuBLAS on SM 12\.x \(pytorch#192707\)"),
    (A100, "tensor", "tensor", BF16, SMALL, r"tensorwise/rowwise FP8 GEMMs need SM 8\.9\+ .*NVIDIA A100 \(SM 8\.0, CUDA 12\.8\) is not one"),
    (MI300, "tensor", "tensor", BF16, SMALL, r"NVIDIA CUDA builds of PyTorch only; AMD Instinct MI300X .* no torch\.version\.cuda"),
    (CPU, "tensor", "tensor", BF16, SMALL, r"need a CUDA device with SM 8\.9\+ .*; the operands are on cpu"),
    (H100, "block1x128", "block128x128", BF16, (256, 256, 384), HARDWARE),
    (H100, "block1x128", "block128x128", F32, (256, 384, 640), HARDWARE),
    (H100, "block1x128", "block1x128", F32, (256, 256, 128), HARDWARE),
    (H100, "block1x128", "block1x128", F16, (256, 256, 128), r"blockwise FP8 GEMMs with float16 output have not been proven"),
    (H100, "block128x128", "block1x128", BF16, (256, 256, 512), r"the blockwise pair block128x128 x block1x128 has not been proven"),
    (H100_CU128, "block1x128", "block128x128", BF16, (256, 256, 512), r"need SM 9\.0 \(Hopper\) and CUDA >= 12\.9; NVIDIA H100 \(SM 9\.0, CUDA 12\.8\) has an older cuBLAS"),
    (L4, "block1x128", "block1x128", BF16, (256, 256, 512), r"blockwise FP8 GEMMs need SM 9\.0 \(Hopper\)"),
    (B200, "block1x128", "block128x128", BF16, (256, 256, 512), r"NVIDIA B200 \(SM 10\.0, CUDA 12\.8\) is not one"),
    (B200, "mx", "mx", BF16, (128, 64, 96), HARDWARE),
    (H100, "mx", "mx", BF16, (128, 64, 96), r"mxfp8 FP8 GEMMs need SM 10\.x"),
    (RTX5090, "mx", "mx", BF16, (128, 64, 96), r"mxfp8 FP8 GEMMs need SM 10\.x"),
    (B200, "nvfp4", "nvfp4", BF16, (128, 64, 96), HARDWARE),
    (DeviceFacts("cuda", (10, 0), (12, 6), "NVIDIA B200"), "nvfp4", "nvfp4", BF16, (128, 64, 96), r"CUDA >= 12\.8"),
    # shapes: torch._scaled_mm's K and N multiples of 16 (a Float8Linear built directly, the public scaled_mm)
    (H100, "tensor", "tensor", BF16, (128, 128, 40), r"K and N to be multiples of 16 .*M=128, K=40, N=128"),
    (H100, "row", "row", BF16, (64, 50257, 32), r"multiples of 16 .*N=50257"),
    (H100, "tensor", "tensor", BF16, (30, 48, 32), HARDWARE),  # M any
    (H100, "tensor", "tensor", BF16, (0, 48, 32), r"an empty GEMM \(M=0, K=32, N=48\)"),
]


def _operand(granularity: str, rows: int, k: int, seed: int, dtype=None):
    return quantize(_random((rows, k), seed), granularity, dtype=dtype)


def _case_id(case) -> str:
    facts, a, b, out, (m, n, k), reason = case
    verdict = "hardware" if reason == HARDWARE else "emulated"
    return f"{facts.name or 'cpu'}-cu{facts.cuda_version}-{a}x{b}-{str(out)[6:]}-{m}x{n}x{k}-{verdict}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_hardware_support_table(case):
    facts, a_gran, b_gran, out_dtype, (m, n, k), reason = case
    a, b = _operand(a_gran, m, k, 1), _operand(b_gran, n, k, 2)
    supported, why = hardware_support(a, b, out_dtype, facts)
    if reason == HARDWARE:
        assert (supported, why) == (True, "")
    else:
        assert not supported
        assert re.search(reason, why), why


def test_two_e5m2_operands_run_emulated():
    a, b = _operand("tensor", 64, 64, 1, E5M2), _operand("tensor", 64, 64, 2, E5M2)
    assert hardware_support(a, b, BF16, H100) == (False, "cuBLAS multiplies no two float8_e5m2 operands")
    assert hardware_support(a, _operand("tensor", 64, 64, 2, E4M3), BF16, H100) == (True, "")


def test_device_facts_at_the_edge():
    assert device_facts(torch.device("cpu")) == CPU
    assert parse_cuda_version("12.8") == (12, 8) and parse_cuda_version("13.0") == (13, 0)
    assert parse_cuda_version(None) is None and parse_cuda_version("13") == (13, 0)
    assert H100.describe() == "NVIDIA H100 (SM 9.0, CUDA 13.0)"


# ---------------------------------------------------------------- scaled_mm on the decision


@pytest.fixture
def fake_device(monkeypatch):
    """``fake_device(facts)``: scaled_mm decides as if the operands were on that device
    (they stay on the CPU, whose _scaled_mm runs tensorwise and rowwise)."""
    gemm_module.backend_log.forget()
    hardware_calls = []

    def spy(*args):
        hardware_calls.append(args)
        return real_hardware_mm(*args)

    real_hardware_mm = gemm_module.hardware_mm
    monkeypatch.setattr(gemm_module, "hardware_mm", spy)
    yield lambda facts: monkeypatch.setattr(gemm_module, "device_facts", lambda device: facts), hardware_calls
    gemm_module.backend_log.forget()


def test_auto_falls_back_with_the_reason_logged_once(fake_device, caplog):
    set_facts, hardware_calls = fake_device
    set_facts(L4)
    a, b = _operand("row", 64, 96, 1), _operand("row", 48, 96, 2)
    with caplog.at_level(logging.INFO, logger="fp8train.quant.gemm"):
        outs = [scaled_mm(a, b, F32, backend="auto") for _ in range(3)]
    messages = [r.getMessage() for r in caplog.records if r.name == "fp8train.quant.gemm"]
    assert len(messages) == 1, messages
    assert "run emulated (rowwise FP8 GEMMs with float32 output run only through cuBLAS" in messages[0]
    assert not hardware_calls
    assert all(torch.equal(out, scaled_mm(a, b, F32, backend="emulated")) for out in outs)


def test_forced_hardware_raises_the_reason_and_the_way_out(fake_device):
    set_facts, _ = fake_device
    set_facts(L4)
    a, b = _operand("row", 64, 96, 1), _operand("tensor", 48, 96, 2)
    with pytest.raises(UnsupportedHardwareError, match=r"no FP8 GEMM on this device: rowwise FP8 GEMMs with float16 .*NVIDIA L4 \(SM 8\.9, CUDA 12\.8\).*Use backend='emulated'"):
        scaled_mm(a, b, F16, backend="hardware")
    a40, b40 = _operand("tensor", 64, 40, 1), _operand("tensor", 48, 40, 2)
    set_facts(H100)
    with pytest.raises(UnsupportedHardwareError, match=r"multiples of 16 .*K=40.*Use backend='emulated'"):
        scaled_mm(a40, b40, BF16, backend="hardware")
    # auto never raises: the misaligned GEMM runs emulated
    assert torch.equal(scaled_mm(a40, b40, BF16), scaled_mm(a40, b40, BF16, backend="emulated"))


def test_auto_runs_the_row_by_tensor_pair_on_the_hardware(fake_device):
    set_facts, hardware_calls = fake_device
    set_facts(H100)
    a, b = _operand("row", 64, 96, 1), _operand("tensor", 48, 96, 2)
    out = scaled_mm(a, b, F32)
    assert len(hardware_calls) == 1
    emulated = scaled_mm(a, b, F32, backend="emulated")
    assert torch.allclose(out, emulated, rtol=1e-6, atol=1e-6 * emulated.abs().max().item())
