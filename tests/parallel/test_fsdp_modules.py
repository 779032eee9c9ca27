"""FSDP2 with the FP8 modules other than Float8Linear: an attention (whose ``out_proj`` is
a Float8Linear, gathered in FP8, and whose in-projection weight is gathered in the
parameter dtype) and fused MoE experts (3-D weights sharded along the experts dim), on 2
CPU processes over gloo, against one process."""

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import fp8train
from fp8train.nn.config import Float8ModuleConfig
from fp8train.nn.modules.experts import Float8Experts
from fp8train.parallel import Float8AllGatherWeight, enable_fp8_all_gather

from ..helpers.sharded_steps import sharded_sgd_losses

WORLD_SIZE = 2
STEPS = 3
RECIPES = ("delayed", "mxfp8")  # scales identical on every rank: only summation order differs
E, NUM_EXPERTS = 128, 4


class _Block(nn.Module):
    def __init__(self, recipe: str):
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(E, 4, batch_first=True)
        config = Float8ModuleConfig(recipe=recipe, backend="emulated")
        self.experts = Float8Experts(NUM_EXPERTS, E, E, nn.SiLU(), config=config)
        with torch.no_grad():
            self.experts.gate_up_proj.normal_(std=E**-0.5)
            self.experts.down_proj.normal_(std=E**-0.5)
        self.head = nn.Linear(E, E)

    def forward(self, x):
        h = x + self.attn(x, x, x, need_weights=False)[0]
        tokens = h.reshape(-1, E)
        rows = torch.arange(tokens.shape[0])
        index = torch.stack([rows % NUM_EXPERTS, (rows + 1) % NUM_EXPERTS], dim=1)  # every expert used
        y = self.experts(tokens, index, torch.full(index.shape, 0.5)).reshape(h.shape)
        return self.head(h + y)


def _model(recipe: str) -> nn.Module:
    # The experts are built FP8; the conversion does the attention and the head.
    return fp8train.convert_to_float8_training(_Block(recipe), recipe, backend="emulated")


def _train(model: nn.Module, shard, world: int) -> list[float]:
    batches = []
    for step in range(STEPS):
        x = torch.randn(4, 32, E, generator=torch.Generator().manual_seed(step))
        x[2:] *= 3
        batches.append(x)
    return sharded_sgd_losses(model, batches, shard, 2 * 32 * E, world, WORLD_SIZE)


def _worker(rank: int, results) -> None:
    warnings.filterwarnings("ignore")
    per_recipe = {}  # filled, then handed over whole: results is a process-shared proxy
    for recipe in RECIPES:
        model = enable_fp8_all_gather(_model(recipe))
        wrapped = sorted(name for name, p in model.named_parameters() if isinstance(p, Float8AllGatherWeight))
        fully_shard(model)
        losses = _train(model, lambda x: x[2 * rank : 2 * (rank + 1)], WORLD_SIZE)
        state = {k: v for k, v in model.state_dict().items() if k.startswith("experts.fp8_")}
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
        per_recipe[recipe] = {"losses": losses, "wrapped": wrapped, "experts_state": state}
    results[rank] = per_recipe


@pytest.mark.heavy
def test_attention_and_experts_train_under_fsdp2_as_in_one_process(spawn_gloo):
    results = spawn_gloo(_worker, world_size=WORLD_SIZE, timeout=240)
    for recipe in RECIPES:
        ranks = [results[rank][recipe] for rank in range(WORLD_SIZE)]
        reference = _train(_model(recipe), lambda x: x, 1)
        assert ranks[0]["losses"] == ranks[1]["losses"]
        torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(reference), rtol=1e-5, atol=0)
        # The Float8Linear weights (the attention's out_proj, the head) gather in FP8.
        assert ranks[0]["wrapped"] == ["attn.out_proj.weight", "head.weight"], recipe
        if recipe == "delayed":  # the experts' per-expert state is reduced: the same on both ranks
            for key, value in ranks[0]["experts_state"].items():
                assert torch.equal(value, ranks[1]["experts_state"][key]), key
            assert ranks[0]["experts_state"]["experts.fp8_amax_history"].any()
