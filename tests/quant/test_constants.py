"""quant/constants.py: a constant is built once per key and shared; a trace's tensors are
never kept."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fp8train.quant.constants import ConstantCache, device_constant


def _counting_cache():
    calls = []

    def build(value, device):
        calls.append((value, device))
        return torch.full((2,), value, device=device)

    return ConstantCache(build), calls


def test_built_once_per_key_and_shared():
    cache, calls = _counting_cache()
    first = cache(1.5, torch.device("cpu"))
    assert cache(1.5, torch.device("cpu")) is first
    assert cache(2.0, torch.device("cpu")) is not first
    assert len(calls) == 2


def test_negative_zero_is_its_own_key():
    assert torch.signbit(device_constant(-0.0, torch.float32, None))
    assert not torch.signbit(device_constant(0.0, torch.float32, None))


def test_device_constant_is_torch_tensor_of_its_values():
    values = (0.0, 0.5, 6.0)
    table = device_constant(values, torch.float32, torch.device("cpu"))
    assert torch.equal(table, torch.tensor(values, dtype=torch.float32)) and not table.requires_grad


def test_built_in_inference_mode_is_a_plain_tensor():
    cache, _ = _counting_cache()
    with torch.inference_mode():
        cache(3.0, torch.device("cpu"))
    assert not cache(3.0, torch.device("cpu")).is_inference()


def test_a_fake_tensor_of_a_trace_is_not_kept():
    cache, calls = _counting_cache()
    with FakeTensorMode():
        cache(4.0, torch.device("cpu"))
    assert type(cache(4.0, torch.device("cpu"))) is torch.Tensor and len(calls) == 2


def test_compiled_code_builds_its_constant_in_the_graph():
    cache, calls = _counting_cache()

    @torch.compile(backend="eager", fullgraph=True)
    def scaled(x):
        return x * cache(5.0, x.device)

    assert torch.equal(scaled(torch.ones(2)), torch.full((2,), 5.0))
    assert cache._tensors == {}
