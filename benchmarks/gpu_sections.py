"""The four sections of benchmarks/bench_gpu.py (its docstring says what each measures and
counts); each returns its rows, a row per case, with ``status`` ok, skipped or error."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

import fp8train
from fp8train.quant.gemm.hardware_support import device_facts, hardware_support
from fp8train.quant.gemm.hardware import hardware_arguments, hardware_fp4_arguments
from fp8train.spec.granularities import GemmFamily

from gpu_timing import BASELINE, Options, child_env, guarded, median_ms, parse_size, skipped, synchronize

TORCHAO_RECIPES = ("tensorwise", "rowwise")
# (name, a's granularity, b's granularity): one row per GEMM family (and pairing) of the recipes.
GEMM_FAMILIES = (
    ("tensorwise", "tensor", "tensor"),
    ("rowwise", "row", "row"),
    ("row x tensor", "row", "tensor"),
    ("blockwise 1x128 x 128x128", "block1x128", "block128x128"),
    ("blockwise 1x128 x 1x128", "block1x128", "block1x128"),
    ("mxfp8", "mx", "mx"),
    ("nvfp4", "nvfp4", "nvfp4_2d"),
    ("mxfp4", "mxfp4", "mxfp4"),
)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel")
COMPARE_TIMEOUT = 1200  # seconds: nine trainings of 50 steps take about a minute on an H100


# ---------------------------------------------------------------------------- linear


def linear_modules(k: int, n: int, device: torch.device, recipes) -> list[tuple[str, str, Callable[[], nn.Module]]]:
    """``(implementation, recipe, build)`` of every module timed: bf16, each fp8train recipe,
    torchao's recipes (``build`` raises ImportError without torchao). One weight for all."""
    torch.manual_seed(0)
    weight = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16).weight.detach()

    def plain() -> nn.Linear:
        linear = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        linear.weight = nn.Parameter(weight.clone())
        return linear

    def torchao(recipe: str) -> nn.Module:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        return convert_to_float8_training(nn.Sequential(plain()), config=config)

    modules = [("torch", BASELINE, plain)]
    modules += [("fp8train", r, lambda r=r: fp8train.Float8Linear.from_linear(plain(), r)) for r in recipes]
    modules += [("torchao", r, lambda r=r: torchao(r)) for r in TORCHAO_RECIPES]
    return modules


def runs_emulated(recipe: str, device: torch.device) -> str | None:
    """Why ``recipe``'s GEMMs run emulated on ``device``, or ``None`` where all run in hardware."""
    plan = fp8train.recipes.from_name(recipe).operand_plan
    for family in {op.granularity.family for op in plan.operands}:
        if device.type != "cuda":
            return f"{family.label} GEMMs run emulated on {device.type}"
        if not family.supports(torch.cuda.get_device_capability(device)):
            return f"{family.label} GEMMs need {family.needs}"
    return None


def time_linear(module: nn.Module, m: int, device: torch.device, options: Options, compiled: bool) -> dict:
    k = next(p for p in module.parameters()).shape[1]
    n = next(p for p in module.parameters()).shape[0]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    model = torch.compile(module, backend=options.compile_backend) if compiled else module

    def step() -> None:
        x.grad = None
        for parameter in module.parameters():
            parameter.grad = None
        model(x).backward(grad)

    ms = median_ms(step, device, options)
    return {"ms": ms, "tflops": 6 * m * k * n / (ms * 1e-3) / 1e12}


def linear_section(options: Options, device: torch.device) -> list[dict]:
    rows = []
    for size in options.sizes:
        m, k, n = parse_size(size)
        for implementation, recipe, build in linear_modules(k, n, device, options.recipes):
            for mode in ("eager", "compiled") if options.compile else ("eager",):
                row = {"size": size, "implementation": implementation, "recipe": recipe, "mode": mode}
                reason = _linear_skip_reason(implementation, recipe, mode, device, options)
                if reason:
                    rows.append(skipped(row, reason))
                    continue
                torch._dynamo.reset()
                rows.append(guarded(row, lambda: time_linear(build(), m, device, options, mode == "compiled")))
    return with_linear_ratios(rows)


def _linear_skip_reason(implementation: str, recipe: str, mode: str, device, options: Options) -> str | None:
    if implementation == "torchao":
        try:
            import torchao.float8  # noqa: F401
        except ImportError as error:
            return f"torchao not importable ({error})"
    if implementation == "fp8train" and mode == "compiled" and not options.compile_emulated:
        reason = runs_emulated(recipe, device)
        if reason:
            return f"not compiled: {reason} (--compile-emulated compiles it)"
    return None


def with_linear_ratios(rows: list[dict]) -> list[dict]:
    """Each timed row's ``vs_bf16`` (its ms over bf16 eager's at its size) and, compiled,
    ``vs_bf16_compiled``: against the baselines of this run."""
    baseline = {(r["size"], r["mode"]): r["ms"] for r in rows if r["recipe"] == BASELINE and r["status"] == "ok"}
    for row in rows:
        if row["status"] != "ok":
            continue
        if (row["size"], "eager") in baseline:
            row["vs_bf16"] = row["ms"] / baseline[(row["size"], "eager")]
        if row["mode"] == "compiled" and (row["size"], "compiled") in baseline:
            row["vs_bf16_compiled"] = row["ms"] / baseline[(row["size"], "compiled")]
    return rows


# ---------------------------------------------------------------------------- scaled_mm


def raw_arguments(a, b) -> tuple:
    """``torch._scaled_mm``'s positional arguments for ``a @ b^T`` as fp8train builds them,
    and NVFP4's ``alpha`` (applied after, by fp8train; ``None`` otherwise)."""
    if a.granularity.fp4:
        a_data, b_data, scale_a, scale_b, alpha = hardware_fp4_arguments(a, b)
        return (a_data, b_data, scale_a, scale_b), alpha
    args = hardware_arguments(a, b)  # the benchmark's sizes need no padding: rows == M
    return (args.a_data, args.b_data, args.scale_a, args.scale_b), None


def time_scaled_mm(a_name: str, b_name: str, size: int, device: torch.device, options: Options) -> dict:
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(size, size, device=device, generator=generator)
    w = torch.randn(size, size, device=device, generator=generator)
    a, b = fp8train.quant.quantize(x, a_name), fp8train.quant.quantize(w, b_name)
    out_dtype = torch.float32 if a.granularity.fp4 else torch.bfloat16  # the FP4 GEMM's own output
    arguments, alpha = raw_arguments(a, b)
    raw_ms = median_ms(lambda: torch._scaled_mm(*arguments, out_dtype=out_dtype), device, options)
    fp8train_ms = median_ms(lambda: fp8train.quant.scaled_mm(a, b, torch.bfloat16), device, options)
    try:
        raw = torch._scaled_mm(*arguments, out_dtype=torch.float32)
    except RuntimeError:  # rowwise takes only bf16 out where cuBLAS does not run it (SM 8.9, 10.x)
        raw = torch._scaled_mm(*arguments, out_dtype=torch.bfloat16)
    raw = raw.double() * (1.0 if alpha is None else float(alpha))
    emulated = fp8train.quant.scaled_mm(a, b, torch.float32, backend="emulated").double()
    error = float((raw - emulated).abs().max() / emulated.abs().max())
    flops = 2 * size**3
    return {"ms": raw_ms, "tflops": flops / (raw_ms * 1e-3) / 1e12, "fp8train_scaled_mm_ms": fp8train_ms,
            "max_rel_err_vs_emulated": error}


def time_bf16_mm(size: int, device: torch.device, options: Options) -> dict:
    x = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    w = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    ms = median_ms(lambda: torch.mm(x, w.t()), device, options)
    return {"ms": ms, "tflops": 2 * size**3 / (ms * 1e-3) / 1e12}


def scaled_mm_section(options: Options, device: torch.device) -> list[dict]:
    size = options.gemm_size
    rows = [guarded({"family": BASELINE, "size": size}, lambda: time_bf16_mm(size, device, options))]
    for family, a_name, b_name in GEMM_FAMILIES:
        row = {"family": family, "size": size}
        reason = _scaled_mm_skip_reason(a_name, b_name, device)
        measure = lambda: time_scaled_mm(a_name, b_name, size, device, options)  # noqa: E731
        rows.append(skipped(row, reason) if reason else guarded(row, measure))
    baseline = rows[0].get("tflops")
    for row in rows:
        if row["status"] == "ok" and baseline:
            row["vs_bf16"] = row["tflops"] / baseline
    return rows


def _scaled_mm_skip_reason(a_name: str, b_name: str, device: torch.device) -> str | None:
    """Why ``device`` has no ``_scaled_mm`` for the pair, or ``None``. PyTorch's CPU build
    runs the tensorwise/rowwise family (slowly): it is timed there too."""
    probe = torch.zeros(128, 128, device=device)  # a shape every granularity quantizes
    a, b = fp8train.quant.quantize(probe, a_name), fp8train.quant.quantize(probe, b_name)
    supported, reason = hardware_support(a, b, torch.bfloat16, device_facts(device))
    if supported or (device.type == "cpu" and a.granularity.family is GemmFamily.TENSORWISE_ROWWISE):
        return None
    return reason


# ---------------------------------------------------------------------------- compare


COMPARE_MODES = {
    "eager": ("--torch_compile", "false", "--cuda_graphs", "false"),
    "graphs": ("--torch_compile", "false", "--cuda_graphs", "auto"),
    "compiled": ("--torch_compile", "true", "--cuda_graphs", "false"),
    "compiled+graphs": ("--torch_compile", "true", "--cuda_graphs", "auto"),
}
"""``fp8train compare``'s flags per mode: CUDA graphs and ``torch.compile``, each on or off."""


def compare_command(options: Options, device: torch.device, recipes, output_dir: Path, mode: str) -> list[str]:
    """``python -m fp8train compare`` on the default GPT in ``mode``, one evaluation."""
    tiny = ["--n_layer", "1", "--seq_len", "32", "--batch_size", "4", "--eval_batches", "1"] if options.quick else [
        "--n_layer", str(options.compare_layers), "--seq_len", str(options.compare_seq_len)]
    return [sys.executable, "-m", "fp8train", "compare", "--recipes", ",".join((BASELINE, *recipes)),
            "--device", device.type, "--output_dir", str(output_dir), "--n_embd", str(options.compare_width),
            "--steps", str(options.compare_steps), "--eval_interval", "0", "--fp8_stats_interval", "0",
            "--save_checkpoints", "false", *COMPARE_MODES[mode], *tiny]


def run_compare(options: Options, device: torch.device, recipes, mode: str = "eager") -> dict:
    """``{recipe: run}`` from one ``fp8train compare`` of ``recipes`` (and bf16) in ``mode``.

    Raises:
        RuntimeError: the command failed (its last lines of output in the message) or did
            not finish in :data:`COMPARE_TIMEOUT` seconds.
    """
    with tempfile.TemporaryDirectory() as output_dir:
        command = compare_command(options, device, recipes, Path(output_dir), mode)
        try:
            result = subprocess.run(command, capture_output=True, text=True, env=child_env(), timeout=COMPARE_TIMEOUT)
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"fp8train compare did not finish in {COMPARE_TIMEOUT} s") from error
        results = Path(output_dir) / "results.json"
        # Only the loss-curve plot, drawn after results.json, needs matplotlib.
        plot_only = importlib.util.find_spec("matplotlib") is None and results.exists()
        if result.returncode != 0 and not plot_only:
            raise RuntimeError(f"fp8train compare exited {result.returncode}: {result.stderr.strip()[-400:]}")
        return json.loads(results.read_text())["runs"]


def compare_runs(options: Options, device: torch.device, mode: str = "eager") -> dict:
    """``{recipe: the compare results it was measured in, or the error}``: every recipe in
    one ``compare``; where that fails, each recipe in its own beside bf16 (so one recipe's
    failure is its row's alone, and each ratio is over the bf16 of its own run)."""
    try:
        return dict.fromkeys((BASELINE, *options.recipes), run_compare(options, device, options.recipes, mode))
    except RuntimeError:
        pass
    by_recipe: dict = {}
    for recipe in options.recipes:
        try:
            by_recipe[recipe] = run_compare(options, device, [recipe], mode)
        except RuntimeError as error:
            by_recipe[recipe] = error
    by_recipe[BASELINE] = next((r for r in by_recipe.values() if isinstance(r, dict)), RuntimeError("every run failed"))
    return by_recipe


def compare_section(options: Options, device: torch.device) -> list[dict]:
    rows = []
    for mode in options.compare_modes:
        for recipe, runs in compare_runs(options, device, mode).items():
            row = {"mode": mode, "recipe": recipe, "width": options.compare_width, "steps": options.compare_steps}
            if isinstance(runs, Exception):
                rows.append({**row, "status": "error", "error": str(runs)})
                continue
            run, baseline = runs[recipe], runs[BASELINE]
            rows.append({**row, "status": "ok", "tokens_per_second": run["tokens_per_second"],
                         "vs_bf16": run["tokens_per_second"] / baseline["tokens_per_second"],
                         "final_val_loss": run["final_val_loss"], "val_gap_percent": run["val_gap_percent"]})
    return rows


# ---------------------------------------------------------------------------- counts


def profile_counts(module: nn.Module, m: int, device: torch.device, steps: int) -> dict:
    """Kernels, launches, synchronizations and aten ops per forward+backward step (see the
    module docstring for what each counts)."""
    from torch.profiler import ProfilerActivity, profile

    k, n = module.weight.shape[1], module.weight.shape[0]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)

    def step() -> None:
        module.weight.grad = x.grad = None
        module(x).backward(grad)

    for _ in range(2):  # warm-up: first-call allocations and one-time checks stay out
        step()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        synchronize(device)
    events = profiler.events()
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    counts = {
        "kernels": sum(1 for e in on_device if not e.name.startswith(("Memcpy", "Memset"))),
        "launches": sum(1 for e in events if e.name.startswith(LAUNCH_CALLS)),
        # Less the one synchronize that closes the profiled steps.
        "syncs": sum(1 for e in events if e.name in SYNC_CALLS) - (device.type == "cuda"),
        "aten_ops": sum(1 for e in events if e.name.startswith("aten::") and e.device_type != torch.autograd.DeviceType.CUDA),
    }
    per_step = {name: count / steps for name, count in counts.items()}
    per_step["sync_warnings"] = sync_warnings(step) if device.type == "cuda" else None
    return per_step


def sync_warnings(step: Callable[[], None]) -> int:
    """How many synchronizing calls ``torch.cuda.set_sync_debug_mode("warn")`` reports in one ``step``."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    return sum(1 for w in caught if "synchroniz" in str(w.message))


def counts_section(options: Options, device: torch.device) -> list[dict]:
    m, k, n = min((parse_size(size) for size in options.sizes), key=lambda mkn: mkn[0] * mkn[1] * mkn[2])
    rows = []
    for implementation, recipe, build in linear_modules(k, n, device, options.recipes):
        if implementation == "torchao":
            continue
        row = {"size": f"{m}x{k}x{n}", "recipe": recipe}
        rows.append(guarded(row, lambda: profile_counts(build(), m, device, steps=1 if options.quick else 3)))
    return rows
