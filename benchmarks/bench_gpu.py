"""FP8 training speed on a GPU, every figure against a baseline measured in the same run.

    python benchmarks/bench_gpu.py [--sizes 16384x8192x8192 4096x4096x4096] [--recipes tensorwise,rowwise]
                                   [--skip-compile] [--skip-compare] [--json PATH] [--quick] [--device cpu]

Five sections, each in a Markdown table and in the JSON file (``--json``, default
``benchmarks/results_gpu.json``, written after each section; the quick sections run first);
a case that fails is recorded with its error and the rest runs.

* ``linear``: forward+backward of one Linear, ``tokens x in x out`` per ``--sizes`` (bf16 weight
  and input, output gradient given), per recipe (fp8train ``Float8Linear``, backend ``auto``),
  eager and compiled (inductor); baselines bf16 ``nn.Linear`` eager and compiled; torchao's
  ``Float8Linear`` (tensorwise, rowwise) beside them where torchao is importable. CUDA-event
  timing, the median of ``--iters`` steps after ``--warmup``. A recipe whose GEMMs run
  emulated on the device is not compiled unless ``--compile-emulated`` (its unrolled K-chunk
  loops take minutes to compile). ``vs bf16`` is over bf16 eager; compiled rows also give
  ``vs bf16 compiled``.
* ``scaled_mm``: raw ``torch._scaled_mm`` TFLOP/s per GEMM family at ``--gemm-size``^3 (the
  arguments fp8train builds: row-major ``a``, column-major ``b``, the family's scale
  layout), beside bf16 ``torch.mm`` and fp8train's own ``scaled_mm`` (layouts included), and
  the raw result's error against the emulation (a wrong layout shows there). Families the
  device does not run are listed as skipped (on the CPU, PyTorch runs tensorwise and rowwise).
* ``compare``: tokens/s of ``fp8train compare`` (the default GPT at ``--compare-width``
  1024, ``--compare-layers`` 2, ``--compare-seq-len`` 128, 16 sequences a step,
  ``--compare-steps`` 50; the first steps' warm-up included alike), per recipe over the
  bf16 of the same mode, read from its ``results.json``, in each ``--compare-modes`` mode:
  ``eager``, ``graphs`` (CUDA graphs, ``--cuda_graphs auto``), ``compiled``,
  ``compiled+graphs``. Issue 38's rows: ``--compare-width 2048 --compare-layers 8
  --compare-seq-len 1024``.
* ``optimizer``: one ``step()`` of ``fp8train.optim.AdamW`` against
  ``torch.optim.AdamW(fused=True)`` on the same float32 parameters, gradients and moments
  (about 629M values; ``--quick``: 524K), ms and ``vs fused`` (ms over the fused
  optimizer's of the same run: issue 31's target is at most 1.00x).
* ``counts``: per Linear forward+backward step at the smallest size, from ``torch.profiler``:
  ``kernels`` (CUDA kernel events on the device), ``launches`` (runtime calls
  ``cudaLaunchKernel*`` / ``cuLaunchKernel*``), ``syncs`` (runtime calls
  ``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize`` and the
  synchronous ``cudaMemcpy``: each ``.item()``, host copy or blocking copy shows as one; the
  profiler's closing synchronize is not counted), and
  ``sync_warnings`` (what ``torch.cuda.set_sync_debug_mode("warn")`` reports in one step,
  outside the profiler); ``aten_ops``: every ``aten::`` op the host dispatched (nested ones
  included), the only count on the CPU.

``--quick`` takes small shapes and few iterations, and runs on the CPU too
(``--device cpu --quick``: emulated recipes, ``aot_eager`` compile), which the CPU tests run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # its sibling modules, run as a script or imported by the tests

import fp8train  # noqa: E402
from fp8train.recipes import RECIPE_NAMES  # noqa: E402
from fp8train.diagnostics.markdown import markdown_table  # noqa: E402

from gpu_optimizer import optimizer_section  # noqa: E402
from gpu_sections import COMPARE_MODES, compare_section, counts_section, linear_section, scaled_mm_section  # noqa: E402
from gpu_timing import Options, parse_size, skipped  # noqa: E402


# ---------------------------------------------------------------------------- report

DEFAULT_SIZES = ("16384x8192x8192", "4096x4096x4096")
QUICK_SIZES = ("256x256x256",)
# The quick sections first: a run cut short (a time limit) keeps them; the report is
# written after each section.
SECTIONS = {"scaled_mm": scaled_mm_section, "counts": counts_section, "optimizer": optimizer_section,
            "compare": compare_section, "linear": linear_section}
COLUMNS = {  # (header, key, format) per section
    "linear": [("size", "size", "{}"), ("implementation", "implementation", "{}"), ("recipe", "recipe", "{}"),
               ("mode", "mode", "{}"), ("ms", "ms", "{:.3f}"), ("TFLOP/s", "tflops", "{:.3g}"),
               ("vs bf16 eager", "vs_bf16", "{:.2f}x"), ("vs bf16 compiled", "vs_bf16_compiled", "{:.2f}x")],
    "scaled_mm": [("family", "family", "{}"), ("size", "size", "{}^3"), ("TFLOP/s", "tflops", "{:.3g}"),
                  ("vs bf16", "vs_bf16", "{:.2f}x"), ("fp8train.quant.scaled_mm ms", "fp8train_scaled_mm_ms", "{:.3f}"),
                  ("error vs emulated", "max_rel_err_vs_emulated", "{:.1e}")],
    "compare": [("mode", "mode", "{}"), ("recipe", "recipe", "{}"), ("tokens/s", "tokens_per_second", "{:.0f}"),
                ("vs bf16 (same mode)", "vs_bf16", "{:.2f}x"),
                ("final val loss", "final_val_loss", "{:.4f}"), ("val gap to bf16", "val_gap_percent", "{:+.2f}%")],
    "optimizer": [("implementation", "implementation", "{}"), ("values", "values", "{:,}"), ("ms per step", "ms", "{:.3f}"),
                  ("Gvalues/s", "gvalues_per_s", "{:.3g}"), ("vs fused", "vs_fused", "{:.2f}x")],
    "counts": [("recipe", "recipe", "{}"), ("size", "size", "{}"), ("kernels", "kernels", "{:.0f}"),
               ("launches", "launches", "{:.0f}"), ("syncs", "syncs", "{:.1f}"),
               ("sync warnings", "sync_warnings", "{}"), ("aten ops", "aten_ops", "{:.0f}")],
}


def table(name: str, rows: list[dict]) -> str:
    """The section's rows as Markdown: its columns, then the status and any error or reason."""
    columns = COLUMNS[name]
    cells = [
        [fmt.format(row[key]) if row.get(key) is not None else "-" for _, key, fmt in columns]
        + [row["status"] + (f": {row.get('error') or row.get('reason')}" if row["status"] != "ok" else "")]
        for row in rows
    ]
    return markdown_table([header for header, _, _ in columns] + ["status"], cells)


def machine(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device)}
    if device.type == "cuda":
        info.update(name=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability(device)))
    return info


def run(options: Options) -> dict:
    """Every enabled section, each guarded: a report of rows per section and their seconds,
    written to ``options.json`` after each section."""
    device = torch.device(options.device)
    report = {"benchmark": "FP8 training on a GPU (benchmarks/bench_gpu.py)", "machine": machine(device),
              "options": asdict(options), "seconds": {}}
    for name, section in SECTIONS.items():
        if name not in options.sections:
            continue
        if name == "compare" and not options.compare:
            report[name] = [skipped({"recipe": "-"}, "--skip-compare")]
            continue
        started = time.perf_counter()
        try:
            report[name] = section(options, device)
        except Exception as error:  # noqa: BLE001 - the other sections still run
            report[name] = [{"status": "error", "error": f"{type(error).__name__}: {error}"}]
        report["seconds"][name] = round(time.perf_counter() - started, 1)
        print(f"\n## {name} ({report['seconds'].get(name, 0)} s)\n\n{table(name, report[name])}", flush=True)
        write(report, options.json)
    return report


def write(report: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def parse_options(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--sizes", nargs="+", help="Linear shapes, tokens x in x out (default: "
                        f"{' '.join(DEFAULT_SIZES)}; --quick: {' '.join(QUICK_SIZES)})")
    parser.add_argument("--recipes", default=",".join(RECIPE_NAMES), help="comma-separated fp8train recipes")
    parser.add_argument("--skip-compile", action="store_true", help="eager only")
    parser.add_argument("--compile-backend", help="torch.compile backend (default: inductor on CUDA, aot_eager on the CPU)")
    parser.add_argument("--compile-emulated", action="store_true", help="also compile recipes the device emulates")
    parser.add_argument("--skip-compare", action="store_true", help="leave out fp8train compare")
    parser.add_argument("--compare-modes", default=None, help="comma-separated compare modes: eager, graphs, "
                        "compiled, compiled+graphs (default: all four; --quick: eager,graphs)")
    parser.add_argument("--compare-width", type=int, help="compare's n_embd (default 1024; --quick 128)")
    parser.add_argument("--compare-layers", type=int, default=2, help="compare's n_layer (default 2)")
    parser.add_argument("--compare-seq-len", type=int, default=128, help="compare's seq_len (default 128)")
    parser.add_argument("--compare-steps", type=int, help="compare's steps (default 50; --quick 2)")
    parser.add_argument("--gemm-size", type=int, help="M = N = K of the scaled_mm section (default 8192; --quick 256)")
    parser.add_argument("--json", default="benchmarks/results_gpu.json", help="JSON output path")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated sections (default: {','.join(SECTIONS)})")
    parser.add_argument("--quick", action="store_true", help="small shapes, few iterations (runs on the CPU too)")
    args = parser.parse_args(argv)
    recipes = tuple(name.strip() for name in args.recipes.split(",") if name.strip())
    for recipe in recipes:
        fp8train.recipes.from_name(recipe)  # raises, listing the valid names
    for size in args.sizes or ():
        parse_size(size)
    quick = args.quick
    modes = tuple(m.strip() for m in (args.compare_modes or ("eager,graphs" if quick else ",".join(COMPARE_MODES))).split(","))
    for mode in modes:
        if mode not in COMPARE_MODES:
            parser.error(f"--compare-modes: {mode!r} is not one of {', '.join(COMPARE_MODES)}")
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    for section in sections:
        if section not in SECTIONS:
            parser.error(f"--sections: {section!r} is not one of {', '.join(SECTIONS)}")
    return Options(
        device=args.device, sizes=tuple(args.sizes or (QUICK_SIZES if quick else DEFAULT_SIZES)), recipes=recipes,
        compile=not args.skip_compile,
        compile_backend=args.compile_backend or ("inductor" if args.device == "cuda" else "aot_eager"),
        compile_emulated=args.compile_emulated or quick, compare=not args.skip_compare,
        compare_width=args.compare_width or (128 if quick else 1024),
        compare_steps=args.compare_steps or (2 if quick else 50), compare_layers=args.compare_layers,
        compare_seq_len=args.compare_seq_len, compare_modes=modes,
        gemm_size=args.gemm_size or (256 if quick else 8192), warmup=1 if quick else 3, iters=3 if quick else 20,
        max_seconds=2.0 if quick else 5.0, quick=quick, json=args.json, sections=sections,
    )


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    run(options)
    print(f"\nwrote {options.json}")


if __name__ == "__main__":
    main()
