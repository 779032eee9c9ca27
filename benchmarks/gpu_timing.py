"""What every section of benchmarks/bench_gpu.py shares: its options, the timing of a step
(CUDA events on a GPU), and rows that record an error or a skip instead of stopping the run."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import fp8train

BASELINE = "bf16"


@dataclass(frozen=True, kw_only=True)
class Options:
    """Settings of one benchmark run (``python benchmarks/bench_gpu.py --help``).

    Attributes:
        device: ``cuda`` or ``cpu``.
        sizes: Linear shapes ``"MxKxN"`` (tokens x in x out).
        recipes: the fp8train recipes timed (bf16 is always the baseline).
        compile: time compiled modules too; ``compile_backend`` is torch.compile's backend.
        compile_emulated: compile recipes whose GEMMs the device emulates too.
        compare: run ``fp8train compare`` (at ``compare_width`` with ``compare_layers`` blocks and
            ``compare_seq_len`` tokens a sequence, ``compare_steps`` steps), once per mode of
            ``compare_modes`` (``eager``, ``graphs``: CUDA graphs, ``compiled``,
            ``compiled+graphs``), each recipe against the bf16 of its own mode.
        gemm_size: M = N = K of the raw ``_scaled_mm`` section.
        warmup, iters, max_seconds: steps before timing, timed steps, and the time after which
            a case stops early (with at least 3 timed steps).
        quick: small shapes, few iterations (the CPU test's run).
        json: where the report is written.
        sections: the sections run (in ``bench_gpu.SECTIONS``' order).
    """

    device: str
    sizes: tuple[str, ...]
    recipes: tuple[str, ...]
    compile: bool
    compile_backend: str
    compile_emulated: bool
    compare: bool
    compare_width: int
    compare_steps: int
    compare_layers: int
    compare_seq_len: int
    compare_modes: tuple[str, ...]
    gemm_size: int
    warmup: int
    iters: int
    max_seconds: float
    quick: bool
    json: str
    sections: tuple[str, ...] = ("scaled_mm", "counts", "optimizer", "compare", "linear")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, options: Options) -> float:
    """Median milliseconds of ``fn`` over ``options.iters`` calls after ``options.warmup``
    (fewer once ``options.max_seconds`` have passed, at least 3): CUDA events on a GPU, the
    wall clock on the CPU."""
    for _ in range(options.warmup):
        fn()
    synchronize(device)
    times, started = [], time.perf_counter()
    for _ in range(options.iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
        if len(times) >= 3 and time.perf_counter() - started > options.max_seconds:
            break
    return statistics.median(times)


def guarded(row: dict, measure: Callable[[], dict]) -> dict:
    """``row`` with what ``measure()`` returns and ``status: ok``, or ``status: error`` and
    the error (the benchmark goes on)."""
    try:
        return {**row, "status": "ok", **measure()}
    except Exception as error:  # noqa: BLE001 - recorded in the table and the JSON
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {**row, "status": "error", "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}


def skipped(row: dict, reason: str) -> dict:
    return {**row, "status": "skipped", "reason": reason}


def parse_size(text: str) -> tuple[int, int, int]:
    """``"MxKxN"`` (tokens x in_features x out_features) -> ``(M, K, N)``."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"size {text!r} must be tokens x in x out, e.g. 4096x4096x4096")
    return int(parts[0]), int(parts[1]), int(parts[2])


def child_env() -> dict:
    """The environment with the fp8train this script imported first on ``PYTHONPATH``."""
    root = str(Path(fp8train.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
