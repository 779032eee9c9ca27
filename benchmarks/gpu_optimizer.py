"""bench_gpu.py's ``optimizer`` section: one step of ``fp8train.optim.AdamW`` against
``torch.optim.AdamW(fused=True)``, both at their defaults on the same float32 parameters and
gradients (float32 moments), every ratio over the fused optimizer of the same run (issue
31's target: fp8train's no slower)."""

from __future__ import annotations

import torch

import fp8train

from gpu_timing import Options, guarded, median_ms

FULL_SHAPES = ((4096, 4096),) * 16 + ((4096, 11008),) * 8  # about 629M values, a 1B-class model's share
QUICK_SHAPES = ((256, 256),) * 4 + ((256, 512),) * 2


def _parameters(shapes, device: torch.device, seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, generator=generator).to(device))
        param.grad = torch.randn(shape, generator=generator).to(device) * 1e-3
        params.append(param)
    return params


def _optimizers(device: torch.device) -> dict:
    """Each implementation's optimizer over its own copy of the same parameters."""
    return {
        "torch AdamW(fused=True)": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
        "fp8train.optim.AdamW": lambda params: fp8train.optim.AdamW(params, lr=1e-3),
    }


def optimizer_section(options: Options, device: torch.device) -> list[dict]:
    """A row per implementation: ms per ``step()``, values per second, and ``vs_fused``
    (ms over the fused optimizer's; lower is faster)."""
    shapes = QUICK_SHAPES if options.quick else FULL_SHAPES
    numel = sum(rows * cols for rows, cols in shapes)
    rows = []
    for name, build in _optimizers(device).items():
        row = {"implementation": name, "values": numel}

        def measure(build=build) -> dict:
            optimizer = build(_parameters(shapes, device))
            ms = median_ms(optimizer.step, device, options)
            return {"ms": ms, "gvalues_per_s": numel / ms / 1e6}

        rows.append(guarded(row, measure))
    fused = next((r["ms"] for r in rows if r["status"] == "ok" and "fused" in r["implementation"]), None)
    for row in rows:
        if row["status"] == "ok" and fused:
            row["vs_fused"] = row["ms"] / fused
    return rows
