"""DDP and FSDP2 (FP8 all-gather) on nccl: one process per GPU, each on its own device,
at world size 1 and, where two GPUs are present, 2; the losses of a few SGD steps against
the same model in this process on the whole batch (:func:`tests.helpers.sharded_steps.sharded_sgd_losses`).
Then the trainer under ``torchrun`` at both sizes, which sets each rank's device itself.

The CPU dry run takes gloo in place of nccl (and runs world size 2 on the CPU).
"""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import fp8train
from fp8train.parallel import enable_fp8_all_gather, precompute_fp8_scales_for_fsdp
from tests.conftest import spawn_ranks
from tests.helpers.sharded_steps import sharded_sgd_losses
from tests.train.torchrun import run_torchrun

from ._suite import child_env, is_finite_number

CASES = (("ddp", "delayed"), ("ddp", "rowwise"), ("fsdp2", "tensorwise"), ("fsdp2", "blockwise"))
STEPS = 3
ROWS, IN_FEATURES, OUT_FEATURES = 256, 256, 256  # each rank's shard: 256 / world size rows
TIMEOUT_SECONDS = 300
LOSS_RTOL = {"tensorwise": 2e-2}
"""Data-parallel losses against one process on the whole batch, by recipe. tensorwise: each
rank scales its own activations from their own amax (tests/parallel/test_fsdp.py's
bound). The others quantize the same rows to the same codes; the hardware GEMM's error
(1e-3 of max |result|) differs between a shard's M and the whole batch's."""
DEFAULT_LOSS_RTOL = 5e-3


def _model(recipe: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN_FEATURES, 512), nn.GELU(), nn.Linear(512, OUT_FEATURES)).to(device)
    return fp8train.convert_to_float8_training(model, recipe, backend="auto")


def _batches() -> list[torch.Tensor]:
    batches = []
    for step in range(STEPS):
        x = torch.randn(ROWS, IN_FEATURES, generator=torch.Generator().manual_seed(step))
        x[ROWS // 2 :] *= 3
        batches.append(x)
    return batches


def _losses(strategy: str, recipe: str, device: torch.device, rank: int, world_size: int) -> list[float]:
    """SGD losses of ``recipe``'s model under ``strategy`` (``none``: this process alone, on
    the whole batch), the mean over ranks."""
    model = _model(recipe, device)
    rows = ROWS // world_size
    shard = (lambda x: x.to(device)) if strategy == "none" else (lambda x: x[rows * rank : rows * (rank + 1)].to(device))
    after_step = None
    if strategy == "ddp":
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif strategy == "fsdp2":
        enable_fp8_all_gather(model)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        after_step = precompute_fp8_scales_for_fsdp
    world = 1 if strategy == "none" else world_size
    return sharded_sgd_losses(model, _batches(), shard, rows * OUT_FEATURES, world, world_size, after_step)


def _worker(rank: int, results, device_type: str, world_size: int) -> None:
    """One rank: join the process group on its own device, run every case, leave."""
    warnings.filterwarnings("ignore")
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=TIMEOUT_SECONDS / 2),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    try:
        for strategy, recipe in CASES:
            try:
                losses = _losses(strategy, recipe, device, rank, world_size)
            except Exception as error:  # noqa: BLE001 - reported per case, the others still run
                losses = f"{type(error).__name__}: {error}"
            if rank == 0:
                results[f"{strategy}-{recipe}"] = losses
    finally:
        dist.destroy_process_group()


def _world_size_available(device: torch.device, world_size: int) -> None:
    if device.type == "cuda" and torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA devices, this machine has {torch.cuda.device_count()}")


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def distributed_losses(request, device) -> tuple[int, dict]:
    """``(world_size, {case: losses or the error})`` from one spawned run of every case."""
    world_size = request.param
    _world_size_available(device, world_size)
    run = spawn_ranks(_worker, device.type, world_size, world_size=world_size, timeout=TIMEOUT_SECONDS, init_group=False)
    assert None not in run.exitcodes, f"ranks did not finish in {TIMEOUT_SECONDS} s (a collective hung?)"
    assert all(code == 0 for code in run.exitcodes), f"rank exit codes {run.exitcodes}"
    return world_size, run.results


@pytest.mark.parametrize("strategy, recipe", CASES, ids=[f"{s}-{r}" for s, r in CASES])
def test_data_parallel_matches_one_process(strategy, recipe, distributed_losses, device):
    world_size, results = distributed_losses
    losses = results[f"{strategy}-{recipe}"]
    assert isinstance(losses, list), f"{strategy} {recipe} at world size {world_size} failed: {losses}"
    expected = _losses("none", recipe, device, 0, world_size)
    assert all(is_finite_number(loss) for loss in losses), losses
    rtol = LOSS_RTOL.get(recipe, DEFAULT_LOSS_RTOL)
    for step, (got, want) in enumerate(zip(losses, expected), start=1):
        assert abs(got - want) <= rtol * abs(want), f"step {step}: {got} ({strategy}) vs {want} (one process)"


@pytest.mark.parametrize("world_size", [1, 2], ids=["world1", "world2"])
@pytest.mark.parametrize("strategy, recipe", [("fsdp2", "blockwise"), ("ddp", "delayed")])
def test_trainer_under_torchrun(strategy, recipe, world_size, device, sizes, tmp_path):
    """``torchrun -m fp8train train`` as a user launches it, on one GPU or two, through its
    final checkpoint (the full state gathered over nccl)."""
    _world_size_available(device, world_size)
    result = run_torchrun(
        ["-m", "fp8train", "train", "--strategy", strategy, "--fp8_recipe", recipe, "--device", device.type,
         "--output_dir", str(tmp_path / "run"), *sizes.train_flags],
        timeout=TIMEOUT_SECONDS, env=child_env(), nproc=world_size,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("final train loss") == 1  # rank 0 only
