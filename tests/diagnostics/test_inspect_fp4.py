"""``fp8train.inspect`` on the 4-bit recipes: operand statistics in the domain the codes hold
(NVFP4's Hadamard-transformed grad_weight operands), 4-bit thresholds, and a measurement
that leaves the generator stochastic rounding draws from as it was."""

import json
import logging
import math

import pytest
import torch
from torch import nn

import fp8train
from fp8train.diagnostics.gemm_capture import RESULT, NumericsRecord
from fp8train.quant.hadamard import random_hadamard_transform
from fp8train.diagnostics.statistics import sqnr_db
from fp8train.diagnostics.inspection import Thresholds

FP4_RECIPES = ("nvfp4", "mxfp4")


def _model_and_batch(tokens: int = 48):
    torch.manual_seed(0)
    return nn.Linear(128, 64), torch.randn(tokens, 128, generator=torch.Generator().manual_seed(1))


def _inspect(recipes):
    model, x = _model_and_batch()
    return model, x, fp8train.inspect(model, x, recipes=recipes)


def _record(inspection, **fields) -> NumericsRecord:
    (record,) = [r for r in inspection if all(getattr(r, k) == v for k, v in fields.items())]
    return record


def test_hadamard_operands_are_measured_against_the_transformed_tensor():
    # NVFP4's grad_weight input: 1x16 groups along the tokens (48 padded to 64), through the
    # transform. Its codes approximate H x, not x: measured against x it would be noise.
    _, x, inspection = _inspect(["nvfp4"])
    record = _record(inspection, gemm="grad_weight", operand="input")
    padded = torch.cat([x, torch.zeros(16, 128)])
    dequantized = fp8train.quant.quantize(padded, "nvfp4", axis=0, rht=True).dequantize()[:48]
    transformed = random_hadamard_transform(padded, 0)[:48]
    assert record.sqnr_db == pytest.approx(sqnr_db(transformed, dequantized), abs=1e-3)
    assert record.sqnr_db > 15 > sqnr_db(x, dequantized)
    assert record.granularity == "nvfp4" and record.format == "E2M1" and record.data_bits == 4
    # The GEMM itself is unchanged by the two transforms: its result is near the 4-bit norm.
    assert _record(inspection, gemm="grad_weight", operand=RESULT).sqnr_db > 12


@pytest.mark.parametrize("name", FP4_RECIPES)
def test_every_gemm_of_a_4bit_recipe_is_measured_and_within_the_4bit_limits(name):
    _, _, inspection = _inspect([name])
    assert {(r.gemm, r.operand) for r in inspection} == {
        ("output", "input"), ("output", "weight"), ("output", RESULT),
        ("grad_input", "grad_output"), ("grad_input", "weight"), ("grad_input", RESULT),
        ("grad_weight", "grad_output"), ("grad_weight", "input"), ("grad_weight", RESULT),
    }
    for record in inspection:
        assert record.data_bits == 4
        assert record.saturation_pct in (None, 0.0)  # 4-bit scales put a block's amax at or below 6.375
        assert not record.flags, record
    # E2M1 flushes what lies under 1/24 of a block's amax: a few % of Gaussian values.
    assert 1 < _record(inspection, gemm="output", operand="input").underflow_pct < 25


def test_measuring_draws_no_random_numbers():
    # NVFP4 rounds grad_output stochastically from the default generator.
    model, x = _model_and_batch()
    torch.manual_seed(5)
    state = torch.get_rng_state()
    fp8train.inspect(model, x, recipes=["nvfp4"])
    assert torch.equal(state, torch.get_rng_state())


def test_4bit_records_are_flagged_by_the_4bit_limits():
    thresholds = Thresholds()
    common = dict(layer="l", call=0, recipe="nvfp4", gemm="output", operand="input", amax=1.0, nonfinite=0,
                  saturation_pct=0.0)
    typical = NumericsRecord(sqnr_db=15.0, underflow_pct=10.0, data_bits=4, **common)
    assert thresholds.flags(typical) == ()
    assert thresholds.flags(NumericsRecord(sqnr_db=15.0, underflow_pct=10.0, data_bits=8, **common)) == (
        "sqnr", "underflow")
    poor = NumericsRecord(sqnr_db=11.0, underflow_pct=30.0, data_bits=4, **common)
    assert thresholds.flags(poor) == ("sqnr", "underflow")
    assert "4-bit: 12 dB" in thresholds.describe()
    with pytest.raises(ValueError, match="fp4_max_underflow_pct"):
        Thresholds(fp4_max_underflow_pct=-1)
    with pytest.raises(ValueError, match="fp4_min_sqnr_db"):
        Thresholds(fp4_min_sqnr_db=math.nan)


def test_the_command_converts_as_the_trainer_does(tmp_path, corpus_file, caplog):
    # --fp8_recipe nvfp4 converts the model first, its head left in high precision: the head is
    # still measured (a plain Linear, hooked), and the conversion line says why it stayed.
    from fp8train.train.commands.cli import main

    caplog.set_level(logging.INFO)
    flags = ["--n_layer", "1", "--n_embd", "128", "--n_head", "2", "--seq_len", "32", "--batch_size", "2",
             "--device", "cpu"]
    code = main(["inspect", "--data", str(corpus_file(8_000)), "--output_dir", str(tmp_path), "--recipes", "mxfp4",
                 "--fp8_recipe", "nvfp4", *flags])
    assert code == 0
    records = json.loads((tmp_path / "records.json").read_text())["records"]
    assert {r["layer"] for r in records} == {"blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.fc",
                                             "blocks.0.fc_proj", "lm_head"}
    assert any("in high precision: lm_head (the head: a 4-bit recipe's default" in r.getMessage()
               for r in caplog.records)
