"""Float8MultiheadAttention against nn.MultiheadAttention: the same semantics (masks, layouts,
weights, bias_kv, zero attention, dropout, kdim/vdim) with the projections in high
precision, FP8 projections close by SQNR with every recipe, parameters shared, reversal."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8train
from tests.helpers.tolerances import min_sqnr_db
from fp8train.nn.modules.attention import Float8MultiheadAttention
from fp8train.nn.config import Float8ModuleConfig
from fp8train.nn.modules.linear import Float8Linear
from fp8train.spec import recipes

MIN_SQNR_DB = 20  # FP8 projections: output and gradients against float32 nn.MultiheadAttention
EMBED_DIM, NUM_HEADS, TGT_LEN, SRC_LEN, BATCH = 32, 4, 5, 7, 3


def _sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return 10 * math.log10(expected.square().sum() / (actual - expected).square().sum())


def _high_precision_projections(attention: Float8MultiheadAttention) -> Float8MultiheadAttention:
    """The FP8 forward with every projection GEMM in float32: what is left is attention."""
    attention.run_linear = F.linear
    attention.out_proj.run_linear = F.linear
    return attention


def _inputs(kind, batch_first, batched, kdim=None, vdim=None, embed_dim=EMBED_DIM, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def shape(length, dim):
        if not batched:
            return (length, dim)
        return (BATCH, length, dim) if batch_first else (length, BATCH, dim)

    if kind == "self":
        query = key = value = torch.randn(shape(SRC_LEN, embed_dim), generator=generator)
    elif kind == "key_is_value":
        query = torch.randn(shape(TGT_LEN, embed_dim), generator=generator)
        key = value = torch.randn(shape(SRC_LEN, embed_dim), generator=generator)
    else:
        query = torch.randn(shape(TGT_LEN, embed_dim), generator=generator)
        key = torch.randn(shape(SRC_LEN, kdim or embed_dim), generator=generator)
        value = torch.randn(shape(SRC_LEN, vdim or embed_dim), generator=generator)
    return query, key, value


def _masks(attn_kind, padding_kind, tgt_len, batched, num_heads=NUM_HEADS, seed=1):
    generator = torch.Generator().manual_seed(seed)
    attn_mask = None
    if attn_kind == "bool_2d":
        attn_mask = torch.triu(torch.ones(tgt_len, SRC_LEN, dtype=torch.bool), 1)
    elif attn_kind == "float_3d":
        attn_mask = torch.randn((BATCH if batched else 1) * num_heads, tgt_len, SRC_LEN, generator=generator)
    padding_mask = None
    if padding_kind is not None:
        padding_mask = torch.zeros((BATCH, SRC_LEN) if batched else (SRC_LEN,), dtype=torch.bool)
        padding_mask[..., -2:] = True
        if padding_kind == "float":
            padding_mask = padding_mask.float() * -1e4
    return attn_mask, padding_mask


# kind, kdim/vdim, bias, add_bias_kv, add_zero_attn: the layouts nn.MultiheadAttention has.
LAYOUTS = [
    ("self", None, True, False, False),
    ("self", None, False, True, True),
    ("key_is_value", None, True, True, False),
    ("distinct", None, True, False, True),
    ("distinct", (16, 48), True, False, False),
    ("distinct", (16, 48), False, True, True),
]
# (attn_mask, key_padding_mask) kinds: each alone, both alike, both mixed.
MASKS = [("none", None), ("bool_2d", None), ("float_3d", None), ("none", "bool"), ("none", "float"),
         ("bool_2d", "bool"), ("float_3d", "float"), ("bool_2d", "float")]
CALLS = list(itertools.product([True, False], MASKS, [True, False]))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "-".join(map(str, l)))
def test_same_outputs_as_nn_multihead_attention_with_projections_in_high_precision(layout):
    """Bit-exact: every layout, batch_first or not, (un)batched, each mask, need_weights and
    average_attn_weights, is_causal."""
    kind, dims, bias, bias_kv, zero_attn = layout
    kdim, vdim = dims or (None, None)
    for batch_first in (False, True):
        torch.manual_seed(0)
        reference = nn.MultiheadAttention(
            EMBED_DIM, NUM_HEADS, bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn, kdim=kdim, vdim=vdim,
            batch_first=batch_first,
        )
        attention = _high_precision_projections(Float8MultiheadAttention.from_attention(reference))
        for batched, (attn_kind, padding_kind), need_weights in CALLS:
            _check_call(reference, attention, kind, batch_first, batched, kdim, vdim, attn_kind, padding_kind, need_weights)


def _check_call(reference, attention, kind, batch_first, batched, kdim, vdim, attn_kind, padding_kind, need_weights):
    query, key, value = _inputs(kind, batch_first, batched, kdim, vdim)
    tgt_len = SRC_LEN if kind == "self" else TGT_LEN
    attn_mask, padding_mask = _masks(attn_kind, padding_kind, tgt_len, batched)
    for average, is_causal in [(True, False), (False, attn_kind == "bool_2d")]:
        kwargs = dict(
            key_padding_mask=padding_mask, need_weights=need_weights, attn_mask=attn_mask,
            average_attn_weights=average, is_causal=is_causal,
        )
        with warnings.catch_warnings():  # mixing a bool and a float mask is deprecated there
            warnings.simplefilter("ignore")
            expected_output, expected_weights = reference(query, key, value, **kwargs)
        output, weights = attention(query, key, value, **kwargs)
        assert torch.equal(output, expected_output), (kind, batch_first, batched, attn_kind, padding_kind)
        assert (weights is None) == (expected_weights is None) == (not need_weights)
        if need_weights:
            assert torch.equal(weights, expected_weights)


@pytest.mark.parametrize("need_weights", [True, False])
def test_dropout_and_gradients_match_in_training(need_weights):
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(EMBED_DIM, NUM_HEADS, dropout=0.3, batch_first=True)
    attention = _high_precision_projections(Float8MultiheadAttention.from_attention(reference))
    assert attention.training
    query = torch.randn(BATCH, SRC_LEN, EMBED_DIM, requires_grad=True)
    grads = []
    for module in (reference, attention):
        torch.manual_seed(1)
        output, _ = module(query, query, query, need_weights=need_weights)
        query.grad = None
        module.zero_grad()
        output.square().sum().backward()
        grads.append([query.grad.clone(), reference.in_proj_weight.grad.clone(), reference.out_proj.weight.grad.clone()])
    for got, want in zip(*grads[::-1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_fp8_off_is_nn_multihead_attention_itself():
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(EMBED_DIM, NUM_HEADS, batch_first=True).eval()
    attention = Float8MultiheadAttention.from_attention(reference, "tensorwise")
    query = torch.randn(BATCH, SRC_LEN, EMBED_DIM)
    with torch.no_grad():  # the conditions of nn.MultiheadAttention's own fused fast path
        expected = reference(query, query, query)
        with fp8train.autocast(enabled=False):
            assert all(torch.equal(a, b) for a, b in zip(attention(query, query, query), expected))
        assert not torch.equal(attention(query, query, query)[0], expected[0])  # FP8: no fast path


@pytest.mark.parametrize("recipe_name", recipes.RECIPE_NAMES)
@pytest.mark.parametrize("kind", ["self", "key_is_value", "distinct"])
def test_fp8_projections_are_close_for_every_recipe(recipe_name, kind):
    embed_dim = 128  # blockwise's alignment
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(embed_dim, NUM_HEADS, batch_first=True)
    config = Float8ModuleConfig(recipe=recipe_name, backend="emulated")
    attention = Float8MultiheadAttention.from_attention(reference, config=config)
    query, key, value = (
        t.requires_grad_() for t in _inputs(kind, batch_first=True, batched=True, embed_dim=embed_dim)
    )
    attn_mask, padding_mask = _masks("bool_2d", "bool", SRC_LEN if kind == "self" else TGT_LEN, batched=True)

    def step(module):
        for t in (query, key, value):
            t.grad = None
        reference.zero_grad()
        output, weights = module(query, key, value, key_padding_mask=padding_mask, attn_mask=attn_mask)
        (output.square().sum() + weights.sum()).backward()
        return output, weights

    with fp8train.autocast():  # a first step alike: delayed scaling's scales come from it
        step(attention)
    grads = {}
    for name, module in (("reference", reference), ("fp8", attention)):
        output, weights = step(module)
        grads[name] = [output, weights, reference.in_proj_weight.grad.clone(), reference.out_proj.weight.grad.clone()]
        grads[name] += [t.grad.clone() for t in {id(t): t for t in (query, key, value)}.values()]
    for got, want in zip(grads["fp8"], grads["reference"]):
        assert not torch.equal(got, want)
        assert _sqnr_db(got.detach(), want.detach()) > min_sqnr_db(recipe_name, MIN_SQNR_DB)


@pytest.mark.parametrize(
    "kind, dims, gemm_shapes",
    [
        ("self", None, [(3 * EMBED_DIM, EMBED_DIM)]),  # one packed GEMM
        ("key_is_value", None, [(2 * EMBED_DIM, EMBED_DIM), (EMBED_DIM, EMBED_DIM)]),
        ("distinct", None, [(EMBED_DIM, EMBED_DIM)] * 3),
        ("distinct", (16, 48), [(EMBED_DIM, EMBED_DIM), (EMBED_DIM, 16), (EMBED_DIM, 48)]),
    ],
)
def test_every_in_projection_runs_in_fp8(kind, dims, gemm_shapes):
    """With out_proj in float32, the output differs from nn.MultiheadAttention's only through
    the in-projection, whose GEMMs each go through the FP8 path."""
    kdim, vdim = dims or (None, None)
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(EMBED_DIM, NUM_HEADS, kdim=kdim, vdim=vdim, batch_first=True)
    attention = Float8MultiheadAttention.from_attention(reference, "tensorwise")
    attention.out_proj.run_linear = F.linear
    shapes, run_linear = [], attention.run_linear
    attention.run_linear = lambda x, w, b: (shapes.append(tuple(w.shape)), run_linear(x, w, b))[1]
    query, key, value = _inputs(kind, batch_first=True, batched=True, kdim=kdim, vdim=vdim)
    output, weights = attention(query, key, value)
    expected, expected_weights = reference(query, key, value)
    assert sorted(shapes) == sorted(gemm_shapes)
    assert not torch.equal(weights, expected_weights) and _sqnr_db(weights, expected_weights) > MIN_SQNR_DB
    assert not torch.equal(output, expected) and _sqnr_db(output, expected) > MIN_SQNR_DB


def test_separate_projection_weights_get_fp8_gradients():
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(EMBED_DIM, NUM_HEADS, kdim=16, vdim=48)
    attention = Float8MultiheadAttention.from_attention(reference, "rowwise")
    query, key, value = _inputs("distinct", batch_first=False, batched=True, kdim=16, vdim=48)
    expected, _ = reference(query, key, value)
    expected.square().sum().backward()
    expected_grads = [p.grad.clone() for p in reference.parameters()]
    reference.zero_grad()
    output, _ = attention(query, key, value)
    output.square().sum().backward()
    assert _sqnr_db(output.detach(), expected.detach()) > MIN_SQNR_DB
    for p, want in zip(reference.parameters(), expected_grads):
        assert p.grad.shape == p.shape and _sqnr_db(p.grad, want) > MIN_SQNR_DB


def test_same_parameters_state_dict_and_attributes():
    reference = nn.MultiheadAttention(EMBED_DIM, NUM_HEADS, add_bias_kv=True, kdim=16, vdim=48, batch_first=True)
    attention = Float8MultiheadAttention.from_attention(reference, "tensorwise")
    assert isinstance(attention, nn.MultiheadAttention) and type(attention.out_proj) is Float8Linear
    assert list(attention.state_dict()) == list(reference.state_dict())
    assert [(n, p) for n, p in attention.named_parameters()] == [(n, p) for n, p in reference.named_parameters()]
    for name in ("embed_dim", "num_heads", "head_dim", "kdim", "vdim", "batch_first", "dropout", "add_zero_attn"):
        assert getattr(attention, name) == getattr(reference, name)
    back = attention.to_attention()
    assert type(back) is nn.MultiheadAttention and type(back.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert [(n, p) for n, p in back.named_parameters()] == [(n, p) for n, p in reference.named_parameters()]


def test_delayed_scaling_state_for_in_and_out_projections():
    torch.manual_seed(0)
    attention = Float8MultiheadAttention.from_attention(nn.MultiheadAttention(EMBED_DIM, NUM_HEADS), "delayed")
    keys = set(attention.state_dict())
    assert {"fp8_scale", "fp8_amax_history", "out_proj.fp8_scale", "out_proj.fp8_amax_history"} <= keys
    query = torch.randn(SRC_LEN, BATCH, EMBED_DIM)
    with fp8train.autocast():
        output, _ = attention(query, query, query)
    output.sum().backward()
    # Input amax recorded by the in-projection; grad_output's by the backward.
    assert attention.fp8_amax_history[-1, 0] == query.abs().max()
    assert (attention.fp8_scale != 1).all() and (attention.out_proj.fp8_scale != 1).all()
    fresh = Float8MultiheadAttention(EMBED_DIM, NUM_HEADS, recipe="delayed")
    fresh.load_state_dict(attention.state_dict())
    assert torch.equal(fresh.fp8_scale, attention.fp8_scale)


def test_bfloat16_autocast_like_nn_multihead_attention():
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(64, NUM_HEADS, batch_first=True)
    attention = Float8MultiheadAttention.from_attention(reference, "mxfp8")
    query = torch.randn(BATCH, SRC_LEN, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, expected_weights = reference(query, query, query)
        output, weights = attention(query, query, query)
    assert (output.dtype, weights.dtype) == (expected.dtype, expected_weights.dtype)
    assert _sqnr_db(output.float(), expected.float()) > MIN_SQNR_DB


def test_constructor_builds_an_fp8_attention():
    config = Float8ModuleConfig(recipe="rowwise", backend="emulated")
    attention = Float8MultiheadAttention(EMBED_DIM, NUM_HEADS, batch_first=True, config=config)
    assert attention.recipe.name == "rowwise" and attention.out_proj.recipe.name == "rowwise"
    output, _ = attention(*_inputs("self", True, True))
    assert output.shape == (BATCH, SRC_LEN, EMBED_DIM)


def test_errors():
    attention = Float8MultiheadAttention(EMBED_DIM, NUM_HEADS)
    query = torch.randn(SRC_LEN, BATCH, EMBED_DIM)
    with pytest.raises(TypeError, match=r"attn_mask has dtype torch.int64: only bool and floating-point masks"):
        attention(query, query, query, attn_mask=torch.zeros(SRC_LEN, SRC_LEN, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attn_mask of shape \(4, 7\) must be \(7, 7\)"):
        attention(query, query, query, attn_mask=torch.zeros(4, SRC_LEN))
    with pytest.raises(ValueError, match=r"key_padding_mask of shape \(3, 4\) must be \(batch, source length\) = \(3, 7\)"):
        attention(query, query, query, key_padding_mask=torch.zeros(BATCH, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"query of shape \(7, 3, 16\) does not end in embed_dim=32"):
        attention(query[..., :16], query, query)
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
        attention(query, query, query, is_causal=True)
    nested = torch.nested.nested_tensor([torch.randn(2, EMBED_DIM), torch.randn(3, EMBED_DIM)])
    with pytest.raises(NotImplementedError, match="does not take nested tensors"):
        attention(nested, nested, nested)
    with pytest.raises(TypeError, match="attention must be an nn.MultiheadAttention"):
        Float8MultiheadAttention.from_attention(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="unknown FP8 recipe 'fp4'"):
        Float8MultiheadAttention(EMBED_DIM, NUM_HEADS, recipe="fp4")
