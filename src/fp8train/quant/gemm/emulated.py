"""The emulated scaled GEMM: exactly what FP8 hardware computes, on any device, in plain
PyTorch (up to float32 accumulation order).

* K-uniform operands (``tensor`` / ``row``: scales constant along K): GEMM of the FP8
  values (exact in bfloat16), float32 accumulation; power-of-two scales fold into the
  values, other scales multiply the float32 output.
* 4-bit operands (``nvfp4``, ``nvfp4_2d``, ``mxfp4``): their block scales fold exactly into
  the E2M1 values (:mod:`fp8train.quant.gemm.fp4`), as power-of-two scales do; NVFP4's
  ``alpha`` multiplies the float32 output.
* Block operands (``block*`` / ``mx``): every K chunk (the block) is promoted with its own
  scales. With power-of-two scales (the default of every block recipe, always for MX) the
  scales fold exactly into the operands, so one GEMM computes the same sum; other scales
  take the literal per-chunk loop in float32.

On CUDA (GEMM dtype bfloat16, the default there) every product but the chunked loop is one
bfloat16 GEMM with float32 output, then the scales, ``alpha`` and bias in float32 and one
rounding (:mod:`fp8train.quant.gemm.single`). On the CPU:

Outputs are rounded once, as the hardware rounds them. With power-of-two scales and a
bfloat16 output, the folded operands are exact in bfloat16 and in float32, so the GEMM
runs in whichever this machine does faster (:func:`emulated_gemm_dtype`): bfloat16 where
the CPU has native bf16 (AVX512-BF16, AMX; float32 accumulation, bias folded into the
accumulation), float32 elsewhere (where a bf16 GEMM is ~5x slower than float32).
Otherwise the GEMM runs in float32 and the scales and bias are applied in float32 before
the one rounding. (A bfloat16 GEMM cannot give the float32 value of the
sum that a non-power-of-two scale must multiply, so ``tensorwise`` and ``delayed``, whose
scales are ``fp8_max / amax``, pay for float32 GEMMs in emulation.)
"""

from __future__ import annotations

import math

import torch

from ..cast import checked_fp8_to_hp, e8m0_float32_bits, fp8_to_hp
from ..kernels.operands import operand_values, try_operand_values
from ..kernels.settings import ACTIVE_SETTINGS
from ..kernels.compiled_fp8 import operand_values as gpu_operand_values
from ..tensor import QuantizedTensor
from .fp4 import fp4_alpha, fp4_operand_values
from .single import one_gemm, one_gemm_runs

__all__ = ["NATIVE_BF16", "emulated_gemm_dtype", "emulated_mm", "chunked_mm", "cpu_bf16_gemm_keeps_every_bit"]

_BIAS_COLUMNS = 16  # keeps K a multiple of 16 for the GEMM

_GEMM_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _cpu_has_native_bf16() -> bool:
    # Private PyTorch probes (torch 2.x); a build without them counts as no native bf16.
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


NATIVE_BF16 = _cpu_has_native_bf16()
"""This CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), read once at import."""


def emulated_gemm_dtype(device_type: str = "cpu") -> torch.dtype:
    """The dtype of the emulated GEMM whose operands are exact in both bfloat16 and float32
    (power-of-two scales folded in, bfloat16 output): the faster one on this machine.

    The settings' ``emulated_gemm`` (:mod:`fp8train.quant.kernels.settings`: ``FP8TRAIN_EMULATED_GEMM``
    at import, or :func:`~fp8train.quant.kernels.use_quant_settings`) overrides the
    choice; ``auto`` takes bfloat16 on GPUs and on CPUs with native bf16, float32 on other
    CPUs. Both give the same result up to float32 accumulation order.
    """
    choice = ACTIVE_SETTINGS.settings.emulated_gemm
    if choice == "auto":
        return torch.bfloat16 if device_type != "cpu" or NATIVE_BF16 else torch.float32
    return _GEMM_DTYPES[choice]


def _scales_are_powers_of_2(qt: QuantizedTensor) -> bool:
    # Static (no look at the data), so compiled graphs do not break here.
    return qt.power_2_scales or qt.granularity.always_power_2


def _scales_fold(qt: QuantizedTensor) -> bool:
    """Whether ``qt``'s scales fold exactly into its values (in bfloat16 and float32):
    powers of two, and every 4-bit block scale (an E2M1 value times an E4M3 or E8M0 scale
    has at most 6 significant bits)."""
    return qt.granularity.fp4 or qt.power_2_scales or qt.granularity.always_power_2


def _operand(
    qt: QuantizedTensor, compute_dtype: torch.dtype, kernels: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GEMM-ready values of an operand and the scale left to apply to the output.

    Power-of-two scales fold exactly into the values (one multiply in ``compute_dtype``);
    other scales of K-uniform operands are returned for the output instead. ``kernels``:
    whether the CPU kernels convert the codes (the caller has checked), ``None`` to ask.
    """
    if qt.granularity.fp4:
        return fp4_operand_values(qt, compute_dtype, kernels), None
    cache = qt.gemm_cache
    if cache is not None and cache.values is not None and cache.compute_dtype == compute_dtype:
        return cache.values, cache.out_scale  # as cache.get, without its call
    rows, k = qt.data.shape
    if rows == 0 or k == 0:  # e.g. a grad_weight GEMM over zero tokens: the GEMM gives zeros
        return fp8_to_hp(qt.data, compute_dtype), None
    out_scale = None
    power_2 = qt.power_2_scales or qt.granularity.always_power_2  # as _scales_are_powers_of_2
    if not power_2:
        # K-uniform scales: one per output row (a) or column (b), or one for all. (Block
        # scales that are not powers of two take chunked_mm instead.)
        assert qt.granularity.k_uniform, qt.granularity
        out_scale = qt.scale_inv if qt.granularity.per_tensor else qt.scale_inv.reshape(-1, 1)
    # On CPU, one pass from codes to scaled values (bit-identical to the PyTorch ops below).
    if kernels is None:
        values = try_operand_values(qt, power_2, compute_dtype)
    else:
        values = operand_values(qt, power_2, compute_dtype) if kernels else None
    if values is None and qt.data.device.type != "cpu":  # on a GPU, the same in one fused kernel
        values = gpu_operand_values(qt, power_2, compute_dtype)
    if values is None:
        traced = kernels is None and torch.compiler.is_compiling()  # a given `kernels`: a bound, eager call
        values = checked_fp8_to_hp(qt.data, compute_dtype, traced)
        if power_2 and qt.granularity.per_tensor:
            values = values * qt.scale_inv.to(compute_dtype)
        elif power_2 and qt.granularity.k_uniform:  # one scale per row, [rows, 1]
            values = values * _scales_in(qt, compute_dtype)
        elif power_2:  # block scales, compact [row groups, col groups]
            row_groups, col_groups = qt.scale_inv.shape  # (no group_shape call: issue 38)
            grouped = values.reshape(row_groups, rows // row_groups, col_groups, k // col_groups)
            scale_inv = qt.scale_inv  # _scales_in where it converts (E8M0, another dtype), else as it is
            if scale_inv.dtype != compute_dtype:
                scale_inv = _scales_in(qt, compute_dtype)
            # (a reshape, not the index that spreads them without a call: fake CUDA tensors,
            # a CPU-only build's stand-in for a GPU's, cannot take an index)
            values = (grouped * scale_inv.reshape(row_groups, 1, col_groups, 1)).reshape(rows, k)
    if cache is not None:
        # A tensor reused by the backward (its transpose) skips a second conversion
        # (cache.put, inline: a call less a conversion, issue 38).
        cache.compute_dtype, cache.values, cache.out_scale = compute_dtype, values, out_scale
        partner = cache.transposed
        if partner is not None and partner.values is None:
            partner.compute_dtype, partner.values, partner.out_scale = compute_dtype, values.T, out_scale
    return values, out_scale


def _scales_in(qt: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """``qt.scale_inv_float32().to(dtype)``, without the calls of the property and its
    conversion where the dtype is already ``dtype``."""
    scale_inv = qt.scale_inv
    if qt.granularity.e8m0_scales:  # e8m0_to_float32, without its call
        scale_inv = e8m0_float32_bits(scale_inv.view(torch.uint8).to(torch.int32)).view(torch.float32)
    return scale_inv if scale_inv.dtype == dtype else scale_inv.to(dtype)


def emulated_mm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    gemm_dtype: torch.dtype | None = None,
    kernels: bool | None = None,
    rows: int | None = None,
    depth: int | None = None,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b)^T (+ bias)`` like the hardware: float32 accumulation,
    scales and bias applied in float32, one rounding to ``out_dtype``. Operands are
    validated by :func:`fp8train.quant.gemm.scaled_mm`.

    ``rows`` and ``depth`` say where a layer's operands hold zero padding (tokens padded to
    a recipe's block): only ``a``'s first ``rows`` rows are wanted (the output has that
    many), and only the first ``depth`` columns of K are non-zero in either operand. The
    folded GEMMs then multiply that extent only: a padded row or column adds exact zeros, so
    the sum is the same, and on the CPU each padded row is arithmetic (16 tokens padded to
    blockwise's 128 made eight times the work). The literal per-chunk loop takes the whole.

    ``gemm_dtype`` (bfloat16 or float32) picks the GEMM where both are exact; ``None``
    takes :func:`emulated_gemm_dtype`. Two 4-bit operands run as folded ones; NVFP4's
    ``alpha`` multiplies the float32 sum (so never the bfloat16 GEMM). ``kernels``: whether
    the CPU kernels convert the operands' codes, where the caller has checked them (plain,
    non-empty CPU tensors, outside ``torch.compile``); ``None`` asks for each operand."""
    if gemm_dtype is None:
        gemm_dtype = emulated_gemm_dtype(a.data.device.type)
    # _scaled_mm takes the bias in the output dtype; round it there first, as it does.
    bias = bias if bias is None or bias.dtype == out_dtype else bias.to(out_dtype)
    a_block, b_block = a.granularity.block, b.granularity.block
    chunk = a_block if a_block >= b_block else b_block  # their max (no max() call: issue 38)
    # _scales_fold(a) and _scales_fold(b), inline (two calls a GEMM, issue 38)
    a_granularity, b_granularity = a.granularity, b.granularity
    folds = (a_granularity.fp4 or a.power_2_scales or a_granularity.always_power_2) and (
        b_granularity.fp4 or b.power_2_scales or b_granularity.always_power_2
    )
    alpha = None if a.global_amax is None else fp4_alpha(a, b, kernels is True)  # NVFP4's; None for every other family
    if chunk and not folds:
        out = chunked_mm(a, b, chunk)
        out = out if rows is None else out[:rows]
        return (out if bias is None else out + bias.to(torch.float32)).to(out_dtype)
    if a.data.is_cuda and one_gemm_runs(a.data, gemm_dtype):  # CUDA: one bfloat16 GEMM, float32 out (single.py)
        a_values, a_scale = _operand(a, torch.bfloat16, kernels)
        b_values, b_scale = _operand(b, torch.bfloat16, kernels)
        if rows is not None or depth is not None:
            a_values, a_scale, b_values = _extent(a_values, a_scale, b_values, rows, depth)
        return one_gemm(a_values, b_values, out_dtype, a_scale, b_scale, alpha, bias)
    bf16_gemm = folds and alpha is None and out_dtype == torch.bfloat16 and gemm_dtype == torch.bfloat16
    if bf16_gemm:
        # Scales fold exactly into bfloat16 operands, and a bfloat16 GEMM accumulates in
        # float32 and rounds once: exactly the hardware's result, at bfloat16 speed.
        a_values, _ = _operand(a, torch.bfloat16, kernels)
        b_values, _ = _operand(b, torch.bfloat16, kernels)
        on_cpu = a.data.device.type == "cpu"
        if on_cpu and not cpu_bf16_gemm_keeps_every_bit(a, b, bias, a_values, b_values):
            return _float32_gemm(a, b, out_dtype, bias, None, kernels, rows, depth)
        if rows is not None or depth is not None:
            a_values, _, b_values = _extent(a_values, None, b_values, rows, depth)
        if bias is None:
            return _mm(a_values, b_values.T)
        return _mm(*_append_bias_column(a_values, b_values, bias))
    # Scales that are not powers of two, NVFP4's alpha, or a float16/float32 output need the
    # float32 value of the GEMM before the one rounding: run it in float32.
    return _float32_gemm(a, b, out_dtype, bias, alpha, kernels, rows, depth)


def _extent(a_values: torch.Tensor, a_scale, b_values: torch.Tensor, rows: int | None, depth: int | None):
    """The folded operands (and ``a``'s scale left for the output) over the extent that
    holds data (:func:`emulated_mm`'s ``rows`` and ``depth``): views, no copy."""
    if rows is not None:
        a_values = a_values[:rows]
        a_scale = a_scale if a_scale is None or a_scale.shape == () else a_scale[:rows]
    if depth is not None:
        a_values, b_values = a_values[:, :depth], b_values[:, :depth]
    return a_values, a_scale, b_values


def _float32_gemm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype, bias, alpha, kernels, rows=None, depth=None
) -> torch.Tensor:
    """:func:`emulated_mm` in float32: the operands' values, their K-uniform scales, NVFP4's
    ``alpha`` and the bias applied in float32, one rounding to ``out_dtype``, over the extent
    ``rows`` and ``depth`` give."""
    # _operand's cache read, inline where a quantizer wrote the operand in its pass (issue 38)
    a_cache, b_cache = a.gemm_cache, b.gemm_cache
    if a_cache is not None and a_cache.values is not None and a_cache.compute_dtype == torch.float32:
        a_values, a_scale = a_cache.values, a_cache.out_scale
    else:
        a_values, a_scale = _operand(a, torch.float32, kernels)
    if b_cache is not None and b_cache.values is not None and b_cache.compute_dtype == torch.float32:
        b_values, b_scale = b_cache.values, b_cache.out_scale
    else:
        b_values, b_scale = _operand(b, torch.float32, kernels)
    if rows is not None or depth is not None:
        a_values, a_scale, b_values = _extent(a_values, a_scale, b_values, rows, depth)
    # (b_values.T: .t() of a 2-D tensor read as an attribute, no call: issue 38)
    if a_values.device.type == "cpu":  # _mm, inline (a call less a GEMM)
        out = torch.mm(a_values, b_values.T, out=torch.empty(a_values.shape[0], b_values.shape[0], dtype=torch.float32))
    else:
        out = _mm(a_values, b_values.T)
    # In place, by operator: the same float32 products, without an allocation or a call each (issue 38).
    if a_scale is not None:  # (a shape test, not a dim() call: issue 38)
        out *= a_scale if a_scale.shape == () else a_scale.reshape(-1, 1)
    if b_scale is not None:
        out *= b_scale if b_scale.shape == () else b_scale.reshape(1, -1)
    if alpha is not None:
        out *= alpha
    if bias is not None:
        out += bias if bias.dtype == torch.float32 else bias.to(torch.float32)
    return out if out.dtype == out_dtype else out.to(out_dtype)


# The exponent of the lowest bit of every code's value: FP8's smallest subnormals (NUMERICS.md
# 1), E2M1's 0.5.
_LOWEST_BIT_EXPONENT = {torch.float8_e4m3fn: -9, torch.float8_e5m2: -16}
_E2M1_LOWEST_BIT_EXPONENT = -1
_BF16_SMALLEST_NORMAL_EXPONENT = -126


def cpu_bf16_gemm_keeps_every_bit(
    a: QuantizedTensor,
    b: QuantizedTensor,
    bias: torch.Tensor | None,
    a_values: torch.Tensor | None = None,
    b_values: torch.Tensor | None = None,
) -> bool:
    """Whether the CPU's bfloat16 GEMM gives the exact sum of these folded operands (and the
    bias column): where no operand value, product or partial sum is below bfloat16's and
    float32's smallest normal, 2^-126.

    The CPU's bfloat16 GEMM (AVX512-BF16's ``vdpbf16ps``, AMX) treats subnormal inputs as
    zero and flushes subnormal results, whatever the floating-point flags say: an MXFP8
    block scaled by 2^-126 lost its values there (a float32 GEMM keeps them). Every value
    of a folded operand is a multiple of its lowest bit, 2^(smallest scale exponent + the
    codes' lowest bit exponent), so every product and partial sum of two operands is a
    multiple of the product of their lowest bits: when that is at least 2^-126, nothing is
    subnormal. One read of each operand's scales (small beside its data), on the CPU only,
    where it syncs nothing. An all-zero block has the smallest scale and fails that bound
    though it adds nothing: where the scales fail it, the folded bfloat16 values
    (``a_values``, ``b_values``, where given) decide instead, by their smallest non-zero
    magnitudes' lowest bits. A GEMM that fails the test runs in float32 (the same bits as
    the hardware's, slower)."""
    if torch.compiler.is_compiling():
        # A traced graph cannot read the scales without breaking: it keeps the bfloat16
        # GEMM, exact everywhere but below 2^-126 (docs/numerics.md).
        return True
    lowest = _lowest_bit_exponent(a) + _lowest_bit_exponent(b)
    if lowest < _BF16_SMALLEST_NORMAL_EXPONENT and a_values is not None and b_values is not None:
        lowest = _smallest_lowest_bit(a_values) + _smallest_lowest_bit(b_values)
    if bias is None or lowest < _BF16_SMALLEST_NORMAL_EXPONENT:
        return lowest >= _BF16_SMALLEST_NORMAL_EXPONENT
    # The bias column adds bias * 1: its values' lowest bits count too.
    return _smallest_lowest_bit(bias) >= _BF16_SMALLEST_NORMAL_EXPONENT


def _smallest_lowest_bit(values: torch.Tensor) -> float:
    """The exponent of the lowest bit of ``values``' smallest non-zero magnitude as bfloat16
    holds it (8 significant bits: 7 below its leading one); ``inf`` where all are zero."""
    magnitudes = values.abs().to(torch.float32)
    smallest = torch.where(magnitudes == 0, torch.inf, magnitudes).amin().tolist()  # see _lowest_bit_exponent
    return math.inf if smallest == math.inf else math.frexp(smallest)[1] - 8


def _lowest_bit_exponent(qt: QuantizedTensor) -> int:
    """The exponent of the lowest bit of ``qt``'s folded values: its smallest power-of-two
    scale's exponent plus its codes' lowest bit's."""
    # Read by tolist(), which dispatches no op: a CUDA graph's capture check
    # (fp8train.nn.step_graph), tracing a step on the CPU for the GPU, sees no read in this
    # CPU-only branch.
    if qt.granularity.e8m0_scales:  # biased exponents (uint8 bits inside torch.compile)
        scale_exponent = qt.scale_inv.view(torch.uint8).amin().tolist() - 127
    else:
        scale_exponent = math.frexp(qt.scale_inv.amin().tolist())[1] - 1
    codes = _E2M1_LOWEST_BIT_EXPONENT if qt.granularity.fp4 else _LOWEST_BIT_EXPONENT[qt.data.dtype]
    return scale_exponent + codes


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in the operands' own dtype, whatever ``torch.autocast`` says: the
    emulation picks its GEMM dtype (float32 where bfloat16 would round). ``out=`` is what
    keeps autocast off it; a ``with torch.autocast(enabled=False)`` would not do, because
    torch.compile cannot trace that inside an autograd.Function's backward, which it
    traces under the forward's ambient autocast.

    On CUDA a bfloat16 GEMM runs with a float32 output, rounded once after: cuBLAS may
    otherwise reduce split-K partial sums in bfloat16 (PyTorch's default
    ``allow_bf16_reduced_precision_reduction``), which is not the hardware's float32
    accumulation the emulation stands for."""
    if a.dtype == torch.bfloat16 and a.device.type == "cuda" and not torch.compiler.is_compiling():
        return torch.mm(a, b, out_dtype=torch.float32).to(torch.bfloat16)
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    return torch.mm(a, b, out=out)


def _append_bias_column(a_values: torch.Tensor, b_values: torch.Tensor, bias: torch.Tensor):
    """``[a, 1, 0...]`` and ``[b, bias, 0...]``: their GEMM adds the bias inside the float32
    accumulation, so the output is still rounded once."""
    (m, k), n = a_values.shape, b_values.shape[0]
    a_ext = a_values.new_zeros(m, k + _BIAS_COLUMNS)
    b_ext = b_values.new_zeros(n, k + _BIAS_COLUMNS)
    a_ext[:, :k] = a_values
    a_ext[:, k].fill_(1)  # a fill, not a tensor from Python data (a copy from the host on a GPU)
    b_ext[:, :k] = b_values
    b_ext[:, k] = bias.to(b_values.dtype)
    return a_ext, b_ext.t()


def chunked_mm(a: QuantizedTensor, b: QuantizedTensor, chunk: int) -> torch.Tensor:
    """The literal per-chunk promotion: float32 partial product per K chunk, times both
    operands' chunk scales, added into a float32 accumulator."""
    a_values, b_values = fp8_to_hp(a.data, torch.float32), fp8_to_hp(b.data, torch.float32)
    a_scales, b_scales = a.scales_per_k_chunk(chunk), b.scales_per_k_chunk(chunk)
    out = torch.zeros(a.data.shape[0], b.data.shape[0], dtype=torch.float32, device=a.data.device)
    for c in range(a.data.shape[1] // chunk):
        k = slice(c * chunk, (c + 1) * chunk)
        partial = _mm(a_values[:, k], b_values[:, k].t())
        out += partial * a_scales[:, c : c + 1] * b_scales[:, c].reshape(1, -1)
    return out
