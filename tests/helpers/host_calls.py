"""Count the Python calls one Float8Linear forward+backward makes on the host (issue 38):
the CPU-side cost of a layer that a GPU's kernels cannot hide, measured without a GPU.

The rule (:func:`count_host_calls`):

* The counted step is ``layer(input_hp).backward(grad_output)`` at :data:`HOST_SHAPE`
  (16 tokens, 256 in, 256 out), float32, bias, one CPU thread; delayed scaling's forward runs
  inside ``fp8train.autocast()``, as in training (the autocast's exit, with its scale update,
  is counted too). Setting the grads to ``None`` before it is not counted.
* The count is ``cProfile``'s total, Python and built-in functions alike, of the second of
  two steps: the first pays for caches, lazy imports and (delayed) the owed update.
* ``kernel`` is the quantize path: ``"auto"`` (the default CPU path: numba's kernels) or
  ``"reference"`` (the PyTorch-ops path a GPU takes outside its fused kernels), set with
  ``use_quant_settings`` exactly as ``FP8TRAIN_QUANTIZE_KERNEL`` sets it at import.

The count is machine-independent; :func:`time_host` measures the same step's wall time beside
``nn.Linear``'s, which at this shape is almost all host time.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import statistics
import time
import torch
from torch import nn

import fp8train
from fp8train.quant.kernels import use_quant_settings

HOST_SHAPE = (16, 256, 256)
"""``(M, K, N)`` of the counted Linear: 16 tokens, 256 in, 256 out (issue 38)."""

KERNELS = ("auto", "reference")
"""The quantize paths counted: the default CPU path and the reference (GPU-like) one."""


@contextlib.contextmanager
def one_thread():
    """One intra-op thread for the block (the count's and the timing's setting)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class LinearStep:
    """One forward+backward of a fresh Linear: ``Float8Linear(recipe)``, or ``nn.Linear``
    where ``recipe`` is ``None``, on ``[M, K]`` float32 input for ``shape = (M, K, N)``."""

    def __init__(self, recipe: str | None, shape=HOST_SHAPE) -> None:
        m, k, n = shape
        generator = torch.Generator().manual_seed(0)
        self.layer = nn.Linear(k, n) if recipe is None else fp8train.Float8Linear(k, n, recipe=recipe)
        self.input_hp = torch.randn(m, k, generator=generator).requires_grad_()
        self.grad_output = torch.randn(m, n, generator=generator)
        self.in_autocast = recipe == "delayed"

    def reset(self) -> None:
        """Set the grads to ``None`` (not counted)."""
        self.layer.zero_grad(set_to_none=True)
        self.input_hp.grad = None

    def run(self) -> None:
        """The counted forward+backward."""
        with fp8train.autocast() if self.in_autocast else contextlib.nullcontext():
            output = self.layer(self.input_hp)
        output.backward(self.grad_output)


def profile_step(recipe: str | None, kernel: str = "auto", shape=HOST_SHAPE) -> pstats.Stats:
    """``cProfile``'s statistics of the second forward+backward (the module's rule)."""
    step = LinearStep(recipe, shape)
    with one_thread(), use_quant_settings(quantize_kernel=kernel):
        step.run()  # the first step, uncounted
        step.reset()
        profile = cProfile.Profile()
        profile.enable()
        step.run()
        profile.disable()
    return pstats.Stats(profile)


def count_host_calls(recipe: str | None, kernel: str = "auto", shape=HOST_SHAPE) -> int:
    """The Python calls (``cProfile``'s total) of one forward+backward of
    ``Float8Linear(recipe)`` (``nn.Linear`` for ``None``) on the ``kernel`` path."""
    return profile_step(recipe, kernel, shape).total_calls


def time_host(recipes: list[str], kernel: str = "auto", repeats: int = 300, warmup: int = 20, shape=HOST_SHAPE) -> dict[str, float]:
    """Median wall time in microseconds of one forward+backward per recipe and of
    ``nn.Linear`` (key ``"nn.Linear"``) at ``shape``, interleaved so load drifts hit all alike."""
    steps = {"nn.Linear": LinearStep(None, shape), **{recipe: LinearStep(recipe, shape) for recipe in recipes}}
    times: dict[str, list[float]] = {name: [] for name in steps}
    with one_thread(), use_quant_settings(quantize_kernel=kernel):
        for repeat in range(warmup + repeats):
            for name, step in steps.items():
                step.reset()
                start = time.perf_counter()
                step.run()
                elapsed = time.perf_counter() - start
                if repeat >= warmup:
                    times[name].append(elapsed)
    return {name: statistics.median(samples) * 1e6 for name, samples in times.items()}


def format_table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table, the first column left-aligned and the others right-aligned."""
    cells = [[str(cell) for cell in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        padded = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join([":" + "-" * (widths[0] + 1)] + ["-" * (w + 1) + ":" for w in widths[1:]]) + "|"
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])
