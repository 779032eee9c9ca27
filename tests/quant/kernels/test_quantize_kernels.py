"""The fused CPU kernels (fp8train.quant.kernels) against the pure-PyTorch reference path,
bit for bit: every granularity, axis, format and input dtype, on every input class of the
numerics tests (zeros, subnormals, infinities, signed NaN, saturation, ties, wide ranges),
with every scale option; plus the path switch and its errors."""

from __future__ import annotations

import math

import pytest
import torch

from fp8train.quant import quantize
from fp8train.quant.cast import format_of
from fp8train.quant.quantize import quantize_both as quantize_both_by_rule
from fp8train.quant.kernels import QuantSettings, launch
from fp8train.quant.kernels import fp8 as fp8_kernels
from fp8train.spec.rule import QuantRule

from .._quantize_reference import ALL_CASES, E4M3, E5M2, _bytes

FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
INPUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NEGATIVE_NAN = torch.tensor(-0x400000, dtype=torch.int32).view(torch.float32).item()  # 0xFFC00000


def quantize_both(x, granularity, *, dtype=E4M3, **options):
    """:func:`fp8train.quant.quantize.quantize_both` with :func:`fp8train.quant.quantize`'s arguments."""
    return quantize_both_by_rule(x, QuantRule(granularity=granularity, format=format_of(dtype), **options))


def _both_paths(kernel_choice, x, granularity, **kwargs):
    kernel_choice("numba")
    fast = quantize(x, granularity, **kwargs)
    kernel_choice("reference")
    reference = quantize(x, granularity, **kwargs)
    return fast, reference


def _assert_same(fast, reference):
    assert fast.data.dtype == reference.data.dtype and fast.data.shape == reference.data.shape
    assert fast.scale_inv.dtype == reference.scale_inv.dtype
    assert fast.scale_inv.shape == reference.scale_inv.shape
    assert fast.axis == reference.axis and fast.power_2_scales == reference.power_2_scales
    # A NaN's sign is not part of the contract (the reference's own depends on which PyTorch
    # vector path ran): NaN codes need only be NaN codes.
    fast_codes, reference_codes = _bytes(fast.data), _bytes(reference.data)
    nan_code = 0x7F if fast.data.dtype == E4M3 else 0x7C
    fast_nan, reference_nan = (fast_codes & 0x7F) >= nan_code, (reference_codes & 0x7F) >= nan_code
    assert (fast_nan == reference_nan).all(), "NaN positions differ"
    data_mismatch = ((fast_codes != reference_codes) & ~reference_nan).nonzero()[0]
    assert data_mismatch.size == 0, f"{data_mismatch.size} codes differ, first at flat index {data_mismatch[:5]}"
    assert (_bytes(fast.scale_inv) == _bytes(reference.scale_inv)).all()


def _spread(shape, seed, dtype, exponents):
    """Normal samples times 2^e with ``e`` drawn per group of 32 columns from ``exponents``,
    so groups see very different ranges (FP8 subnormals in some, huge values in others)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    lo, hi = exponents
    e = torch.randint(lo, hi + 1, (shape[0], shape[1] // 32), generator=g).repeat_interleave(32, dim=1)
    e = e + torch.randint(-3, 4, shape, generator=g)
    return (x * torch.pow(2.0, e.double())).to(dtype)


def _exponent_range(dtype):
    # Keep the samples finite in the input dtype; the special cases add inf/NaN on purpose.
    return {torch.float32: (-140, 120), torch.bfloat16: (-130, 120), torch.float16: (-24, 13)}[dtype]


def _with_specials(x, seed):
    """Sprinkle +-0, +-inf, +-NaN and the input dtype's smallest subnormal into a few groups."""
    g = torch.Generator().manual_seed(seed)
    flat = x.reshape(-1)
    tiny = torch.finfo(x.dtype).smallest_normal / 4
    specials = [0.0, -0.0, math.inf, -math.inf, math.nan, NEGATIVE_NAN, tiny, -tiny]
    positions = torch.randperm(flat.numel(), generator=g)[: 3 * len(specials)]
    for n, position in enumerate(positions.tolist()):
        flat[position] = specials[n % len(specials)]
    return x


def _ties(shape, dtype, fp8_dtype, seed):
    """Groups whose amax is fp8_max * 2^j (a power-of-two scale) and whose other values are
    exact midpoints between neighbouring FP8 codes, times 2^j: every cast is a tie."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.arange(0, 0x7E if fp8_dtype == E4M3 else 0x7B, dtype=torch.uint8)
    values = codes.view(fp8_dtype).double()
    midpoints = (values[:-1] + values[1:]) / 2
    picks = midpoints[torch.randint(0, midpoints.numel(), shape, generator=g)]
    signs = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).double()
    x = picks * signs
    x[:, ::32] = FP8_MAX[fp8_dtype]  # one amax per 32-column group and per row
    x[::32, :] = FP8_MAX[fp8_dtype]  # ... and per 32-row group (axis 0)
    j = 4 if dtype == torch.float16 else 20
    return (x * 2.0**j).to(dtype)


INPUT_CLASSES = ["spread", "specials", "ties", "zeros", "subnormal_input"]


def _input(kind, dtype, fp8_dtype, seed, shape=(256, 256)):
    if kind == "spread":
        return _spread(shape, seed, dtype, _exponent_range(dtype))
    if kind == "specials":
        return _with_specials(_spread(shape, seed, dtype, _exponent_range(dtype)), seed)
    if kind == "ties":
        return _ties(shape, dtype, fp8_dtype, seed)
    if kind == "zeros":
        x = torch.zeros(shape, dtype=dtype)
        x[1::2] = -0.0
        return x
    # every value a subnormal of the input dtype
    tiny = torch.finfo(dtype).smallest_normal
    return (torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * tiny).to(dtype)


@pytest.mark.parametrize("granularity, axis", ALL_CASES)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", INPUT_CLASSES)
def test_kernels_match_reference(kernel_choice, granularity, axis, fp8_dtype, dtype, kind):
    x = _input(kind, dtype, fp8_dtype, seed=hash((granularity, axis, kind)) % 1000)
    _assert_same(*_both_paths(kernel_choice, x, granularity, axis=axis, dtype=fp8_dtype))


@pytest.mark.parametrize("granularity, axis", ALL_CASES)
@pytest.mark.parametrize("power_2_scales", [True, False])
@pytest.mark.parametrize("amax_epsilon", [0.0, 1e-3])
def test_kernels_match_reference_scale_options(kernel_choice, granularity, axis, power_2_scales, amax_epsilon):
    if granularity == "mx" and not power_2_scales:
        pytest.skip("E8M0 scales are always powers of two")
    x = _with_specials(_spread((256, 256), 3, torch.bfloat16, (-30, 30)), 4)
    kwargs = dict(axis=axis, power_2_scales=power_2_scales, amax_epsilon=amax_epsilon)
    _assert_same(*_both_paths(kernel_choice, x, granularity, **kwargs))


@pytest.mark.parametrize("rule", ["ceil", "ocp"])
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_kernels_match_reference_mx_rules(kernel_choice, rule, axis, fp8_dtype, dtype):
    # Wide ranges reach float32-subnormal amaxes and the clamps of both E8M0 rules.
    x = _with_specials(_spread((128, 256), 5, dtype, _exponent_range(dtype)), 6)
    kwargs = dict(axis=axis, dtype=fp8_dtype, mx_scale_rule=rule)
    _assert_same(*_both_paths(kernel_choice, x, "mx", **kwargs))


@pytest.mark.parametrize("scale", [0.7, 1.0, 3.0e-5, 1.0e6, 2.0**-20])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_kernels_match_reference_given_scale(kernel_choice, scale, fp8_dtype, dtype):
    # A delayed-scaling scale: not a power of two, and large enough to saturate.
    x = _with_specials(_spread((64, 96), 7, dtype, (-12, 12)), 8)
    kwargs = dict(dtype=fp8_dtype, scale=torch.tensor(scale))
    _assert_same(*_both_paths(kernel_choice, x, "tensor", **kwargs))


@pytest.mark.parametrize("granularity, axis", ALL_CASES)
def test_kernels_take_any_layout_and_rank(kernel_choice, granularity, axis):
    base = _spread((256, 512), 9, torch.bfloat16, (-8, 8))
    strided = base[:, ::2]  # non-contiguous
    transposed = _spread((256, 256), 10, torch.bfloat16, (-8, 8)).t()
    three_d = base.reshape(2, 128, 512).requires_grad_()
    for x in (strided, transposed, three_d):
        fast, reference = _both_paths(kernel_choice, x, granularity, axis=axis)
        _assert_same(fast, reference)
        assert fast.data.shape == x.shape and fast.data.is_contiguous()


def test_kernels_cover_tall_and_wide_shapes(kernel_choice):
    # One 128-row stripe, many stripes, one row group that is all rows (row axis 0).
    for shape in [(128, 1024), (1024, 128), (4096, 32)]:
        x = _spread(shape, 11, torch.bfloat16, (-20, 20))
        for granularity, axis in ALL_CASES:
            if "128" in granularity and shape[1] % 128:
                continue
            _assert_same(*_both_paths(kernel_choice, x, granularity, axis=axis))


def test_reference_path_never_touches_the_kernels(kernel_choice):
    kernel_choice("reference")
    assert not launch.kernels_usable(torch.ones(4, 4))
    kernel_choice("auto")
    assert launch.kernels_usable(torch.ones(4, 4))
    assert not launch.kernels_usable(torch.ones(0, 4))  # nothing to do: reference path
    assert not launch.kernels_usable(torch.ones(4, 4, device="meta"))


def test_unknown_kernel_choice_is_named():
    with pytest.raises(ValueError, match=r"FP8TRAIN_QUANTIZE_KERNEL='fast' is not one of auto, numba, reference"):
        QuantSettings.from_environment({"FP8TRAIN_QUANTIZE_KERNEL": "fast"})
    with pytest.raises(ValueError, match=r"quantize_kernel='fast' must be one of auto, numba, reference"):
        QuantSettings(quantize_kernel="fast")


def test_asking_for_numba_without_it_says_how_to_fix(monkeypatch, kernel_choice):
    kernel_choice("numba")
    monkeypatch.setattr(launch, "compiled_elements", lambda: None)
    with pytest.raises(RuntimeError, match="pip install numba"):
        quantize(torch.ones(4, 4), "tensor")
    kernel_choice("auto")  # auto falls back quietly
    assert quantize(torch.ones(4, 4), "tensor").data.float().eq(448).all()


def test_tensor_amax_kernel_matches_torch():
    x = _spread((64, 64), 12, torch.bfloat16, (-100, 100))
    assert fp8_kernels.tensor_amax(x).item() == x.abs().max().float().item()
    x[3, 5] = NEGATIVE_NAN
    assert math.isnan(fp8_kernels.tensor_amax(x).item())


# ---------------------------------------------------------------- both usages in one pass


@pytest.mark.parametrize("granularity", ["tensor", "row", "block1x128", "block128x128", "mx"])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["spread", "specials", "ties"])
def test_quantize_both_matches_two_reference_calls(kernel_choice, granularity, fp8_dtype, dtype, kind):
    x = _input(kind, dtype, fp8_dtype, seed=hash((granularity, kind)) % 1000)
    kernel_choice("numba")
    last, first = quantize_both(x, granularity, dtype=fp8_dtype)
    for axis, fast in ((-1, last), (0, first)):
        kernel_choice("reference")
        _assert_same(fast, quantize(x, granularity, axis=axis, dtype=fp8_dtype))


@pytest.mark.parametrize("granularity", ["row", "block1x128", "mx"])
@pytest.mark.parametrize("shape", [(128, 1024), (1024, 128), (4096, 32), (2, 64, 96)])
def test_quantize_both_any_shape_and_options(kernel_choice, granularity, shape):
    if granularity != "row" and (shape[-1] % 128 or math.prod(shape[:-1]) % 128):
        pytest.skip("the block must tile the shape")
    x = _with_specials(_spread((math.prod(shape[:-1]), shape[-1]), 13, torch.bfloat16, (-30, 30)), 14)
    x = x.reshape(shape)
    options = [dict(), dict(amax_epsilon=1e-3), dict(mx_scale_rule="ocp")]
    if granularity != "mx":
        options.append(dict(power_2_scales=False))
    for kwargs in options:
        kernel_choice("numba")
        pair = quantize_both(x, granularity, **kwargs)
        kernel_choice("reference")
        for axis, fast in zip((-1, 0), pair):
            _assert_same(fast, quantize(x, granularity, axis=axis, **kwargs))


@pytest.mark.parametrize("rule", ["ceil", "ocp"])
def test_e8m0_codes_from_every_kernel_entry(kernel_choice, rule):
    """The MX kernels store their E8M0 scales as codes themselves (no conversion on the host):
    the rows kernel, the stripes kernel, the whole-column kernel (a block of rows as tall as
    the tensor: 32 x 256 along the columns) and the both-usages kernel, each equal to the
    reference's codes, NaN (255), zero's and the clamps' included."""
    x = _with_specials(_spread((32, 256), 21, torch.float32, _exponent_range(torch.float32)), 22)
    x[5] = 0.0  # an all-zero row: groups of amax 0
    tall = _with_specials(_spread((64, 256), 23, torch.float32, _exponent_range(torch.float32)), 24)
    for tensor, axis in ((x, -1), (x, 0), (tall, 0)):
        fast, reference = _both_paths(kernel_choice, tensor, "mx", axis=axis, mx_scale_rule=rule)
        assert fast.scale_inv.dtype == torch.float8_e8m0fnu
        _assert_same(fast, reference)
    kernel_choice("numba")
    pair = quantize_both(x, "mx", mx_scale_rule=rule)
    kernel_choice("reference")
    for axis, fast in zip((-1, 0), pair):
        _assert_same(fast, quantize(x, "mx", axis=axis, mx_scale_rule=rule))


def test_quantize_both_checks_its_arguments():
    with pytest.raises(ValueError, match="divisible by 128"):
        quantize_both(torch.ones(128, 100), "block1x128")
    with pytest.raises(ValueError, match="mx_scale_rule"):
        quantize_both(torch.ones(64, 64), "mx", mx_scale_rule="floor")


def test_tensor_subclasses_take_the_reference_path(kernel_choice):
    class Wrapped(torch.Tensor):
        pass

    kernel_choice("auto")
    assert launch.kernels_usable(torch.nn.Parameter(torch.ones(4, 4)))
    assert not launch.kernels_usable(torch.ones(4, 4).as_subclass(Wrapped))


def test_delayed_amax_uses_the_kernel_and_matches_torch(kernel_choice):
    from fp8train.nn.delayed.amax import tensor_amax

    x = _with_specials(_spread((192, 96), 15, torch.bfloat16, (-60, 60)), 16).reshape(3, 64, 96)
    x.reshape(-1)[5] = 0.0
    finite = x.clone()
    finite[~torch.isfinite(finite)] = 0
    kernel_choice("numba")
    assert tensor_amax(finite).item() == finite.abs().max().float().item()
    assert math.isnan(tensor_amax(x).item())
    assert tensor_amax(torch.tensor(-2.5)).item() == 2.5


def test_kernels_leave_storages_resizable(kernel_choice):
    # FSDP2 frees and restores an unsharded parameter by resizing its storage; NumPy views
    # made with Tensor.numpy() would have marked it non-resizable for good.
    kernel_choice("numba")
    weight = torch.nn.Parameter(torch.randn(256, 128))
    outputs = [quantize(weight, "row"), quantize(weight, "tensor"), *quantize_both(weight, "mx")]
    weight.untyped_storage().resize_(0)
    for qt in outputs:
        qt.data.untyped_storage().resize_(0)


def _quantize_in_forked_child(queue):
    torch.set_num_threads(1)  # as DataLoader workers do: GNU OpenMP pools do not survive fork
    x = _spread((256, 256), 17, torch.bfloat16, (-10, 10))
    queue.put((launch.kernels_usable(x), _bytes(quantize(x, "mx").data).tolist()))


def test_a_process_forked_after_a_kernel_launch_quantizes_on_the_reference_path(kernel_choice):
    # numba's OpenMP layer would abort the child's first parallel launch (DataLoader
    # workers fork the training process).
    import multiprocessing

    kernel_choice("auto")
    x = _spread((256, 256), 17, torch.bfloat16, (-10, 10))
    expected = _bytes(quantize(x, "mx").data).tolist()  # launches the kernels here
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_quantize_in_forked_child, args=(queue,))
    child.start()
    usable, codes = queue.get(timeout=60)
    child.join(timeout=120)
    assert child.exitcode == 0
    assert not usable and codes == expected


def test_kernels_read_a_tensor_at_its_storage_offset(kernel_choice):
    # The kernels take a tensor by its address: a contiguous view into a larger tensor
    # (rows 8 onwards) must be read from its own first element, not its storage's.
    kernel_choice("numba")
    base = _spread((40, 64), 3, torch.float32, (-10, 10))
    view = base[8:]
    for granularity in ("tensor", "row", "mx"):
        assert (_bytes(quantize(view, granularity).data) == _bytes(quantize(view.clone(), granularity).data)).all()
