"""``torch.compile`` and converted models: graph breaks per recipe, and training speed
compiled against eager, both measured in the same run.

    python benchmarks/bench_compile.py breaks [--models mlp,gpt] [--recipes ...] [--compiled-autograd]
    python benchmarks/bench_compile.py speed [--recipes bf16,tensorwise,mxfp8] [--steps 4] [--threads N]

``breaks``: for a converted 2-layer MLP (dims 256) and the trainer's default GPT, under the
trainer's contexts (bf16 ``torch.autocast`` and ``fp8train.autocast``), the forward's graph
breaks as ``torch._dynamo.explain`` counts them, then three training steps through
``torch.compile`` (backend ``aot_eager``: the breaks are Dynamo's, whatever the backend)
counting every graph break of forward and backward (``torch._dynamo.utils.counters``; with
``--compiled-autograd`` the backward is traced by compiled autograd too) and the frames
compiled. Each break is listed with its reason and the user code it came from.

``speed``: tokens/s of training steps (the trainer's step: forward and loss under the two
autocasts, backward, gradient clipping, AdamW) of the default GPT, eager and compiled
(inductor), for each recipe, after warm-up: ``--repeats`` blocks of ``--steps`` steps,
eager and compiled blocks interleaved so that drifts in machine load hit both alike. On a
shared machine other processes can slow these steps several-fold: each block records the
share of the CPUs others used meanwhile, and the figures (fastest and median block) come
from the quiet blocks (see :func:`measure_speed`). Compile time is the first compiled
step's (inductor's caches on disk can shorten it).

Both print a Markdown table and write JSON (``--out``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import logging
import os
import platform
import statistics
import time
from typing import Callable

import torch
from torch import nn

import fp8train
from fp8train.quant.gemm.emulated import emulated_gemm_dtype
from fp8train.recipes import RECIPE_NAMES
from fp8train.train.arguments import TrainingArguments
from fp8train.diagnostics.markdown import markdown_table
from fp8train.train.user_model import build_model

BASELINE = "bf16"
BREAK_STEPS = 3
QUIET_LOAD = 0.15
"""Share of the CPUs other processes may use during a timed block for it to count as quiet."""


def machine() -> dict:
    """What the numbers depend on: CPU, threads, the emulated GEMM's dtype, torch."""
    return {
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "emulated_gemm_dtype": str(emulated_gemm_dtype()).removeprefix("torch."),
        "torch": torch.__version__,
    }


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------------------- models


def build(model_name: str, recipe: str) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """``(model, loss)`` for ``model_name`` (``mlp`` or ``gpt``), converted to ``recipe``
    (``bf16``: not converted); ``loss(model)`` runs one forward on a fixed batch."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if model_name == "mlp":
        model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
        x = torch.randn(64, 256, generator=generator)

        def loss(m: nn.Module) -> torch.Tensor:
            return m(x).float().square().mean()

    else:
        args = TrainingArguments()
        model = build_model(args)
        shape = (args.batch_size, args.seq_len)
        inputs = torch.randint(0, model.config.vocab_size, shape, generator=generator)
        targets = torch.randint(0, model.config.vocab_size, shape, generator=generator)

        def loss(m: nn.Module) -> torch.Tensor:
            return m(inputs, targets)

    if recipe != BASELINE:
        fp8train.convert_to_float8_training(model, recipe)
    return model, loss


@contextlib.contextmanager
def step_contexts():
    """The trainer's contexts around a forward (bf16 mixed precision, FP8 autocast)."""
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast():
        yield


# ---------------------------------------------------------------------------- breaks


class _BreakLog(logging.Handler):
    """Counts the graph breaks Dynamo logs (``graph_breaks`` artifact) by user code site and reason."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def emit(self, record) -> None:
        message = record.getMessage()
        if "Graph break" in message and "in user code at" in message:
            site = message.split("in user code at", 1)[1].splitlines()[0].strip()
            site = site.split("site-packages/")[-1].split("src/")[-1]
            reason = next((line.strip() for line in message.splitlines() if "Explanation:" in line), "")
            self.sites[(site, reason.removeprefix("Explanation: ")[:160])] += 1

    def lines(self) -> list[str]:
        return [f"{n}x {site}: {reason}" for (site, reason), n in self.sites.items()]


@contextlib.contextmanager
def capture_breaks():
    """Yield a :class:`_BreakLog` of every graph break in the block (kept off stderr)."""
    log = _BreakLog()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(graph_breaks=True)
    quiet = [(h, h.level) for name in ("torch", "torch._dynamo") for h in logging.getLogger(name).handlers]
    for handler, _ in quiet:
        handler.setLevel(logging.CRITICAL)
    logger.addHandler(log)
    try:
        yield log
    finally:
        logger.removeHandler(log)
        for handler, level in quiet:
            handler.setLevel(level)
        torch._logging.set_logs()


def count_breaks(model_name: str, recipe: str, compiled_autograd: bool) -> dict:
    """Graph breaks of one converted model: the forward by ``explain``, and
    :data:`BREAK_STEPS` compiled training steps by Dynamo's counters."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, loss = build(model_name, recipe)
    with capture_breaks() as forward, step_contexts():
        explanation = torch._dynamo.explain(loss)(model)

    torch._dynamo.reset()
    counters.clear()
    model, loss = build(model_name, recipe)
    compiled = torch.compile(model, backend="aot_eager")
    with capture_breaks() as training:
        for _ in range(BREAK_STEPS):
            with step_contexts():
                value = loss(compiled)
            backward = (
                torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager"))
                if compiled_autograd
                else contextlib.nullcontext()
            )
            with backward:
                value.backward()
    return {
        "model": model_name,
        "recipe": recipe,
        "forward_graphs": explanation.graph_count,
        "forward_breaks": explanation.graph_break_count,
        "forward_break_sites": forward.lines(),
        "training_breaks": sum(counters["graph_break"].values()),
        "training_break_sites": training.lines(),
        "compiled_frames": counters["frames"]["total"],
        "compiled_autograd": compiled_autograd,
    }


def print_breaks(rows: list[dict]) -> None:
    headers = ("model", "recipe", "forward graphs", "forward breaks", f"breaks in {BREAK_STEPS} training steps",
               "frames compiled")
    cells = [
        (r["model"], r["recipe"], r["forward_graphs"], r["forward_breaks"], r["training_breaks"], r["compiled_frames"])
        for r in rows
    ]
    print(markdown_table(headers, cells, align="llrrrr"))
    for r in rows:
        sites = r["forward_break_sites"] + r["training_break_sites"]
        if sites:
            print(f"\n{r['model']} {r['recipe']}:")
            for site in r["forward_break_sites"]:
                print(f"  forward  {site}")
            for site in r["training_break_sites"]:
                print(f"  training {site}")


# ---------------------------------------------------------------------------- speed


class _Training:
    """A model, its AdamW and the trainer's step."""

    def __init__(self, model: nn.Module, loss: Callable[[nn.Module], torch.Tensor], forward: nn.Module) -> None:
        self.model, self.loss, self.forward = model, loss, forward
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(self) -> None:
        with step_contexts():
            value = self.loss(self.forward)
        value.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed(self, steps: int) -> tuple[float, float, float]:
        """``(wall seconds, process CPU seconds, other processes' share of the CPUs)`` of
        ``steps`` steps."""
        busy, wall, cpu = _busy_cpu_seconds(), time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        others = (_busy_cpu_seconds() - busy - cpu) / (wall * (os.cpu_count() or 1))
        return wall, cpu, max(0.0, others)


def _busy_cpu_seconds() -> float:
    """CPU seconds all processes have used since boot (Linux ``/proc/stat``; else 0)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def measure_speed(recipe: str, steps: int, repeats: int, warmup: int, quiet_blocks: int) -> dict:
    """Tokens/s of the default GPT's training step, eager and compiled, for one recipe.

    Blocks of ``steps`` steps alternate, eager then compiled, up to ``repeats`` pairs, and
    stop early once each mode has ``quiet_blocks`` quiet blocks: blocks during which other
    processes used less than :data:`QUIET_LOAD` of the CPUs (``/proc/stat``). On a shared
    machine a neighbour that saturates a core and the memory bus slows these
    memory-bound steps several-fold, so the figures come from the quiet blocks (best and
    median), or, with fewer than two of them, from all blocks (``quiet`` says which).
    """
    torch._dynamo.reset()
    args = TrainingArguments()
    tokens = args.batch_size * args.seq_len
    model, loss = build("gpt", recipe)
    eager = _Training(model, loss, model)
    compiled_model = copy.deepcopy(model)
    compiled = _Training(compiled_model, loss, torch.compile(compiled_model))
    compile_seconds = compiled.timed(1)[0]
    for run in (eager, compiled):
        run.timed(warmup)
    blocks: dict[str, list[tuple[float, float, float]]] = {"eager": [], "compiled": []}
    for _ in range(repeats):
        blocks["eager"].append(eager.timed(steps))
        blocks["compiled"].append(compiled.timed(steps))
        if all(sum(b[2] < QUIET_LOAD for b in times) >= quiet_blocks for times in blocks.values()):
            break
    row: dict = {"recipe": recipe, "tokens_per_step": tokens, "compile_seconds": round(compile_seconds, 1)}
    for mode, times in blocks.items():
        quiet = [t for t in times if t[2] < QUIET_LOAD]
        used = quiet if len(quiet) >= 2 else times
        walls = [t[0] for t in used]
        row[f"{mode}_quiet"] = len(quiet) >= 2
        row[f"{mode}_tokens_per_s_best"] = round(tokens * steps / min(walls))
        row[f"{mode}_tokens_per_s_median"] = round(tokens * steps / statistics.median(walls))
        row[f"{mode}_blocks"] = [
            {"seconds": round(wall, 3), "cpu_seconds": round(cpu, 3), "other_load": round(other, 2)}
            for wall, cpu, other in times
        ]
    for key in ("best", "median"):
        row[f"speedup_{key}"] = round(row[f"compiled_tokens_per_s_{key}"] / row[f"eager_tokens_per_s_{key}"], 2)
    return row


def print_speed(rows: list[dict]) -> None:
    base = next((r for r in rows if r["recipe"] == BASELINE), None)
    cells = []
    for r in rows:
        vs_base = f"{r['compiled_tokens_per_s_best'] / base['eager_tokens_per_s_best']:.2f}" if base else "-"
        loaded = {mode: "" if r[f"{mode}_quiet"] else " (loaded)" for mode in ("eager", "compiled")}
        cells.append((
            r["recipe"], f"{r['eager_tokens_per_s_best']} / {r['eager_tokens_per_s_median']}{loaded['eager']}",
            f"{r['compiled_tokens_per_s_best']} / {r['compiled_tokens_per_s_median']}{loaded['compiled']}",
            f"{r['speedup_best']:.2f} / {r['speedup_median']:.2f}", vs_base, r["compile_seconds"],
        ))
    headers = ("recipe", "eager tokens/s (best / median)", "compiled tokens/s (best / median)",
               "compiled / eager (best / median)", "compiled / bf16 eager (best)", "compile s")
    print(markdown_table(headers, cells, align="lrrrrr"))


# ---------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("breaks", "speed"))
    parser.add_argument("--models", default="mlp,gpt", help="breaks: mlp, gpt or both")
    parser.add_argument("--recipes", default=None, help=f"comma-separated, {BASELINE} and/or {', '.join(RECIPE_NAMES)}")
    parser.add_argument("--compiled-autograd", action="store_true", help="breaks: trace the backward too")
    parser.add_argument("--steps", type=int, default=4, help="speed: steps per timed block")
    parser.add_argument("--repeats", type=int, default=40, help="speed: most timed blocks per mode")
    parser.add_argument("--quiet-blocks", type=int, default=5, help="speed: quiet blocks per mode to stop at")
    parser.add_argument("--warmup", type=int, default=3, help="speed: untimed steps after the first")
    parser.add_argument("--threads", type=int, default=None, help="speed: torch threads (default: torch's)")
    parser.add_argument("--out", default=None, help="JSON file (default benchmarks/results_compile_<what>.json)")
    options = parser.parse_args()
    out = options.out or os.path.join(os.path.dirname(__file__), f"results_compile_{options.what}.json")
    if options.threads:
        torch.set_num_threads(options.threads)
    result: dict = {"machine": machine(), "load_average_before": load_average()}
    if options.what == "breaks":
        recipes = (options.recipes or ",".join(RECIPE_NAMES)).split(",")
        rows = [
            count_breaks(model_name, recipe, options.compiled_autograd)
            for model_name in options.models.split(",")
            for recipe in recipes
        ]
        print_breaks(rows)
    else:
        recipes = (options.recipes or f"{BASELINE},tensorwise,mxfp8").split(",")
        rows = [
            measure_speed(recipe, options.steps, options.repeats, options.warmup, options.quiet_blocks)
            for recipe in recipes
        ]
        print_speed(rows)
    result.update(rows=rows, load_average_after=load_average())
    print(f"\nload average before {result['load_average_before']}, after {result['load_average_after']}")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
