"""bf16 GEMMs as float32 GEMMs of their bf16 operands, rounded once
(:mod:`fp8train.quant.gemm.bf16`): the decision both ways on any machine, and the numbers.

What is pinned bit for bit: where float32 accumulation is exact in any order (integer-valued
operands whose sums fit float32's 24 bits), the route equals torch's own bf16 GEMM exactly,
forward and backward, with bias. With random operands the two differ only by float32
accumulation order (measured here, AVX512-BF16: 0 to 34 elements of 512x384 per GEMM for
K = 16..1024, 1 ulp in most), so both are held to float64 with the bound of one bf16 rounding
plus float32 accumulation.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fp8train.quant.gemm.bf16 as bf16_gemm
from fp8train.quant.gemm.bf16 import (
    Bf16MatmulsViaFloat32, bf16_matmul_line, bf16_matmuls_via_float32, bf16_via_float32, cpu_has_native_bf16,
    matmul_bf16_via_float32, matmul_via_float32_active,
)

BF16_UNIT_ROUNDOFF = 2.0**-8
FLOAT32_UNIT_ROUNDOFF = 2.0**-24
native_only = pytest.mark.skipif(not bf16_gemm.NATIVE_BF16_GEMM, reason="needs a CPU with native bf16 to compare with")


def _integers(*shape, generator, high=8) -> torch.Tensor:
    """bf16 integers in [-high, high]: their products and sums stay exact in float32."""
    return torch.randint(-high, high + 1, shape, generator=generator).to(torch.bfloat16)


@pytest.mark.parametrize(("device_type", "native", "expected"), [
    ("cpu", False, True), ("cpu", True, False), ("cuda", False, False), ("cuda", True, False),
])
def test_the_route_is_taken_on_a_cpu_without_native_bf16_only(device_type, native, expected):
    assert bf16_via_float32(device_type, native) is expected


def test_the_probe_is_onednns(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert cpu_has_native_bf16() is False
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert cpu_has_native_bf16() is True


def test_the_line_says_what_ran_and_why():
    assert bf16_matmul_line(True).startswith("this CPU has no native bf16: bf16 matmuls ran as float32 matmuls")
    assert "same numerics" in bf16_matmul_line(True)
    assert "natively" in bf16_matmul_line(False)


def test_the_context_is_the_mode_only_where_enabled():
    with bf16_matmuls_via_float32(False):
        assert not matmul_via_float32_active()
    with bf16_matmuls_via_float32(True) as mode:
        assert isinstance(mode, Bf16MatmulsViaFloat32) and matmul_via_float32_active()
    assert not matmul_via_float32_active()


@native_only
@pytest.mark.parametrize("k", [16, 256, 1024])
def test_exact_sums_equal_torchs_native_bf16_gemm_bit_for_bit(k):
    g = torch.Generator().manual_seed(k)
    x, w, b = _integers(64, k, generator=g), _integers(48, k, generator=g), _integers(48, generator=g)
    a3, c3 = _integers(4, 32, k, generator=g), _integers(4, k, 40, generator=g)

    def products():
        return (F.linear(x, w, b), F.linear(x, w), x @ w.t(), torch.mm(x, w.t()), torch.bmm(a3, c3), a3 @ c3[0],
                torch.addmm(b, x, w.t()), b.addmm(x, w.t(), beta=0.5, alpha=2))

    with bf16_matmuls_via_float32(True):
        routed = products()
    native = products()
    for got, want in zip(routed, native):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want)


@native_only
def test_the_backward_under_autocast_equals_the_native_one_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(128, 64)
    with torch.no_grad():
        layer.weight.copy_(_integers(64, 128, generator=g, high=4))
        layer.bias.copy_(_integers(64, generator=g, high=4))
    x = _integers(32, 128, generator=g, high=4).float()
    upstream = _integers(32, 64, generator=g, high=2)

    def run(enabled):
        layer.zero_grad()
        inputs = x.clone().requires_grad_()
        with bf16_matmuls_via_float32(enabled), torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(inputs)
        out.backward(upstream)
        return out, inputs.grad, layer.weight.grad, layer.bias.grad

    for got, want in zip(run(True), run(False)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def _bound(a: torch.Tensor, b: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """One bf16 rounding of the float32 sum plus float32 accumulation over K, elementwise."""
    k = a.shape[-1]
    magnitude = a.double().abs() @ b.double().abs()
    return BF16_UNIT_ROUNDOFF * reference.abs() + 2 * k * FLOAT32_UNIT_ROUNDOFF * magnitude


@pytest.mark.parametrize("k", [16, 256, 1024])
def test_random_operands_stay_within_one_bf16_rounding_of_float64(k):
    g = torch.Generator().manual_seed(k)
    a = torch.randn(96, k, generator=g).to(torch.bfloat16)
    b = torch.randn(k, 80, generator=g).to(torch.bfloat16)
    reference = a.double() @ b.double()
    results = [matmul_bf16_via_float32(a, b)]
    if bf16_gemm.NATIVE_BF16_GEMM:
        results.append(a @ b)
    for got in results:
        assert got.dtype == torch.bfloat16
        assert ((got.double() - reference).abs() <= _bound(a, b, reference)).all()


class _GemmDtypes(TorchDispatchMode):
    """The operand dtypes of every aten GEMM run inside it."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.seen.update(a.dtype for a in args if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16_tensors", "bf16_autocast"])
def test_every_matmul_form_runs_as_a_float32_gemm_forward_and_backward(autocast):
    g = torch.Generator().manual_seed(0)
    dtype = torch.float32 if autocast else torch.bfloat16
    x, w, b = (torch.randn(*shape, generator=g, dtype=dtype, requires_grad=True) for shape in ((8, 16), (4, 16), (4,)))
    a3 = torch.randn(2, 8, 16, generator=g, dtype=dtype)
    with _GemmDtypes() as gemms:
        with bf16_matmuls_via_float32(True), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outs = (F.linear(x, w, b), x @ w.t(), x.matmul(w.t()), torch.mm(x, w.t()), x.mm(w.t()),
                    torch.bmm(a3, a3.transpose(1, 2)), a3.bmm(a3.transpose(1, 2)), torch.addmm(b, x, w.t()),
                    b.addmm(x, w.t()))
        sum(out.float().sum() for out in outs).backward()
    assert all(out.dtype == torch.bfloat16 for out in outs)
    assert gemms.seen == {torch.float32}


def test_operands_passed_by_keyword_go_to_torch_as_they_came():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 16, generator=g).bfloat16(), torch.randn(4, 16, generator=g).bfloat16()
    with bf16_matmuls_via_float32(True):
        by_keyword = F.linear(input=x, weight=w)
    assert torch.equal(by_keyword, F.linear(x, w))


def test_the_mode_leaves_float32_and_other_calls_alone():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g)
    with bf16_matmuls_via_float32(True):
        assert torch.equal(a @ b, torch.matmul(a, b))
        out = torch.empty(8, 4, dtype=torch.bfloat16)
        torch.mm(a.bfloat16(), b.bfloat16(), out=out)  # out= goes to torch as it came
        assert torch.equal(torch.relu(a), a.clamp_min(0))
    assert torch.equal(out, a.bfloat16() @ b.bfloat16())
    with bf16_matmuls_via_float32(True), torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a.double() @ b.double()).dtype == torch.float64  # autocast leaves float64 alone, so does the route


def test_tensor_subclasses_keep_their_own_matmul():
    seen = []

    class Traced(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    a = torch.randn(4, 8).bfloat16().as_subclass(Traced)
    with bf16_matmuls_via_float32(True):
        a @ torch.randn(8, 2).bfloat16()
    assert seen[0] in (torch.Tensor.__matmul__, torch.Tensor.matmul)  # as it came, not upcast first


def test_autocast_inputs_keep_their_float32_gradients():
    weight = torch.nn.Parameter(torch.randn(4, 16))
    x = torch.randn(8, 16, requires_grad=True)
    with bf16_matmuls_via_float32(True), torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.linear(x, weight)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == weight.grad.dtype == torch.float32
