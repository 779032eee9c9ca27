"""``fp8train.inspect``: faults injected into a model are found where they are, the
numbers agree with an independent float64 computation, and the model is left untouched."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import fp8train
from fp8train import convert_to_float8_training
from fp8train.diagnostics.gemm_capture import RESULT
from fp8train.spec.recipes import RECIPE_NAMES, from_name
from fp8train.diagnostics.inspection import Thresholds

BLOCK_RECIPES = ("blockwise", "mxfp8")
OUTLIER_RATIO = 1e5


def _mlp(seed: int = 0, *, dims) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for i, (d_in, d_out) in enumerate(zip(dims, dims[1:])):
        layers += [nn.Linear(d_in, d_out)] + ([nn.ReLU()] if i < len(dims) - 2 else [])
    return nn.Sequential(*layers)


def _records(inspection, **fields):
    return [r for r in inspection if all(getattr(r, k) == v for k, v in fields.items())]


def test_weight_outliers_are_flagged_for_underflow_under_tensorwise_in_that_layer_only():
    # Layer "2": a 1024x1024 weight, 64 tiles of 128x128, one of them holding the outliers.
    model = _mlp(dims=(256, 1024, 1024, 256))
    with torch.no_grad():  # three outliers, all in one 128x128 tile of layer "2"'s weight
        weight = model[2].weight
        outlier = OUTLIER_RATIO * weight.std()
        for row, col in ((5, 7), (40, 90), (100, 3)):
            weight[row, col] = outlier
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    inspection = fp8train.inspect(model, x, recipes=("tensorwise", "delayed", *BLOCK_RECIPES))
    for name in ("tensorwise", "delayed"):
        flagged = {r.layer for r in _records(inspection, recipe=name, operand="weight") if "underflow" in r.flags}
        assert flagged == {"2"}, name
    for name in BLOCK_RECIPES:
        assert not [r for r in _records(inspection, recipe=name, operand="weight") if "underflow" in r.flags], name
    # The outlier layer's weight: about 17% of its values flush to zero under one scale.
    (record,) = _records(inspection, recipe="tensorwise", layer="2", gemm="output", operand="weight")
    assert 5 < record.underflow_pct < 30
    assert record.amax == pytest.approx(float(model[2].weight.detach().abs().max()))


def _train_delayed(model, inputs, steps=3):
    for _ in range(steps):
        with fp8train.autocast():
            model(inputs).pow(2).mean().backward()


def test_a_stale_delayed_scale_is_flagged_for_saturation():
    model = convert_to_float8_training(_mlp(dims=(128, 128, 128)), "delayed")
    generator = torch.Generator().manual_seed(2)
    _train_delayed(model, 0.01 * torch.randn(64, 128, generator=generator))
    # The history holds amaxes 100x smaller than the input now.
    inspection = fp8train.inspect(model, torch.randn(64, 128, generator=generator), recipes=["delayed", "tensorwise"])
    (stale,) = _records(inspection, recipe="delayed", layer="0", gemm="output", operand="input")
    assert "saturation" in stale.flags and stale.saturation_pct > 50
    assert stale.scale_min == pytest.approx(float(model[0].fp8_scale[0]))
    (grad_output,) = _records(inspection, recipe="delayed", layer="0", gemm="grad_input", operand="grad_output")
    assert grad_output.scale_min == pytest.approx(float(model[0].fp8_scale[2]))
    (fresh,) = _records(inspection, recipe="tensorwise", layer="0", gemm="output", operand="input")
    assert fresh.saturation_pct == 0 and not fresh.flags


def test_gemm_result_sqnr_matches_an_independent_float64_gemm():
    model = _mlp(dims=(128, 256))
    x = torch.randn(48, 128, generator=torch.Generator().manual_seed(3))
    inspection = fp8train.inspect(model, x, recipes=["rowwise", "tensorwise"])
    weight = model[0].weight.detach()
    for name in ("rowwise", "tensorwise"):
        plan = from_name(name).operand_plan
        op_x, op_w = (plan.operand(u) for u in fp8train.spec.roles.Gemm.OUTPUT.usages)
        x_dq = fp8train.quant.quantize(x, op_x.granularity, dtype=torch.float8_e4m3fn, power_2_scales=op_x.power_2_scales).dequantize()
        w_dq = fp8train.quant.quantize(weight, op_w.granularity, dtype=torch.float8_e4m3fn, power_2_scales=op_w.power_2_scales).dequantize()
        reference = x.double() @ weight.double().t()
        approximation = x_dq.double() @ w_dq.double().t()
        expected = 10 * math.log10(float(reference.pow(2).sum() / (reference - approximation).pow(2).sum()))
        (result,) = _records(inspection, recipe=name, gemm="output", operand=RESULT)
        assert result.sqnr_db == pytest.approx(expected, abs=0.01)
        (operand,) = _records(inspection, recipe=name, gemm="output", operand="input")
        expected_operand = 10 * math.log10(float(x.double().pow(2).sum() / (x.double() - x_dq.double()).pow(2).sum()))
        assert operand.sqnr_db == pytest.approx(expected_operand, abs=1e-3)


def test_every_recipe_every_gemm_and_operand():
    model = _mlp(dims=(128, 128, 128))
    inspection = fp8train.inspect(model, torch.randn(2, 40, 128))
    assert inspection.recipes == list(RECIPE_NAMES)
    assert inspection.layers == [("0", 0), ("2", 0)]
    for name in RECIPE_NAMES:
        plan = from_name(name).operand_plan
        for layer in ("0", "2"):
            got = {(r.gemm, r.operand) for r in _records(inspection, recipe=name, layer=layer)}
            expected = {
                (gemm.value, operand)
                for gemm in fp8train.spec.roles.Gemm
                if plan.quantizes(gemm)
                for operand in [u.role.value for u in gemm.usages] + [RESULT]
            }
            assert got == expected, (name, layer)
    assert not _records(inspection, recipe="rowwise_with_gw_hp", gemm="grad_weight")  # high precision there
    assert not inspection.flagged()
    for record in inspection:
        assert record.data_bits == from_name(record.recipe).role_format("input").bits
        min_sqnr_db = Thresholds().limits(record.data_bits)[0]
        assert record.nonfinite == 0 and record.sqnr_db > min_sqnr_db


def test_the_model_is_left_as_it_was():
    model = convert_to_float8_training(_mlp(dims=(128, 128, 128)), "delayed")
    model.insert(1, nn.Dropout(0.5))
    _train_delayed(model, torch.randn(32, 128))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    x = torch.randn(32, 128)
    rng = torch.get_rng_state()
    fp8train.inspect(model, x)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())
    assert torch.equal(rng, torch.get_rng_state())


def test_nonfinite_input_is_counted_and_flagged():
    model = _mlp(dims=(128, 128))
    x = torch.randn(32, 128)
    x[3, 5] = float("nan")
    inspection = fp8train.inspect(model, x, recipes=["tensorwise"])
    (record,) = _records(inspection, gemm="output", operand="input")
    assert record.nonfinite == 1 and "nonfinite" in record.flags


class _Kwargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(128, 128)
        self.head = nn.Linear(128, 32)  # not a multiple of 128: blockwise skips it

    def forward(self, input_ids, scale=1.0):
        hidden = self.proj(input_ids) * scale
        hidden = self.proj(hidden)  # called twice
        return SimpleNamespace(loss=self.head(hidden).pow(2).mean())


def test_batch_forms_loss_and_skipped_layers(tmp_path):
    model = _Kwargs()
    x = torch.randn(16, 128)
    inspection = fp8train.inspect(model, {"input_ids": x, "scale": 2.0}, recipes=["blockwise", "tensorwise"], report_dir=tmp_path)
    assert inspection.layers == [("proj", 0), ("proj", 1), ("head", 0)]
    assert inspection.skipped["blockwise"] == {"head": "in_features=128, out_features=32 are not both multiples of 128"}
    assert _records(inspection, recipe="blockwise", layer="proj", call=1)
    assert not _records(inspection, recipe="blockwise", layer="head")
    report = (tmp_path / "report.md").read_text()
    assert "| proj (call 2) |" in report and "head under blockwise" in report
    data = json.loads((tmp_path / "records.json").read_text())
    assert len(data["records"]) == len(inspection)
    assert (tmp_path / "heatmap.png").stat().st_size > 10_000
    # A tuple of positional arguments, and a tensor; the default loss: the mean square.
    plain = _mlp(dims=(128, 128))
    assert len(fp8train.inspect(plain, (x,), recipes=["tensorwise"])) == 9
    assert len(fp8train.inspect(plain, x, recipes=["tensorwise"], loss_fn=lambda out: out.sum())) == 9


def test_under_torch_autocast_the_gemm_dtype_is_captured():
    model = _mlp(dims=(128, 128))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inspection = fp8train.inspect(model, torch.randn(32, 128), recipes=["tensorwise"])
    (weight,) = _records(inspection, gemm="output", operand="weight")
    assert weight.amax == float(model[0].weight.detach().bfloat16().abs().max())


def test_thresholds_and_best_recipes():
    thresholds = Thresholds(min_sqnr_db=40.0)
    model = _mlp(dims=(128, 128))
    inspection = fp8train.inspect(model, torch.randn(32, 128), recipes=["tensorwise", "rowwise"], thresholds=thresholds)
    assert all("sqnr" in r.flags for r in inspection)  # nothing reaches 40 dB
    scores = {name: inspection.worst_gemm_sqnr("0", 0, name) for name in ("tensorwise", "rowwise")}
    best = inspection.best_recipes("0")
    assert max(scores, key=scores.get) in best
    assert set(best) == {name for name, score in scores.items() if score >= max(scores.values()) - 0.1}
    with pytest.raises(ValueError, match="max_underflow_pct"):
        Thresholds(max_underflow_pct=-1)


def test_errors():
    model = _mlp(dims=(128, 128))
    with pytest.raises(TypeError, match="batch of type set"):
        fp8train.inspect(model, {1, 2})
    with pytest.raises(TypeError, match="scalar tensor"):
        fp8train.inspect(model, torch.randn(4, 128), loss_fn=lambda out: out)
    with pytest.raises(ValueError, match="no nn.Linear"):
        fp8train.inspect(nn.ReLU(), torch.randn(4))
    with pytest.raises(ValueError, match="not_a_recipe"):
        fp8train.inspect(model, torch.randn(4, 128), recipes=["not_a_recipe"])
    with pytest.raises(TypeError, match="loss_fn"):
        fp8train.inspect(model, torch.randn(4, 128), loss_fn=3)


# ---------------------------------------------------------------------------- the command line
TINY_FLAGS = [
    "--n_layer", "1", "--n_embd", "128", "--n_head", "2", "--seq_len", "32", "--batch_size", "4", "--device", "cpu",
]


def test_the_command_writes_the_report_and_prints_the_summary(tmp_path, corpus_file, capsys):
    from fp8train.train.commands.cli import main

    data = str(corpus_file(8_000))
    train_dir = tmp_path / "run"
    assert main(["train", "--data", data, "--output_dir", str(train_dir), "--steps", "2",
                 "--fp8_recipe", "delayed", *TINY_FLAGS]) == 0
    capsys.readouterr()
    out_dir = tmp_path / "inspect"
    code = main(["inspect", "--data", data, "--output_dir", str(out_dir), "--recipes", "tensorwise,delayed",
                 "--fp8_recipe", "delayed", "--checkpoint", str(train_dir / "checkpoint-2"), *TINY_FLAGS])
    out = capsys.readouterr().out
    assert code == 0
    assert "## Worst GEMM per layer" in out and "| lm_head |" in out and "Every FP8 GEMM" not in out
    assert {p.name for p in out_dir.iterdir()} == {"report.md", "records.json", "heatmap.png"}
    records = json.loads((out_dir / "records.json").read_text())["records"]
    # 5 layers x 2 recipes x 9 records; the delayed records use the checkpoint's scales.
    assert len(records) == 90
    code = main(["inspect", "--output_dir", str(out_dir), "--recipes", "nope", *TINY_FLAGS])
    assert code == 2 and "nope" in capsys.readouterr().err
