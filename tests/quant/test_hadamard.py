"""The random Hadamard transform of NVFP4 (NUMERICS.md 6): the matrix, its signs, the
float32 sum in index order, and a GEMM of two transformed operands."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fp8train
from fp8train.quant.hadamard import RHT_SIGNS, hadamard_matrix, random_hadamard_transform

# From NUMERICS.md 6 (Transformer Engine's sign vector), typed in again, not imported.
SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _h_float64() -> np.ndarray:
    return np.diag(SIGNS) @ _sylvester(16) / 4


def test_matrix_is_diag_s_h16_over_4_and_orthonormal():
    assert list(RHT_SIGNS) == SIGNS
    h = hadamard_matrix(torch.float64).numpy()
    np.testing.assert_array_equal(h, _h_float64())
    np.testing.assert_array_equal(h @ h.T, np.eye(16))


@pytest.mark.parametrize("axis", [-1, 0])
def test_equals_the_float64_matmul_where_that_is_exact(axis):
    # integers times 1/4, sums below 2^24: every float32 step is exact, so any order agrees
    x = torch.randint(-1000, 1000, (32, 64), generator=torch.Generator().manual_seed(0)).float()
    y = random_hadamard_transform(x, axis).numpy()
    runs = x.numpy().astype(np.float64) if axis == -1 else x.numpy().T.astype(np.float64)
    expected = (runs.reshape(runs.shape[0], -1, 16) @ _h_float64()).reshape(runs.shape)
    np.testing.assert_array_equal(y, expected if axis == -1 else expected.T)


def test_float32_sum_in_index_order_then_one_rounding():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)) * torch.logspace(-8, 8, 16)
    h = _h_float64().astype(np.float32)
    acc = x.numpy()[:, 0:1] * h[0]
    for i in range(1, 16):
        acc = (acc + x.numpy()[:, i : i + 1] * h[i]).astype(np.float32)
    np.testing.assert_array_equal(random_hadamard_transform(x, -1).numpy(), acc)
    xb = x.to(torch.bfloat16)
    accb = xb.float().numpy()[:, 0:1] * h[0]
    for i in range(1, 16):
        accb = (accb + xb.float().numpy()[:, i : i + 1] * h[i]).astype(np.float32)
    yb = random_hadamard_transform(xb, -1)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, torch.from_numpy(accb).to(torch.bfloat16))


def test_gemm_of_two_transformed_operands_is_unchanged():
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(-8, 8, (16, 64), generator=gen).double()
    b = torch.randint(-8, 8, (32, 64), generator=gen).double()
    ta, tb = random_hadamard_transform(a, -1), random_hadamard_transform(b, -1)
    assert torch.equal(ta @ tb.t(), a @ b.t())
    assert not torch.equal(ta, a)


def test_quantize_with_rht_quantizes_the_transform():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    for axis in (-1, 0):
        with_rht = fp8train.quant.quantize(x, "nvfp4", axis=axis, rht=True)
        plain = fp8train.quant.quantize(random_hadamard_transform(x, axis), "nvfp4", axis=axis)
        assert torch.equal(with_rht.data.view(torch.uint8), plain.data.view(torch.uint8))
        assert torch.equal(with_rht.global_amax, plain.global_amax)
