"""One GPU per rank on nccl, and every collective's tensor on its group's device, checked on
a CPU: torch's own calls are spied on, never fp8train's logic.

An nccl world is made of what torch reports: ``dist.get_backend`` says ``"nccl"``, two
ranks, ``torch.cuda.current_device()`` is this rank's GPU, and ``FakeTensorMode`` lets a
CPU build of torch hold tensors on ``cuda:1``. Each collective is replaced by a spy that
records its tensors' devices and stops the call there (fake tensors have no values to
read on)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from fp8train.nn.delayed.amax import all_reduce_max
from fp8train.nn.collective_device import backend_device, collective_device
from fp8train.parallel.distributed import init_distributed, mean_over_ranks, process_group_backend, wrap_model
from fp8train.parallel.local_optimizer_state import _gather_rows

RANK_GPU = 1


@pytest.mark.parametrize(
    "backend, device",
    [("nccl", torch.device("cuda", 3)), ("gloo", torch.device("cpu")), ("mpi", torch.device("cpu")),
     ("cpu:gloo,cuda:nccl", torch.device("cuda", 3)), ("NCCL", torch.device("cuda", 3))],
)
def test_a_backend_reduces_on_the_ranks_gpu_for_nccl_and_on_the_cpu_otherwise(backend, device):
    assert backend_device(backend, 3) == device


def test_a_cuda_device_starts_nccl_and_any_other_gloo():
    assert process_group_backend(torch.device("cuda", 2)) == "nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"


def test_without_a_process_group_collectives_are_on_the_cpu():
    assert not dist.is_initialized()
    assert collective_device() == torch.device("cpu")


@pytest.fixture
def torchrun_calls(monkeypatch) -> list:
    """Two ranks under torchrun; ``torch.cuda.set_device`` and ``init_process_group``
    record their calls, in order (no group starts)."""
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: calls.append(("init", args, kwargs)))
    return calls


def test_an_nccl_rank_is_bound_to_its_gpu_before_the_group_starts(torchrun_calls):
    gpu = torch.device("cuda", RANK_GPU)
    assert init_distributed(gpu, timeout_seconds=5) == (0, 1)  # the spy started no group
    timeout = datetime.timedelta(seconds=5)
    assert torchrun_calls == [("set_device", gpu), ("init", ("nccl",), {"timeout": timeout, "device_id": gpu})]


def test_torchrun_with_one_process_starts_a_group_of_one(torchrun_calls, monkeypatch):
    """DDP and FSDP2 need a group: under ``torchrun --nproc-per-node 1`` they run as at N."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    gpu = torch.device("cuda", 0)
    init_distributed(gpu, timeout_seconds=5)
    timeout = datetime.timedelta(seconds=5)
    assert torchrun_calls == [("set_device", gpu), ("init", ("nccl",), {"timeout": timeout, "device_id": gpu})]


def test_without_torchrun_no_group_starts(torchrun_calls, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE")
    assert init_distributed(torch.device("cpu"), timeout_seconds=5) == (0, 1)
    assert torchrun_calls == []


def test_a_gloo_rank_sets_no_gpu(torchrun_calls):
    init_distributed(torch.device("cpu"), timeout_seconds=5)
    assert torchrun_calls == [("init", ("gloo",), {"timeout": datetime.timedelta(seconds=5)})]


def test_an_nccl_rank_without_its_gpu_index_is_refused(torchrun_calls):
    with pytest.raises(ValueError, match=r"device='cuda'.*torch.device\('cuda', LOCAL_RANK\)"):
        init_distributed(torch.device("cuda"))
    assert torchrun_calls == []


class CollectiveCalled(Exception):
    """Raised by a spied collective: which one, and its tensors' devices."""

    def __init__(self, name: str, devices: list[torch.device]) -> None:
        super().__init__(name)
        self.name, self.devices = name, devices


def _spy(name: str):
    def collective(*tensors, **_):
        flat = [t for arg in tensors for t in (arg if isinstance(arg, list) else [arg]) if isinstance(t, torch.Tensor)]
        raise CollectiveCalled(name, [t.device for t in flat])

    return collective


@pytest.fixture
def nccl_world(monkeypatch):
    """Rank ``RANK_GPU`` of two on nccl, as torch reports it, inside ``FakeTensorMode``."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: RANK_GPU)
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor"):
        monkeypatch.setattr(dist, name, _spy(name))
    with FakeTensorMode():
        yield torch.device("cuda", RANK_GPU)


def _collective_of(call) -> CollectiveCalled:
    with pytest.raises(CollectiveCalled) as called:
        call()
    return called.value


def test_the_trainers_loss_mean_is_reduced_on_the_ranks_gpu(nccl_world):
    called = _collective_of(lambda: mean_over_ranks(2.5))
    assert called.name == "all_reduce"
    assert called.devices == [nccl_world] == [collective_device()]


def test_an_amax_held_on_the_cpu_is_reduced_on_the_ranks_gpu(nccl_world):
    called = _collective_of(lambda: all_reduce_max([torch.zeros(3), torch.zeros(2, 2)], None))
    assert called.devices == [nccl_world]


def test_the_optimizer_states_row_counts_are_gathered_on_the_ranks_gpu(nccl_world):
    local = torch.zeros(4, 8, device=nccl_world)
    called = _collective_of(lambda: _gather_rows(local, None))
    assert called.name == "all_gather"
    assert called.devices == [nccl_world] * 3  # the two outputs and the count


def test_fsdp2_shards_on_the_training_devices_type_not_torchs_accelerator(one_rank_group, monkeypatch):
    """On a CUDA machine training on the CPU (gloo), FSDP2's default mesh would be CUDA's."""
    import torch.distributed.fsdp

    meshes = []
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.distributed.fsdp, "fully_shard", lambda module, mesh=None: meshes.append(mesh))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    wrap_model(model, "fsdp2", torch.device("cpu"))
    assert len(meshes) == 3
    assert all(mesh is not None and mesh.device_type == "cpu" and mesh.size() == 1 for mesh in meshes)
