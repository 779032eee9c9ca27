"""PEFT (LoRA) on FP8 base layers: adapters stay in high precision, in either order of
conversion and ``get_peft_model``; merging leaves the weight FP8 quantizes as a freshly
converted model's; a LoRA fine-tune trains only the adapters."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fp8train
from fp8train import Float8Linear
from fp8train.nn.config import Float8ModuleConfig
from fp8train.nn.delayed.state import fp8_max_per_role
from fp8train.nn.weights.float8_weight import Float8Weight
from fp8train.spec.roles import Role

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

# peft 0.21 asks transformers 5.23 a deprecated question on every get_peft_model.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]
NUM_LAYERS = 2
MERGE_RECIPES = ("tensorwise", "delayed", "mxfp8", "nvfp4")


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256,
    )
    return transformers.LlamaForCausalLM(config)


def lora_config(rank: int = 16, random_b: bool = False):
    """LoRA on ``TARGETS``; ``random_b``: lora_B starts random (a merge then changes the weight)."""
    return peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=not random_b
    )


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))


def lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]


def assert_adapters_high_precision(model: nn.Module) -> None:
    layers = lora_layers(model)
    assert len(layers) == NUM_LAYERS * len(TARGETS)
    for layer in layers:
        assert type(layer.get_base_layer()) is Float8Linear
        for adapter in (*layer.lora_A.values(), *layer.lora_B.values()):
            assert type(adapter) is nn.Linear and adapter.weight.dtype == torch.float32


@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("order", ["peft_then_convert", "convert_then_peft", "convert_peft_convert"])
def test_adapters_stay_in_high_precision_in_either_order(order, rank, caplog):
    with caplog.at_level(logging.INFO, logger="fp8train"):
        if order == "peft_then_convert":
            model = fp8train.convert_to_float8_training(peft.get_peft_model(tiny_llama(), lora_config(rank)))
        else:
            model = peft.get_peft_model(fp8train.convert_to_float8_training(tiny_llama()), lora_config(rank))
            if order == "convert_peft_convert":
                model = fp8train.convert_to_float8_training(model)
    assert_adapters_high_precision(model)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # nothing skipped
    if order != "convert_then_peft":
        report = fp8train.conversion_report(model)
        assert len(report.adapters) == 2 * NUM_LAYERS * len(TARGETS) and not report.skipped
        assert report.num_converted == NUM_LAYERS * 7 + 1  # every projection and lm_head
        assert all("lora_" in m.fqn and m.module_type == "Linear" for m in report.adapters)


def test_report_says_adapters_were_kept_and_why():
    model = fp8train.convert_to_float8_training(peft.get_peft_model(tiny_llama(), lora_config()))
    report = fp8train.conversion_report(model)
    entry = next(m for m in report.modules if m.fqn.endswith("layers.0.self_attn.q_proj.lora_A.default"))
    assert entry.status == "adapter" and entry.num_params == 16 * 64
    assert entry.reason == (
        "a PEFT adapter (Linear.lora_A): adapters train in high precision; convert_adapters=True converts them"
    )
    assert report.summary().endswith(
        "; 16 PEFT adapter modules kept in high precision (they train; convert_adapters=True converts them)"
    )


def test_convert_adapters_converts_those_that_can():
    for rank, adapter_type in ((16, Float8Linear), (8, nn.Linear)):
        model = peft.get_peft_model(tiny_llama(), lora_config(rank))
        model = fp8train.convert_to_float8_training(model, convert_adapters=True)
        report = fp8train.conversion_report(model)
        assert not report.adapters
        layer = lora_layers(model)[0]
        assert type(layer.lora_A["default"]) is adapter_type and type(layer.lora_B["default"]) is adapter_type
        if rank == 8:  # in 64, out 8: not multiples of 16
            assert len(report.skipped) == 2 * NUM_LAYERS * len(TARGETS)


def test_convert_adapters_must_be_a_bool():
    with pytest.raises(TypeError, match="convert_adapters"):
        fp8train.convert_to_float8_training(nn.Linear(16, 16), convert_adapters="yes")


def test_conversion_does_not_import_peft(monkeypatch):
    for name in [n for n in sys.modules if n == "peft" or n.startswith("peft.")]:
        monkeypatch.delitem(sys.modules, name)
    fp8train.convert_to_float8_training(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)))
    assert not [n for n in sys.modules if n == "peft" or n.startswith("peft.")]


def trained_lora_model(recipe: str) -> nn.Module:
    """A LoRA model (random lora_B) on FP8 base layers after one training step's forward
    and backward (delayed scaling's history then holds the base weights' amaxes)."""
    model = fp8train.convert_to_float8_training(peft.get_peft_model(tiny_llama(), lora_config(random_b=True)), recipe)
    with fp8train.autocast():
        model(input_ids=tokens(), labels=tokens()).loss.backward()
    return model


def fresh_converted(merged: nn.Module, recipe: str) -> nn.Module:
    """A plain Llama holding ``merged``'s weights, frozen as PEFT left them, converted fresh;
    with delayed scaling, the input's and grad_output's state copied from ``merged`` (only
    the weight's must be re-derived)."""
    model = tiny_llama()
    model.load_state_dict(fp8train.drop_fp8_state(merged.state_dict()))
    model.requires_grad_(False)
    model = fp8train.convert_to_float8_training(model, recipe)
    fp8_modules = dict(merged.named_modules())
    for fqn, module in model.named_modules():
        if getattr(module, "delayed_state", None) is not None:
            source = fp8_modules[fqn]
            keep = [Role.INPUT.index, Role.GRAD_OUTPUT.index]
            module.fp8_scale[keep] = source.fp8_scale[keep]
            module.fp8_amax_history[:, keep] = source.fp8_amax_history[:, keep]
    return model


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens(2)).logits


@pytest.mark.parametrize("recipe", MERGE_RECIPES)
def test_merged_model_quantizes_the_merged_weight_as_a_fresh_conversion(recipe):
    model = trained_lora_model(recipe)
    base_weight = lora_layers(model)[0].get_base_layer().weight.detach().clone()
    merged = model.merge_and_unload()
    q_proj = merged.model.layers[0].self_attn.q_proj
    assert type(q_proj) is Float8Linear and not torch.equal(q_proj.weight, base_weight)
    assert torch.equal(logits(merged), logits(fresh_converted(merged, recipe)))


def expected_weight_scale(module: nn.Module) -> torch.Tensor:
    """Delayed scaling's scale for ``module``'s weight from its own amax: fp8_max / amax."""
    fp8_max = fp8_max_per_role(module.recipe)[Role.WEIGHT.index]
    return fp8_max / module.weight.detach().abs().amax().float()


def test_merge_and_unmerge_refresh_the_delayed_weight_scale():
    model = trained_lora_model("delayed")
    base = lora_layers(model)[0].get_base_layer()
    weight_column = Role.WEIGHT.index
    assert base.fp8_scale[weight_column] == expected_weight_scale(base)
    for change in (model.merge_adapter, model.unmerge_adapter):
        stale = base.fp8_scale[weight_column].clone()
        change()
        logits(model)
        assert base.fp8_scale[weight_column] == expected_weight_scale(base) != stale
        assert torch.all(base.fp8_amax_history[1:, weight_column] == base.weight.abs().amax())


def test_lora_finetune_trains_only_the_adapters_in_high_precision():
    model = fp8train.convert_to_float8_training(peft.get_peft_model(tiny_llama(), lora_config()), "delayed")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(6):
        with fp8train.autocast():
            loss = model(input_ids=tokens(), labels=tokens()).loss
        loss.backward()
        assert all((p.grad is not None) == ("lora_" in n) for n, p in model.named_parameters())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert_adapters_high_precision(model)


def test_gpt2_conv1d_base_layers_convert_and_merge():
    """transformers' Conv1D base layers (GPT-2's c_attn, LoRA with fan_in_fan_out) convert
    after get_peft_model, and a merge refreshes their delayed weight scale too."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=64, n_layer=1, n_head=4, n_positions=32, vocab_size=256, bos_token_id=0, eos_token_id=0
    )
    lora = peft.LoraConfig(r=16, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora)
    model = fp8train.convert_to_float8_training(model, "delayed")
    base = lora_layers(model)[0].get_base_layer()
    assert type(base).__name__ == "Float8Conv1D" and len(fp8train.conversion_report(model).adapters) == 2
    merged = model.merge_and_unload()
    logits(merged)
    assert base.fp8_scale[Role.WEIGHT.index] == expected_weight_scale(base)


def test_docs_example_runs_and_prints_what_the_page_says(capsys):
    page = (Path(__file__).resolve().parents[2] / "docs" / "peft.md").read_text()
    example = re.findall(r"```python\n(.*?)```", page, flags=re.S)[0]
    exec(compile(example, "<docs/peft.md example>", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out.splitlines()
    documented = re.search(r"summary\(\)\)\n((?:# .*\n)+)", example).group(1)
    assert printed[0] == " ".join(line[2:] for line in documented.splitlines())
    losses = [float(line.rpartition(" ")[2]) for line in printed[1:]]
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_only_a_frozen_weight_takes_its_own_scale_under_delayed_scaling():
    """The rule below the merges, on a bare Float8Linear: a frozen weight's scale comes from
    its own amax from the first forward on; a trainable one's from its history (scale 1 at
    first), as before."""
    x = torch.randn(32, 64)
    for frozen in (True, False):
        config = Float8ModuleConfig(recipe="delayed", backend="emulated")
        module = Float8Linear(64, 32, config=config).requires_grad_(not frozen)
        module(x)
        expected = expected_weight_scale(module) if frozen else torch.tensor(1.0)
        assert module.fp8_scale[Role.WEIGHT.index] == expected


@pytest.mark.slow
def test_frozen_weight_scale_under_torch_compile_matches_eager():
    torch.manual_seed(0)
    config = Float8ModuleConfig(recipe="delayed", backend="emulated")
    eager = Float8Linear(64, 64, config=config).requires_grad_(False)
    compiled_module = Float8Linear(64, 64, config=config).requires_grad_(False)
    compiled_module.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_module)
    for step in range(3):
        if step == 2:  # a merge's change of the weight, outside training
            with torch.no_grad():
                eager.weight.mul_(3)
                compiled_module.weight.mul_(3)
        x = torch.randn(32, 64, requires_grad=True)
        x_compiled = x.detach().clone().requires_grad_()
        with fp8train.autocast():
            out, out_compiled = eager(x), compiled(x_compiled)
        out.sum().backward()
        out_compiled.sum().backward()
        assert torch.equal(out, out_compiled) and torch.equal(x.grad, x_compiled.grad)
        # (the compiled forward's input update waits for its next forward: no parameter trains)
        assert eager.fp8_scale[Role.WEIGHT.index] == compiled_module.fp8_scale[Role.WEIGHT.index]
    assert compiled_module.fp8_scale[Role.WEIGHT.index] == expected_weight_scale(compiled_module)


def lora_model_with_fp8_only_base(order: str, store: bool) -> nn.Module:
    """A LoRA model on mxfp8 base layers built in ``order``; ``store``: its frozen weights
    in FP8 only (after PEFT froze them, or, for ``"freeze_store_peft"``, before PEFT wraps
    a model frozen by hand)."""
    if order == "peft_then_convert":
        model = fp8train.convert_to_float8_training(peft.get_peft_model(tiny_llama(), lora_config()), "mxfp8")
    else:
        model = fp8train.convert_to_float8_training(tiny_llama(), "mxfp8")
        if order == "freeze_store_peft":
            model.requires_grad_(False)
            assert not store or len(fp8train.store_frozen_weights_in_fp8(model)) == NUM_LAYERS * 7 + 1
        model = peft.get_peft_model(model, lora_config())
    assert not store or len(fp8train.store_frozen_weights_in_fp8(model)) == NUM_LAYERS * 7 + 1
    return model


@pytest.mark.parametrize("order", ["peft_then_convert", "convert_then_peft", "freeze_store_peft"])
def test_base_weights_in_fp8_only_train_the_adapters_as_high_precision_ones_do(order):
    """The LoRA adapters train in high precision on base weights stored in FP8 only, with
    the losses and adapters of the same model whose base weights stay in high precision."""
    results = []
    for store in (False, True):
        model = lora_model_with_fp8_only_base(order, store)
        assert (type(lora_layers(model)[0].get_base_layer().weight) is Float8Weight) == store
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for _ in range(2):
            with fp8train.autocast():
                loss = model(input_ids=tokens(), labels=tokens()).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        results.append((losses, [p.detach().clone() for p in model.parameters() if p.requires_grad]))
        assert_adapters_high_precision(model)
    assert results[0][0] == results[1][0] and results[1][0][-1] < results[1][0][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_merge_of_fp8_only_base_weights_is_refused_until_they_are_restored():
    model = fp8train.convert_to_float8_training(peft.get_peft_model(tiny_llama(), lora_config(random_b=True)))
    assert len(fp8train.store_frozen_weights_in_fp8(model)) == NUM_LAYERS * 7 + 1  # PEFT, then conversion
    assert_adapters_high_precision(model)
    with pytest.raises(RuntimeError, match=r"stored in FP8 only.*restore_high_precision_weights\(model\) first"):
        model.merge_and_unload()
    layer = lora_layers(model)[0]
    base_fp8 = layer.get_base_layer().weight.dequantize()
    delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * layer.scaling["default"]
    fp8train.restore_high_precision_weights(model)
    merged = model.merge_and_unload()
    # The merge of the FP8 values (lossy: the base weight was quantized) and the adapters.
    assert torch.allclose(merged.model.layers[0].self_attn.q_proj.weight, base_fp8 + delta, rtol=0, atol=1e-6)


def test_docs_frozen_fp8_example_runs_and_prints_what_the_page_says(capsys):
    page = (Path(__file__).resolve().parents[2] / "docs" / "peft.md").read_text()
    example = re.findall(r"```python\n(.*?)```", page, flags=re.S)[1]
    assert "store_frozen_weights_in_fp8" in example
    exec(compile(example, "<docs/peft.md frozen example>", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out.splitlines()
    documented = re.search(r"\n# (\d+ weights in FP8 only.*)\n", example).group(1)
    assert printed[0] == documented
    losses = [float(line.rpartition(" ")[2]) for line in printed[1:]]
    assert len(losses) == 3 and losses[-1] < losses[0]
