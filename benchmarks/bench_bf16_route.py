"""bf16 work on this CPU, native against the route of issue 39 (:mod:`fp8train.quant.gemm.bf16`:
float32 GEMMs of bf16 operands, rounded once), both measured in the same run, best of N.

    OMP_NUM_THREADS=1 python benchmarks/bench_bf16_route.py
    ONEDNN_MAX_CPU_ISA=AVX2 FP8TRAIN_EMULATED_GEMM=float32 OMP_NUM_THREADS=1 python benchmarks/bench_bf16_route.py

The second line imitates a CPU without native bf16 on one that has it (oneDNN then runs bf16
GEMMs through its slow fallback; the FP8 emulation's own GEMM dtype follows a different
probe, so it is set as such a CPU chooses it). One thread: on a shared 2-core machine two
threads' spin-waits, not the arithmetic, decide the times. Rows: a 2048x128 @ 128x512 GEMM
(bf16, float32), the default GPT's bf16-autocast step (2 x 128 wide, 16 x 128 tokens), and a
1024-wide rowwise_with_gw_hp Float8Linear forward+backward (4096 tokens) beside float32
``nn.Linear``; each of the last two both ways, whatever the probe says.
"""

from __future__ import annotations

import time

import torch
from torch import nn

import fp8train
from fp8train.quant.gemm.bf16 import cpu_has_native_bf16
from fp8train.train.arguments import TrainingArguments
from fp8train.train.model import GPT, GPTConfig
from fp8train.train.trainer_setup import mixed_precision_autocast

CPU = torch.device("cpu")
REPEATS = 4


def best_ms(step, repeats: int = REPEATS) -> float:
    """The fastest of ``repeats`` timed calls of ``step``, after one untimed."""
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def steps() -> dict:
    """``{row: step}``: every call the table times."""
    torch.manual_seed(0)
    args = TrainingArguments()
    a, b = torch.randn(2048, 128), torch.randn(128, 512)
    gpt = GPT(GPTConfig(block_size=128))
    idx, targets = torch.randint(0, 256, (16, 128)), torch.randint(0, 256, (16, 128))
    linear = nn.Linear(1024, 1024)
    x = torch.randn(4096, 1024)
    layer = fp8train.convert_to_float8_training(nn.Sequential(nn.Linear(1024, 1024)), "rowwise_with_gw_hp")

    def gpt_step(native):
        with mixed_precision_autocast(args, CPU, native_bf16=native):
            loss = gpt(idx, targets)
        loss.backward()

    def layer_step(native):
        with mixed_precision_autocast(args, CPU, native_bf16=native), fp8train.autocast():
            out = layer(x)
        out.float().sum().backward()

    return {
        "GEMM 2048x128x512 float32": lambda: a @ b,
        "GEMM 2048x128x512 bf16": lambda: a.bfloat16() @ b.bfloat16(),
        "GPT bf16 step, torch's bf16 GEMMs": lambda: gpt_step(True),
        "GPT bf16 step, routed": lambda: gpt_step(False),
        "nn.Linear 1024 float32 fwd+bwd": lambda: linear(x).sum().backward(),
        "rowwise_with_gw_hp 1024, torch's bf16 GEMM": lambda: layer_step(True),
        "rowwise_with_gw_hp 1024, routed": lambda: layer_step(False),
    }


def main() -> dict:
    print(f"native bf16 (oneDNN): {cpu_has_native_bf16()}, threads: {torch.get_num_threads()}")
    results = {}
    for _ in range(2):  # two passes, interleaved: a load that comes and goes hits every row alike
        for name, step in steps().items():
            results[name] = min(results.get(name, float("inf")), best_ms(step))
    for name, ms in results.items():
        print(f"| {name} | {ms:.1f} ms |")
    return results


if __name__ == "__main__":
    main()
