"""save_pretrained_quantized's ``nvfp4_modelopt`` format (NVFP4 as NVIDIA ModelOpt writes it,
vLLM's ``modelopt_fp4``): the bytes against a numpy float32 / ml_dtypes hand computation, the
two config files against ModelOpt's export, and a trained Llama whose every written weight,
dequantized by the loaders' formula ``e2m1 * weight_scale * weight_scale_2``, is fp8train's
dequantization bit for bit. ModelOpt itself does not install here (it needs requests, pulp,
omegaconf, nvidia-ml-py, ninja): the references are independent hand computations of its
conventions (``NVFP4QTensor``: low nibble = even element, ``weight_scale_2 = amax / 2688``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

import fp8train  # noqa: E402
from fp8train.integrations.checkpoint_formats import checkpoint_format  # noqa: E402
from fp8train.quant.quantize import quantize  # noqa: E402
from fp8train.spec.rule import QuantRule  # noqa: E402
from tests.integrations import export_models as models  # noqa: E402

GLOBAL_RANGE = np.float32(6.0 * 448.0)  # ModelOpt: weight_scale_2 = amax / (6 * 448)
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
FORMAT = "nvfp4_modelopt"
NVFP4_RULE = QuantRule(granularity="nvfp4")
PREFIX = "model.layers.0."
FUSED = {leaf: group for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")) for leaf in group}


def _hand_dequantized(tensors: dict[str, torch.Tensor]) -> np.ndarray:
    """float32 ``(e2m1 * weight_scale) * weight_scale_2``, as ModelOpt and vLLM read the layout."""
    packed = tensors["weight"].numpy()
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    block_scale = np.repeat(tensors["weight_scale"].float().numpy(), 16, axis=1)
    return (E2M1_VALUES[codes] * block_scale) * np.float32(tensors["weight_scale_2"].item())


def _assert_decode_scale(written: torch.Tensor, amax: torch.Tensor) -> None:
    """``written`` is the float32 scalar ``1 / (2688 / amax)``, ModelOpt's ``amax / 2688`` to one
    float32 rounding."""
    assert written.dtype == torch.float32 and written.shape == ()
    amax32 = np.float32(amax.item())
    assert written.item() == np.float32(1.0) / (GLOBAL_RANGE / amax32)
    assert abs(written.item() - amax32 / GLOBAL_RANGE) <= written.item() * 2.0**-23


def test_bytes_match_the_hand_computation_and_modelopts_conventions():
    weight = models.edge_weight()
    tensors = checkpoint_format(FORMAT).weight_tensors(weight)
    packed, scale_bytes, encode = models.hand_nvfp4(weight)
    decode = np.float32(1.0) / encode
    assert sorted(tensors) == ["weight", "weight_scale", "weight_scale_2"]
    assert tensors["weight"].dtype == torch.uint8 and tensors["weight"].shape == (48, 32)
    assert tensors["weight_scale"].dtype == torch.float8_e4m3fn and tensors["weight_scale"].shape == (48, 4)
    assert np.array_equal(tensors["weight"].numpy(), packed)
    assert np.array_equal(tensors["weight_scale"].view(torch.uint8).numpy(), scale_bytes)
    assert tensors["weight_scale_2"].item() == decode
    _assert_decode_scale(tensors["weight_scale_2"], weight.abs().amax())
    dequantized = _hand_dequantized(tensors)
    assert np.array_equal(dequantized[1:3, :32], np.zeros((2, 32), dtype=np.float32))  # zero groups: scale 0
    at_amax = np.unravel_index(np.abs(weight.numpy()).argmax(), weight.shape)  # code 6, block scale 448
    assert abs(dequantized[at_amax] / weight.numpy()[at_amax] - 1) <= 2.0**-22


def _config(quant_algo: str, input_activations: bool) -> tuple[dict, dict]:
    """What ModelOpt 0.47's export writes for NVFP4 / W4A16_NVFP4 with ``lm_head`` excluded:
    ``hf_quant_config.json`` and ``config.json``'s ``quantization_config``."""
    producer = {"name": "modelopt", "version": "0.47.0"}
    hf_quant = {
        "producer": producer,
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": ["lm_head"]},
    }
    args = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    group = {"input_activations": args, "weights": args, "targets": ["Linear"]}
    if not input_activations:
        del group["input_activations"]
    config = {"config_groups": {"group_0": group}, "ignore": ["lm_head"], "quant_algo": quant_algo,
              "producer": producer, "quant_method": "modelopt"}
    return hf_quant, config


def test_the_configs_are_modelopts_weight_only_and_w4a4():
    fmt = checkpoint_format(FORMAT)
    for written, quant_algo, calibrated in ((fmt, "W4A16_NVFP4", False), (fmt.with_input_amax(), "NVFP4", True)):
        hf_quant, config = _config(quant_algo, calibrated)
        assert written.extra_files(["lm_head"]) == {"hf_quant_config.json": hf_quant}
        assert written.quantization_config(["lm_head"]) == config


def _files(directory) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    hf_quant = json.loads((directory / "hf_quant_config.json").read_text())
    return hf_quant, config, load_file(directory / "model.safetensors")


def test_a_trained_llama_written_dequantizes_to_fp8trains_weights_and_fused_layers_share_scales(tmp_path):
    model = models.train(fp8train.convert_to_float8_training(models.llama(), "nvfp4"))
    written = fp8train.save_pretrained_quantized(model, tmp_path / "w4a16", format=FORMAT)
    assert written.format == FORMAT and len(written.fp8_modules) == 7 and "weight-only" in written.summary()
    hf_quant, config, tensors = _files(tmp_path / "w4a16")
    assert (hf_quant, config) == _config("W4A16_NVFP4", input_activations=False)
    assert tensors["lm_head.weight"].dtype == torch.float32 and not any(k.endswith("input_scale") for k in tensors)
    weights = {module: model.get_submodule(module).weight.detach() for module in written.fp8_modules}
    for module, weight in weights.items():
        leaf = module.rpartition(".")[2]
        fused = [other for other in weights if other.rpartition(".")[2] in FUSED.get(leaf, ())]
        amax = torch.stack([weights[other].abs().amax() for other in fused or [module]]).amax()
        _assert_decode_scale(tensors[f"{module}.weight_scale_2"], amax)
        mine = {suffix: tensors[f"{module}.{suffix}"] for suffix in ("weight", "weight_scale", "weight_scale_2")}
        fp8trains = quantize(weight, NVFP4_RULE, global_amax=amax.reshape(1)).dequantize(torch.float32)
        assert np.array_equal(_hand_dequantized(mine).view(np.int32), fp8trains.numpy().view(np.int32)), module
    parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    parts += ("self_attn.o_proj",)
    scales = {part: tensors[f"{PREFIX}{part}.weight_scale_2"] for part in parts}
    assert scales["self_attn.q_proj"] == scales["self_attn.k_proj"] == scales["self_attn.v_proj"]
    assert scales["mlp.gate_proj"] == scales["mlp.up_proj"] != scales["self_attn.q_proj"]
    assert scales["self_attn.o_proj"] != scales["self_attn.q_proj"]


def test_input_amax_gives_input_scale_shared_by_fused_layers(tmp_path):
    model = models.llama()
    input_amax = models.calibrated_input_amax(model, [models.batch(seed=20)])
    input_amax[f"{PREFIX}self_attn.k_proj"] *= 1.5  # the parts of a fused layer share the largest
    written = fp8train.save_pretrained_quantized(model, tmp_path / "w4a4", format=FORMAT, input_amax=input_amax)
    assert "NVFP4 (ModelOpt, W4A4)" in written.summary()
    hf_quant, config, tensors = _files(tmp_path / "w4a4")
    assert (hf_quant, config) == _config("NVFP4", input_activations=True)
    qkv = [tensors[f"{PREFIX}self_attn.{p}_proj.input_scale"] for p in "qkv"]
    assert qkv[0] == qkv[1] == qkv[2]
    _assert_decode_scale(qkv[0], input_amax[f"{PREFIX}self_attn.k_proj"])
    gate, up = (tensors[f"{PREFIX}mlp.{p}_proj.input_scale"] for p in ("gate", "up"))
    assert gate == up
    gate_up_amax = torch.maximum(input_amax[f"{PREFIX}mlp.gate_proj"], input_amax[f"{PREFIX}mlp.up_proj"])
    _assert_decode_scale(gate, gate_up_amax)
    _assert_decode_scale(tensors[f"{PREFIX}self_attn.o_proj.input_scale"], input_amax[f"{PREFIX}self_attn.o_proj"])
    assert "lm_head.input_scale" not in tensors


def test_an_all_zero_weight_writes_a_finite_decode_scale_and_dequantizes_to_zeros():
    """amax 0: the encode scale is FLT_MAX (NUMERICS.md section 6), so ``weight_scale_2`` is its
    float32 reciprocal 2^-128 (subnormal; ModelOpt's ``0 / 2688`` writes 0); every block scale
    and code is 0, and either reading gives +0.0."""
    tensors = checkpoint_format(FORMAT).weight_tensors(torch.zeros(32, 64))
    assert tensors["weight_scale_2"].item() == np.float32(1.0) / np.finfo(np.float32).max
    assert not tensors["weight"].any() and not tensors["weight_scale"].float().any()
    dequantized = _hand_dequantized(tensors)
    assert np.array_equal(dequantized.view(np.int32), np.zeros((32, 64), np.int32))
