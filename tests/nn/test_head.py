"""The output head's rule (:mod:`fp8train.nn.head`): under a 4-bit recipe
``convert_to_float8_training`` keeps the head in high precision by default, says so in its
log and report, and ``keep_head`` overrides the default both ways; the trainer's
``high_precision_modules=auto`` is the same rule."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from torch import nn

from fp8train.nn.convert import conversion_report, convert_to_float8_training
from fp8train.nn.head import HEAD_KEPT_REASON, NO_HEAD_NOTE, head_names, heads_kept
from fp8train.nn.modules.linear import Float8Linear
from fp8train.nn.report import CONVERTED, EXCLUDED, HEAD
from fp8train.spec import recipes
from fp8train.train.high_precision import select_high_precision

LOGGER = "fp8train.nn.convert"
FOUR_BIT = ("nvfp4", "mxfp4")
EIGHT_BIT = tuple(name for name in recipes.RECIPE_NAMES if name not in FOUR_BIT)


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=256,
    )
    return transformers.LlamaForCausalLM(config)


class _Named(nn.Module):
    """A head found by its name alone (no ``get_output_embeddings``)."""

    def __init__(self, head_name: str = "lm_head") -> None:
        super().__init__()
        self.body = nn.Linear(128, 128)
        setattr(self, head_name, nn.Linear(128, 256))


class _OutputEmbeddings(nn.Module):
    """``get_output_embeddings()`` names the head, whatever it is called."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(128, 128)
        self.lm_head = nn.Linear(128, 128)  # a module named lm_head that is not the head
        self.to_logits = nn.Linear(128, 256)

    def get_output_embeddings(self) -> nn.Module:
        return self.to_logits


def test_recipes_say_whether_they_keep_the_head():
    assert all(recipes.from_name(name).keeps_head_in_high_precision for name in FOUR_BIT)
    assert not any(recipes.from_name(name).keeps_head_in_high_precision for name in EIGHT_BIT)


@pytest.mark.parametrize("recipe", FOUR_BIT)
def test_a_4bit_conversion_keeps_the_head_and_says_why(recipe, caplog):
    model = _llama()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        convert_to_float8_training(model, recipe, backend="emulated")
    assert type(model.lm_head) is nn.Linear
    assert all(type(m) is Float8Linear for name, m in model.named_modules() if name.startswith("model.layers.0.") and isinstance(m, nn.Linear))
    report = conversion_report(model)
    (head,) = report.heads
    assert (head.fqn, head.status, head.reason) == ("lm_head", HEAD, HEAD_KEPT_REASON)
    assert report.num_converted == report.num_matmul_modules - 1 == 7
    said = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert f"FP8 training: skipping lm_head: {HEAD_KEPT_REASON}" in said
    assert said[-1] == report.summary()
    assert report.summary().endswith(f"; head kept in high precision: lm_head ({HEAD_KEPT_REASON})")


@pytest.mark.parametrize("recipe", FOUR_BIT)
def test_keep_head_false_converts_the_head_under_4bit(recipe):
    model = convert_to_float8_training(_llama(), recipe, backend="emulated", keep_head=False)
    assert type(model.lm_head) is Float8Linear
    assert conversion_report(model).heads == ()


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_fp8_recipes_convert_the_head_unless_asked_to_keep_it(recipe):
    assert type(convert_to_float8_training(_llama(), recipe, backend="emulated").lm_head) is Float8Linear
    kept = convert_to_float8_training(_llama(), recipe, backend="emulated", keep_head=True)
    assert type(kept.lm_head) is nn.Linear and conversion_report(kept).heads[0].status == HEAD


def test_the_filter_still_excludes_other_modules_beside_the_kept_head():
    model = convert_to_float8_training(
        _llama(), "mxfp4", backend="emulated", module_filter_fn=lambda module, fqn: "mlp" not in fqn
    )
    statuses = {m.fqn: m.status for m in conversion_report(model).modules}
    assert statuses["lm_head"] == HEAD
    assert {statuses[f"model.layers.0.mlp.{p}"] for p in ("gate_proj", "up_proj", "down_proj")} == {EXCLUDED}
    assert statuses["model.layers.0.self_attn.q_proj"] == CONVERTED


def test_get_output_embeddings_names_the_head_before_any_lm_head():
    model = _OutputEmbeddings()
    assert head_names(model) == ["to_logits"]
    convert_to_float8_training(model, "nvfp4", backend="emulated")
    assert type(model.to_logits) is nn.Linear and type(model.lm_head) is Float8Linear


def test_without_get_output_embeddings_a_module_named_lm_head_is_the_head():
    assert head_names(_Named()) == ["lm_head"]
    assert heads_kept(_Named(), recipes.from_name("mxfp4"), keep_head=None) == ["lm_head"]
    assert heads_kept(_Named(), recipes.from_name("mxfp4"), keep_head=False) == []
    assert heads_kept(_Named(), recipes.from_name("tensorwise"), keep_head=None) == []


def test_a_model_without_a_head_converts_everything_and_says_none_was_found(caplog):
    model = _Named(head_name="classifier")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        convert_to_float8_training(model, "mxfp4", backend="emulated")
    assert type(model.classifier) is Float8Linear
    assert any(NO_HEAD_NOTE in r.getMessage() for r in caplog.records)


def test_keep_head_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match="keep_head"):
        convert_to_float8_training(_llama(), "mxfp4", keep_head="yes")


@pytest.mark.parametrize("text, keep_head, head_converts", [("auto", None, False), ("none", False, True)])
def test_the_trainers_setting_passes_the_same_rule(text, keep_head, head_converts):
    """``high_precision_modules=auto`` is the library's default (``keep_head=None``);
    ``none`` converts the head under a 4-bit recipe too."""
    model = _llama()
    chosen = select_high_precision(model, text, recipes.from_name("mxfp4"))
    assert chosen.keep_head is keep_head
    convert_to_float8_training(model, "mxfp4", backend="emulated", module_filter_fn=chosen.converts, keep_head=chosen.keep_head)
    assert (type(model.lm_head) is Float8Linear) is head_converts
