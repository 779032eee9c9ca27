"""save_pretrained_quantized's compressed-tensors formats (nvfp4, mxfp4, mxfp8): the bytes
(against ml_dtypes and a numpy float32 hand computation, and compressed-tensors' own packing
and global-scale rule), compressed-tensors' own decompression of them (bit for bit what
fp8train's dequantization gives), and a trained Llama that transformers loads from them."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
compressed_tensors = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.mxfp8 import MXFP8QuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor, pack_fp4_to_uint8  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import generate_gparam  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import fp8train  # noqa: E402
from fp8train.integrations.checkpoint_formats import checkpoint_format  # noqa: E402
from fp8train.quant.quantize import quantize  # noqa: E402
from tests.integrations import export_models as models  # noqa: E402

from tests.integrations.export_models import E2M1_MAX, E4M3_MAX  # noqa: E402
# The loaded model's loss against the trained model's, relative: 1% for the 8-bit format; for the
# 4-bit ones the recipe's own trained gap to bf16 (the library's defaults on the transformers
# Llama, 8 seeds: benchmarks/results_fp4_compare/llama_hp_8seeds.md), which the export must not add to.
MAX_LOSS_CHANGE = {"nvfp4": 0.0223, "mxfp4": 0.0206, "mxfp8": 0.01}
COMPRESSORS = {"nvfp4": NVFP4PackedCompressor, "mxfp4": MXFP4PackedCompressor, "mxfp8": MXFP8QuantizationCompressor}
PRESETS = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4", "mxfp8": "MXFP8"}


def _hand_mx(weight: torch.Tensor, data_max: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """The scaled values and biased E8M0 exponents per 1x32 group: ``e`` is the exponent of
    ``amax * float32(1/max)`` rounded up (0 for an all-zero group)."""
    w = weight.float().numpy()
    groups = w.reshape(w.shape[0], -1, 32)
    t = np.abs(groups).max(axis=2, keepdims=True) * (np.float32(1.0) / data_max)
    mantissa, exponent = np.frexp(t.astype(np.float64))  # t = mantissa * 2**exponent, mantissa in [0.5, 1)
    e = np.where(t == 0, 0, np.where(mantissa == 0.5, exponent - 1, exponent) + 127)
    scaled = groups * np.exp2(127.0 - e).astype(np.float32)
    return scaled.reshape(w.shape), e[..., 0].astype(np.uint8)


def test_nvfp4_bytes_match_the_hand_computation_and_compressed_tensors_conventions():
    weight = models.edge_weight()
    tensors = checkpoint_format("nvfp4").weight_tensors(weight)
    packed, scale_bytes, encode = models.hand_nvfp4(weight)
    assert sorted(tensors) == ["weight_global_scale", "weight_packed", "weight_scale"]
    assert tensors["weight_packed"].dtype == torch.uint8 and tensors["weight_packed"].shape == (48, 32)
    assert tensors["weight_scale"].dtype == torch.float8_e4m3fn and tensors["weight_scale"].shape == (48, 4)
    assert np.array_equal(tensors["weight_packed"].numpy(), packed)
    assert np.array_equal(tensors["weight_scale"].view(torch.uint8).numpy(), scale_bytes)
    global_scale = tensors["weight_global_scale"]
    assert global_scale.item() == encode
    # compressed-tensors' own rule for the global scale (448 * 6 / amax), and its own packing.
    amax = weight.abs().amax()
    _assert_encode_scale(global_scale, amax)
    e2m1 = torch.from_numpy(_unpack_values(packed))
    assert torch.equal(pack_fp4_to_uint8(e2m1), tensors["weight_packed"])


def _assert_encode_scale(written: torch.Tensor, amax: torch.Tensor) -> None:
    """``written`` is the float32 ``[1]`` encode scale ``448 * 6 / amax``, the quotient rounded
    once (fp8train's ``ge``); compressed-tensors' ``generate_gparam`` computes it as
    ``2688 * float32(1 / amax)`` (PyTorch's scalar / tensor), the same to one float32 rounding."""
    assert written.dtype == torch.float32 and written.shape == (1,)
    assert written.item() == np.float32(2688.0) / np.float32(amax.item())
    assert abs(written.item() - generate_gparam(-amax, amax).item()) <= written.item() * 2.0**-23


def _unpack_values(packed: np.ndarray) -> np.ndarray:
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    magnitude = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)[codes & 7]
    return np.where(codes & 8, -magnitude, magnitude).astype(np.float32)


def test_mxfp4_and_mxfp8_bytes_match_the_hand_computation():
    weight = models.edge_weight()
    mxfp4 = checkpoint_format("mxfp4").weight_tensors(weight)
    scaled, exponents = _hand_mx(weight, E2M1_MAX)
    assert sorted(mxfp4) == ["weight_packed", "weight_scale"] and mxfp4["weight_scale"].dtype == torch.uint8
    assert np.array_equal(mxfp4["weight_packed"].numpy(), models.pack(models.e2m1_codes(scaled)))
    assert np.array_equal(mxfp4["weight_scale"].numpy(), exponents) and exponents.shape == (48, 2)

    mxfp8 = checkpoint_format("mxfp8").weight_tensors(weight)
    scaled, exponents = _hand_mx(weight, E4M3_MAX)
    codes = np.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert sorted(mxfp8) == ["weight", "weight_scale"] and mxfp8["weight"].dtype == torch.float8_e4m3fn
    assert np.array_equal(mxfp8["weight"].view(torch.uint8).numpy(), codes)
    assert np.array_equal(mxfp8["weight_scale"].numpy(), exponents)


def _scheme(name: str):
    config = QuantizationConfig.model_validate(checkpoint_format(name).quantization_config([]))
    return config.config_groups["group_0"]


def _fp8train_dequantized(name: str, weight: torch.Tensor, fused_amax=None) -> torch.Tensor:
    """fp8train's bfloat16 dequantization of ``weight`` quantized by the format's rule (rows
    padded with zeros to whole 32-row tiles and cut again)."""
    rule = checkpoint_format(name).rule
    global_amax = fused_amax if rule.granularity.two_level_scales else None
    padded = torch.nn.functional.pad(weight, (0, 0, 0, -weight.shape[0] % 32))
    return quantize(padded, rule, global_amax=global_amax).dequantize(torch.bfloat16)[: weight.shape[0]]


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("amax", [5.25, 3.7])  # 5.25: NVFP4's global scale 512, a power of two
def test_compressed_tensors_decompression_gives_fp8trains_dequantized_weight(name, amax):
    weight = models.edge_weight(rows=40)  # 40 rows: padded to whole 16/32-row tiles and cut again
    weight = weight * (amax / weight.abs().max())
    tensors = checkpoint_format(name).weight_tensors(weight)
    decompressed = COMPRESSORS[name].decompress(tensors, _scheme(name))["weight"]
    assert decompressed.dtype == torch.bfloat16
    assert torch.equal(decompressed.view(torch.int16), _fp8train_dequantized(name, weight).view(torch.int16))


def test_the_config_is_compressed_tensors_preset_and_names_what_stays_in_high_precision():
    for name, preset in PRESETS.items():
        raw = checkpoint_format(name).quantization_config(["lm_head"])
        config = QuantizationConfig.model_validate(raw)
        assert raw["quant_method"] == "compressed-tensors" and config.ignore == ["lm_head"]
        assert config.quantization_status == "compressed"
        # As llm-compressor's config.json holds the preset (model_dump leaves out the zero point's dtype).
        expected = preset_name_to_scheme(preset, ["Linear"]).model_dump(mode="json")
        assert config.config_groups["group_0"].model_dump(mode="json") == expected, name


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "mxfp8"])
def test_a_trained_llama_loads_in_transformers_with_the_weights_written(tmp_path, name):
    recipe = "mxfp8" if name == "mxfp8" else name
    model = models.train(fp8train.convert_to_float8_training(models.llama(), recipe))
    written = fp8train.save_pretrained_quantized(model, tmp_path / name, format=name)
    config = json.loads((tmp_path / name / "config.json").read_text())["quantization_config"]
    assert config == checkpoint_format(name).quantization_config(["lm_head"])
    assert len(written.fp8_modules) == 7 and written.format == name
    tensors = load_file(tmp_path / name / "model.safetensors")
    assert not any(f"{module}.weight" in tensors for module in written.fp8_modules if name != "mxfp8")

    # transformers runs compressed-tensors checkpoints on CPU by decompressing (to bfloat16) on the first forward.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.bfloat16)
    batch = models.batch()
    assert abs(models.loss(loaded, batch) / models.loss(model, batch) - 1) <= MAX_LOSS_CHANGE[name]
    weights = {module: model.get_submodule(module).weight.detach() for module in written.fp8_modules}
    for module, weight in weights.items():
        fused = [other for other in weights if other.rpartition(".")[2] in _FUSED.get(module.rpartition(".")[2], ())]
        fused_amax = torch.stack([weights[other].abs().amax() for other in fused]).amax() if fused else None
        expected = _fp8train_dequantized(name, weight, fused_amax)
        assert torch.equal(loaded.get_submodule(module).weight.view(torch.int16), expected.view(torch.int16)), module


_FUSED = {leaf: group for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")) for leaf in group}


def test_fused_linears_share_one_nvfp4_global_scale_and_short_rows_stay_in_high_precision(tmp_path):
    model = models.llama(intermediate_size=200)  # down_proj's in_features=200: not whole groups of 16 or 32
    for name in ("nvfp4", "mxfp8"):
        written = fp8train.save_pretrained_quantized(model, tmp_path / name, format=name)
        kept = dict(written.high_precision_modules)
        reason = kept["model.layers.0.mlp.down_proj"]
        assert reason.startswith("in_features=200 is not a multiple of the format's group")
        assert "model.layers.0.mlp.up_proj" not in kept  # vLLM needs no whole 128-row blocks here
    tensors = load_file(tmp_path / "nvfp4" / "model.safetensors")
    prefix = "model.layers.0."
    qkv = [tensors[f"{prefix}self_attn.{p}_proj.weight_global_scale"] for p in "qkv"]
    assert torch.equal(qkv[0], qkv[1]) and torch.equal(qkv[0], qkv[2])
    amax = torch.stack([model.get_submodule(f"{prefix}self_attn.{p}_proj").weight.abs().amax() for p in "qkv"]).amax()
    _assert_encode_scale(qkv[0], amax)
    gate, up = (tensors[f"{prefix}mlp.{p}_proj.weight_global_scale"] for p in ("gate", "up"))
    assert torch.equal(gate, up) and not torch.equal(gate, tensors[f"{prefix}self_attn.o_proj.weight_global_scale"])


def test_nvfp4_with_calibrated_input_amax_is_w4a4_and_loads(tmp_path):
    model = models.train(fp8train.convert_to_float8_training(models.llama(), "nvfp4"))
    input_amax = models.calibrated_input_amax(model, [models.batch(seed=20), models.batch(seed=21)])
    input_amax["model.layers.0.self_attn.k_proj"] *= 1.5  # what a fused layer's parts are given, they share the largest
    written = fp8train.save_pretrained_quantized(model, tmp_path / "w4a4", format="nvfp4", input_amax=input_amax)
    assert "W4A4" in written.summary()
    raw = json.loads((tmp_path / "w4a4" / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(raw)
    expected = preset_name_to_scheme("NVFP4", ["Linear"]).model_dump(mode="json")
    assert config.config_groups["group_0"].model_dump(mode="json") == expected
    tensors = load_file(tmp_path / "w4a4" / "model.safetensors")
    o_amax = input_amax["model.layers.0.self_attn.o_proj"]
    _assert_encode_scale(tensors["model.layers.0.self_attn.o_proj.input_global_scale"], o_amax)
    qkv = [tensors[f"model.layers.0.self_attn.{p}_proj.input_global_scale"] for p in "qkv"]
    assert torch.equal(qkv[0], qkv[1]) and torch.equal(qkv[0], qkv[2]) and "lm_head.input_global_scale" not in tensors
    k_amax = input_amax["model.layers.0.self_attn.k_proj"]
    _assert_encode_scale(qkv[0], k_amax)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "w4a4", dtype=torch.bfloat16)
    batch = models.batch()
    assert abs(models.loss(loaded, batch) / models.loss(model, batch) - 1) <= MAX_LOSS_CHANGE["nvfp4"]
    o_proj = loaded.get_submodule("model.layers.0.self_attn.o_proj")
    assert torch.equal(o_proj.input_global_scale, tensors["model.layers.0.self_attn.o_proj.input_global_scale"])


def test_input_amax_errors_name_the_problem(tmp_path):
    model = models.llama()
    names = [f"model.layers.0.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    full = dict.fromkeys(names, 1.0)
    with pytest.raises(ValueError, match="format='mxfp8' takes no input_amax"):
        fp8train.save_pretrained_quantized(model, tmp_path / "x", format="mxfp8", input_amax=full)
    short = dict.fromkeys(names[:4], 1.0)
    with pytest.raises(ValueError, match=r"input_amax has no amax for the Linears written quantized \['model.layers.0.mlp"):
        fp8train.save_pretrained_quantized(model, tmp_path / "x", format="nvfp4", input_amax=short)
    not_finite = {**full, names[-1]: float("nan")}
    with pytest.raises(ValueError, match="input_amax must be positive and finite, got {'model.layers.0.mlp.down_proj': nan}"):
        fp8train.save_pretrained_quantized(model, tmp_path / "x", format="nvfp4", input_amax=not_finite)
    with pytest.raises(TypeError, match="input_amax must be a mapping"):
        fp8train.save_pretrained_quantized(model, tmp_path / "x", format="nvfp4", input_amax=[1.0])
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "mxfp8"])
def test_an_all_zero_weight_writes_finite_scales_and_decompresses_to_zeros(name):
    """amax 0: NVFP4's encode scale is FLT_MAX (NUMERICS.md section 6: ``min(2688 / 0, FLT_MAX)``),
    every block scale and code 0; the MX scales are E8M0 code 0 (2^-127); nothing is NaN or inf."""
    weight = torch.zeros(32, 64)
    tensors = checkpoint_format(name).weight_tensors(weight)
    assert all(torch.isfinite(t.float()).all() for t in tensors.values())
    data = tensors["weight_packed" if name != "mxfp8" else "weight"]
    assert not data.float().any() and not tensors["weight_scale"].float().any()
    if name == "nvfp4":
        assert tensors["weight_global_scale"].item() == np.finfo(np.float32).max
    decompressed = COMPRESSORS[name].decompress(tensors, _scheme(name))["weight"]
    assert torch.equal(decompressed.view(torch.int16), torch.zeros(32, 64, dtype=torch.int16))  # +0.0, no NaN
    assert torch.equal(decompressed.view(torch.int16), _fp8train_dequantized(name, weight).view(torch.int16))
