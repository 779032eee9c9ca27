"""``save_pretrained_quantized`` of a model trained with mixed recipes (issue 41): a
checkpoint format holds one scheme, computed afresh from the weights (docs/serving.md), so
every Linear that trained in FP8, under whichever recipe its pattern gave it (a hybrid with a
delayed direction included), is written in the format, bit for bit as the same weights
unconverted are; what the map kept in bf16 stays there, and a module vLLM fuses with it says
which one."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import fp8train  # noqa: E402
from tests.integrations import export_models as models  # noqa: E402

MAP = {"*.self_attn.*": "hybrid(forward=delayed,backward=mxfp8)", "*.mlp.*": "nvfp4", "lm_head": None}


def _tensors(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("format", ["fp8_block", pytest.param("nvfp4", marks=pytest.mark.slow)])
def test_a_mixed_model_writes_every_fp8_linear_as_the_same_weights_unconverted(tmp_path, format):
    mixed = fp8train.convert_to_float8_training(models.llama(), MAP)  # (its delayed state: buffers, not written)
    report = {m.fqn: m.recipe for m in fp8train.conversion_report(mixed).modules if m.status == "converted"}
    assert report["model.layers.0.self_attn.q_proj"] == "hybrid(forward=delayed,backward=mxfp8)"
    written = fp8train.save_pretrained_quantized(mixed, tmp_path / "mixed", format=format)
    plain = models.llama()
    plain.load_state_dict(fp8train.drop_fp8_state(mixed.state_dict()))
    expected = fp8train.save_pretrained_quantized(plain, tmp_path / "plain", format=format)
    assert written.fp8_modules == expected.fp8_modules and len(written.fp8_modules) == 7
    assert dict(written.high_precision_modules) == {"lm_head": "trained in high precision (not converted to FP8)"}
    got, want = _tensors(tmp_path / "mixed"), _tensors(tmp_path / "plain")
    assert got.keys() == want.keys() and not any("fp8_scale" in key or "amax_history" in key for key in got)
    for key, tensor in want.items():
        assert torch.equal(got[key].view(torch.uint8) if tensor.element_size() == 1 else got[key],
                           tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor), key


def test_a_module_the_map_keeps_in_bf16_keeps_the_layer_vllm_fuses_it_into(tmp_path):
    mixed = fp8train.convert_to_float8_training(models.llama(), {"*.q_proj": None, "*": "mxfp8"})
    written = fp8train.save_pretrained_quantized(mixed, tmp_path / "ckpt", format="mxfp8")
    kept = dict(written.high_precision_modules)
    layer = "model.layers.0.self_attn."
    assert kept[layer + "q_proj"] == "trained in high precision (not converted to FP8)"
    assert kept[layer + "k_proj"] == f"vLLM fuses it with {layer}q_proj, which stays in high precision, into one layer"
    assert "model.layers.0.mlp.up_proj" in written.fp8_modules
