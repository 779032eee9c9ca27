"""convert_to_float8_training on real model code: transformers' GPT-2 (Conv1D) and
PyTorch's nn.TransformerEncoderLayer (nn.MultiheadAttention), tiny random-init configs.

Every matmul module runs in FP8 (its output differs from the same module with FP8 off on
the same input, and is close to it), the state_dict keeps its keys and shapes, parameters
are shared, convert_to_linear restores the original classes, the models train close to
bf16, and the report and its summary line say what converted."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8train
from tests.helpers.bf16_loops import bf16_autocast
from tests.helpers.tolerances import min_sqnr_db
from fp8train.nn.modules.attention import Float8MultiheadAttention
from fp8train.nn.modules.conv1d import Float8Conv1D, is_transformers_conv1d
from fp8train.nn.convert import conversion_report, convert_to_float8_training, convert_to_linear, drop_fp8_state
from fp8train.nn.modules.linear import Float8Linear
from fp8train.spec import recipes

transformers = pytest.importorskip("transformers")

LOGGER = "fp8train.nn.convert"
MIN_SQNR_DB = 20  # each converted module's FP8 output against its FP8-off output
GPT2_MATMULS = [f"transformer.h.{i}.{name}" for i in range(2) for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
TRAIN_STEPS = 8
MAX_LOSS_GAP = 0.05  # nats, FP8 against bf16 after TRAIN_STEPS on one batch (gaps seen: <= 0.02; both fall by > 2)
MIN_LOSS_DROP = 1.0


def _sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return 10 * math.log10(expected.square().sum() / (actual - expected).square().sum())


def _gpt2(seed: int = 0, **overrides) -> nn.Module:
    config = dict(n_layer=2, n_embd=128, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**config, **overrides}))


def _tokens(batch=4, seq=32) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1))


class _Encoder(nn.Module):
    """Token classifier on nn.TransformerEncoder (two nn.TransformerEncoderLayer)."""

    def __init__(self, vocab=64, d_model=128, num_classes=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, tokens, padding_mask=None):
        return self.head(self.encoder(self.embed(tokens), src_key_padding_mask=padding_mask))


def _encoder(seed=0) -> _Encoder:
    torch.manual_seed(seed)
    return _Encoder()


def _module_inputs(model: nn.Module, types: tuple, run) -> dict[str, tuple]:
    """Each module of ``types``'s positional and keyword inputs in one call of ``run()``."""
    inputs, handles = {}, []
    for fqn, module in model.named_modules():
        if isinstance(module, types):
            hook = lambda m, args, kwargs, fqn=fqn: inputs.setdefault(fqn, (args, kwargs))  # noqa: E731
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        run()
    for handle in handles:
        handle.remove()
    return inputs


def _first_tensor(output):
    return output[0] if isinstance(output, tuple) else output


def _check_every_module_runs_in_fp8(model: nn.Module, originals: nn.Module, run, fqns, recipe=None) -> None:
    """For each converted module, on the input it got in ``run()``: FP8 on differs from FP8
    off and is close to it, and FP8 off is the original module bit for bit."""
    fp8_types = (Float8Linear, Float8Conv1D, Float8MultiheadAttention)
    inputs = _module_inputs(model, fp8_types, run)
    assert set(inputs) == set(fqns)
    for fqn, (args, kwargs) in inputs.items():
        module, original = model.get_submodule(fqn), originals.get_submodule(fqn)
        with torch.no_grad():
            fp8 = _first_tensor(module(*args, **kwargs))
            with fp8train.autocast(enabled=False):
                high_precision = _first_tensor(module(*args, **kwargs))
            expected = _first_tensor(original(*args, **kwargs))
        assert not torch.equal(fp8, high_precision), fqn
        assert _sqnr_db(fp8, high_precision) > min_sqnr_db(recipe, MIN_SQNR_DB), fqn
        assert torch.equal(high_precision, expected), fqn


# ---------------------------------------------------------------------------------- GPT-2


@pytest.mark.parametrize("recipe_name", recipes.RECIPE_NAMES)
def test_gpt2_every_conv1d_and_the_head_run_in_fp8(recipe_name, caplog):
    model = _gpt2()
    original = copy.deepcopy(model)
    shapes = {key: value.shape for key, value in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        result = convert_to_float8_training(model, recipe_name, backend="emulated", keep_head=False)
    assert result is model
    assert all(type(model.get_submodule(fqn)) is Float8Conv1D for fqn in GPT2_MATMULS)
    assert type(model.lm_head) is Float8Linear and model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert [id(p) for p in model.parameters()] == params
    assert {key: value.shape for key, value in drop_fp8_state(model.state_dict()).items()} == shapes
    if recipe_name != "delayed":
        assert {key: value.shape for key, value in model.state_dict().items()} == shapes

    report = conversion_report(model)
    assert [m.fqn for m in report.modules] == [*GPT2_MATMULS, "lm_head"]
    assert [m.module_type for m in report.modules] == ["Conv1D"] * 8 + ["Linear"]
    assert (report.num_converted, report.fp8_param_share) == (9, 1.0)
    line = f"FP8 training ({recipe_name}): converted 9/9 matmul modules, 100.0% of matmul parameters in FP8"
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER][-1] == report.summary() == line

    model.eval(), original.eval()
    tokens = _tokens()
    _check_every_module_runs_in_fp8(model, original, lambda: model(tokens), [*GPT2_MATMULS, "lm_head"], recipe_name)

    convert_to_linear(model)
    assert all(is_transformers_conv1d(model.get_submodule(fqn)) for fqn in GPT2_MATMULS)
    assert type(model.lm_head) is nn.Linear and [id(p) for p in model.parameters()] == params
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, original(tokens).logits)


def test_gpt2_skipped_layers_are_named_in_a_warning(caplog):
    model = _gpt2(vocab_size=250)  # the head's 250 outputs are no multiple of 16
    with caplog.at_level(logging.INFO, logger=LOGGER):
        convert_to_float8_training(model, "tensorwise")
    record = [r for r in caplog.records if r.name == LOGGER][-1]
    assert record.levelno == logging.WARNING
    conv1d_params = 2 * (128 * 384 + 384 + 128 * 128 + 128 + 128 * 512 + 512 + 512 * 128 + 128)
    share = 100 * conv1d_params / (conv1d_params + 128 * 250)  # the head has no bias
    assert record.getMessage() == (
        f"FP8 training (tensorwise): converted 8/9 matmul modules, {share:.1f}% of matmul parameters in FP8; "
        "1 skipped: lm_head (Linear: in_features=128, out_features=250 are not both multiples of 16)"
    )
    (skipped,) = conversion_report(model).skipped
    assert (skipped.fqn, skipped.num_params) == ("lm_head", 128 * 250)


def _train(model: nn.Module, loss_fn, steps=TRAIN_STEPS) -> list[float]:
    """AdamW on one batch under bf16 autocast (the trainer's mixed precision, its bf16
    matmuls routed as the trainer routes them on a CPU without native bf16)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        with bf16_autocast(), fp8train.autocast():
            loss = loss_fn(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe_name", ["tensorwise", "blockwise"])
def test_gpt2_trains_close_to_bf16(recipe_name):
    tokens = _tokens(batch=4, seq=32)
    loss_fn = lambda model: model(tokens, labels=tokens).loss  # noqa: E731
    bf16 = _train(_gpt2().train(), loss_fn)
    fp8 = _train(convert_to_float8_training(_gpt2(), recipe_name, backend="emulated").train(), loss_fn)
    assert fp8[0] - fp8[-1] > MIN_LOSS_DROP and bf16[0] - bf16[-1] > MIN_LOSS_DROP, (bf16, fp8)
    assert abs(fp8[-1] - bf16[-1]) < MAX_LOSS_GAP, (bf16, fp8)


# --------------------------------------------------------------------- TransformerEncoder


def test_transformer_encoder_layer_projections_run_in_fp8_with_masks(caplog):
    model = _encoder()
    original = copy.deepcopy(model)
    params = [id(p) for p in model.parameters()]
    keys = list(model.state_dict())
    with caplog.at_level(logging.INFO, logger=LOGGER):
        convert_to_float8_training(model, "tensorwise")
    layers = model.encoder.layers
    assert all(type(layer.self_attn) is Float8MultiheadAttention for layer in layers)
    assert all(type(layer.linear1) is type(layer.linear2) is Float8Linear for layer in layers)
    assert [id(p) for p in model.parameters()] == params and list(model.state_dict()) == keys
    report = conversion_report(model)
    matmuls = [f"encoder.layers.{i}.{name}" for i in range(2) for name in ("self_attn", "linear1", "linear2")] + ["head"]
    assert [m.fqn for m in report.modules] == matmuls
    assert [m.module_type for m in report.modules[:3]] == ["MultiheadAttention", "Linear", "Linear"]
    assert report.summary() == "FP8 training (tensorwise): converted 7/7 matmul modules, 100.0% of matmul parameters in FP8"

    tokens = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    padding = torch.zeros(3, 12, dtype=torch.bool)
    padding[0, -4:] = padding[2, -7:] = True
    # out_proj, a Float8Linear called by its attention's forward, is checked on its own too.
    out_projs = [f"encoder.layers.{i}.self_attn.out_proj" for i in range(2)]
    for run in (lambda: model(tokens), lambda: model(tokens, padding)):
        _check_every_module_runs_in_fp8(model, original, run, matmuls + out_projs)
    # A causal float mask and a padding mask, through the layer's own call of self_attn.
    layer, original_layer = layers[0], original.encoder.layers[0]
    x = torch.randn(3, 12, 128)
    causal = nn.Transformer.generate_square_subsequent_mask(12)
    call = dict(src_mask=causal, src_key_padding_mask=padding, is_causal=True)
    with torch.no_grad():
        expected = original_layer(x, **call)
        with fp8train.autocast(enabled=False):
            assert torch.equal(layer(x, **call), expected)
        fp8 = layer(x, **call)
    assert not torch.equal(fp8, expected) and _sqnr_db(fp8, expected) > MIN_SQNR_DB


def test_transformer_encoder_fused_fast_path_does_not_bypass_fp8():
    """In eval without grad nn.TransformerEncoderLayer would run one fused kernel on its
    weights, and nn.TransformerEncoder would nest padded batches: neither, once converted."""
    model = _encoder().eval()
    original = copy.deepcopy(model)
    convert_to_float8_training(model, "tensorwise")
    tokens = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    padding = torch.zeros(3, 12, dtype=torch.bool)
    padding[0, -4:] = True
    for args in ((tokens,), (tokens, padding)):
        with torch.no_grad():  # the fast path's conditions
            expected = original(*args)
            fp8 = model(*args)
        with torch.enable_grad():  # the modules' forwards, which the fast path would skip
            fp8_slow_path = model(*args).detach()
        assert torch.equal(fp8, fp8_slow_path)
        valid = ~padding[..., None].expand_as(fp8) if len(args) == 2 else torch.ones_like(fp8, dtype=torch.bool)
        assert not torch.equal(fp8[valid], expected[valid]) and _sqnr_db(fp8[valid], expected[valid]) > MIN_SQNR_DB
    assert not model.encoder.use_nested_tensor

    convert_to_linear(model)
    layer = model.encoder.layers[0]
    assert type(layer.self_attn) is nn.MultiheadAttention and type(layer.linear1) is nn.Linear
    assert not layer._forward_pre_hooks
    with torch.no_grad():
        assert torch.equal(model(tokens), original(tokens))


def test_transformer_encoder_trains_close_to_bf16():
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (8, 16), generator=generator)
    targets = (tokens * 7 + tokens.roll(1, dims=1)) % 16
    loss_fn = lambda model: F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())  # noqa: E731
    bf16 = _train(_encoder().train(), loss_fn)
    fp8 = _train(convert_to_float8_training(_encoder(), "rowwise", backend="emulated").train(), loss_fn)
    assert fp8[0] - fp8[-1] > MIN_LOSS_DROP and bf16[0] - bf16[-1] > MIN_LOSS_DROP, (bf16, fp8)
    assert abs(fp8[-1] - bf16[-1]) < MAX_LOSS_GAP, (bf16, fp8)


def test_attention_with_misaligned_dims_is_skipped_and_named(caplog):
    model = nn.Sequential(nn.MultiheadAttention(72, 4), nn.Linear(64, 64))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        convert_to_float8_training(model, "tensorwise")
    assert type(model[0]) is nn.MultiheadAttention
    message = [r.getMessage() for r in caplog.records if r.name == LOGGER][-1]
    assert message.endswith(
        "1 skipped: 0 (MultiheadAttention: embed_dim=72, kdim=72, vdim=72 are not all multiples of 16)"
    )


# ------------------------------------------------------------------------ MoE experts


def _mixtral(seed=0) -> nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(config)


def test_fused_experts_convert_through_the_same_call_and_report():
    experts_module = pytest.importorskip("fp8train.nn.modules.experts")
    model = _mixtral()
    experts_type = type(model.model.layers[0].mlp.experts)
    convert_to_float8_training(model, "tensorwise")
    assert type(model.model.layers[0].mlp.experts) is experts_module.Float8Experts
    report = conversion_report(model)
    entry = next(m for m in report.modules if m.fqn == "model.layers.0.mlp.experts")
    assert (entry.module_type, entry.status, entry.num_params) == (experts_type.__name__, "converted", 4 * 3 * 128 * 128)
    assert report.num_converted == report.num_matmul_modules  # q, k, v, o, experts, lm_head
    tokens = _tokens(batch=2, seq=16)
    model(tokens, labels=tokens).loss.backward()
    convert_to_linear(model)
    assert type(model.model.layers[0].mlp.experts) is experts_type


def test_experts_that_break_the_contract_are_skipped_with_the_reason():
    pytest.importorskip("fp8train.nn.modules.experts")
    model = _mixtral()
    model.model.layers[0].mlp.experts.has_bias = True
    convert_to_float8_training(model, "tensorwise")
    (skipped,) = conversion_report(model).skipped
    assert skipped.fqn == "model.layers.0.mlp.experts"
    assert skipped.reason == "fused experts that do not meet the contract: has_bias=True (only has_bias=False converts)"


def test_a_root_attention_converts_once_and_comes_back():
    attention = nn.MultiheadAttention(64, 4)
    converted = convert_to_float8_training(attention, "mxfp8")
    assert type(converted) is Float8MultiheadAttention and converted.in_proj_weight is attention.in_proj_weight
    modules = dict(converted.named_modules())
    again = convert_to_float8_training(converted, "rowwise")  # already FP8: counted, left alone
    assert again is converted and dict(converted.named_modules()) == modules
    report = conversion_report(converted)
    assert [(m.fqn, m.module_type, m.status) for m in report.modules] == [("", "Float8MultiheadAttention", "converted")]
    back = convert_to_linear(converted)
    assert type(back) is nn.MultiheadAttention and back.out_proj.weight is attention.out_proj.weight
