"""Granularities: how a tensor is cut into scaling groups, one registry for all of them.

Every granularity is one rule over the 2-D view ``(M, K)`` of a tensor (leading dims
flattened): a grid of groups of ``rows x cols`` values, each with its own scale. A group
runs ``along`` values in the direction of the quantization ``axis`` and ``across`` values
in the other direction (``None``: the whole dim):

=================  =====  ======  ===========================  ============================
granularity        along  across  group, ``axis=-1``            group, ``axis=0``
=================  =====  ======  ===========================  ============================
``tensor``         all    all     ``M x K``                    ``M x K``
``row``            all    1       ``1 x K``  -> scale ``(M,1)``  ``M x 1`` -> scale ``(1,K)``
``block1x128``     128    1       ``1 x 128`` -> ``(M,K/128)``   ``128 x 1`` -> ``(M/128,K)``
``block128x128``   128    128     ``128 x 128`` -> ``(M/128,K/128)`` (both axes)
``mx``             32     1       ``1 x 32`` -> ``(M,K/32)``     ``32 x 1`` -> ``(M/32,K)``
``nvfp4``          16     1       ``1 x 16`` -> ``(M,K/16)``     ``16 x 1`` -> ``(M/16,K)``
``nvfp4_2d``       16     16      ``16 x 16`` -> ``(M/16,K/16)`` (both axes)
``mxfp4``          32     1       ``1 x 32`` -> ``(M,K/32)``     ``32 x 1`` -> ``(M/32,K)``
=================  =====  ======  ===========================  ============================

The last three take 4-bit E2M1 data (``data_bits == 4``), packed two values a byte along
the scaling axis; the others take FP8 data.

Adding a granularity is one member of :class:`Granularity` (and, if no existing family
takes it, one :class:`GemmFamily`); code elsewhere asks these objects, never the names.
"""

from __future__ import annotations

import enum
import math

from .checks import check_int

__all__ = [
    "GemmFamily",
    "Granularity",
    "GRANULARITIES",
    "FP8_GRANULARITIES",
    "FP4_GRANULARITIES",
    "check_gemm_operands",
    "normalize_axis",
    "round_up",
    "view_2d_shape",
]


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= value`` (plain arithmetic: an
    integer tensor of values rounds elementwise)."""
    return -(-value // multiple) * multiple


class GemmFamily(enum.Enum):
    """A family of hardware FP8 GEMMs (``torch._scaled_mm`` scale modes), the CUDA compute
    capabilities that run it, as ``(lowest, highest)`` inclusive (``None`` open), and the
    lowest CUDA toolkit (the cuBLAS PyTorch was built with) that has its scale mode."""

    TENSORWISE_ROWWISE = ("tensorwise/rowwise", (8, 9), None, None, "SM 8.9+ (Ada, Hopper, Blackwell)")
    # cuBLAS's 1x128 and 128x128 block scales (VEC128_32F, BLK128x128_32F) came in 12.9.
    BLOCKWISE = ("blockwise", (9, 0), (9, 0), (12, 9), "SM 9.0 (Hopper) and CUDA >= 12.9")
    # cuBLAS's VEC32_UE8M0 / VEC16_UE4M3 block scales came in 12.8.
    MXFP8 = ("mxfp8", (10, 0), (10, 99), (12, 8), "SM 10.x (Blackwell) and CUDA >= 12.8")
    NVFP4 = ("nvfp4", (10, 0), (10, 99), (12, 8), "SM 10.x (Blackwell) and CUDA >= 12.8")
    MXFP4 = ("mxfp4", (10, 0), (10, 99), (12, 8), "SM 10.x (Blackwell) and CUDA >= 12.8")

    # Members compare by identity, so they hash by it (Enum's __hash__ is a Python call).
    __hash__ = object.__hash__

    @property
    def label(self) -> str:
        """Short name used in logs and errors."""
        return self.value[0]

    @property
    def needs(self) -> str:
        """The hardware (and CUDA toolkit) this family needs, in words."""
        return self.value[4]

    @property
    def min_cuda(self) -> tuple[int, int] | None:
        """The lowest CUDA toolkit version ``(major, minor)`` whose cuBLAS has this family's
        scale mode (``None``: every CUDA build PyTorch ships)."""
        return self.value[3]

    def supports(self, capability: tuple[int, int]) -> bool:
        """Whether a CUDA device of compute ``capability`` runs this family's GEMMs."""
        lowest, highest = self.value[1], self.value[2]
        return tuple(capability) >= lowest and (highest is None or tuple(capability) <= highest)

    @staticmethod
    def of(a: "Granularity", b: "Granularity") -> "GemmFamily":
        """The family of a GEMM whose operands have granularities ``a`` and ``b``.

        Raises:
            NotImplementedError: the two belong to different families.
        """
        if a.family is not b.family:
            raise NotImplementedError(
                f"no FP8 GEMM mixes {str(a)!r} with {str(b)!r}; quantize both operands "
                "with granularities of one recipe"
            )
        return a.family


class Granularity(enum.StrEnum):
    """A scaling granularity. Members are strings (``Granularity.MX == "mx"``), so the
    public API keeps taking names, and each knows its own facts.

    Attributes:
        along: values per group along the quantization axis (``None``: the whole dim).
        across: values per group across it (``None``: the whole dim).
        alignment: the multiple a Linear layer's dims need for this granularity's GEMMs.
        family: the :class:`GemmFamily` whose hardware GEMMs take it.
        scale_dtype_name: dtype of its ``scale_inv`` (``"float32"``, ``"float8_e8m0fnu"``, or
            ``"float8_e4m3fn"`` for NVFP4's block scales).
        data_bits: bits of one data value: 8 (FP8 data) or 4 (E2M1 data, two values a byte).

    Derived from those:
        per_tensor: one group covers the whole tensor: one scale, and ``axis`` means nothing.
        block: block length the tensor must tile in both dims (0: any shape).
        k_uniform: one scale per row along the whole contraction dim (``tensor``, ``row``):
            a GEMM can apply it to its output instead of per K chunk.
        symmetric: the group shape is the same for both axes (one scale per tensor, or
            square tiles): ``axis`` does not matter, and a tensor's first-dim usage is the
            transpose of its last-dim usage, so one quantization serves both.
        e8m0_scales: ``scale_inv`` is E8M0 (exponent bits; uint8 inside ``torch.compile``).
        always_power_2: every scale is a power of two whatever the recipe says (E8M0).
        min_rank: smallest tensor rank this granularity can quantize.
        fp4: the data is 4-bit E2M1 (``data_bits == 4``).
        two_level_scales: NVFP4's E4M3 block scales under a float32 global scale from the
            tensor's amax (the quantized tensor carries ``global_amax``).
    """

    along: int | None
    across: int | None
    alignment: int
    family: GemmFamily
    scale_dtype_name: str
    per_tensor: bool
    block: int
    k_uniform: bool
    symmetric: bool
    e8m0_scales: bool
    always_power_2: bool
    min_rank: int
    data_bits: int
    fp4: bool
    two_level_scales: bool

    def __new__(cls, name, along, across, alignment, family, scale_dtype_name, data_bits=8):
        member = str.__new__(cls, name)
        member._value_ = name
        member.along, member.across, member.alignment = along, across, alignment
        member.family, member.scale_dtype_name, member.data_bits = family, scale_dtype_name, data_bits
        # Derived facts, as plain attributes: they are read on every quantization and GEMM.
        member.per_tensor = along is None and across is None
        member.block = along or 0
        member.k_uniform = along is None
        member.symmetric = along == across
        member.e8m0_scales = scale_dtype_name == "float8_e8m0fnu"
        member.always_power_2 = member.e8m0_scales
        member.min_rank = 2 if along else (0 if across is None else 1)
        member.fp4 = data_bits == 4
        member.two_level_scales = scale_dtype_name == "float8_e4m3fn"
        return member

    TENSOR = "tensor", None, None, 16, GemmFamily.TENSORWISE_ROWWISE, "float32"
    ROW = "row", None, 1, 16, GemmFamily.TENSORWISE_ROWWISE, "float32"
    BLOCK_1X128 = "block1x128", 128, 1, 128, GemmFamily.BLOCKWISE, "float32"
    BLOCK_128X128 = "block128x128", 128, 128, 128, GemmFamily.BLOCKWISE, "float32"
    MX = "mx", 32, 1, 32, GemmFamily.MXFP8, "float8_e8m0fnu"
    # 4-bit: alignment 32 as for the recipes (NUMERICS.md 6) and torch._scaled_mm's FP4 K.
    NVFP4 = "nvfp4", 16, 1, 32, GemmFamily.NVFP4, "float8_e4m3fn", 4
    NVFP4_2D = "nvfp4_2d", 16, 16, 32, GemmFamily.NVFP4, "float8_e4m3fn", 4
    MXFP4 = "mxfp4", 32, 1, 32, GemmFamily.MXFP4, "float8_e8m0fnu", 4

    @classmethod
    def coerce(cls, value: "Granularity | str") -> "Granularity":
        """``value`` as a :class:`Granularity`.

        Raises:
            ValueError: an unknown name; the message lists the valid ones.
        """
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"granularity={value!r} is not one of {', '.join(GRANULARITIES)}") from None

    @property
    def default_power_2_scales(self) -> bool:
        """Power-of-two scales unless asked otherwise: the per-tensor scale and NVFP4's
        E4M3 block scales are the ones that default to exact (not power-of-two) scales."""
        return not self.per_tensor and not self.two_level_scales

    def group_shape(self, axis: int, shape_2d: tuple[int, int]) -> tuple[int, int]:
        """``(rows, cols)`` of one scaling group for a 2-D view of ``shape_2d``.

        ``axis`` is -1 (groups along the last dim) or 0 (along the first).
        """
        m, k = shape_2d
        if axis == -1:
            return (m if self.across is None else self.across), (k if self.along is None else self.along)
        return (m if self.along is None else self.along), (k if self.across is None else self.across)

    def values_shape_2d(self, data_shape: tuple[int, ...], axis: int) -> tuple[int, int]:
        """``(M, K)`` of the 2-D view of the values a quantized tensor's data of
        ``data_shape`` holds: the data's own 2-D view for FP8; 4-bit data holds two values a
        byte along its scaling ``axis`` (-1: the last dim; 0: the first of the 2-D view)."""
        m, k = view_2d_shape(data_shape)
        if not self.fp4:
            return m, k
        return (m, 2 * k) if axis == -1 else (2 * m, k)

    def rows_per_group(self, axis: int) -> int | None:
        """Rows of the 2-D view one group spans for ``axis`` (``None``: all of them).
        A shard of whole rows can compute its own scales when this divides its rows."""
        return self.across if axis == -1 else self.along


GRANULARITIES = tuple(g.value for g in Granularity)
"""Names of every granularity: the FP8 ones in order of size of their groups' cover
(``tensor`` first), then the 4-bit ones."""

FP8_GRANULARITIES = tuple(g.value for g in Granularity if not g.fp4)
"""Names of the granularities that take FP8 data (every recipe before 4-bit training)."""

FP4_GRANULARITIES = tuple(g.value for g in Granularity if g.fp4)
"""Names of the granularities that take 4-bit E2M1 data: ``nvfp4``, ``nvfp4_2d``, ``mxfp4``."""


def view_2d_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(M, K)`` of the 2-D view of ``shape`` (any sequence of ints: a ``torch.Size``, a
    JAX shape) that every granularity's groups tile: leading dims flattened into M."""
    try:  # the common case, rank 2, without a product or a len() call (issue 38)
        m, k = shape
        return m, k
    except ValueError:
        pass
    rank = len(shape)
    if rank == 0:
        return 1, 1
    if rank == 1:
        return 1, shape[0]
    return math.prod(shape[:-1]), shape[-1]


def normalize_axis(axis: int, ndim: int) -> int:
    """The scaling-group axis of a quantization of a rank-``ndim`` input: ``-1`` (groups
    along the last dim, rowwise usage; the last dim's index is accepted too) or ``0``
    (along the first, flattened dim, columnwise usage). Both frontends' ``quantize``."""
    if type(axis) is not int:  # a bool or a non-int raises here
        check_int("axis", axis)
    if axis in (-1, 0) or (ndim >= 2 and axis == ndim - 1):
        return -1 if axis != 0 else 0
    raise ValueError(
        f"axis={axis!r} is not supported for a rank-{ndim} input; use axis=-1 (groups along the "
        "last dim, rowwise usage) or axis=0 (groups along the first, flattened dim, columnwise usage)"
    )


def check_gemm_operands(a, b, bias_shape: tuple[int, ...] | None, noun: str) -> None:
    """The shape rules of a scaled GEMM ``a @ b^T`` of two quantized operands (anything with
    ``data.shape``, ``axis`` and ``granularity``: PyTorch's ``QuantizedTensor``, JAX's
    ``QuantizedArray``): both 2-D, scaled along K (``axis=-1``) unless their scaling is
    symmetric, the same K, and a bias of shape ``[N]``. ``noun`` names the operands' kind
    in the fix ("a tensor", "an array"). Raises ``ValueError`` naming the shapes."""
    for name, operand in (("a", a), ("b", b)):
        if len(operand.data.shape) != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(operand.data.shape)}")
        if operand.axis != -1 and not operand.granularity.symmetric:
            raise ValueError(
                f"{name} ({operand.granularity}) is scaled along its first dim (axis=0); the GEMM "
                f"contracts the last dim. Pass transpose({name}) of {noun} quantized along K"
            )
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(
            f"contraction dims differ: a is {tuple(a.data.shape)}, b is {tuple(b.data.shape)} (both [*, K])"
        )
    if bias_shape is not None and tuple(bias_shape) != (b.data.shape[0],):
        raise ValueError(f"bias of shape {tuple(bias_shape)} must be [N] = [{b.data.shape[0]}] (b is [N, K])")
