"""The harness of tests/helpers/host_syncs.py catches each kind of event a GPU synchronizes or
copies from the host for, and nothing that runs on the device alone."""

import pytest
import torch

from .host_syncs import DEVICE_COPY, HOST_READ, PYTHON_DATA, HostSyncRecorder, assert_no_host_syncs

X = torch.arange(6, dtype=torch.float32)

CAUGHT = {
    "tensor_of_list": (lambda: torch.tensor([1.0, 2.0], device=X.device), PYTHON_DATA),
    "tensor_of_scalar": (lambda: torch.tensor(0.5), PYTHON_DATA),
    "as_tensor_of_scalar": (lambda: torch.as_tensor(3.0, device=X.device), PYTHON_DATA),
    "as_tensor_of_tuple": (lambda: torch.as_tensor((1, 2)), PYTHON_DATA),
    "new_tensor": (lambda: X.new_tensor([1.0]), PYTHON_DATA),
    "item": (lambda: X.sum().item(), HOST_READ),
    "float": (lambda: float(X[0]), HOST_READ),
    "int": (lambda: int(X[1]), HOST_READ),
    "bool": (lambda: bool(X[1] > 0), HOST_READ),
    "if_tensor": (lambda: 1 if X.amax() > 0 else 0, HOST_READ),
    "tolist": (lambda: X.tolist(), HOST_READ),
    "numpy": (lambda: X.numpy(), HOST_READ),
    "equal": (lambda: torch.equal(X, X), HOST_READ),
    "nonzero": (lambda: X.nonzero(), HOST_READ),
    "boolean_mask": (lambda: X[X > 2], HOST_READ),
    "boolean_mask_assignment": (lambda: X.clone().index_put_((X > 2,), torch.zeros(())), HOST_READ),
    "unique": (lambda: X.unique(), HOST_READ),
    "repeat_interleave": (lambda: torch.repeat_interleave(X.long()), HOST_READ),
    "cpu": (lambda: X.cpu(), DEVICE_COPY),
    "to_cpu_string": (lambda: X.to("cpu"), DEVICE_COPY),
    "to_meta": (lambda: X.to("meta"), DEVICE_COPY),
    "copy_across_devices": (lambda: torch.empty(6, device="meta").copy_(X), DEVICE_COPY),
}

NOT_CAUGHT = {
    "python_scalar_operand": lambda: X * 0.5 + 1,
    "full_like": lambda: torch.full_like(X, 448.0),
    "factories": lambda: (torch.zeros(3), torch.ones(2), torch.arange(4), torch.full((2,), 2.0)),
    "where_with_scalars": lambda: torch.where(X > 1, X, 0.0),
    "as_tensor_of_a_tensor": lambda: torch.as_tensor(X, dtype=torch.float32, device=X.device),
    "to_own_device": lambda: X.to(X.device),
    "to_dtype": lambda: X.to(torch.bfloat16),
    "repeat_interleave_sized": lambda: torch.repeat_interleave(X.long(), output_size=15),
    "reductions": lambda: (X.amax(), X.abs().max(), torch.maximum(X, X)),
}


@pytest.mark.parametrize("name", CAUGHT)
def test_records_each_kind(name):
    call, kind = CAUGHT[name]
    with HostSyncRecorder() as recorder:
        call()
    assert [event.kind for event in recorder.events][:1] == [kind], recorder.events
    assert "test_host_syncs.py" in recorder.events[0].where


@pytest.mark.parametrize("name", NOT_CAUGHT)
def test_device_only_work_records_nothing(name):
    assert_no_host_syncs(NOT_CAUGHT[name])


def test_records_in_autograd_functions_backward():
    class Builds(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * torch.tensor(2.0)

    x = X.clone().requires_grad_()
    with HostSyncRecorder() as recorder:
        Builds.apply(x).sum().backward()
    assert [event.kind for event in recorder.events] == [PYTHON_DATA]


def test_assert_no_host_syncs_lists_the_events():
    with pytest.raises(AssertionError, match=r"(?s)1 host syncs.*tensor from Python data"):
        assert_no_host_syncs(lambda: torch.tensor([1.0]))


def test_cpu_only_branches_are_kept_apart():
    from fp8train.quant.cast import DIRECT_ELEMENTS, fp8_to_hp

    # More codes than PyTorch's own conversion takes (quant/cast.py DIRECT_ELEMENTS): the bits' path.
    data = torch.ones(DIRECT_ELEMENTS + 8).to(torch.float8_e4m3fn)
    with HostSyncRecorder() as recorder:
        fp8_to_hp(data, torch.float32)
    # One read: does any code need the NaN/inf fix-up (magnitude bits of both signs at once).
    assert not recorder.events and [event.kind for event in recorder.cpu_only] == [HOST_READ]
