"""``fp8train compare --seeds N``: the statistics against hand-computed values, the report,
and one tiny end-to-end run over 2 seeds."""

import json
import math

import pytest
import torch

from fp8train.train import user_model
from fp8train.train.commands.cli import main
from fp8train.train.commands.compare_seeds import (
    BEYOND, NOISE_STANDARD_ERRORS, WITHIN, format_seeds_report, gap_percent, summarize, summarize_seeds,
)
from fp8train.train.user_model import build_model

from .test_cli import PNG_SIGNATURE, TINY_FLAGS, _assert_one_line_error, _run

# ---------------------------------------------------------------------------- statistics, by hand


def _run_result(train: float, val: float, tokens_per_second: float = 1000.0, converted: int = 5) -> dict:
    return {"final_train_loss": train, "final_val_loss": val, "tokens_per_second": tokens_per_second,
            "converted_layers": converted, "total_linear_layers": 5}


def test_gap_percent_is_positive_for_the_higher_loss():
    assert gap_percent(2.02, 2.0) == pytest.approx(1.0)
    assert gap_percent(1.98, 2.0) == pytest.approx(-1.0)
    assert math.isnan(gap_percent(1.0, 0.0))


def test_summarize_uses_the_sample_standard_deviation():
    stats = summarize([2.0, 2.2, 2.1])
    # mean 2.1; squared deviations 0.01 + 0.01 + 0 = 0.02; / (n - 1) = 0.01 -> std 0.1
    # (the population std would be sqrt(0.02 / 3) = 0.0816).
    assert stats["n"] == 3
    assert stats["mean"] == pytest.approx(2.1)
    assert stats["std"] == pytest.approx(0.1)
    assert stats["se"] == pytest.approx(0.1 / math.sqrt(3))
    assert (stats["min"], stats["max"]) == (2.0, 2.2)


def test_summarize_of_one_value_or_a_nan_has_no_spread():
    assert math.isnan(summarize([2.0])["std"]) and summarize([2.0])["mean"] == 2.0
    assert math.isnan(summarize([2.0, math.nan])["mean"])


# bf16 under seeds 0, 1, 2: val losses 2.0, 2.2, 2.1 (mean 2.1, sample std 0.1).
BF16_VAL = {"0": 2.0, "1": 2.2, "2": 2.1}
BF16_TRAIN = {"0": 3.0, "1": 3.3, "2": 3.6}
# Paired val gaps in % per seed, and what each recipe's mean gap should be judged:
#   steady: +1, +1, +1 -> mean 1, std 0: beyond noise although 1% is far under bf16's 4.76%
#           seed-to-seed spread, because pairing removes that spread.
#   mixed:  +1, -1, +3 -> mean 1, std 2, se 2/sqrt(3) = 1.155, 2 se = 2.309: within noise.
#   edge:    0, +1, +2 -> mean 1, sample std 1, 2 se = 1.155: within (the population std
#           0.816 would give 2 se = 0.943 and call it beyond).
#   better: -1, -1, -1 -> mean -1: beyond noise, lower loss than bf16.
VAL_GAPS = {"steady": (1, 1, 1), "mixed": (1, -1, 3), "edge": (0, 1, 2), "better": (-1, -1, -1)}
EXPECTED = {
    "steady": (1.0, 0.0, BEYOND),
    "mixed": (1.0, 2.0, WITHIN),
    "edge": (1.0, 1.0, WITHIN),
    "better": (-1.0, 0.0, BEYOND),
}


def _hand_made_runs() -> dict:
    runs = {"bf16": {seed: _run_result(BF16_TRAIN[seed], BF16_VAL[seed]) for seed in BF16_VAL}}
    for name, gaps in VAL_GAPS.items():
        # Seeds in reverse order: pairing goes by seed, not by position.
        runs[name] = {
            seed: _run_result(BF16_TRAIN[seed] * 1.02, BF16_VAL[seed] * (1 + gap / 100))
            for seed, gap in reversed(list(zip(BF16_VAL, gaps)))
        }
    return runs


def test_paired_gaps_mean_std_and_verdicts_match_hand_computed_values():
    aggregates = summarize_seeds(_hand_made_runs(), "bf16")["aggregates"]
    for name, (mean, std, verdict) in EXPECTED.items():
        gaps = aggregates[name]["val_gap_percent"]
        assert gaps["mean"] == pytest.approx(mean), name
        assert gaps["std"] == pytest.approx(std, abs=1e-9), name
        assert gaps["se"] == pytest.approx(std / math.sqrt(3), abs=1e-9), name
        assert aggregates[name]["verdict"] == verdict, name
        # Every seed's train loss is 2% over bf16's: paired, the train gap has no spread.
        assert aggregates[name]["train_gap_percent"]["mean"] == pytest.approx(2.0)
        assert aggregates[name]["train_gap_percent"]["std"] == pytest.approx(0.0, abs=1e-9)
    mixed = aggregates["mixed"]["val_gap_percent"]
    assert (mixed["min"], mixed["max"]) == (pytest.approx(-1.0), pytest.approx(3.0))
    assert aggregates["bf16"]["verdict"] is None
    assert aggregates["bf16"]["val_gap_percent"]["mean"] == 0
    assert NOISE_STANDARD_ERRORS == 2


def test_losses_are_summarized_per_recipe():
    aggregates = summarize_seeds(_hand_made_runs(), "bf16")["aggregates"]
    bf16 = aggregates["bf16"]
    assert bf16["final_val_loss"]["mean"] == pytest.approx(2.1)
    assert bf16["final_val_loss"]["std"] == pytest.approx(0.1)
    assert bf16["final_train_loss"]["mean"] == pytest.approx(3.3)
    assert bf16["final_train_loss"]["std"] == pytest.approx(0.3)
    # steady: 2.02, 2.222, 2.121 -> mean 2.121, std 0.101
    assert aggregates["steady"]["final_val_loss"]["mean"] == pytest.approx(2.121)
    assert aggregates["steady"]["final_val_loss"]["std"] == pytest.approx(0.101)
    assert (aggregates["steady"]["tokens_per_second"], aggregates["steady"]["converted_layers"]) == (1000.0, 5)


def test_noise_floor_is_bf16s_val_loss_spread_over_seeds():
    noise = summarize_seeds(_hand_made_runs(), "bf16")["noise_floor"]
    assert noise["loss"] == "val"
    assert noise["mean"] == pytest.approx(2.1)
    assert noise["std"] == pytest.approx(0.1)
    assert noise["percent"] == pytest.approx(100 * 0.1 / 2.1)  # 4.76%


def test_without_validation_loss_the_noise_and_verdict_use_the_train_loss():
    runs = {
        "bf16": {"0": _run_result(3.0, math.nan), "1": _run_result(3.3, math.nan)},
        # train gaps +1% and +3%: mean 2, std sqrt(2), 2 se = 2: within (|2| <= 2)
        "fp8": {"0": _run_result(3.03, math.nan), "1": _run_result(3.399, math.nan)},
    }
    summary = summarize_seeds(runs, "bf16")
    assert summary["noise_floor"]["loss"] == "train"
    assert summary["noise_floor"]["std"] == pytest.approx(0.3 / math.sqrt(2))
    assert summary["aggregates"]["fp8"]["train_gap_percent"]["mean"] == pytest.approx(2.0)
    assert summary["aggregates"]["fp8"]["verdict"] == WITHIN
    assert math.isnan(summary["aggregates"]["fp8"]["val_gap_percent"]["mean"])


def test_a_recipe_with_other_seeds_is_an_error():
    runs = {"bf16": {"0": _run_result(3.0, 2.0), "1": _run_result(3.0, 2.0)}, "fp8": {"0": _run_result(3.0, 2.0)}}
    with pytest.raises(ValueError, match="recipe 'fp8' ran seeds"):
        summarize_seeds(runs, "bf16")


def test_report_states_spreads_noise_floor_and_verdicts():
    runs = _hand_made_runs()
    results = {
        "config": {"steps": 40, "batch_size": 8, "high_precision_modules": "auto"}, "model": "default GPT", "recipes": ["bf16", *VAL_GAPS],
        "seeds": [0, 1, 2], "runs": runs, **summarize_seeds(runs, "bf16"),
    }
    report = format_seeds_report(results)
    rows = {}  # the first table's row of each recipe
    for line in report.splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split("|")[1].strip(), line)
    assert "| bf16 | 3.3000 ± 0.3000 | 2.1000 ± 0.1000 | - | - | - |" in report
    assert "| +1.00% ± 2.00% | within noise (2 x SE = 2.31%) |" in rows["mixed"]
    assert "| -1.00% ± 0.00% | beyond noise (2 x SE = 0.00%) |" in rows["better"]
    assert "0.1000 (sample std), 4.76% of its mean 2.1000" in report
    assert "|mean| <= 2 x its standard error" in report
    assert "| mixed | 3.0600 – 3.6720 | 2.0200 – 2.1780 | +2.00% – +2.00% | -1.00% – +3.00% |" in report
    assert "| bf16 | 2.0000 | 2.2000 | 2.1000 |" in report  # every run's final val loss, by seed


# ---------------------------------------------------------------------------- end to end

DATA_BYTES = 8_000
STEPS = 4
SEEDS = 2


@pytest.fixture(scope="module")
def seeds_run(tmp_path_factory, corpus_file):
    """The output directory of a 2-seed compare, and the initial LM-head weights of its
    runs in the order they trained: (seed 5: bf16, tensorwise), (seed 6: bf16, tensorwise)."""
    output_dir = tmp_path_factory.mktemp("compare_seeds")
    argv = ["compare", "--seeds", str(SEEDS), "--recipes", "bf16,tensorwise", "--data", str(corpus_file(DATA_BYTES)),
            "--output_dir", str(output_dir), "--steps", str(STEPS), *TINY_FLAGS, "--seed", "5"]
    initial_weights = []

    def recording_build_model(args):
        model = build_model(args)
        initial_weights.append(model.lm_head.weight.detach().clone())
        return model

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(user_model, "build_model", recording_build_model)
        assert main(argv) == 0
    return output_dir, initial_weights


def test_compare_seeds_writes_a_run_per_recipe_and_seed(seeds_run):
    seeds_run, _ = seeds_run
    results = json.loads((seeds_run / "results.json").read_text())
    assert results["seeds"] == [5, 6]
    assert results["recipes"] == ["bf16", "tensorwise"]
    for name in ("bf16", "tensorwise"):
        assert sorted(results["runs"][name]) == ["5", "6"]
        for seed in (5, 6):
            run_dir = seeds_run / name / f"seed-{seed}"
            assert json.loads((run_dir / "config.json").read_text())["seed"] == seed
            assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == STEPS
    assert set(results["aggregates"]["tensorwise"]) >= {"final_val_loss", "val_gap_percent", "verdict"}
    assert results["aggregates"]["tensorwise"]["verdict"] in (WITHIN, BEYOND)
    assert results["noise_floor"]["loss"] == "val"
    report = (seeds_run / "report.md").read_text()
    assert "# fp8train compare, 2 seeds" in report and "Noise floor" in report and "| tensorwise |" in report
    assert (seeds_run / "loss_curves.png").read_bytes().startswith(PNG_SIGNATURE)


def test_seeds_differ_while_recipes_under_one_seed_start_alike(seeds_run):
    output_dir, initial_weights = seeds_run
    assert len(initial_weights) == 2 * SEEDS
    (bf16_5, tensorwise_5), (bf16_6, tensorwise_6) = initial_weights[:2], initial_weights[2:]
    assert torch.equal(bf16_5, tensorwise_5) and torch.equal(bf16_6, tensorwise_6)
    assert not torch.equal(bf16_5, bf16_6)
    runs = json.loads((output_dir / "results.json").read_text())["runs"]
    assert runs["bf16"]["5"]["losses"] != runs["bf16"]["6"]["losses"]
    assert runs["bf16"]["5"]["final_val_loss"] != runs["bf16"]["6"]["final_val_loss"]
    # The gap of each run is against bf16 under its own seed.
    tensorwise = runs["tensorwise"]["6"]
    assert tensorwise["val_gap_percent"] == pytest.approx(
        gap_percent(tensorwise["final_val_loss"], runs["bf16"]["6"]["final_val_loss"])
    )


@pytest.mark.parametrize("value, fragment", [
    ("0", "--seeds 0 must be an int >= 1"),
    ("two", "'two' is not a valid int"),
])
def test_seeds_must_be_a_positive_int(value, fragment, capsys, tmp_path):
    code, _, err = _run(["compare", "--seeds", value, "--output_dir", str(tmp_path)], capsys)
    if value == "0":
        _assert_one_line_error(code, err, "compare", fragment)
    else:  # argparse's own type error
        assert code == 2 and fragment in err
    assert not list(tmp_path.iterdir())


def test_the_report_shows_memory_beside_the_losses(seeds_run):
    output_dir, _ = seeds_run
    report = (output_dir / "report.md").read_text()
    assert "| bytes/param (weights + grads + optimizer) |" in report
    # float32 weights and gradients, torch.optim.AdamW's two float32 moments (and step counts).
    bf16_row = next(line for line in report.splitlines() if line.startswith("| bf16 | "))
    assert bf16_row.endswith("| 4.0 + 4.0 + 8.0 = 16.0 |")
