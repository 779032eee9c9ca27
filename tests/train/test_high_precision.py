"""``high_precision_modules`` (train/high_precision.py): the matching rule, the 4-bit recipes'
high-precision head, the trainer's conversion line, and the errors of the flag."""

import logging

import pytest
import torch
from torch import nn

from fp8train import Float8Linear
from fp8train.spec.recipes import from_name
from fp8train.train.arguments import TrainingArguments
from fp8train.train.commands.compare import format_report
from fp8train.train.high_precision import (
    describe_setting, head_names, parse_patterns, select_high_precision,
)
from fp8train.train.trainer_setup import build_training_model
from fp8train.train.user_model import build_model

from ._trainer_helpers import NUM_LINEAR_LAYERS, _args, _train

NVFP4, MXFP8 = from_name("nvfp4"), from_name("mxfp8")
CPU = torch.device("cpu")


class _Stack(nn.Module):
    """``model.layers.{0,1,10}.{attn.q, mlp.fc, mlp.fc_proj}``, ``out`` (the head, named by
    ``get_output_embeddings``), ``odd`` (48 outputs: no 4-bit recipe converts it)."""

    def __init__(self, with_head_method: bool = True):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({
            str(i): nn.ModuleDict({
                "attn": nn.ModuleDict({"q": nn.Linear(64, 64)}),
                "mlp": nn.ModuleDict({"fc": nn.Linear(64, 64), "fc_proj": nn.Linear(64, 64)}),
            })
            for i in (0, 1, 10)
        })
        self.odd = nn.Linear(64, 48)
        self.out = nn.Linear(64, 256)
        self.with_head_method = with_head_method

    def get_output_embeddings(self):
        return self.out if self.with_head_method else None


def _kept(pattern: str, recipe=NVFP4, model=None) -> set[str]:
    return set(select_high_precision(model or _Stack(), pattern, recipe).reasons)


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("model.layers.0.mlp.fc", {"model.layers.0.mlp.fc"}),  # the whole qualified name
        ("fc", {f"model.layers.{i}.mlp.fc" for i in (0, 1, 10)}),  # one part: not fc_proj
        ("layers.1", {f"model.layers.1.{m}" for m in ("attn.q", "mlp.fc", "mlp.fc_proj")}),  # a block
        ("layers.1*", {f"model.layers.{i}.{m}" for i in (1, 10) for m in ("attn.q", "mlp.fc", "mlp.fc_proj")}),
        ("layers.*.attn.q", {f"model.layers.{i}.attn.q" for i in (0, 1, 10)}),
        ("mlp.fc*", {f"model.layers.{i}.mlp.{m}" for i in (0, 1, 10) for m in ("fc", "fc_proj")}),
        ("odd,layers.0.attn", {"odd", "model.layers.0.attn.q"}),
        ("none", set()),
        ("", set()),
    ],
)
def test_matching_rule_under_an_fp8_recipe(pattern, expected):
    assert _kept(pattern, MXFP8) == expected  # FP8: 'auto' is nothing, patterns are all


def test_the_4bit_head_by_default_and_beside_patterns():
    assert _kept("auto") == {"out"}
    assert _kept("auto", MXFP8) == set()
    assert _kept("auto,layers.0.mlp.fc") == {"out", "model.layers.0.mlp.fc"}
    assert _kept("layers.0.mlp.fc") == {"model.layers.0.mlp.fc"}  # patterns replace the default
    assert _kept("none") == set()
    chosen = select_high_precision(_Stack(), "auto,out", NVFP4)
    assert chosen.reasons == {"out": "the head: a 4-bit recipe's default, high_precision_modules='auto'"}


def test_the_head_of_the_default_gpt_and_of_transformers_llama():
    assert head_names(_Stack()) == ["out"]
    assert head_names(_Stack(with_head_method=False)) == []  # no lm_head either
    assert head_names(build_model(_args("unused"))) == ["lm_head"]  # by name
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=256, max_position_embeddings=32,
    )
    assert head_names(transformers.LlamaForCausalLM(config)) == ["lm_head"]  # get_output_embeddings()


def test_no_head_found_is_said():
    chosen = select_high_precision(_Stack(with_head_method=False), "auto", NVFP4)
    assert chosen.reasons == {} and "no head found" in chosen.note


def test_malformed_and_unmatched_patterns_are_errors_naming_them():
    with pytest.raises(ValueError, match="empty pattern between commas"):
        parse_patterns("lm_head,,fc")
    with pytest.raises(ValueError, match="'none' beside patterns"):
        parse_patterns("none,lm_head")
    with pytest.raises(ValueError, match="empty pattern"):
        TrainingArguments(high_precision_modules="lm_head,")
    with pytest.raises(ValueError, match=r"pattern 'layers\.2' names none .*\(model\.layers\.0\.attn\.q, .*in all\)"):
        select_high_precision(_Stack(), "fc,layers.2", MXFP8)
    assert parse_patterns(" AUTO , lm_head ") == ("auto", "lm_head")


def _settings(high_precision_modules: str) -> TrainingArguments:
    return TrainingArguments(fp8_recipe="nvfp4", high_precision_modules=high_precision_modules, device="cpu")


def test_the_trainer_keeps_the_head_and_logs_why(caplog):
    caplog.set_level(logging.INFO, logger="fp8train.train.trainer_setup")
    converted, converted_count, total = build_training_model(_Stack, _settings("auto,layers.10"), CPU)
    assert (converted_count, total) == (6, 11)
    assert type(converted.out) is nn.Linear and type(converted.odd) is nn.Linear
    assert isinstance(converted.model.layers["0"]["mlp"]["fc"], Float8Linear)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "fp8train.train.trainer_setup"]
    assert line.startswith("nvfp4: 6/11 matmul modules converted; in high precision: ")
    assert "model.layers.10.attn.q (pattern 'layers.10')" in line
    assert "odd (in_features=64, out_features=48 are not both multiples of 32)" in line
    assert "out (the head: a 4-bit recipe's default, high_precision_modules='auto')" in line
    assert build_training_model(_Stack, _settings("none"), CPU)[1:] == (10, 11)  # all but odd
    with pytest.raises(ValueError, match=r"converted none of the model's 11 matmul modules: .*pattern 'layers'"):
        build_training_model(_Stack, _settings("layers,out"), CPU)


def test_the_report_says_what_stayed_in_high_precision():
    assert describe_setting("auto") == "the model's head under a 4-bit recipe (auto)"
    assert describe_setting("") == describe_setting("none")
    assert "'lm_head', 'layers.11'" in describe_setting("lm_head,layers.11")
    results = {
        "config": {**TrainingArguments(high_precision_modules="none").to_dict(), "steps": 2},
        "model": "default GPT", "recipes": ["bf16"],
        "runs": {"bf16": {"final_train_loss": 1.0, "final_val_loss": 1.0, "tokens_per_second": 1.0,
                          "converted_layers": 0, "total_linear_layers": 5}},
    }
    assert "Kept in high precision: none (" in format_report(results)


@pytest.mark.slow  # ~20 s of CPU where nothing has compiled the 4-bit kernels yet
def test_a_4bit_run_trains_with_its_head_in_high_precision_and_measuring_it_changes_nothing(tmp_path, datasets):
    # Stochastic rounding draws from the default generator; the statistics steps must not
    # (test_inspect_fp4.py checks the same of one measurement, in the default run).
    quiet = _train(_args(tmp_path / "quiet", steps=2, fp8_recipe="nvfp4", fp8_stats_interval=0), datasets)
    measured = _train(_args(tmp_path / "measured", steps=2, fp8_recipe="nvfp4", fp8_stats_interval=1), datasets)
    assert quiet["losses"] == measured["losses"]
    assert (measured["converted_layers"], measured["total_linear_layers"]) == (NUM_LINEAR_LAYERS - 1, NUM_LINEAR_LAYERS)
