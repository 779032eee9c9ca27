"""The granularity registry: every fact each granularity knows, against hand tables."""

import pytest

from fp8train.spec.granularities import FP4_GRANULARITIES, FP8_GRANULARITIES, GRANULARITIES, GemmFamily, Granularity, round_up

G = Granularity

# granularity: (group shape axis=-1, group shape axis=0) of a 256 x 512 view
GROUP_SHAPES = {
    G.TENSOR: ((256, 512), (256, 512)),
    G.ROW: ((1, 512), (256, 1)),
    G.BLOCK_1X128: ((1, 128), (128, 1)),
    G.BLOCK_128X128: ((128, 128), (128, 128)),
    G.MX: ((1, 32), (32, 1)),
    G.NVFP4: ((1, 16), (16, 1)),
    G.NVFP4_2D: ((16, 16), (16, 16)),
    G.MXFP4: ((1, 32), (32, 1)),
}
# granularity: (alignment, block, family, scale dtype, symmetric, k_uniform, per_tensor, min_rank)
FACTS = {
    G.TENSOR: (16, 0, GemmFamily.TENSORWISE_ROWWISE, "float32", True, True, True, 0),
    G.ROW: (16, 0, GemmFamily.TENSORWISE_ROWWISE, "float32", False, True, False, 1),
    G.BLOCK_1X128: (128, 128, GemmFamily.BLOCKWISE, "float32", False, False, False, 2),
    G.BLOCK_128X128: (128, 128, GemmFamily.BLOCKWISE, "float32", True, False, False, 2),
    G.MX: (32, 32, GemmFamily.MXFP8, "float8_e8m0fnu", False, False, False, 2),
    G.NVFP4: (32, 16, GemmFamily.NVFP4, "float8_e4m3fn", False, False, False, 2),
    G.NVFP4_2D: (32, 16, GemmFamily.NVFP4, "float8_e4m3fn", True, False, False, 2),
    G.MXFP4: (32, 32, GemmFamily.MXFP4, "float8_e8m0fnu", False, False, False, 2),
}
# granularity: (data bits, two-level scales) of the 4-bit ones; every other is (8, False)
FP4_FACTS = {G.NVFP4: (4, True), G.NVFP4_2D: (4, True), G.MXFP4: (4, False)}
# rows of the view one group spans, axis=-1 and axis=0 (None: all rows)
ROWS_PER_GROUP = {
    G.TENSOR: (None, None),
    G.ROW: (1, None),
    G.BLOCK_1X128: (1, 128),
    G.BLOCK_128X128: (128, 128),
    G.MX: (1, 32),
    G.NVFP4: (1, 16),
    G.NVFP4_2D: (16, 16),
    G.MXFP4: (1, 32),
}


def test_registry_names_and_string_equality():
    assert GRANULARITIES == ("tensor", "row", "block1x128", "block128x128", "mx", "nvfp4", "nvfp4_2d", "mxfp4")
    assert FP8_GRANULARITIES == GRANULARITIES[:5] and FP4_GRANULARITIES == GRANULARITIES[5:]
    for name in GRANULARITIES:
        g = Granularity(name)
        assert g == name and str(g) == name and f"{g}" == name and hash(g) == hash(name)
        assert Granularity.coerce(name) is g


def test_unknown_granularity_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"granularity='block64' is not one of tensor, row, block1x128, block128x128, mx, nvfp4, nvfp4_2d, mxfp4"):
        Granularity.coerce("block64")


@pytest.mark.parametrize("granularity", list(Granularity))
def test_group_shapes(granularity):
    last, first = GROUP_SHAPES[granularity]
    assert granularity.group_shape(-1, (256, 512)) == last
    assert granularity.group_shape(0, (256, 512)) == first


@pytest.mark.parametrize("granularity", list(Granularity))
def test_facts(granularity):
    alignment, block, family, scale_dtype, symmetric, k_uniform, per_tensor, min_rank = FACTS[granularity]
    assert granularity.alignment == alignment
    assert granularity.block == block
    assert granularity.family is family
    assert granularity.scale_dtype_name == scale_dtype
    assert granularity.symmetric is symmetric
    assert granularity.k_uniform is k_uniform
    assert granularity.per_tensor is per_tensor
    assert granularity.min_rank == min_rank
    assert granularity.always_power_2 is (granularity in (G.MX, G.MXFP4))
    assert granularity.default_power_2_scales is (granularity not in (G.TENSOR, G.NVFP4, G.NVFP4_2D))
    assert (granularity.data_bits, granularity.two_level_scales) == FP4_FACTS.get(granularity, (8, False))
    assert granularity.fp4 is (granularity.data_bits == 4)
    assert (granularity.rows_per_group(-1), granularity.rows_per_group(0)) == ROWS_PER_GROUP[granularity]


@pytest.mark.parametrize(
    "family, capability, supported",
    [
        (GemmFamily.TENSORWISE_ROWWISE, (8, 6), False),
        (GemmFamily.TENSORWISE_ROWWISE, (8, 9), True),
        (GemmFamily.TENSORWISE_ROWWISE, (9, 0), True),
        (GemmFamily.TENSORWISE_ROWWISE, (12, 0), True),
        (GemmFamily.BLOCKWISE, (8, 9), False),
        (GemmFamily.BLOCKWISE, (9, 0), True),
        (GemmFamily.BLOCKWISE, (10, 0), False),
        (GemmFamily.MXFP8, (9, 0), False),
        (GemmFamily.MXFP8, (10, 0), True),
        (GemmFamily.MXFP8, (10, 3), True),
        (GemmFamily.MXFP8, (12, 0), False),
        (GemmFamily.NVFP4, (9, 0), False),
        (GemmFamily.NVFP4, (10, 0), True),
        (GemmFamily.NVFP4, (12, 0), False),
        (GemmFamily.MXFP4, (10, 3), True),
        (GemmFamily.MXFP4, (12, 0), False),
    ],
)
def test_gemm_family_capabilities(family, capability, supported):
    assert family.supports(capability) is supported


@pytest.mark.parametrize(
    "family, min_cuda",
    [
        (GemmFamily.TENSORWISE_ROWWISE, None),
        (GemmFamily.BLOCKWISE, (12, 9)),  # cuBLAS's VEC128_32F / BLK128x128_32F scales
        (GemmFamily.MXFP8, (12, 8)),
        (GemmFamily.NVFP4, (12, 8)),
        (GemmFamily.MXFP4, (12, 8)),
    ],
)
def test_gemm_family_min_cuda(family, min_cuda):
    assert family.min_cuda == min_cuda
    if min_cuda is not None:
        assert f"CUDA >= {min_cuda[0]}.{min_cuda[1]}" in family.needs


def test_gemm_family_of_operands():
    assert GemmFamily.of(G.TENSOR, G.ROW) is GemmFamily.TENSORWISE_ROWWISE
    assert GemmFamily.of(G.BLOCK_1X128, G.BLOCK_128X128) is GemmFamily.BLOCKWISE
    assert GemmFamily.of(G.MX, G.MX) is GemmFamily.MXFP8
    with pytest.raises(NotImplementedError, match="no FP8 GEMM mixes 'mx' with 'row'"):
        GemmFamily.of(G.MX, G.ROW)


@pytest.mark.parametrize("value, multiple, expected", [(0, 4, 0), (1, 4, 4), (4, 4, 4), (5, 128, 128), (129, 128, 256)])
def test_round_up(value, multiple, expected):
    assert round_up(value, multiple) == expected
