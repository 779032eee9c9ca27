"""FSDP2 with FP8 primary weights (``fp8_weights=True``): each rank's parameter holds its rows
of the weight only quantized (:class:`~fp8train.parallel.Float8WeightShard`), FSDP2 gathers
those bytes as they are, and ``fp8train.optim.AdamW`` keeps each shard's master. Two gloo
ranks on the same batch train as one process with ``fp8_weights=True`` does, bit for bit
(losses, gathered FP8 weights, masters, delayed-scaling buffers), and resume exactly from a
``state_dict``; the refusals run in one process."""

from __future__ import annotations

import gc
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fp8train
from fp8train.nn.weights.float8_weight import Float8Weight
from fp8train.optim import AdamW
from fp8train.parallel import Float8WeightShard, enable_fp8_all_gather
from fp8train.parallel.local_optimizer_state import gather_local_state, holds_local_state, load_local_state

STEPS = 3
RESUME_AT = 2
OPTIMIZER = dict(lr=1e-2, weight_decay=0.1, exp_avg_dtype=torch.bfloat16, stochastic_rounding=False)
# Block recipes need whole blocks per shard of 2 ranks, and blockwise 128-wide inputs.
DIMS = {"blockwise": (256, 256, 256)}
FOUR_BIT = ("nvfp4", "mxfp4")  # two codes a byte
DEFAULT_DIMS = (64, 128, 64)


def _model(recipe: str) -> nn.Module:
    torch.manual_seed(0)
    d_in, d_hidden, d_out = DIMS.get(recipe, DEFAULT_DIMS)
    model = nn.Sequential(nn.Linear(d_in, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_out))
    return fp8train.convert_to_float8_training(model, recipe=recipe, backend="emulated", fp8_weights=True)


def _sharded(recipe: str, mesh) -> tuple[nn.Module, AdamW]:
    model = enable_fp8_all_gather(_model(recipe), shard_world_size=mesh.size())
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, AdamW(model.parameters(), **OPTIMIZER)


def _steps(model: nn.Module, optimizer, steps) -> list[float]:
    """The same batch on every rank: FSDP2's mean of the ranks' gradients is one process's."""
    losses = []
    for step in steps:
        x = torch.randn(32, model[0].in_features, generator=torch.Generator().manual_seed(step))
        with fp8train.autocast():
            loss = (model(x) - x[:, : model[2].out_features]).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _payload_bits(weight) -> list[torch.Tensor]:
    """The bytes of a whole quantized weight's two operands (data, scales, global amax): copies."""
    parts = []
    for qt in (weight.fp8_rowwise, weight.first_dim_operand()):
        parts += [qt.data, qt.scale_inv] + ([] if qt.global_amax is None else [qt.global_amax])
    # 1-byte data (4-bit pairs among them, which have no copy kernel) is viewed as bytes first.
    parts = [t.view(torch.uint8) if t.element_size() == 1 else t.contiguous().reshape(-1).view(torch.uint8) for t in parts]
    return [t.contiguous().reshape(-1).clone() for t in parts]


def _reference(recipe: str) -> dict:
    """One process, ``fp8_weights=True``: what the sharded run must equal."""
    model = _model(recipe)
    optimizer = AdamW(model.parameters(), **OPTIMIZER)
    losses = _steps(model, optimizer, range(STEPS))
    weights = [model[0].weight, model[2].weight]
    return {
        "losses": losses,
        "gathered": [_payload_bits(w) for w in weights],
        "masters": [optimizer.state[w]["master"] for w in weights],
        "buffers": [b.clone() for b in model.buffers()],
        "state": model.state_dict(),
    }


def _all_rows(local: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of a tensor sharded along dim 0, in rank order."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts)


def _train_sharded(recipe: str, mesh) -> dict:
    inputs, gathered = [], []
    original_pre, original_post = Float8WeightShard.fsdp_pre_all_gather, Float8WeightShard.fsdp_post_all_gather

    def spy_pre(self, mesh, outer_size, outer_stride, module, mp_policy):  # FSDP2 inspects this signature
        result = original_pre(self, mesh, outer_size, outer_stride, module, mp_policy)
        stored = self._state.rowwise.data
        inputs.append(([(t.dtype, t.numel()) for t in result[0]], self.numel(), result[0][0].data_ptr() == stored.data_ptr()))
        return result

    def spy_post(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        result = original_post(self, all_gather_outputs, metadata, param_dtype, out=out)
        gathered.append(_payload_bits(out if out is not None else result[0]))
        return result

    Float8WeightShard.fsdp_pre_all_gather, Float8WeightShard.fsdp_post_all_gather = spy_pre, spy_post
    try:
        model, optimizer = _sharded(recipe, mesh)
        weights = [model[0].weight, model[2].weight]
        pending = [w._local_tensor.fp8_master.pending for w in weights]
        losses = _steps(model, optimizer, range(STEPS))
        buffers, state = [b.clone() for b in model.buffers()], model.state_dict()
        gathered.clear()
        with torch.no_grad(), fp8train.autocast(enabled=False):  # the trained weights, gathered
            model(torch.zeros(2, model[0].in_features))
    finally:
        Float8WeightShard.fsdp_pre_all_gather, Float8WeightShard.fsdp_post_all_gather = original_pre, original_post
    locals_ = [w._local_tensor for w in weights]
    return {
        "losses": losses, "gathered": gathered, "inputs": inputs, "pending_freed": pending == [None, None],
        "masters": [_all_rows(optimizer.state[w]["master"]) for w in weights],
        "buffers": buffers,
        "storage": [(type(t).__name__, t.storage_nbytes, t.numel(), t._state.columnwise is not None) for t in locals_],
        "state": {k: (type(v).__name__, type(v._local_tensor).__name__ if isinstance(v, DTensor) else None,
                      v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state.items()},
    }  # fmt: skip


def _resumed(recipe: str, mesh) -> list[float]:
    """``RESUME_AT`` steps, a ``state_dict`` of the model and the optimizer's whole state
    (its local rows gathered, as the trainer's checkpoints hold it), a fresh model and
    optimizer that load them, and the remaining steps: their losses."""
    model, optimizer = _sharded(recipe, mesh)
    _steps(model, optimizer, range(RESUME_AT))
    assert holds_local_state(optimizer)
    model_state, optimizer_state = model.state_dict(), gather_local_state(optimizer)
    resumed, resumed_optimizer = _sharded(recipe, mesh)
    resumed.load_state_dict(model_state)
    load_local_state(resumed_optimizer, optimizer_state)
    return _steps(resumed, resumed_optimizer, range(RESUME_AT, STEPS))


def _worker(rank: int, results, recipes: tuple[str, ...], resumes: tuple[str, ...]) -> None:
    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for recipe in recipes:
        out[recipe] = _train_sharded(recipe, mesh)
        # FSDP2 leaves reference cycles: collect the model on every rank alike, or a delayed
        # model's state, still registered on one rank, would join one rank's amax all-reduce.
        gc.collect()
    for recipe in resumes:  # tensorwise's load re-quantizes under a reduced scale: a collective per weight
        out[f"resumed {recipe}"] = _resumed(recipe, mesh)
        gc.collect()
    results[rank] = out


def _check_against_one_process(results: dict, recipe: str) -> None:
    expected = _reference(recipe)
    for rank in (0, 1):
        got = results[rank][recipe]
        assert got["losses"] == expected["losses"]
        assert len(got["gathered"]) == 2
        for mine, theirs in zip(got["gathered"], expected["gathered"]):
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(got["masters"], expected["masters"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(got["buffers"], expected["buffers"], strict=True))
        # Checkpoints hold the high-precision weights (DTensors of plain rows): one process's.
        assert got["state"].keys() == expected["state"].keys()
        for key, (outer, local, value) in got["state"].items():
            if key.endswith("weight"):
                assert (outer, local) == ("DTensor", "Tensor")
            assert torch.equal(value, expected["state"][key]), key
        _check_bytes(got, 0.5 if recipe in FOUR_BIT else 1)


def _check_bytes(got: dict, bytes_per_element: float) -> None:
    """Each rank's parameter holds its rows in FP8 (or 4 bits) only, one copy or two (a
    columnwise one of its own), plus small scales; FSDP2 gathers those stored bytes, not a
    cast of them."""
    assert got["pending_freed"]  # the optimizer took the high-precision rows as its masters
    for name, nbytes, numel, columnwise in got["storage"]:
        payload = (2 if columnwise else 1) * numel * bytes_per_element
        assert name == "Float8WeightShard"
        assert payload <= nbytes < payload * (1 + 1 / 4)
    assert got["inputs"]
    for payload, shard_numel, as_stored in got["inputs"]:
        assert as_stored and payload[0] == (torch.uint8, shard_numel * bytes_per_element)
        assert all(dtype == torch.uint8 for dtype, _ in payload)


@pytest.mark.heavy
def test_fsdp2_shards_fp8_weights_and_trains_as_one_process(spawn_gloo):
    results = spawn_gloo(_worker, ("tensorwise", "delayed", "mxfp8"), ("delayed", "tensorwise"), timeout=180)
    for recipe in ("tensorwise", "delayed", "mxfp8"):
        _check_against_one_process(results, recipe)
    for recipe in ("delayed", "tensorwise"):
        expected = _reference(recipe)["losses"][RESUME_AT:]
        assert results[0][f"resumed {recipe}"] == results[1][f"resumed {recipe}"] == expected


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["blockwise", "nvfp4", "mxfp4"])
def test_fsdp2_shards_fp8_weights_of_other_recipes(recipe, spawn_gloo):
    results = spawn_gloo(_worker, (recipe,), (), timeout=180)
    _check_against_one_process(results, recipe)


# ---------------------------------------------------------------------------- one process


@pytest.fixture
def one_rank_mesh(one_rank_group):
    return init_device_mesh("cpu", (1,))


def test_a_shard_holds_fp8_bytes_and_refuses_writes(one_rank_mesh):
    model, optimizer = _sharded("tensorwise", one_rank_mesh)
    weight = model[0].weight
    local = weight._local_tensor
    assert isinstance(weight, DTensor) and isinstance(local, Float8WeightShard)
    assert local.storage_nbytes == local.numel() + 4  # E4M3 codes and one float32 scale
    assert local.fp8_master.pending is None and optimizer.state[weight]["master"].shape == local.shape
    assert torch.equal(local.checkpoint_value(), optimizer.state[weight]["master"])
    with pytest.raises(RuntimeError, match=r"aten::add_ would change a weight stored in FP8 \(fp8_weights=True\)"):
        with torch.no_grad():
            local.add_(1)
    with pytest.raises(ValueError, match="forward runs another recipe"):
        with fp8train.autocast(recipe="delayed"):
            model(torch.randn(4, 64))


def test_recipes_that_cannot_shard_fp8_weights_are_refused():
    with pytest.raises(NotImplementedError, match=r"0 \(rowwise, fp8_weights=True\): FSDP2 cannot shard a weight"):
        enable_fp8_all_gather(_model("rowwise"), shard_world_size=2)
    # 64 output rows over 4 ranks: 16 rows a shard, half an MXFP8 32-row block.
    with pytest.raises(NotImplementedError, match="out_features=64 over 4 ranks .* whole 32-row blocks .* multiple of 128"):
        enable_fp8_all_gather(_model("mxfp8"), shard_world_size=4)
    # Per-tensor scales: FSDP2 would pad the last shard, whose padding the stored bytes lack.
    refusal = r"0 \(tensorwise, fp8_weights=True\): out_features=128 over 3 ranks .* as many rows \(no padding\)"
    with pytest.raises(NotImplementedError, match=refusal):
        enable_fp8_all_gather(_model("tensorwise"), shard_world_size=3)


def test_fp8_weights_of_other_modules_are_refused():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    fp8train.convert_to_float8_training(model, recipe="tensorwise", fp8_weights=True)
    refusal = r"transformer.h.0.attn.c_attn.weight \(Float8Conv1D\) is stored in FP8 .* Float8Linear weights only"
    with pytest.raises(NotImplementedError, match=refusal):
        enable_fp8_all_gather(model, shard_world_size=2)


def test_an_optimizer_built_before_sharding_is_refused():
    model = _model("tensorwise")
    optimizer = AdamW(model.parameters())  # held: it holds the masters
    assert model[0].weight.fp8_master.master is optimizer.state[model[0].weight]["master"]
    with pytest.raises(ValueError, match="build fp8train.optim.AdamW after enable_fp8_all_gather and fully_shard"):
        enable_fp8_all_gather(model, shard_world_size=2)


def test_fully_shard_without_enable_fp8_all_gather_is_refused():
    model = _model("tensorwise")
    assert isinstance(model[0].weight, Float8Weight)
    with pytest.raises(NotImplementedError, match=r"enable_fp8_all_gather\(model\), called before fully_shard"):
        torch.chunk(model[0].weight, 2)  # what fully_shard does to a parameter


def test_the_docs_example_runs_and_prints_what_the_page_says(capsys):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    page = Path(__file__).resolve().parents[2] / "docs" / "optim.md"
    example = next(b for b in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S) if "Float8WeightShard" in b)
    exec(compile(example, "<docs/optim.md FSDP2 example>", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.splitlines()[-1] == re.search(r"\n# (Float8WeightShard .*)\n", example).group(1)


def test_the_gathered_optimizer_state_loads_on_as_many_ranks_only(one_rank_mesh):
    model, optimizer = _sharded("tensorwise", one_rank_mesh)
    _steps(model, optimizer, range(1))
    state = gather_local_state(optimizer)
    index = next(iter(state["local_shard_rows"]))
    state["local_shard_rows"][index] = {key: [*rows, 0] for key, rows in state["local_shard_rows"][index].items()}
    with pytest.raises(ValueError, match="saved over 2 ranks, this run shards over 1: resume on 2 ranks"):
        load_local_state(optimizer, state)


def test_local_optimizer_state_on_a_2d_mesh_is_refused(one_rank_mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1, 1))
    param = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Replicate()]))
    optimizer = AdamW([param], exp_avg_dtype=torch.bfloat16)
    param.grad = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Replicate()])
    optimizer.step()
    with pytest.raises(NotImplementedError, match="on a 2-D mesh .* use torch.optim.AdamW there"):
        gather_local_state(optimizer)
