"""In-training telemetry (``fp8_stats_interval``): the FP8 layers' quantization statistics
in ``metrics.jsonl`` every N steps, checked against values computed by hand."""

import math

import torch

from fp8train.train.commands.compare import build_model

from ._trainer_helpers import NUM_LINEAR_LAYERS, _args, _metrics, _train

E4M3_MAX = 448.0
RECORDS_PER_LAYER = 9  # three GEMMs x (two operands + the result), tensorwise


def test_statistics_every_n_steps(tmp_path, datasets):
    args = _args(tmp_path, steps=4, fp8_recipe="tensorwise", fp8_stats_interval=2)
    _train(args, datasets)
    records = _metrics(tmp_path)
    assert ["fp8_stats" in record for record in records] == [False, True, False, True]
    stats = records[1]["fp8_stats"]
    assert len(stats) == NUM_LINEAR_LAYERS * RECORDS_PER_LAYER
    assert {(s["gemm"], s["operand"]) for s in stats} == {
        (gemm, operand)
        for gemm, operands in (("output", ("input", "weight")), ("grad_input", ("grad_output", "weight")),
                               ("grad_weight", ("grad_output", "input")))
        for operand in (*operands, "result")
    }
    for s in stats:
        assert s["nonfinite"] == 0 and s["sqnr_db"] > 15, s


def test_step_one_weight_statistics_match_the_initial_weights(tmp_path, datasets):
    # Tensorwise, under bf16 autocast: the weight operand at step 1 is the initial weight
    # in bf16; its scale is 448 / amax, computed here independently.
    args = _args(tmp_path, steps=1, fp8_recipe="tensorwise", fp8_stats_interval=1)
    _train(args, datasets)
    (record,) = _metrics(tmp_path)
    torch.manual_seed(args.seed)
    initial = build_model(args)
    for name, module in initial.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        amax = float(module.weight.detach().bfloat16().abs().max())
        (weight,) = [s for s in record["fp8_stats"] if (s["layer"], s["gemm"], s["operand"]) == (name, "output", "weight")]
        assert weight["amax"] == amax
        assert weight["scale_min"] == weight["scale_max"]
        assert math.isclose(weight["scale_min"], float(torch.tensor(E4M3_MAX) / torch.tensor(amax)), rel_tol=1e-7)
        assert weight["saturation_pct"] == 0.0


def test_off_without_fp8_or_at_zero(tmp_path, datasets):
    _train(_args(tmp_path / "bf16", steps=2, fp8_stats_interval=1), datasets)
    _train(_args(tmp_path / "off", steps=2, fp8_recipe="rowwise", fp8_stats_interval=0), datasets)
    for run in ("bf16", "off"):
        assert not any("fp8_stats" in record for record in _metrics(tmp_path / run))
