"""What ``fp8train.inspect`` and the trainer's telemetry see beyond ``nn.Linear``: the
GEMMs of transformers' ``Conv1D`` (GPT-2) and of a converted attention's in-projection,
with the operands those GEMMs really get; and what they cannot see, named."""

import json

import pytest
import torch
from torch import nn

import fp8train
from fp8train.nn.gemm_observers import observe_gemms
from fp8train.diagnostics.gemm_capture import capture_linear_calls
from fp8train.train.arguments import TrainingArguments
from fp8train.train.trainer import Trainer

transformers = pytest.importorskip("transformers")

E = 128


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=E, n_layer=1, n_head=2, vocab_size=256, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(E, 4, 2 * E, dropout=0.0, batch_first=True)


def test_conv1d_gemms_are_captured_with_the_transposed_weight():
    model = _gpt2()
    conv = model.transformer.h[0].mlp.c_fc  # Conv1D: y = x @ W + b, W [in, out]
    ids = torch.randint(0, 256, (2, 16))
    with capture_linear_calls({"c_fc": conv}) as calls:
        model(input_ids=ids, labels=ids).loss.backward()
    (call,) = calls
    assert torch.equal(call.weight, conv.weight.detach().t())  # [out, in], as the GEMM sees it
    assert (call.in_features, call.out_features) == (E, 4 * E)
    assert call.input.shape == (32, E) and call.grad_output.shape == (32, 4 * E)
    # The captured operands reproduce the layer's output.
    torch.testing.assert_close(call.input @ call.weight.t() + conv.bias.detach(),
                               conv(call.input).detach(), rtol=1e-5, atol=1e-5)


def test_gpt2_every_conv1d_is_measured():
    ids = torch.randint(0, 256, (2, 64))
    inspection = fp8train.inspect(_gpt2(), {"input_ids": ids, "labels": ids}, recipes=["tensorwise"])
    layers = {layer for layer, _ in inspection.layers}
    assert layers == {"transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
                      "transformer.h.0.mlp.c_proj", "lm_head"}
    c_attn = [r for r in inspection if r.layer == "transformer.h.0.attn.c_attn"]
    assert {(r.gemm, r.operand) for r in c_attn} >= {("output", "weight"), ("grad_weight", "grad_output")}
    assert inspection.unseen == {}


def test_attention_in_projection_is_measured_once_converted_and_named_before():
    x = torch.randn(2, 16, E)
    plain = fp8train.inspect(_encoder(), x, recipes=["tensorwise"])
    assert {layer for layer, _ in plain.layers} == {"linear1", "linear2"}
    assert "MultiheadAttention" in plain.unseen["self_attn"]
    converted = fp8train.convert_to_float8_training(_encoder(), "tensorwise")
    inspection = fp8train.inspect(converted, x, recipes=["tensorwise", "mxfp8"])
    assert inspection.layers == [("self_attn", 0), ("self_attn.out_proj", 0), ("linear1", 0), ("linear2", 0)]
    assert inspection.unseen == {}
    in_proj = [r for r in inspection if r.layer == "self_attn" and r.recipe == "tensorwise"]
    weight = next(r for r in in_proj if r.gemm == "output" and r.operand == "weight")
    # The packed in-projection weight [3E, E] is the operand.
    assert weight.amax == pytest.approx(converted.self_attn.in_proj_weight.detach().abs().max().item())
    # The inspected forward is the attention's own: its output equals nn.MultiheadAttention's.
    with fp8train.autocast(enabled=False):
        expected = converted(x)
    with fp8train.autocast(enabled=False), observe_gemms(lambda *args: None):
        observed = converted(x)
    torch.testing.assert_close(observed, expected, rtol=1e-6, atol=1e-6)


def test_attention_with_separate_key_and_value_runs_three_captured_gemms():
    attention = fp8train.convert_to_float8_training(nn.MultiheadAttention(E, 4, batch_first=True), "tensorwise")
    q, k, v = (torch.randn(2, 8, E) for _ in range(3))
    with capture_linear_calls({"attn": attention, "attn.out_proj": attention.out_proj}) as calls:
        with fp8train.autocast(enabled=False):
            attention(q, k, v)[0].sum().backward()
    assert [(c.layer, c.call, c.out_features) for c in calls] == [
        ("attn", 0, E), ("attn", 1, E), ("attn", 2, E), ("attn.out_proj", 0, E)
    ]
    for call, source in zip(calls, (q, k, v)):
        assert torch.equal(call.input, source.transpose(0, 1).reshape(-1, E))


class _EncoderClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, E)
        self.encoder = _encoder()
        self.head = nn.Linear(E, 256)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)))


def _loss(model, inputs, targets):
    return nn.functional.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())


def test_telemetry_records_every_converted_gemm_of_the_first_micro_batch(tmp_path, datasets):
    args = TrainingArguments(output_dir=str(tmp_path), steps=1, batch_size=4, seq_len=32, fp8_recipe="tensorwise",
                             fp8_stats_interval=1, grad_accumulation_steps=2, eval_interval=0, device="cpu")
    train, val = datasets
    seen = []

    def loss_fn(model, inputs, targets):
        seen.append((inputs, model.embed.weight.detach().clone()))
        return _loss(model, inputs, targets)

    Trainer(_EncoderClassifier, args, train, val, loss_fn=loss_fn).train()
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    calls = {(s["layer"], s["call"]) for s in record["fp8_stats"]}
    # One call each: the first of the two micro-batches only.
    assert calls == {("encoder.self_attn", 0), ("encoder.self_attn.out_proj", 0), ("encoder.linear1", 0),
                     ("encoder.linear2", 0), ("head", 0)}
    assert len(record["fp8_stats"]) == 5 * 9
    # The attention's input is the embedding of the first micro-batch's tokens (in bf16,
    # the autocast dtype, where rounding keeps the order of magnitudes).
    (first_ids, embedding), (second_ids, _) = seen[:2]  # then the evaluation's
    attention_input = next(s for s in record["fp8_stats"]
                           if s["layer"] == "encoder.self_attn" and s["gemm"] == "output" and s["operand"] == "input")
    expected = embedding[first_ids].abs().max().bfloat16().float().item()
    assert attention_input["amax"] == expected != embedding[second_ids].abs().max().bfloat16().float().item()
