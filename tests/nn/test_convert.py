"""convert_to_float8_training / convert_to_linear: which layers are swapped (alignment per
recipe, filter, subclasses, root module), logging and the report, shared parameters, round
trip, errors. Models from real model code (GPT-2, attention): test_convert_models.py."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from fp8train.nn.convert import conversion_report, convert_to_float8_training, convert_to_linear
from fp8train.nn.modules.linear import Float8Linear
from fp8train.spec import recipes

LOGGER = "fp8train.nn.convert"
# Alignment of in_features and out_features per recipe (NUMERICS.md section 5).
ALIGNMENT = {
    "tensorwise": 16,
    "delayed": 16,
    "rowwise": 16,
    "rowwise_with_gw_hp": 16,
    "blockwise": 128,
    "mxfp8": 32,
    "nvfp4": 32,
    "mxfp4": 32,
}
# (in_features, out_features) of the model's layers, chosen so each recipe skips a
# different subset: 256x128 fits all, 128x192 not 128, 128x80 not 32 (nor 128), 128x24 none.
LAYER_DIMS = {
    "encoder.0": (256, 128),
    "encoder.2.proj": (128, 192),
    "decoder.fc": (128, 80),
    "lm_head": (128, 24),
}


class _Proj(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.proj = nn.Linear(*dims)

    def forward(self, x):
        return self.proj(x)


class _Model(nn.Module):
    """Linear layers nested in Sequential, a custom module and a ModuleDict."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(*LAYER_DIMS["encoder.0"]), nn.ReLU(), _Proj(LAYER_DIMS["encoder.2.proj"])
        )
        self.decoder = nn.ModuleDict({"fc": nn.Linear(*LAYER_DIMS["decoder.fc"])})
        self.lm_head = nn.Linear(*LAYER_DIMS["lm_head"])

    def forward(self, x):
        h = self.encoder(x)
        return self.decoder["fc"](h[..., :128]), self.lm_head(h[..., :128])


def _model(seed=0) -> _Model:
    torch.manual_seed(seed)
    return _Model()


def _converted_fqns(model: nn.Module) -> set[str]:
    return {fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}


def _convert_records(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def _expected_converted(alignment: int) -> set[str]:
    return {fqn for fqn, (k, n) in LAYER_DIMS.items() if alignment == 0 or (k % alignment == 0 and n % alignment == 0)}


def _share_pct(dims: dict, converted: set[str]) -> str:
    """The summary's share of matmul parameters (weights and biases) in FP8, as printed."""
    params = {fqn: k * n + n for fqn, (k, n) in dims.items()}
    return f"{100 * sum(params[f] for f in converted) / sum(params.values()):.1f}%"


@pytest.mark.parametrize("recipe_name", recipes.RECIPE_NAMES)
def test_converts_aligned_layers_and_logs_each_skip(recipe_name, caplog):
    model = _model()
    weights = {fqn: model.get_submodule(fqn).weight for fqn in LAYER_DIMS}
    with caplog.at_level(logging.INFO, logger=LOGGER):
        result = convert_to_float8_training(model, recipe_name)
    assert result is model
    expected = _expected_converted(ALIGNMENT[recipe_name])
    assert _converted_fqns(model) == expected
    for fqn in LAYER_DIMS:
        module = model.get_submodule(fqn)
        assert type(module) is (Float8Linear if fqn in expected else nn.Linear), fqn
        assert module.weight is weights[fqn]
        if fqn in expected:
            assert module.recipe.name == recipe_name
    messages = _convert_records(caplog)
    skipped = set(LAYER_DIMS) - expected
    skip_lines = [m for m in messages if "skipping" in m]
    assert len(skip_lines) == len(skipped)
    for fqn in skipped:
        (line,) = [m for m in skip_lines if re.search(rf"skipping {re.escape(fqn)}\b", m)]
        k, n = LAYER_DIMS[fqn]
        assert f"in_features={k}" in line and f"out_features={n}" in line and str(ALIGNMENT[recipe_name]) in line
    summary = (
        f"FP8 training ({recipe_name}): converted {len(expected)}/{len(LAYER_DIMS)} matmul modules, "
        f"{_share_pct(LAYER_DIMS, expected)} of matmul parameters in FP8"
    )
    assert messages[-1].startswith(summary)
    # Skips are a WARNING (shown without any logging setup), each named with its reason.
    last = [r for r in caplog.records if r.name == LOGGER][-1]
    assert last.levelno == (logging.WARNING if skipped else logging.INFO)
    assert (f"; {len(skipped)} skipped: " in messages[-1]) == bool(skipped)
    for fqn in skipped:
        assert re.search(rf"{re.escape(fqn)} \(Linear: in_features=\d+, out_features=\d+ are not", messages[-1])
    report = conversion_report(model)
    assert [m.fqn for m in report.modules] == list(LAYER_DIMS)
    assert {m.fqn for m in report.converted} == expected and {m.fqn for m in report.skipped} == skipped
    assert report.summary() == messages[-1]


def test_summary_line_format(caplog):
    """Three Linear layers, one of them misaligned for tensorwise."""
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 10))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        convert_to_float8_training(model, "tensorwise")
    summaries = [m for m in _convert_records(caplog) if "converted" in m]
    assert len(summaries) == 1
    assert re.fullmatch(
        r"FP8 training \(tensorwise\): converted 2/3 matmul modules, 96\.2% of matmul parameters in FP8; "
        r"1 skipped: 2 \(Linear: in_features=64, out_features=10 are not both multiples of 16\)",
        summaries[0],
    )
    report = conversion_report(model)
    assert (report.num_matmul_modules, report.num_converted) == (3, 2)
    assert report.fp8_param_share == pytest.approx((64 * 128 + 128 + 128 * 64 + 64) / (64 * 128 + 128 + 128 * 64 + 64 + 650))
    (skipped,) = report.skipped
    assert (skipped.fqn, skipped.module_type, skipped.status, skipped.num_params) == ("2", "Linear", "skipped", 650)


def test_dim_alignment_zero_turns_the_check_off(caplog):
    model = _model()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        convert_to_float8_training(model, "tensorwise", dim_alignment=0)
    assert _converted_fqns(model) == set(LAYER_DIMS)
    assert not [m for m in _convert_records(caplog) if "skipping" in m]
    outputs = model(torch.randn(4, 256))
    assert [o.shape for o in outputs] == [(4, 80), (4, 24)]


def test_explicit_dim_alignment_overrides_the_recipe():
    model = _model()
    convert_to_float8_training(model, "tensorwise", dim_alignment=64)
    assert _converted_fqns(model) == _expected_converted(64) == {"encoder.0", "encoder.2.proj"}


def test_module_filter_fn_excludes_layers(caplog):
    model = _model()
    seen = []

    def keep(module, fqn):
        seen.append((type(module), fqn))
        return fqn != "lm_head"

    with caplog.at_level(logging.INFO, logger=LOGGER):
        convert_to_float8_training(model, "tensorwise", module_filter_fn=keep, dim_alignment=0)
    assert sorted(fqn for _, fqn in seen) == sorted(LAYER_DIMS)
    assert all(cls is nn.Linear for cls, _ in seen)
    assert _converted_fqns(model) == set(LAYER_DIMS) - {"lm_head"}
    assert type(model.lm_head) is nn.Linear
    (line,) = [m for m in _convert_records(caplog) if "skipping" in m]
    assert "lm_head" in line and "module_filter_fn" in line
    share = _share_pct(LAYER_DIMS, set(LAYER_DIMS) - {"lm_head"})
    assert _convert_records(caplog)[-1] == (
        f"FP8 training (tensorwise): converted 3/4 matmul modules, {share} of matmul parameters in FP8; "
        "1 excluded by module_filter_fn: lm_head"
    )
    # A module the user excluded is no surprise: INFO, not a warning.
    assert [r.levelno for r in caplog.records if r.name == LOGGER][-1] == logging.INFO
    (excluded,) = conversion_report(model).excluded
    assert (excluded.fqn, excluded.reason) == ("lm_head", "excluded by module_filter_fn")


def test_root_linear_is_converted_and_returned():
    linear = nn.Linear(128, 256)
    converted = convert_to_float8_training(linear, "rowwise")
    assert type(converted) is Float8Linear and converted is not linear
    assert converted.weight is linear.weight and converted.bias is linear.bias
    assert convert_to_float8_training(nn.Linear(128, 100), "rowwise").__class__ is nn.Linear  # misaligned: kept
    back = convert_to_linear(converted)
    assert type(back) is nn.Linear and back.weight is linear.weight and back.bias is linear.bias


def test_parameters_are_shared_with_an_existing_optimizer():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {fqn: model.get_submodule(fqn).weight.detach().clone() for fqn in LAYER_DIMS}
    convert_to_float8_training(model, "tensorwise")
    optimizer_params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert {id(p) for p in model.parameters()} == optimizer_params
    out_fc, out_head = model(torch.randn(32, 256))
    (out_fc.square().mean() + out_head.square().mean()).backward()
    optimizer.step()
    for fqn in LAYER_DIMS:
        module = model.get_submodule(fqn)
        assert module.weight.grad is not None
        torch.testing.assert_close(module.weight.detach(), before[fqn] - 0.1 * module.weight.grad)
    assert isinstance(model.encoder[0], Float8Linear)


class MyLinear(nn.Linear):
    """A subclass whose forward is nn.Linear's, with an attribute of its own."""

    def __init__(self, *args, tag="mine", **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag


def test_linear_subclasses_are_skipped_with_the_way_to_opt_in(caplog):
    model = nn.Sequential(MyLinear(128, 128), nn.Linear(128, 128))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        convert_to_float8_training(model, "tensorwise")
    assert type(model[0]) is MyLinear and type(model[1]) is Float8Linear
    record = [r for r in caplog.records if r.name == LOGGER][-1]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "FP8 training (tensorwise): converted 1/2 matmul modules, 50.0% of matmul parameters in FP8; 1 skipped: "
        "0 (MyLinear: an nn.Linear subclass, whose forward may not be F.linear: pass linear_subclasses=(MyLinear,) "
        "to convert it if it is)"
    )


def test_opted_in_linear_subclasses_convert_and_come_back(caplog):
    model = nn.Sequential(MyLinear(128, 128, tag="kept"), nn.Linear(128, 128))
    original, x = model[0], torch.randn(4, 128)
    expected = model(x)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        convert_to_float8_training(model, "tensorwise", linear_subclasses=(MyLinear,))
    assert type(model[0]) is Float8Linear and model[0].weight is original.weight
    assert not torch.equal(model(x), expected)
    assert conversion_report(model).num_converted == 2
    assert [r.levelno for r in caplog.records if r.name == LOGGER][-1] == logging.INFO
    convert_to_linear(model)
    assert model[0] is original and original.tag == "kept" and type(model[1]) is nn.Linear
    assert torch.equal(model(x), expected)


@pytest.mark.heavy  # a subprocess or a JAX compile of seconds: CI's second leg runs it (default run under 6 minutes)
def test_skips_are_visible_without_any_logging_setup():
    """Python's default logging shows WARNING and above on stderr; INFO stays quiet."""
    code = (
        "import torch.nn as nn, fp8train\n"
        "fp8train.convert_to_float8_training(nn.Sequential(nn.Linear(64, 64)), 'tensorwise')\n"
        "fp8train.convert_to_float8_training(nn.Sequential(nn.Linear(64, 10)), 'tensorwise')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "FP8 training" in line]
    assert lines == [
        "FP8 training (tensorwise): converted 0/1 matmul modules, 0.0% of matmul parameters in FP8; "
        "1 skipped: 0 (Linear: in_features=64, out_features=10 are not both multiples of 16)"
    ]


def test_conversion_report_of_an_unconverted_model_says_what_to_do():
    with pytest.raises(ValueError, match=r"Sequential has no conversion report: call fp8train.convert_to_float8_training"):
        conversion_report(nn.Sequential(nn.Linear(16, 16)))
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        conversion_report("model")
    model = convert_to_float8_training(nn.Sequential(nn.Linear(16, 16)))
    convert_to_linear(model)
    with pytest.raises(ValueError, match="no conversion report"):
        conversion_report(model)


def test_a_model_without_matmul_modules_warns(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        convert_to_float8_training(nn.Sequential(nn.LayerNorm(16), nn.ReLU()), "tensorwise")
    record = [r for r in caplog.records if r.name == LOGGER][-1]
    assert record.levelno == logging.WARNING and "no matmul modules found" in record.getMessage()


def test_converting_twice_changes_nothing():
    model = _model()
    convert_to_float8_training(model, "tensorwise")
    modules = dict(model.named_modules())
    convert_to_float8_training(model, "rowwise")
    assert all(modules[fqn] is m for fqn, m in model.named_modules())
    assert model.encoder[0].recipe.name == "tensorwise"


@pytest.mark.parametrize("recipe_name", ["tensorwise", "delayed", "blockwise"])
def test_round_trip_back_to_nn_linear(recipe_name):
    model = _model()
    x = torch.randn(16, 256)
    expected = model(x)
    state_keys = list(model.state_dict())
    params = {name: p for name, p in model.named_parameters()}
    convert_to_float8_training(model, recipe_name)
    assert _converted_fqns(model)
    fp8_outputs = model(x)
    assert not torch.equal(fp8_outputs[0], expected[0])  # FP8 was really on
    result = convert_to_linear(model)
    assert result is model
    assert all(type(model.get_submodule(fqn)) is nn.Linear for fqn in LAYER_DIMS)
    assert not _converted_fqns(model)
    assert all(p is params[name] for name, p in model.named_parameters())
    assert list(model.state_dict()) == state_keys  # FP8 state dropped
    for got, want in zip(model(x), expected):
        assert torch.equal(got, want)


def test_errors():
    with pytest.raises(ValueError, match=r"unknown FP8 recipe 'fp4'; valid names: (?=.*tensorwise)(?=.*delayed)(?=.*rowwise_with_gw_hp)(?=.*blockwise)(?=.*mxfp8)"):
        convert_to_float8_training(_model(), "fp4")
    for bad in (-16, -1):
        with pytest.raises(ValueError, match=rf"dim_alignment={bad} must be an int >= 0"):
            convert_to_float8_training(_model(), "tensorwise", dim_alignment=bad)
    with pytest.raises(ValueError, match=r"dim_alignment=True must be an int >= 0"):
        convert_to_float8_training(_model(), "tensorwise", dim_alignment=True)
    with pytest.raises(TypeError, match=r"recipe=3.5 must be a Recipe or a recipe name"):
        convert_to_float8_training(_model(), 3.5)
    with pytest.raises(ValueError, match=r"backend='tpu' must be one of auto, emulated, hardware"):
        convert_to_float8_training(_model(), "tensorwise", backend="tpu")
    model = _model()
    with pytest.raises(ValueError):
        convert_to_float8_training(model, "tensorwise", dim_alignment=-1)
    assert not _converted_fqns(model)  # nothing half-converted
    for bad in (MyLinear, [MyLinear(4, 4)], (Float8Linear,), (nn.Conv1d,)):
        with pytest.raises(TypeError, match=r"linear_subclasses=.* must be a tuple of nn.Linear subclasses"):
            convert_to_float8_training(model, "tensorwise", linear_subclasses=bad)
    assert not _converted_fqns(model)
