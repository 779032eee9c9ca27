"""``fp8train.calibrate_input_amax``: each Linear's largest |input| over the batches, against
hand-computed values; the model run as inference runs it (eval, no grad) and left as it was;
the batch forms, the errors; and the W4A4 export it feeds."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fp8train

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from . import export_models as models  # noqa: E402


def _two_layers() -> nn.Sequential:
    """Linear(2 -> 2) with weight [[1, -2], [3, 0.5]] and bias [0, -1], ReLU, Linear(2 -> 1)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, -2.0], [3.0, 0.5]]))
        model[0].bias.copy_(torch.tensor([0.0, -1.0]))
    return model


def test_the_amax_of_each_linear_input_over_all_batches_by_hand():
    batches = [torch.tensor([[1.0, 2.0]]), torch.tensor([[-4.0, 0.5], [0.25, -1.0]])]
    # Layer 0 inputs: |x| up to 4. Its outputs, ReLU'd (x @ W.T + b):
    #   [1, 2]      -> [1 - 4, 3 + 1 - 1]      = [-3, 3]     -> [0, 3]
    #   [-4, 0.5]   -> [-4 - 1, -12 + 0.25 - 1] = [-5, -12.75] -> [0, 0]
    #   [0.25, -1]  -> [0.25 + 2, 0.75 - 0.5 - 1] = [2.25, -0.75] -> [2.25, 0]
    assert fp8train.calibrate_input_amax(_two_layers(), batches) == {"0": 4.0, "2": 3.0}


def test_the_model_runs_as_inference_runs_it_and_is_left_as_it_was():
    model = nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4))
    model.train()
    model[2].eval()  # a mixed state, restored module by module
    x = torch.full((64, 4), 2.0)
    grad_enabled = []

    def forward(module, batch):
        grad_enabled.append(torch.is_grad_enabled())
        return module(batch)

    amax = fp8train.calibrate_input_amax(model, [x], forward=forward)
    assert amax["1"] == 2.0  # dropout off: in training mode the kept inputs would be 4.0
    assert grad_enabled == [False]
    assert [m.training for m in model.modules()] == [True, True, True, False, True]
    assert all(not module._forward_pre_hooks for module in model.modules())


def test_batch_forms_mapping_tuple_tensor_and_a_keyword_input():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x, y=None):
            return self.a(x) + (self.b(input=y) if y is not None else 0)

    model = Two()
    x, y = torch.tensor([[1.0, -5.0]]), torch.tensor([[7.0, 0.0]])
    assert fp8train.calibrate_input_amax(model, [{"x": x, "y": y}]) == {"a": 5.0, "b": 7.0}
    assert fp8train.calibrate_input_amax(model, [(x, y)]) == {"a": 5.0, "b": 7.0}
    assert fp8train.calibrate_input_amax(model, iter([x])) == {"a": 5.0}  # b never called: absent


def test_a_converted_model_calibrates_through_its_quantized_layers():
    model = models.llama()
    plain = fp8train.calibrate_input_amax(model, [models.batch(seed=3)])
    converted = fp8train.convert_to_float8_training(models.llama(), "nvfp4")
    converted.load_state_dict(model.state_dict(), strict=False)
    quantized = fp8train.calibrate_input_amax(converted, [models.batch(seed=3)])
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert list(plain) == list(quantized) == linears
    first = "model.layers.0.self_attn.q_proj"  # after the embedding and a norm: the same input
    assert quantized[first] == plain[first]
    assert quantized["lm_head"] != plain["lm_head"]  # after 4-bit GEMMs: what the quantized model feeds it


def test_errors_name_the_problem():
    model = _two_layers()
    with pytest.raises(ValueError, match="batches is empty; calibrate on at least one batch"):
        fp8train.calibrate_input_amax(model, [])
    with pytest.raises(ValueError, match="ReLU has no nn.Linear to calibrate"):
        fp8train.calibrate_input_amax(nn.ReLU(), [torch.ones(1)])
    with pytest.raises(TypeError, match="model must be an nn.Module, got dict"):
        fp8train.calibrate_input_amax({}, [torch.ones(1)])
    with pytest.raises(TypeError, match="forward=3 must be a callable"):
        fp8train.calibrate_input_amax(model, [torch.ones(1, 2)], forward=3)
    with pytest.raises(ValueError, match=r"a NaN or an infinity at \{'0': nan, '2': nan\}"):
        fp8train.calibrate_input_amax(model, [torch.ones(1, 2), torch.tensor([[float("nan"), 1.0]])])
    with pytest.raises(ValueError, match=r"a NaN or an infinity at \{'0': inf\}"):
        fp8train.calibrate_input_amax(model, [torch.tensor([[-float("inf"), 1.0]])], forward=lambda m, b: m[0](b))
    with pytest.raises(RuntimeError, match="the batch failed"):
        fp8train.calibrate_input_amax(model, [torch.ones(1, 2)], forward=lambda m, b: _fail())
    assert all(not module._forward_pre_hooks for module in model.modules()) and model.training


def _fail():
    raise RuntimeError("the batch failed")


def test_the_calibration_makes_a_w4a4_checkpoint(tmp_path):
    model = models.train(fp8train.convert_to_float8_training(models.llama(), "nvfp4"))
    amax = fp8train.calibrate_input_amax(model, [models.batch(seed=20), models.batch(seed=21)])
    written = fp8train.save_pretrained_quantized(model, tmp_path / "w4a4", format="nvfp4", input_amax=amax)
    assert written.calibrated_inputs and "W4A4" in written.summary()
    tensors = load_file(tmp_path / "w4a4" / "model.safetensors")
    o_proj = "model.layers.0.self_attn.o_proj"
    assert tensors[f"{o_proj}.input_global_scale"].item() == torch.tensor(2688.0 / amax[o_proj]).item()
    config = json.loads((tmp_path / "w4a4" / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["input_activations"]["num_bits"] == 4


def test_an_uncalibrated_linear_is_named_with_the_fix(tmp_path):
    model = models.llama()
    amax = fp8train.calibrate_input_amax(model, [models.batch()])
    del amax["model.layers.0.mlp.up_proj"]
    with pytest.raises(ValueError, match=r"\['model.layers.0.mlp.up_proj'\].*fp8train.calibrate_input_amax records"):
        fp8train.save_pretrained_quantized(model, tmp_path / "x", format="nvfp4", input_amax=amax)
    amax["model.layers.0.mlp.up_proj"] = 0.0  # a Linear only ever fed zeros: no scale to set
    with pytest.raises(ValueError, match=r"must be positive and finite, got \{'model.layers.0.mlp.up_proj': 0.0\}"):
        fp8train.save_pretrained_quantized(model, tmp_path / "x", format="nvfp4", input_amax=amax)
