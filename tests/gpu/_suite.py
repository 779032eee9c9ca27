"""What the GPU suite's tests share: the sizes they run at on each device, the float64
reference of a quantized GEMM, the comparison against it, and the environment of a child
process (which must import the fp8train under test, installed or on ``PYTHONPATH``)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

import fp8train
from fp8train.quant.gemm.hardware_support import device_facts, hardware_support
from fp8train.quant.scaling import nvfp4_global_scales
from fp8train.quant.tensor import QuantizedTensor
from fp8train.spec.recipes import resolve_recipe
from tests.helpers.tolerances import EMULATED_GEMM_REL_ERR, HARDWARE_GEMM_REL_ERR, OUTPUT_ROUNDING


@dataclass(frozen=True, kw_only=True)
class SuiteSizes:
    """The sizes the suite runs at.

    Attributes:
        gemm_ms: GEMM rows before rounding up to a family's block (not multiples of 128).
        gemm_ns: GEMM columns: a small one, a vocabulary (multiple of 128), and one that is
            not a multiple of 16 (a vocabulary as GPT-2 has it: the hardware refuses it).
        compare_flags: ``fp8train compare`` flags beyond the recipes, device and output.
        train_flags: a short ``fp8train train`` run (compiled, and under torchrun).
        compile_backend: ``torch.compile``'s backend (inductor on CUDA; on the CPU dry run
            ``aot_eager``, as inductor's CPU compile takes minutes on a small machine).
    """

    gemm_ms: tuple[int, ...]
    gemm_ns: tuple[int, ...]
    compare_flags: tuple[str, ...]
    train_flags: tuple[str, ...]
    compile_backend: str


_SHORT_TRAIN = ("--steps", "4", "--n_layer", "1", "--n_embd", "256", "--n_head", "2", "--seq_len", "64",
                "--batch_size", "4", "--eval_interval", "0", "--eval_batches", "1", "--log_interval", "1",
                "--warmup_steps", "1", "--fp8_stats_interval", "0")

CUDA_SIZES = SuiteSizes(
    gemm_ms=(1, 100, 300),
    gemm_ns=(256, 50304, 50257),
    # The default model at width 1024 for the command's default 150 steps (the README's gap
    # bound is for them), evaluated once at the end.
    compare_flags=("--n_embd", "1024", "--eval_interval", "0", "--fp8_stats_interval", "0", "--log_interval", "25"),
    train_flags=_SHORT_TRAIN,
    compile_backend="inductor",
)
CPU_DRY_RUN_SIZES = SuiteSizes(
    gemm_ms=(1, 100, 300),
    gemm_ns=(256, 1152, 1009),
    compare_flags=("--n_embd", "128", "--n_layer", "1", "--steps", "3", "--seq_len", "32", "--batch_size", "4",
                   "--eval_interval", "0", "--eval_batches", "1", "--fp8_stats_interval", "0", "--log_interval", "1"),
    train_flags=_SHORT_TRAIN,
    compile_backend="aot_eager",
)


def sizes_for(device: torch.device) -> SuiteSizes:
    return CUDA_SIZES if device.type == "cuda" else CPU_DRY_RUN_SIZES


# ---------------------------------------------------------------------------- float64 references


def dequantize_f64(qt: QuantizedTensor) -> torch.Tensor:
    """The ``[M, K]`` values of a K-last operand in float64 on its device: its codes times
    its group scales (times NVFP4's global decode scale), each exact in float64."""
    m, k = qt.unpacked_shape_2d
    rows, cols = qt.group_shape
    values = qt.values_float32().double().reshape(m // rows, rows, k // cols, cols)
    scale_inv = qt.scale_inv_float32().double().reshape(m // rows, 1, k // cols, 1)
    out = (values * scale_inv).reshape(m, k)
    if qt.global_amax is not None:
        out = out * nvfp4_global_scales(qt.global_amax)[1].double()
    return out


def reference_mm(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """``dequant(a) @ dequant(b)^T`` in float64."""
    return dequantize_f64(a) @ dequantize_f64(b).T


def gemm_rel_err(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> float:
    """The bound a GEMM of ``a`` and ``b`` into ``out_dtype`` meets: the hardware's where
    ``_scaled_mm`` runs it on their device, the emulation's where it falls back."""
    supported, _ = hardware_support(a, b, out_dtype, device_facts(a.data.device))
    return HARDWARE_GEMM_REL_ERR if supported else EMULATED_GEMM_REL_ERR


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rel_err: float,
    roundings: int,
    scale: float | None = None,
    what: str = "",
) -> None:
    """``|actual - expected| <= rel_err * scale + roundings * u * max(|actual|, |expected|)``
    elementwise, with ``u`` the unit roundoff of ``actual``'s dtype and ``scale`` max
    |expected| unless given: a GEMM's error relative to its largest result, plus each
    rounding to the output dtype between the two. Non-finite values fail."""
    unit = OUTPUT_ROUNDING[str(actual.dtype).removeprefix("torch.")]
    # On actual's device: a vocabulary-sized GEMM's check takes seconds on the host.
    actual = actual.detach().double()
    expected = expected.detach().to(actual.device, torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(expected).all(), f"{what}: the reference is not finite"
    nonfinite = int((~torch.isfinite(actual)).sum())
    assert nonfinite == 0, f"{what}: {nonfinite} of {actual.numel()} values are NaN or inf"
    scale = float(expected.abs().max()) if scale is None else scale
    bound = rel_err * scale + roundings * unit * torch.maximum(actual.abs(), expected.abs())
    excess = (actual - expected).abs() - bound
    if excess.numel() and bool(excess.max() > 0):
        worst = int(excess.argmax())
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {excess.numel()} values beyond the bound "
            f"(rel_err {rel_err:g} x {scale:.4g} + {roundings} rounding(s)); worst at flat index {worst}: "
            f"{actual.flatten()[worst].item()!r} vs {expected.flatten()[worst].item()!r}, "
            f"max |diff| / scale = {float((actual - expected).abs().max()) / scale:.3g}"
        )


# ---------------------------------------------------------------------------- recipes


def draws_random_numbers(recipe: str) -> bool:
    """Whether ``recipe`` rounds some operand stochastically (NVFP4's backward): its draws
    come from each device's own generator, so the CPU and a GPU quantize those operands to
    different codes, and only their accuracy can be compared."""
    return any(op.rule.stochastic_rounding for op in resolve_recipe(recipe).operand_plan.operands)


def gemm_families(recipe: str) -> set:
    """The :class:`~fp8train.spec.granularities.GemmFamily` of each quantized GEMM of ``recipe``."""
    return {op.granularity.family for op in resolve_recipe(recipe).operand_plan.operands}


def runs_on_hardware(family, device: torch.device) -> bool:
    """Whether ``_scaled_mm`` runs ``family`` on ``device`` (by its compute capability)."""
    return device.type == "cuda" and family.supports(torch.cuda.get_device_capability(device))


# ---------------------------------------------------------------------------- child processes


def child_env() -> dict[str, str]:
    """This process's environment, with the directory of the fp8train under test first on
    ``PYTHONPATH``: a child (``torchrun``, ``python -m fp8train``) imports the same copy,
    installed or not, from any working directory."""
    package_root = str(Path(fp8train.__file__).resolve().parents[1])
    paths = [package_root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
