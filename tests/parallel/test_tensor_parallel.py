"""Tensor and sequence parallelism with FP8 GEMMs, on 2 CPU processes over gloo (spawned by
the ``spawn_gloo`` fixture): the FP8 all-gather of sequence-sharded activations against
quantizing the whole tensor in one process, and a transformer block (attention + MLP)
with TP=2 and sequence parallelism against the same block in one process."""

from __future__ import annotations

import contextlib
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

import fp8train
from fp8train.parallel import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput, gather_plan
from fp8train.parallel.sequence_gather import activation_gather_plan, all_gather_fp8
from fp8train.quant.operand import quantize_operand
from fp8train.quant.scaling import amax_to_scale
from fp8train.spec import Role
from fp8train.spec.recipes import RECIPE_NAMES, from_name

# Two gloo processes per module fixture, seconds each: CI's second leg runs them (default run under 6 minutes).
pytestmark = pytest.mark.heavy

WORLD_SIZE = 2
TIMEOUT_SECONDS = 240
OUTLIER = 1e4
# Recipes whose input and grad_output a shard of whole 128-token stretches gathers in FP8.
FP8_GATHERED = ("tensorwise", "delayed", "blockwise", "mxfp8")
HIGH_PRECISION_GATHERED = ("rowwise", "rowwise_with_gw_hp")
# The 4-bit recipes' gathers and blocks: test_tensor_parallel_4bit.py.
FP8_RECIPE_NAMES = tuple(
    name for name in RECIPE_NAMES if not any(g.fp4 for g in from_name(name).operand_plan.granularities)
)
DELAYED_SCALE = 0.03125  # a stored scale, the same on every rank
# Mixtures (issue 41): each direction's slots gather as their own recipe's; a delayed slot
# takes the stored scale, the other direction's slots their own.
MIXTURES = ("hybrid(forward=mxfp8,backward=blockwise)", "hybrid(forward=delayed,backward=mxfp8)")

# Transformer block vs one process, per recipe: relative Frobenius error of the output and
# of every parameter's gradient. delayed, blockwise, mxfp8: the same FP8 codes and scales
# (gathered operands bit-equal, weight and feature shards cut on block boundaries, delayed
# amaxes all-reduced), only float32 summation order differs. tensorwise and rowwise: each
# rank scales its own weight slice (and rowwise its per-column weight scales over its own
# rows), as Transformer Engine does, so quantization differs a little (tensorwise: 7% on
# the worst gradient, E5M2 grad_output; rowwise: its power-of-two column scales of the
# uniformly initialised weights happen to agree here).
BLOCK_RTOL = {"delayed": 1e-5, "blockwise": 1e-5, "mxfp8": 1e-5, "tensorwise": 0.1, "rowwise": 1e-3}
BLOCK_RTOL[MIXTURES[0]] = 1e-5  # MXFP8 forward, blockwise backward: both gathered bit-equal
DIM, HEADS, HIDDEN, BATCH, SEQ = 256, 4, 512, 1, 256


# ---------------------------------------------------------------------------- gather


def _full_tensor(role: Role) -> torch.Tensor:
    """``[2, 256, 256]``: two sequences of 256 tokens; rank 1's half of the second holds an outlier."""
    x = torch.randn(2, 256, 256, generator=torch.Generator().manual_seed(7 + role.index))
    x[1, 200, 17] = OUTLIER
    return x


@contextlib.contextmanager
def _recording_gathers():
    """Record ``(dtype, numel)`` of what every ``all_gather_into_tensor`` sends."""
    moved = []
    original = dist.all_gather_into_tensor

    def spy(output, input, group=None, async_op=False):
        moved.append((input.dtype, input.numel()))
        return original(output, input, group=group, async_op=async_op)

    dist.all_gather_into_tensor = spy
    try:
        yield moved
    finally:
        dist.all_gather_into_tensor = original


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (data or scales, any dtype, any rank; 4-bit data viewed as bytes
    first: PyTorch copies no transposed 4-bit tensor)."""
    if t.element_size() == 1:
        return t.view(torch.uint8).contiguous().reshape(-1)
    return t.contiguous().reshape(-1).view(torch.uint8)


def _reference(recipe, role: Role, x: torch.Tensor, scale):
    """The role's two usages quantized from the whole tensor in one process (columnwise
    in its compact orientation, ``None`` where the transpose of the rowwise one serves)."""
    gather = gather_plan(recipe, role)
    rowwise = quantize_operand(gather.rowwise, x, scale)
    columnwise = None if gather.columnwise is None else quantize_operand(gather.columnwise, x)
    return rowwise, columnwise


def _gather_worker(rank: int, results) -> None:
    warnings.filterwarnings("ignore")
    group = dist.group.WORLD
    out = {}
    with _recording_gathers() as moved:
        for name in FP8_RECIPE_NAMES + MIXTURES:
            recipe = from_name(name)
            for role in (Role.INPUT, Role.GRAD_OUTPUT):
                x = _full_tensor(role)
                shard = x.chunk(WORLD_SIZE, dim=1)[rank]
                gather, reason = activation_gather_plan(recipe, role, tuple(shard.shape), 1, WORLD_SIZE)
                if gather is None:
                    out[name, role.value] = {"reason": reason}
                    continue
                scale = None
                if gather.delayed:  # the gathered slot's own (a mixture's other slots are not)
                    scale = torch.tensor(DELAYED_SCALE)
                del moved[:]
                gathered = all_gather_fp8(shard, gather, 1, group, scale)
                rowwise, columnwise = _reference(recipe, role, x, scale)
                got_columnwise = gathered.fp8_columnwise
                record = {
                    "type": type(gathered).__name__,
                    "shape": tuple(gathered.shape),
                    "data_equal": torch.equal(_bits(gathered.fp8_rowwise.data), _bits(rowwise.data)),
                    "scale_equal": torch.equal(_bits(gathered.fp8_rowwise.scale_inv), _bits(rowwise.scale_inv)),
                    "scale_inv": gathered.fp8_rowwise.scale_inv.float().flatten()[:4].tolist(),
                    "columnwise": got_columnwise is not None,
                    "moved": list(moved),
                    "numel": x.numel(),
                    "shard_amax": None if gathered.fp8_shard_amax is None else gathered.fp8_shard_amax.item(),
                }
                if columnwise is not None:
                    expected_t = columnwise.data.reshape(-1, x.shape[-1]).t()
                    record["columnwise_data_equal"] = torch.equal(_bits(got_columnwise.data), _bits(expected_t))
                    record["columnwise_scale_equal"] = torch.equal(
                        _bits(got_columnwise.scale_inv), _bits(columnwise.scale_inv.t())
                    )
                out[name, role.value] = record
    out["errors"] = _bad_uses(rank)
    results[rank] = out


def _error_of(call) -> str:
    try:
        call()
    except (TypeError, ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _bad_uses(rank: int) -> dict:
    """What each misuse raises (a 2-rank group, so that meshes can be built)."""
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    linear = lambda recipe, out=256: fp8train.Float8Linear(256, out, recipe=recipe)  # noqa: E731
    mlp = lambda recipe: nn.Sequential(linear(recipe), nn.GELU(), linear(recipe))  # noqa: E731
    errors = {
        "2-D mesh": _error_of(
            lambda: parallelize_module(linear("tensorwise"), init_device_mesh("cpu", (1, 2)), Float8ColwiseParallel())
        ),
        "split block": _error_of(lambda: parallelize_module(linear("blockwise", 128), mesh, Float8ColwiseParallel())),
        "bad fqn": _error_of(
            lambda: parallelize_module(
                mlp("tensorwise"), mesh, PrepareFloat8ModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), fwd_config_submodule_fqn="9"
                )
            )
        ),
        "delayed without owner": _error_of(
            lambda: parallelize_module(
                mlp("tensorwise"), mesh, PrepareFloat8ModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), recipe="delayed"
                )
            )
        ),
    }
    # An input gathered for MXFP8, fed to tensorwise layers.
    block = nn.Sequential(nn.Sequential(linear("tensorwise")))
    parallelize_module(block, mesh, {
        "0": PrepareFloat8ModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), recipe="mxfp8"),
        "0.0": Float8ColwiseParallel(),
    })
    errors["other recipe"] = _error_of(lambda: block(torch.randn(1, 64, 256)))
    # Delayed scaling: a training forward outside fp8train.autocast, and without amax reduction.
    no_reduction = fp8train.DelayedScaling(reduce_amax=False)
    for key, recipe in (("delayed outside autocast", "delayed"), ("no reduce_amax", no_reduction)):
        layer = parallelize_module(linear(recipe), mesh, Float8ColwiseParallel(input_layouts=Shard(1)))
        errors[key] = _error_of(lambda: layer(torch.randn(1, 64, 256)))
    from fp8train.parallel.distributed import apply_tensor_parallel

    errors["no plan"] = _error_of(lambda: apply_tensor_parallel(nn.Linear(4, 4), 2, "none", torch.device("cpu")))
    errors["tp vs world"] = _error_of(
        lambda: apply_tensor_parallel(_TinyWithPlan(), 4, "none", torch.device("cpu"))
    )
    return errors


class _TinyWithPlan(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)

    def tensor_parallel_plan(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def gathered(spawn_gloo):
    return spawn_gloo(_gather_worker, world_size=WORLD_SIZE, timeout=TIMEOUT_SECONDS)


@pytest.mark.parametrize("name", FP8_GATHERED)
@pytest.mark.parametrize("role", ["input", "grad_output"])
def test_fp8_all_gather_is_bit_equal_to_quantizing_the_whole_tensor(gathered, name, role):
    for rank in range(WORLD_SIZE):
        record = gathered[rank][name, role]
        assert record["type"] == "PrequantizedTensor" and record["shape"] == (2, 256, 256)
        assert record["data_equal"] and record["scale_equal"], record
        if record["columnwise"]:
            assert record["columnwise_data_equal"] and record["columnwise_scale_equal"], record
    # Every rank ends up with the same scales, and the payload is FP8 bytes plus small scales.
    assert gathered[0][name, role]["scale_inv"] == gathered[1][name, role]["scale_inv"]
    (dtype, num_bytes), = gathered[0][name, role]["moved"]
    copies = 2 if gathered[0][name, role]["columnwise"] else 1  # MXFP8 and 1x128 blocks: both usages
    assert dtype == torch.uint8
    assert copies * 256 * 256 <= num_bytes < copies * 256 * 256 * 1.05  # one shard: 2 x 128 x 256 values


@pytest.mark.parametrize("name", MIXTURES)
@pytest.mark.parametrize("role", ["input", "grad_output"])
def test_a_mixture_gathers_each_slot_as_its_own_recipe_bit_for_bit(gathered, name, role):
    # Each gathered slot is bit-equal to quantizing the whole tensor by its own rule. The
    # input of hybrid(forward=delayed, backward=mxfp8) feeds a delayed per-tensor GEMM and
    # an MXFP8 one: no one FP8 copy serves both, so it gathers in high precision, saying so.
    record = gathered[0][name, role]
    if name == "hybrid(forward=delayed,backward=mxfp8)" and role == "input":
        assert "gathered in high precision" in record["reason"], record
        return
    for rank in range(WORLD_SIZE):
        record = gathered[rank][name, role]
        assert record.get("type") == "PrequantizedTensor", record
        assert record["data_equal"] and record["scale_equal"], record
        if record["columnwise"]:
            assert record["columnwise_data_equal"] and record["columnwise_scale_equal"], record


@pytest.mark.parametrize("name", ["tensorwise", "delayed"])
def test_per_tensor_scale_covers_an_outlier_on_one_rank(gathered, name):
    record = gathered[0][name, "input"]
    recipe = from_name(name)
    op = gather_plan(recipe, Role.INPUT).rowwise
    if name == "delayed":  # the stored scale; rank 1 records its own shard's amax (the outlier)
        assert record["scale_inv"] == [1 / DELAYED_SCALE]
        assert gathered[1][name, "input"]["shard_amax"] == OUTLIER
        assert record["shard_amax"] < 10
    else:  # one scale from the MAX over the ranks, though rank 0's shard has no outlier
        expected = 1 / amax_to_scale(torch.tensor(OUTLIER), op.format.max)
        assert record["scale_inv"] == [expected.item()]


@pytest.mark.parametrize("name", HIGH_PRECISION_GATHERED)
def test_rowwise_recipes_gather_in_high_precision_and_say_why(gathered, name):
    for role in ("input", "grad_output"):
        assert "high precision" in gathered[0][name, role]["reason"]


ERRORS = {
    "2-D mesh": "ValueError: Float8ColwiseParallel takes a 1-D tensor-parallel mesh",
    "split block": "splits out_features=128 of",
    "bad fqn": "fwd_config_submodule_fqn='9' is not a converted FP8 submodule",
    "delayed without owner": "needs a module with delayed-scaling state",
    "other recipe": "ValueError: input arrived all-gathered in FP8 as 'mx'",
    "delayed outside autocast": "RuntimeError: the input gather: delayed scaling with sequence parallelism must train "
    "inside fp8train.autocast()",
    "no reduce_amax": "reduce_amax=False cannot gather",
    "no plan": "tp=2 needs a model with a tensor_parallel_plan() method",
    "tp vs world": "tp=4 on 2 processes",
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_misuse_raises_a_clear_error(gathered, case):
    assert ERRORS[case] in gathered[0]["errors"][case]


def test_shards_that_split_a_block_gather_in_high_precision():
    recipe = from_name("blockwise")
    gather, reason = activation_gather_plan(recipe, Role.INPUT, (2, 64, 256), 1, 2)
    assert gather is None and "64 consecutive tokens" in reason and "128-token" in reason
    gather, _ = activation_gather_plan(recipe, Role.INPUT, (2, 128, 256), 1, 2)
    assert gather is not None and gather.rows_multiple == 128
    gather, reason = activation_gather_plan(recipe, Role.INPUT, (2, 128, 256), 2, 2)
    assert gather is None and "feature dim" in reason
    # Sharded along the batch dim, the whole shard is one stretch of tokens.
    gather, _ = activation_gather_plan(from_name("mxfp8"), Role.GRAD_OUTPUT, (1, 32, 64), 0, 2)
    assert gather is not None


# ---------------------------------------------------------------------------- block


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(DIM), Attention()
        self.norm2, self.w1, self.w2 = nn.LayerNorm(DIM), nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.w2(F.gelu(self.w1(self.norm2(x))))


def tp_plan() -> dict:
    """Sequence parallel as in torchtitan's Llama plan: attention's three projections share
    one FP8 gather; the MLP's first layer gathers its own."""
    return {
        "norm1": SequenceParallel(),
        "attn": PrepareFloat8ModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attn.wq": Float8ColwiseParallel(),
        "attn.wk": Float8ColwiseParallel(),
        "attn.wv": Float8ColwiseParallel(),
        "attn.wo": Float8RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "w1": Float8ColwiseParallel(input_layouts=Shard(1)),
        "w2": Float8RowwiseParallel(output_layouts=Shard(1)),
    }


def _block(recipe: str) -> nn.Module:
    torch.manual_seed(0)
    block = Block()
    with torch.no_grad():
        for norm in (block.norm1, block.norm2):  # not the identity: their gradients mean something
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.1, 0.1)
    return fp8train.convert_to_float8_training(block, recipe, backend="emulated")


def _block_input(step: int) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(100 + step))


def _run_block(block: nn.Module, shard) -> tuple[list, dict]:
    """Two forward and backward passes (delayed scaling: the second uses scales updated
    from the first's all-reduced amaxes); the second's output and gradients."""
    for step in range(2):
        block.zero_grad()
        x = shard(_block_input(step))
        with fp8train.autocast():
            y = block(x)
        (y * torch.linspace(-1, 1, DIM)).square().sum().backward()
    grads = {name: p.grad for name, p in block.named_parameters()}
    return y.detach(), grads


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _block_worker(rank: int, results, recipes: tuple) -> None:
    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("fp8train.parallel.sequence_gather")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out = {}
    with _recording_gathers() as moved:
        for recipe in recipes:
            block = parallelize_module(_block(recipe), mesh, tp_plan())
            del moved[:]
            y, grads = _run_block(block, lambda x: x.chunk(WORLD_SIZE, dim=1)[rank])
            out[recipe] = {
                "output": y,
                "grads": {name: _full(g) for name, g in grads.items()},
                "moved": list(moved),
                "logged": list(logged),
                "scales": {
                    name: m.fp8_scale.clone() for name, m in block.named_modules() if hasattr(m, "fp8_scale")
                },
            }
    results[rank] = out


def _relative_error(reference: torch.Tensor, result: torch.Tensor) -> float:
    return ((result.double() - reference.double()).norm() / reference.double().norm()).item()


@pytest.fixture(scope="module")
def block_runs(spawn_gloo):
    return spawn_gloo(_block_worker, tuple(BLOCK_RTOL), world_size=WORLD_SIZE, timeout=TIMEOUT_SECONDS)


@pytest.mark.parametrize("recipe", list(BLOCK_RTOL))
def test_sequence_parallel_block_matches_one_process(block_runs, recipe):
    reference = _block(recipe)
    y_ref, grads_ref = _run_block(reference, lambda x: x)
    y = torch.cat([block_runs[rank][recipe]["output"] for rank in range(WORLD_SIZE)], dim=1)
    rtol = BLOCK_RTOL[recipe]
    assert _relative_error(y_ref, y) < rtol
    grads = block_runs[0][recipe]["grads"]
    assert set(grads) == set(grads_ref)
    for name, grad_ref in grads_ref.items():
        assert _relative_error(grad_ref, grads[name]) < rtol, name
        torch.testing.assert_close(block_runs[1][recipe]["grads"][name], grads[name])
    if recipe == "delayed":  # the scales follow the whole tensors' amaxes, on every rank
        scales_ref = {name: m.fp8_scale for name, m in reference.named_modules() if hasattr(m, "fp8_scale")}
        for rank in range(WORLD_SIZE):
            for name, scale in block_runs[rank][recipe]["scales"].items():
                torch.testing.assert_close(scale, scales_ref[name], rtol=1e-6, atol=0)


@pytest.mark.parametrize("recipe", FP8_GATHERED)
def test_sequence_parallel_block_gathers_fp8_bytes(block_runs, recipe):
    # Per step: attention's input (once, for wq, wk and wv), w1's input, and the
    # grad_output of wo and w2; each a 128-token shard of 256 features (1 byte each, and
    # a second copy where the backward needs its own columnwise quantization), plus scales.
    moved = block_runs[0][recipe]["moved"]
    assert len(moved) == 2 * 4
    shard = SEQ // WORLD_SIZE * BATCH * DIM
    for dtype, num_bytes in moved:
        assert dtype == torch.uint8
        assert shard <= num_bytes < 2 * shard * 1.05


def test_rowwise_block_gathers_in_high_precision_and_logs_it_once(block_runs):
    assert block_runs[0]["rowwise"]["moved"] == []
    logged = [m for m in block_runs[0]["rowwise"]["logged"] if "rowwise" in m]
    # Two steps, three gathers each (attention's input, w1's input, the grad_outputs of
    # wo and w2): one line per kind of tensor.
    assert len(logged) == 2 and len(set(logged)) == 2, logged
    assert any("rowwise input: gathered in high precision" in m for m in logged)
    assert any("rowwise grad_output: gathered in high precision" in m for m in logged)
