"""``fp8train.detect_nonfinite``: a NaN or inf placed at one spot of a model's forward or
backward is named as that spot (module, GEMM, operand), for plain and converted models of
every recipe; and the detector changes nothing when every value is finite."""

import copy

import pytest
import torch
from torch import nn

import fp8train
from fp8train.diagnostics.nonfinite import BACKWARD, FORWARD, NonFiniteFinding
from fp8train.spec.recipes import RECIPE_NAMES

from ..helpers.faults import PoisonGradient

TOKENS = 64
WIDTH = 128  # every recipe converts 128-wide layers (blockwise needs 128)
NUM_POISONED = 3


class _InjectNaN(nn.Module):
    """Identity, except ``NUM_POISONED`` NaN in the first row of its output."""

    def forward(self, x):
        x = x.clone()
        x[0, :NUM_POISONED] = float("nan")
        return x


class _PoisonGradientModule(nn.Module):
    def forward(self, x):
        return PoisonGradient.apply(x)


def _mlp(*middle: nn.Module, recipe: str | None = None) -> nn.Sequential:
    """``0`` Linear, GELU, ``*middle``, then Linear, GELU, Linear (named by position)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), *middle, nn.Linear(2 * WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH)
    )
    if recipe is not None:
        fp8train.convert_to_float8_training(model, recipe, backend="emulated")
    return model


def _step(model: nn.Module, x: torch.Tensor, autocast_dtype: torch.dtype | None = torch.bfloat16) -> torch.Tensor:
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        out = model(x)
    out.float().square().mean().backward()
    return out


def _detect(model: nn.Module, x: torch.Tensor, **step_options):
    with fp8train.detect_nonfinite(model, raise_on_first=False) as detector:
        _step(model, x, **step_options)
    return detector


def _inputs(requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=requires_grad)


# ---------------------------------------------------------------------------- forward


@pytest.mark.parametrize("recipe", (None,) + RECIPE_NAMES)
def test_a_nan_in_one_layers_input_is_named_as_that_layer(recipe):
    model = _mlp(_InjectNaN(), recipe=recipe)  # 0 Linear, 1 GELU, 2 inject, 3 Linear, ...
    detector = _detect(model, _inputs())
    expected_type = "Linear" if recipe is None else "Float8Linear"
    assert detector.finding == NonFiniteFinding(
        "3", expected_type, "output", "input", FORWARD, num_nan=NUM_POISONED, num_inf=0, recipe=recipe
    )
    assert detector.origin == NonFiniteFinding("2", "_InjectNaN", None, "output", FORWARD, NUM_POISONED, 0)
    description = detector.describe()
    assert description.startswith(f"input of the output GEMM of 3 ({expected_type}")
    assert "it started at the output of 2 (_InjectNaN) in the forward, from finite inputs: 3 NaN" in description


def test_a_nan_placed_by_a_forward_pre_hook_is_named_as_that_layer():
    model = _mlp(recipe="tensorwise")

    def inject(module, args):
        x = args[0].clone()
        x[1, 5] = float("nan")
        return (x,)

    model[4].register_forward_pre_hook(inject)  # the last Linear
    finding = _detect(model, _inputs()).finding
    assert (finding.module, finding.gemm, finding.operand, finding.num_nan) == ("4", "output", "input", 1)
    assert str(finding) == "input of the output GEMM of 4 (Float8Linear, recipe tensorwise) in the forward: 1 NaN"


@pytest.mark.parametrize("recipe", (None, "tensorwise", "mxfp8"))
def test_an_inf_weight_is_named_as_the_weight(recipe):
    model = _mlp(recipe=recipe)
    with torch.no_grad():
        model[2].weight[3, 4] = float("-inf")
    finding = _detect(model, _inputs()).finding
    assert (finding.module, finding.gemm, finding.operand, finding.phase) == ("2", "output", "weight", FORWARD)
    assert (finding.num_nan, finding.num_inf) == (0, 1)


def test_a_nan_bias_is_named_as_the_bias():
    model = _mlp()
    with torch.no_grad():
        model[0].bias[7] = float("nan")
    finding = _detect(model, _inputs()).finding
    assert (finding.module, finding.operand, finding.num_nan) == ("0", "bias", 1)


def test_an_overflow_in_the_autocast_cast_counts():
    # 1e5 is finite in float32 but not in float16: the fp16 GEMM gets an inf.
    model = _mlp()
    x = _inputs()
    x[2, 3] = 1e5
    finding = _detect(model, x, autocast_dtype=torch.float16).finding
    assert (finding.module, finding.operand, finding.num_nan, finding.num_inf) == ("0", "input", 0, 1)
    assert _detect(_mlp(), x, autocast_dtype=None).finding is None  # float32 holds it


def test_an_overflowing_gemm_is_named_by_its_result():
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(1e30)
    finding = _detect(model, _inputs().abs() * 1e20, autocast_dtype=None).finding
    assert (finding.module, finding.gemm, finding.operand, finding.phase) == ("0", "output", "result", FORWARD)
    assert finding.num_inf == TOKENS * WIDTH


def test_a_nan_in_a_layernorm_is_the_origin():
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH))
    with torch.no_grad():
        model[1].weight[0] = float("nan")
    detector = _detect(model, _inputs())
    assert (detector.finding.module, detector.finding.operand, detector.finding.num_nan) == ("2", "input", TOKENS)
    assert (detector.origin.module, detector.origin.module_type) == ("1", "LayerNorm")


def test_a_nan_made_between_submodules_is_placed_inside_their_parent():
    class Halves(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return self.second(torch.log(self.first(x)))  # log of negatives: NaN, in no submodule

    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Halves())
    detector = _detect(model, _inputs())
    assert (detector.finding.module, detector.finding.operand) == ("1.second", "input")
    assert (detector.origin.module, detector.origin.module_type) == ("1", "Halves")
    assert detector.describe().endswith("it started inside 1 (Halves), in its own code: its inputs are finite")


def test_a_minus_inf_mask_is_not_a_finding():
    class MaskedSoftmax(nn.Module):
        def __init__(self):
            super().__init__()
            self.mask = Mask()

        def forward(self, x):
            return torch.softmax(x + self.mask(x), dim=-1)

    class Mask(nn.Module):
        def forward(self, x):
            return torch.full_like(x, float("-inf")).triu(1)

    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), MaskedSoftmax(), nn.Linear(WIDTH, WIDTH))
    with fp8train.detect_nonfinite(model) as detector:  # raise_on_first: it must not raise
        _step(model, _inputs())
    assert detector.finding is None
    assert detector.origin.module == "1.mask"  # recorded, not raised: only GEMM findings raise


# ---------------------------------------------------------------------------- backward


@pytest.mark.parametrize("recipe", (None,) + RECIPE_NAMES)
def test_a_nan_that_first_appears_in_backward_is_named_as_grad_output(recipe):
    # 0 Linear, 1 GELU, 2 Linear, 3 poison, 4 GELU, 5 Linear: the poisoned gradient reaches
    # layer 2's output first; the forward is finite.
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), _PoisonGradientModule(), nn.GELU(),
        nn.Linear(WIDTH, WIDTH),
    )
    if recipe is not None:
        fp8train.convert_to_float8_training(model, recipe, backend="emulated")
    detector = _detect(model, _inputs())
    assert detector.origin is None
    finding = detector.finding
    where = (finding.module, finding.gemm, finding.operand, finding.phase)
    assert where == ("2", "grad_input", "grad_output", BACKWARD)
    assert (finding.num_nan, finding.recipe) == (1, recipe)
    # The first layer's input needs no gradient: its grad_output feeds only grad_weight.
    model = nn.Sequential(_PoisonGradientModule(), nn.Linear(WIDTH, WIDTH))
    finding = _detect(nn.Sequential(nn.Linear(WIDTH, WIDTH), *model), _inputs()).finding
    assert (finding.module, finding.gemm, finding.operand) == ("0", "grad_weight", "grad_output")


def test_an_overflowing_grad_input_gemm_is_named_by_its_result():
    # Forward: x (1e-30) @ W (1e30) is finite; backward: dy (1e10) @ W overflows.
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(1e30)
    x = torch.full((TOKENS, WIDTH), 1e-30, requires_grad=True)
    with fp8train.detect_nonfinite(model, raise_on_first=False) as detector:
        (model(x) * 1e10).sum().backward()
    finding = detector.finding
    assert (finding.module, finding.gemm, finding.operand, finding.phase) == ("0", "grad_input", "result", BACKWARD)


def test_an_overflowing_grad_weight_gemm_is_named_by_its_result():
    # Forward: x (1e30) @ W (1e-30) is finite; backward: dy^T (1e10) @ x overflows.
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(1e-30)
    x = torch.full((TOKENS, WIDTH), 1e30)
    with fp8train.detect_nonfinite(model, raise_on_first=False) as detector:
        (model(x) * 1e10).sum().backward()
    finding = detector.finding
    assert (finding.module, finding.gemm, finding.operand, finding.phase) == ("0", "grad_weight", "result", BACKWARD)


# ---------------------------------------------------------------------------- raising


def test_raise_on_first_raises_at_the_finding_in_forward_and_in_backward():
    model = _mlp(_InjectNaN())
    expected = r"^non-finite value: input of the output GEMM of 3 \(Linear\)"
    with pytest.raises(fp8train.NonFiniteError, match=expected) as caught:
        with fp8train.detect_nonfinite(model):
            model(_inputs())
    assert caught.value.finding.module == "3" and caught.value.origin.module == "2"
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), _PoisonGradientModule(), nn.Linear(WIDTH, WIDTH))
    with pytest.raises(fp8train.NonFiniteError, match="grad_output of the grad_weight GEMM of 0"):
        with fp8train.detect_nonfinite(model):
            output = model(_inputs())  # the forward is finite
            output.sum().backward()


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        with fp8train.detect_nonfinite(lambda x: x):
            pass
    with pytest.raises(TypeError, match="raise_on_first=1 must be True or False"):
        with fp8train.detect_nonfinite(nn.Linear(2, 2), raise_on_first=1):
            pass


# ---------------------------------------------------------------------------- no effect


def _hook_counts(model: nn.Module) -> list[int]:
    counts = []
    for module in model.modules():
        counts += [len(module._forward_hooks), len(module._forward_pre_hooks)]
    return counts + [len(p._backward_hooks or {}) for p in model.parameters()]


@pytest.mark.parametrize("recipe", (None, "delayed", "blockwise"))
def test_the_detector_changes_nothing_when_all_is_finite(recipe):
    model = _mlp(recipe=recipe)
    twin = copy.deepcopy(model)  # delayed scaling's state included
    hooks_before = _hook_counts(model)
    x = _inputs(requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    out_twin = _step(twin, x_twin)
    with fp8train.detect_nonfinite(model) as detector:
        out = _step(model, x)
    assert detector.finding is None and detector.origin is None
    assert detector.describe() == "no non-finite value"
    assert torch.equal(out, out_twin) and torch.equal(x.grad, x_twin.grad)
    for (name, p), p_twin in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, p_twin.grad), name
    for (name, b), b_twin in zip(model.named_buffers(), twin.buffers()):
        assert torch.equal(b, b_twin), name
    assert _hook_counts(model) == hooks_before  # every hook removed on exit


def test_hooks_are_removed_when_the_block_raises():
    model = _mlp(_InjectNaN())
    hooks_before = _hook_counts(model)
    with pytest.raises(fp8train.NonFiniteError):
        with fp8train.detect_nonfinite(model):
            _step(model, _inputs())
    assert _hook_counts(model) == hooks_before
