"""Does fp8train's CPU kernel layer respect PyTorch's thread count? Step time of a small
transformers Llama (``llama_model.build``), mxfp8 against the same model unconverted, with
numba free to use every core and with ``NUMBA_NUM_THREADS=1``, in two settings:

* ``ddp``: ``torchrun --nproc-per-node 2``, DDP over gloo (torchrun sets
  ``OMP_NUM_THREADS=1``, so PyTorch runs one thread per rank);
* ``single``: one process after ``torch.set_num_threads(1)``.

    python benchmarks/bench_threads.py [--steps 12] [--recipe mxfp8] [--out benchmarks/results_threads.json]

numba reads ``NUMBA_NUM_THREADS`` at import, so every configuration runs in a process of its
own. The kernels follow ``torch.get_num_threads()`` (``fp8train.quant.kernels``), so both
numba columns should match; before they did, numba's pool took every core and a DDP step
ran ~4.5x slower. Each figure is the median step time of rank 0 after two warm-up steps.
Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NUMBA_SETTINGS = {"numba: all cores": None, "NUMBA_NUM_THREADS=1": "1"}


def _worker(recipe: str, steps: int, single_thread: bool) -> None:
    """One configuration: train ``steps`` steps, print rank 0's median step time (JSON)."""
    import torch
    import torch.distributed as dist

    import fp8train

    sys.path.insert(0, str(HERE))
    from llama_model import build

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    if single_thread:
        torch.set_num_threads(1)
    torch.manual_seed(0)
    built = build()
    model, loss_fn = built["model"], built["loss_fn"]
    if recipe != "bf16":
        fp8train.convert_to_float8_training(model, recipe)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    if not distributed or dist.get_rank() == 0:
        print(json.dumps({"step_s": statistics.median(times[2:]), "torch_threads": torch.get_num_threads()}))
    if distributed:
        dist.destroy_process_group()


def _run(setting: str, recipe: str, steps: int, numba_threads: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"}
    if numba_threads is not None:
        env["NUMBA_NUM_THREADS"] = numba_threads
    me = [str(Path(__file__).resolve()), "--worker", "--recipe", recipe, "--steps", str(steps)]
    if setting == "ddp":
        torchrun = str(Path(sys.executable).parent / "torchrun")
        command = [torchrun, "--nproc-per-node", "2", "--master-port", "29533", *me]
    else:
        command = [sys.executable, *me, "--single-thread"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--recipe", default="mxfp8")
    parser.add_argument("--out", default=str(HERE / "results_threads.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--single-thread", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.recipe, args.steps, args.single_thread)
        return
    sys.path.insert(0, str(HERE))
    from bench_linear import cpu_features

    from fp8train.diagnostics.markdown import markdown_table

    rows, records = [], []
    for setting in ("ddp", "single"):
        baseline = _run(setting, "bf16", args.steps, None)["step_s"]
        record = {"setting": setting, "unconverted_step_s": baseline}
        for label, value in NUMBA_SETTINGS.items():
            record[label] = _run(setting, args.recipe, args.steps, value)["step_s"]
        ratio = record["numba: all cores"] / record["NUMBA_NUM_THREADS=1"]
        records.append({**record, "all_cores_over_one": ratio})
        cells = [f"{record[label] * 1e3:.0f} ms ({record[label] / baseline:.2f}x)" for label in NUMBA_SETTINGS]
        rows.append([setting, f"{baseline * 1e3:.0f} ms", *cells, f"{ratio:.2f}"])
    header = ["setting", "unconverted (bf16 autocast)", *(f"{args.recipe}, {k}" for k in NUMBA_SETTINGS), "ratio"]
    print(markdown_table(header, rows))
    Path(args.out).write_text(json.dumps({"cpu": cpu_features(), "recipe": args.recipe, "results": records}, indent=2))


if __name__ == "__main__":
    main()
