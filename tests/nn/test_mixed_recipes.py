"""Mixed recipes in a layer (issue 41): a hybrid recipe's output GEMM is its forward recipe's,
bit for bit, and its grad_input and grad_weight GEMMs are its backward recipe's; every slot
of a hybrid or per-slot recipe quantizes as the recipe its rule came from does (the oracle:
the plain recipes, run on their own)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

import fp8train
from fp8train import recipes
from fp8train.quant.operand import quantize_usage
from fp8train.spec import QuantRule, Usage

CURRENT = [name for name in recipes.RECIPE_NAMES if name != "delayed"]
DIM, TOKENS = 128, 128  # tokens a multiple of every alignment: no recipe pads them


@functools.lru_cache(maxsize=None)
def _step(recipe):
    """Output, grad_input, grad_weight, grad_bias of one seeded step (stochastic rounding
    drawing from the same seed in every run); each recipe's once (a plain recipe is the
    oracle of many mixtures)."""
    torch.manual_seed(0)
    layer = fp8train.Float8Linear(DIM, DIM, recipe=recipe)
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out = layer(x)
    torch.manual_seed(2)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
    return out.detach(), x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("forward, backward", list(itertools.product(CURRENT, CURRENT)))
def test_a_hybrid_runs_its_forward_recipes_output_gemm_and_its_backward_recipes_grad_gemms(forward, backward):
    out, grad_input, grad_weight, grad_bias = _step(recipes.hybrid(forward=forward, backward=backward))
    expected_out = _step(forward)[0]
    _, expected_grad_input, expected_grad_weight, expected_grad_bias = _step(backward)
    assert torch.equal(out, expected_out)
    assert torch.equal(grad_input, expected_grad_input)
    assert torch.equal(grad_weight, expected_grad_weight)
    assert torch.equal(grad_bias, expected_grad_bias)


@pytest.mark.parametrize("forward, backward", [("nvfp4", "mxfp8"), ("tensorwise", "blockwise"), ("mxfp4", "rowwise_with_gw_hp")])
def test_every_slot_quantizes_as_the_recipe_its_rule_came_from(forward, backward):
    plan = recipes.hybrid(forward=forward, backward=backward).operand_plan
    generator = torch.Generator().manual_seed(0)
    shapes = {"input": (TOKENS, DIM), "weight": (DIM, DIM), "grad_output": (TOKENS, DIM)}
    for usage in Usage:
        source = recipes.from_name(forward if usage.gemm.value == "output" else backward).operand_plan
        if not source.quantizes_usage(usage):
            assert not plan.quantizes_usage(usage)
            continue
        t = torch.randn(shapes[usage.role.value], generator=generator)
        torch.manual_seed(4)
        got = quantize_usage(plan, usage, t)
        torch.manual_seed(4)
        expected = quantize_usage(source, usage, t)
        assert torch.equal(got.data.view(torch.uint8), expected.data.view(torch.uint8)), usage
        assert torch.equal(got.scale_inv.reshape(-1).view(torch.uint8), expected.scale_inv.reshape(-1).view(torch.uint8))


def test_a_slot_reuses_another_slots_quantization_only_under_the_same_rule():
    assert recipes.from_name("tensorwise").operand_plan.reuses_last_dim(Usage.GRAD_INPUT_WEIGHT)
    assert not recipes.hybrid(forward="tensorwise", backward="mxfp8").operand_plan.reuses_last_dim(Usage.GRAD_INPUT_WEIGHT)
    same = recipes.hybrid(forward="tensorwise", backward="tensorwise").operand_plan
    assert same.reuses_last_dim(Usage.GRAD_INPUT_WEIGHT)


def test_a_per_slot_recipe_runs_its_rules_and_its_grad_weight_gemm_in_high_precision_where_it_has_none():
    mx = QuantRule(granularity="mx")
    slots = ("OUTPUT_INPUT", "OUTPUT_WEIGHT", "GRAD_INPUT_GRAD_OUTPUT", "GRAD_INPUT_WEIGHT")
    out, grad_input, grad_weight, _ = _step(recipes.custom(dict.fromkeys(slots, mx)))
    mx_out, mx_grad_input, _, _ = _step("mxfp8")
    assert torch.equal(out, mx_out) and torch.equal(grad_input, mx_grad_input)
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(1))
    grad_output = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(3))
    assert torch.equal(grad_weight, grad_output.t() @ x)


def test_bad_mixtures_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"backward: unknown FP8 recipe 'mxfp9'"):
        recipes.hybrid(forward="mxfp8", backward="mxfp9")
    with pytest.raises(TypeError, match=r"forward: recipe=3 must be a Recipe or a recipe name"):
        recipes.hybrid(forward=3, backward="mxfp8")
    with pytest.raises(TypeError, match=r"forward='mxfp8' must be a Recipe; name recipes with fp8train.recipes.hybrid"):
        recipes.HybridRecipe(forward="mxfp8", backward=recipes.from_name("mxfp8"))
    with pytest.raises(ValueError, match=r"the output GEMM cannot multiply 'mx' \(OUTPUT_INPUT\) with 'row' \(OUTPUT_WEIGHT\)"):
        recipes.custom({"OUTPUT_INPUT": QuantRule(granularity="mx"), "OUTPUT_WEIGHT": QuantRule(granularity="row")})
    row = QuantRule(granularity="row")
    with pytest.raises(ValueError, match=r"a rule for GRAD_INPUT_WEIGHT but none for GRAD_INPUT_GRAD_OUTPUT"):
        recipes.custom({"OUTPUT_INPUT": row, "OUTPUT_WEIGHT": row, "GRAD_INPUT_WEIGHT": row})
    with pytest.raises(ValueError, match=r"the grad_input GEMM has no rules: give GRAD_INPUT_GRAD_OUTPUT and GRAD_INPUT_WEIGHT"):
        recipes.custom({"OUTPUT_INPUT": row, "OUTPUT_WEIGHT": row})
    with pytest.raises(ValueError, match=r"unknown operand slot 'OUTPUT'; the slots are OUTPUT_INPUT"):
        recipes.custom({"OUTPUT": QuantRule(granularity="row")})
    with pytest.raises(TypeError, match=r"rules\[OUTPUT_INPUT\]='row' must be a QuantRule"):
        recipes.custom({"OUTPUT_INPUT": "row", "OUTPUT_WEIGHT": QuantRule(granularity="row")})


def test_mixtures_describe_themselves_and_hash_as_values():
    recipe = recipes.hybrid(forward="nvfp4", backward="mxfp8")
    assert recipe.describe() == "hybrid(forward=nvfp4,backward=mxfp8)"
    assert recipe == recipes.hybrid(forward=recipes.from_name("nvfp4"), backward="mxfp8")
    assert hash(recipe) == hash(recipes.hybrid(forward="nvfp4", backward="mxfp8"))
    assert recipe.role_format("input").name == "E2M1" and recipe.role_format("grad_output").name == "E4M3"
    rule = QuantRule(granularity="row")
    slots = ("OUTPUT_INPUT", "OUTPUT_WEIGHT", "GRAD_INPUT_GRAD_OUTPUT", "GRAD_INPUT_WEIGHT")
    described = recipes.custom(dict.fromkeys(slots, rule)).describe()
    assert described == "custom(output_input=row,output_weight=row,grad_input_grad_output=row,grad_input_weight=row)"


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.GELU(), torch.nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        return self.mlp(self.attn(x))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block())
    model.lm_head = torch.nn.Linear(DIM, DIM)
    return model


MAP = {"*.attn": "mxfp8", "*.mlp.*": "nvfp4", "lm_head": None}


@pytest.mark.parametrize("form", ["dict", "pairs", "line"])
def test_a_recipe_per_module_converts_each_module_by_its_first_matching_pattern(form):
    given = {"dict": MAP, "pairs": list(MAP.items()), "line": "*.attn=mxfp8; *.mlp.*=nvfp4; lm_head=bf16"}[form]
    model = fp8train.convert_to_float8_training(_model(), given)
    report = fp8train.conversion_report(model)
    assert report.recipe == "*.attn=mxfp8;*.mlp.*=nvfp4;lm_head=bf16"
    by_name = {m.fqn: (m.status, m.recipe) for m in report.modules}
    assert by_name == {
        "0.attn": ("converted", "mxfp8"), "1.attn": ("converted", "mxfp8"),
        "0.mlp.0": ("converted", "nvfp4"), "0.mlp.2": ("converted", "nvfp4"),
        "1.mlp.0": ("converted", "nvfp4"), "1.mlp.2": ("converted", "nvfp4"),
        "lm_head": ("excluded", None),
    }
    assert model[0].attn.recipe == recipes.from_name("mxfp8") and model[1].mlp[2].recipe == recipes.from_name("nvfp4")
    assert type(model.lm_head) is torch.nn.Linear


def test_the_first_pattern_wins_and_an_unmatched_module_stays_in_high_precision():
    model = fp8train.convert_to_float8_training(_model(), [("0.*", "tensorwise"), ("*.attn", "mxfp8")])
    statuses = {m.fqn: (m.status, m.recipe) for m in fp8train.conversion_report(model).modules}
    assert statuses["0.attn"] == ("converted", "tensorwise") and statuses["1.attn"] == ("converted", "mxfp8")
    assert statuses["1.mlp.0"][0] == "excluded" and statuses["lm_head"][0] == "excluded"
    reasons = {m.fqn: m.reason for m in fp8train.conversion_report(model).modules}
    assert "no pattern of the recipe map matches it" in reasons["lm_head"]


def test_a_mapped_model_trains_each_module_as_its_recipe_alone_would():
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(1))
    mixed = fp8train.convert_to_float8_training(_model(), {"*.attn": "mxfp8", "*": "nvfp4"})
    attn_only = fp8train.convert_to_float8_training(_model()[0].attn, "mxfp8")
    torch.manual_seed(5)
    expected = attn_only(x)
    torch.manual_seed(5)
    assert torch.equal(mixed[0].attn(x), expected)
    mixed(x).sum().backward()  # every module runs its own recipe's backward
    assert all(p.grad is not None for p in mixed.parameters())


def test_a_hybrid_recipe_goes_in_a_map_too_and_the_report_names_it():
    model = fp8train.convert_to_float8_training(_model(), {"*": recipes.hybrid(forward="nvfp4", backward="mxfp8")})
    converted = {m.recipe for m in fp8train.conversion_report(model).modules if m.status == "converted"}
    assert converted == {"hybrid(forward=nvfp4,backward=mxfp8)"}


def test_bad_recipe_maps_name_the_pattern_and_convert_nothing():
    model = _model()
    with pytest.raises(ValueError, match=r"pattern\(s\) '\*\.attention' match no matmul module .*nothing was converted"):
        fp8train.convert_to_float8_training(model, {"*.attn": "mxfp8", "*.attention": "nvfp4"})
    assert type(model[0].attn) is torch.nn.Linear  # nothing converted
    with pytest.raises(ValueError, match=r"recipe map pattern '\*\.mlp\.\*': unknown FP8 recipe 'nvfp5'"):
        fp8train.convert_to_float8_training(_model(), {"*.mlp.*": "nvfp5"})
    with pytest.raises(TypeError, match=r"a recipe map must be ordered .* not a set"):
        fp8train.convert_to_float8_training(_model(), {("*", "mxfp8")})
    with pytest.raises(ValueError, match=r"recipe map entry 'mxfp8' is not pattern=recipe"):
        fp8train.convert_to_float8_training(_model(), "*.attn=mxfp8;mxfp8")
    with pytest.raises(ValueError, match=r"pattern '\*' is given twice"):
        fp8train.convert_to_float8_training(_model(), [("*", "mxfp8"), ("*", "nvfp4")])


def test_a_hybrid_is_named_where_a_recipe_name_goes_and_compare_takes_it():
    from fp8train.train.commands.compare import parse_recipes

    named = recipes.from_name(" Hybrid(forward=nvfp4, backward=MXFP8) ")
    assert named == recipes.hybrid(forward="nvfp4", backward="mxfp8")
    assert named.describe() == "hybrid(forward=nvfp4,backward=mxfp8)"
    assert parse_recipes("bf16,nvfp4, hybrid(forward=nvfp4,backward=mxfp8)") == [
        "bf16", "nvfp4", "hybrid(forward=nvfp4,backward=mxfp8)",
    ]
    with pytest.raises(ValueError, match=r"must name both directions and nothing else"):
        recipes.from_name("hybrid(forward=nvfp4)")


def test_compare_keeps_a_map_s_patterns_as_given_and_lower_cases_recipe_names():
    # Module names are case-sensitive (a pattern lower-cased would match nothing).
    from fp8train.train.commands.compare import split_recipe_list

    assert split_recipe_list("BF16, MXFP8,*.Attn.*=MXFP8;*=nvfp4") == ["bf16", "mxfp8", "*.Attn.*=MXFP8;*=nvfp4"]
    mapping = fp8train.spec.recipe_map.recipe_map(split_recipe_list("*.Attn.*=MXFP8;*=nvfp4")[0])
    assert [pattern for pattern, _ in mapping.entries] == ["*.Attn.*", "*"]
    assert mapping.entries[0][1] == recipes.from_name("mxfp8")


def test_the_one_line_map_takes_a_hybrid_by_name():
    mapping = fp8train.spec.recipe_map.recipe_map("*.attn=hybrid(forward=nvfp4,backward=mxfp8);*=mxfp8")
    assert mapping.entries[0][1] == recipes.hybrid(forward="nvfp4", backward="mxfp8")
    assert mapping.describe() == "*.attn=hybrid(forward=nvfp4,backward=mxfp8);*=mxfp8"


def test_the_trainer_converts_by_a_recipe_per_module_and_checks_it_early():
    from fp8train.train.arguments import TrainingArguments
    from fp8train.train.trainer_setup import convert_for_training

    args = TrainingArguments(fp8_recipe="*.attn=mxfp8;*.mlp.*=nvfp4;lm_head=bf16", model="x:y")
    model = convert_for_training(_model(), args)
    converted = {m.fqn: m.recipe for m in fp8train.conversion_report(model).modules if m.status == "converted"}
    assert converted["0.attn"] == "mxfp8" and converted["1.mlp.2"] == "nvfp4" and "lm_head" not in converted
    with pytest.raises(ValueError, match=r"recipe map pattern '\*\.mlp\.\*': unknown FP8 recipe 'nvfp5'"):
        TrainingArguments(fp8_recipe="*.attn=mxfp8;*.mlp.*=nvfp5")
    assert TrainingArguments(fp8_recipe="hybrid(forward=nvfp4,backward=mxfp8)").fp8_recipe.startswith("hybrid(")


def test_the_report_names_a_built_in_recipe_by_its_name_however_it_was_given():
    gw_hp = recipes.RowwiseScaling(grad_weight_hp=True)  # the class's name is "rowwise"
    model = fp8train.convert_to_float8_training(_model(), {"*.attn": gw_hp, "*": "mxfp8"})
    labels = {m.fqn: m.recipe for m in fp8train.conversion_report(model).modules}
    assert labels["0.attn"] == "rowwise_with_gw_hp" and labels["0.mlp.0"] == "mxfp8"
    assert recipes.hybrid(forward=gw_hp, backward="MXFP8").describe() == "hybrid(forward=rowwise_with_gw_hp,backward=mxfp8)"


def test_the_conversion_report_names_a_hybrid_by_its_description():
    model = fp8train.convert_to_float8_training(_model(), recipes.hybrid(forward="nvfp4", backward="mxfp8"))
    report = fp8train.conversion_report(model)
    assert report.recipe == "hybrid(forward=nvfp4,backward=mxfp8)"  # not its class's name, 'hybrid'


def test_a_mixed_module_s_repr_names_its_mixture():
    hybrid = recipes.hybrid(forward="nvfp4", backward="mxfp8")
    assert "recipe=hybrid(forward=nvfp4,backward=mxfp8)," in repr(fp8train.Float8Linear(32, 32, recipe=hybrid))
    assert "recipe=delayed," in repr(fp8train.Float8Linear(32, 32, recipe="delayed"))
