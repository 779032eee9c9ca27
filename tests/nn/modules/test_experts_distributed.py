"""Delayed scaling of fused MoE experts across processes: the experts' per-expert state joins
the one batched amax all-reduce of the step; an expert idle on every rank keeps its state.

Spawns 2 CPU processes (gloo) through the ``spawn_gloo`` fixture. Kept apart from
``test_experts.py`` so the workers do not import transformers."""

import pytest
import torch
from torch import nn

import fp8train
from fp8train.nn.config import Float8ModuleConfig
from fp8train.nn.modules.experts import Float8Experts
from fp8train.spec.recipes import DelayedScaling
from fp8train.spec.roles import Role

RECIPE = DelayedScaling(amax_history_len=4)


def _experts() -> Float8Experts:
    torch.manual_seed(0)
    experts = Float8Experts(4, 128, 128, nn.SiLU(), config=Float8ModuleConfig(recipe=RECIPE, backend="emulated"))
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=128**-0.5)
        experts.down_proj.normal_(std=128**-0.5)
    return experts


def _hidden() -> torch.Tensor:
    hidden = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(1))
    hidden[1] *= 4  # rank-dependent magnitudes: without the reduction the scales would differ
    return hidden


def _step(experts: Float8Experts, hidden: torch.Tensor, experts_used: list[int]) -> None:
    """One training step routing every token to ``experts_used`` (top-2)."""
    index = torch.tensor(experts_used).repeat(hidden.shape[0], 1)
    with fp8train.autocast():
        out = experts(hidden, index, torch.full(index.shape, 0.5))
    out.square().mean().backward()


def _worker(rank: int, results) -> None:
    experts, hidden = _experts(), _hidden()[rank]
    _step(experts, hidden, [0, 1] if rank == 0 else [2, 3])  # every expert runs once
    first = (experts.fp8_scale.clone(), experts.fp8_amax_history.clone())
    # Rank 0 routes to experts 0 and 1, rank 1 to 1 and 2; expert 3 is idle everywhere.
    _step(experts, hidden, [0, 1] if rank == 0 else [1, 2])
    results[rank] = (*first, experts.fp8_scale.clone(), experts.fp8_amax_history.clone())


@pytest.mark.heavy
def test_delayed_experts_reduce_amaxes_across_processes_and_idle_ones_stay(spawn_gloo):
    results = spawn_gloo(_worker)
    for rank0, rank1 in zip(results[0], results[1]):
        assert torch.equal(rank0, rank1)  # every scale and history identical on both ranks
    first_scale, first_history, scale, history = results[0]
    # Expert 1 ran on both ranks: its input amax is the larger rank's.
    assert history[-1, 1, 0, Role.INPUT.index] == _hidden()[1].abs().amax()
    # Experts 0 and 2 ran on one rank each: updated everywhere. Expert 3 ran on none.
    for expert in (0, 2):
        assert not first_history[0, expert].any() and history[-1, expert].all()
        assert not torch.equal(history[:, expert], first_history[:, expert])
    assert torch.equal(history[:, 3], first_history[:, 3]) and torch.equal(scale[3], first_scale[3])
