"""A layer's GEMMs over its real tokens (issue 38): the tokens are padded to the recipe's
alignment (blockwise 128, MX and 4-bit 32) for the blocks that run along them, but the
emulated GEMMs multiply only the rows (forward, grad_input) and the K columns (grad_weight)
that hold tokens, rounded up to 16. Padding adds exact zeros: the output and grad_input are
the padded GEMMs' bit for bit (their rows are independent), the grad_weight GEMM's sum over
the tokens is the same sum, equal up to float32 accumulation order (NUMERICS.md 4; BLAS
blocks a longer K otherwise). 16 tokens padded to 128 no longer cost 128 rows of arithmetic
on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fp8train
from fp8train.nn.function import Float8LinearFunction
from fp8train.quant import quantize
from fp8train.quant.gemm.emulated import emulated_mm

IN_FEATURES, OUT_FEATURES = 256, 128
BLOCK_RECIPES = ["blockwise", "mxfp8", "nvfp4", "mxfp4"]


def _layer(recipe: str, dtype: torch.dtype) -> fp8train.Float8Linear:
    torch.manual_seed(0)
    return fp8train.Float8Linear(IN_FEATURES, OUT_FEATURES, recipe=recipe).to(dtype)


def _step(layer, x: torch.Tensor, grad_output: torch.Tensor, padded_by_caller: bool) -> dict:
    """One forward+backward; ``padded_by_caller``: the tokens padded before the autograd
    function (no zero-padding left for it to skip), its output sliced after, as before."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(1)  # nvfp4's stochastic rounding: the same draws for both
    if padded_by_caller:
        plan = layer.fp8_config.recipe.operand_plan
        padded = -(-x.shape[0] // plan.alignment) * plan.alignment
        call, delayed = layer._begin_call(layer.fp8_config.recipe, None)
        x_padded = torch.nn.functional.pad(x, (0, 0, 0, padded - x.shape[0]))
        output = Float8LinearFunction.apply(x_padded, layer.weight, layer.bias, call, delayed)[: x.shape[0]]
    else:
        output = layer(x)
    output.backward(grad_output)
    return {"output": output, "grad_input": x.grad, "grad_weight": layer.weight.grad, "grad_bias": layer.bias.grad}


# One token (a GEMV for BLAS, were it not rounded up to 16), 40 in one padded block, 130 past it.
CASES = [(recipe, tokens, torch.float32) for recipe in BLOCK_RECIPES for tokens in (1, 40)] + [
    ("blockwise", 130, torch.float32),
    ("mxfp8", 130, torch.bfloat16),
    ("nvfp4", 40, torch.bfloat16),
]


@pytest.mark.parametrize("recipe, tokens, dtype", CASES, ids=str)
def test_gemms_over_the_real_tokens_give_the_padded_gemms_bits(recipe, tokens, dtype):
    layer = _layer(recipe, dtype)
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, IN_FEATURES, generator=generator).to(dtype)
    grad_output = torch.randn(tokens, OUT_FEATURES, generator=generator).to(dtype)
    got = _step(layer, x, grad_output, padded_by_caller=False)
    expected = _step(layer, x, grad_output, padded_by_caller=True)
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape, name
        if name == "grad_weight":  # one ulp of the largest, for the float32 order
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(got[name], tensor, rtol=eps, atol=eps * tensor.abs().max().item())
        else:
            assert torch.equal(got[name], tensor), name


class _MmShapes(TorchDispatchMode):
    """The operand shapes of every ``aten.mm`` dispatched in the block."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default or func is torch.ops.aten.mm.out:
            self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_sixteen_tokens_are_multiplied_as_sixteen_rows_not_the_padded_block(recipe):
    layer = _layer(recipe, torch.float32)
    x = torch.randn(16, IN_FEATURES, requires_grad=True)
    with _MmShapes() as mode:
        layer(x).backward(torch.randn(16, OUT_FEATURES))
    assert len(mode.shapes) == 3, mode.shapes
    token_dims = {mode.shapes[0][0][0], mode.shapes[1][0][0], mode.shapes[2][0][1]}  # M, M, K
    assert token_dims == {16}, mode.shapes


def _block_operands(granularity: str, rows: int, depth: int, **options):
    """``a[128, 256]`` holding data in its first ``rows`` rows and ``depth`` columns, and
    ``b[128, 256]`` in its first ``depth`` columns, quantized by ``granularity``."""
    generator = torch.Generator().manual_seed(0)
    a = torch.zeros(128, 256)
    a[:rows, :depth] = torch.randn(rows, depth, generator=generator)
    b = torch.zeros(128, 256)
    b[:, :depth] = torch.randn(128, depth, generator=generator)
    return quantize(a, granularity, **options), quantize(b, granularity, **options)


@pytest.mark.parametrize(
    "granularity, options",
    [
        ("block1x128", {}),  # folded, float32 GEMM
        ("block1x128", {"power_2_scales": False}),  # the literal per-chunk loop
        ("row", {"power_2_scales": False}),  # a per-row scale left for the output
        ("tensor", {}),
        ("mx", {}),
        ("nvfp4", {}),  # alpha
        ("mxfp4", {}),
    ],
)
# float32 without a bias; bfloat16 with one (MX's bfloat16 GEMM appends the bias column)
@pytest.mark.parametrize("out_dtype, with_bias", [(torch.float32, False), (torch.bfloat16, True)], ids=str)
def test_emulated_mm_over_an_extent_equals_the_whole_products_rows(granularity, options, out_dtype, with_bias):
    a, b = _block_operands(granularity, rows=32, depth=160, **options)
    bias = torch.randn(128) if with_bias else None
    whole = emulated_mm(a, b, out_dtype, bias)
    a, b = _block_operands(granularity, rows=32, depth=160, **options)  # fresh caches
    assert torch.equal(emulated_mm(a, b, out_dtype, bias, rows=32), whole[:32])
    a, b = _block_operands(granularity, rows=32, depth=160, **options)
    got = emulated_mm(a, b, out_dtype, bias, rows=32, depth=160)
    assert got.shape == (32, 128)
    eps = torch.finfo(out_dtype).eps  # the same sum, up to float32 order (and one rounding)
    torch.testing.assert_close(got, whole[:32], rtol=eps, atol=eps * whole.abs().max().item())
