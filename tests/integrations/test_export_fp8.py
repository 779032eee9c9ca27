"""save_pretrained_fp8: the bytes it writes (against ml_dtypes and a float64 hand computation),
that transformers loads them as they are, the loss of the loaded model, and its errors."""

from __future__ import annotations

import ast
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

import fp8train  # noqa: E402
from fp8train.integrations import fp8_checkpoint  # noqa: E402
from fp8train.integrations.block_fp8 import UE8M0_WEIGHT_BLOCK_RULE, quantize_weight_blocks  # noqa: E402
from tests.integrations import export_models as models  # noqa: E402

E4M3_MAX = 448.0
MAX_LOSS_CHANGE = 0.01  # the loaded FP8 model's loss against the trained model's, relative


def _hand_block_fp8(weight: torch.Tensor, power_2: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """float64 reference: per 128x128 block scale = 448/amax in float32 (1 for zeros),
    with ``power_2`` the largest power of two not above it (``math.frexp``), scale_inv =
    1/scale, codes = ml_dtypes' round-to-nearest-even of the float32 product, clipped to
    +-448 first (a saturating cast)."""
    w = weight.float().numpy().astype(np.float64)
    rows, cols = w.shape
    grid = (-(-rows // 128), -(-cols // 128))
    codes = np.zeros(w.shape, dtype=ml_dtypes.float8_e4m3fn)
    scale_inv = np.zeros(grid, dtype=np.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            amax = np.abs(block).max()
            scale = np.float32(1.0) if amax == 0 else np.float32(E4M3_MAX / amax)
            if power_2:
                scale = np.float32(2.0 ** (math.frexp(float(scale))[1] - 1))
            scale_inv[i, j] = np.float32(1.0 / np.float64(scale))
            product = np.float32(block * np.float64(scale))
            codes[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = np.clip(product, -E4M3_MAX, E4M3_MAX).astype(
                ml_dtypes.float8_e4m3fn
            )
    return codes, scale_inv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(256, 384), (200, 136), (64, 128), (1, 1)])
def test_block_bytes_match_the_hand_computation(shape, dtype):
    torch.manual_seed(0)
    weight = (torch.randn(shape) * torch.logspace(-3, 2, shape[1])).to(dtype)
    weight[:128, :128] = 0 if shape[0] > 128 else weight[:128, :128]  # an all-zero block
    weight_fp8, weight_scale_inv = quantize_weight_blocks(weight)
    codes, scale_inv = _hand_block_fp8(weight)
    assert weight_fp8.dtype == torch.float8_e4m3fn and weight_fp8.shape == weight.shape
    assert weight_scale_inv.dtype == torch.float32 and tuple(weight_scale_inv.shape) == scale_inv.shape
    assert np.array_equal(weight_fp8.view(torch.uint8).numpy(), codes.view(np.uint8))
    assert np.array_equal(weight_scale_inv.numpy().view(np.uint32), scale_inv.view(np.uint32))


@pytest.mark.parametrize("shape", [(256, 384), (200, 136), (1, 1)])
def test_ue8m0_block_bytes_match_the_hand_computation_and_nothing_saturates(shape):
    torch.manual_seed(0)
    weight = (torch.randn(shape) * torch.logspace(-3, 2, shape[1])).to(torch.bfloat16)
    weight_fp8, weight_scale_inv = quantize_weight_blocks(weight, UE8M0_WEIGHT_BLOCK_RULE)
    codes, scale_inv = _hand_block_fp8(weight, power_2=True)
    assert np.array_equal(weight_fp8.view(torch.uint8).numpy(), codes.view(np.uint8))
    assert np.array_equal(weight_scale_inv.numpy().view(np.uint32), scale_inv.view(np.uint32))
    assert (weight_scale_inv.view(torch.int32) & 0x7FFFFF == 0).all()  # powers of two: E8M0 holds them
    # Rounded up, the scales put every block's amax at or below 448: no value is clipped.
    scaled = _dequantized(torch.ones(shape), 1 / weight_scale_inv) * weight.float()
    assert float(scaled.abs().max()) <= E4M3_MAX


def test_block_quantization_refuses_non_finite_weights():
    with pytest.raises(ValueError, match="NaN or an infinity"):
        quantize_weight_blocks(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="must be 2-D"):
        quantize_weight_blocks(torch.ones(4))


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path)


def _dequantized(weight_fp8: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """``weight * scale_inv`` per 128x128 block, in float32."""
    rows, cols = weight_fp8.shape
    expanded = weight_scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return weight_fp8.float() * expanded


def test_trained_fp8_model_loads_with_the_weights_the_file_holds(tmp_path):
    model = models.train(fp8train.convert_to_float8_training(models.llama(), "delayed"))
    assert any(key.endswith("fp8_scale") for key in model.state_dict())
    written = fp8train.save_pretrained_fp8(model, tmp_path / "fp8")
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    expected_config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert expected_config.items() <= config["quantization_config"].items()
    assert config["quantization_config"]["modules_to_not_convert"] == [n for n, _ in written.high_precision_modules]
    assert len(written.fp8_modules) == 7 and not any("fp8_scale" in key for key in tensors)
    assert written.high_precision_modules == (
        ("lm_head", "the output head, which vLLM runs in high precision (as FP8 checkpoints keep it)"),
    )

    loaded = _load(tmp_path / "fp8")
    for name in written.fp8_modules:
        weight_fp8, weight_scale_inv = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"]
        assert weight_fp8.dtype == torch.float8_e4m3fn and weight_scale_inv.dtype == torch.float32
        assert torch.equal(loaded.get_submodule(name).weight, _dequantized(weight_fp8, weight_scale_inv))
    for key, value in model.state_dict().items():
        if key in tensors and tensors[key].dtype != torch.float8_e4m3fn:
            assert tensors[key].dtype == torch.float32 and torch.equal(loaded.state_dict()[key], value)
    batch = models.batch()
    assert abs(models.loss(loaded, batch) / models.loss(model, batch) - 1) < MAX_LOSS_CHANGE


def test_ue8m0_checkpoint_loads_with_the_power_of_two_scales_it_holds(tmp_path):
    model = models.train(fp8train.convert_to_float8_training(models.llama(), "mxfp8"))
    written = fp8train.save_pretrained_quantized(model, tmp_path / "ue8m0", format="fp8_block_ue8m0")
    tensors = load_file(tmp_path / "ue8m0" / "model.safetensors")
    config = json.loads((tmp_path / "ue8m0" / "config.json").read_text())["quantization_config"]
    assert config == {**fp8_checkpoint.quantization_config(["lm_head"]), "scale_fmt": "ue8m0"}
    assert written.format == "fp8_block_ue8m0" and "power-of-two (UE8M0) scales" in written.summary()
    loaded = _load(tmp_path / "ue8m0")
    for name in written.fp8_modules:
        weight_fp8, weight_scale_inv = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"]
        assert (weight_scale_inv.view(torch.int32) & 0x7FFFFF == 0).all(), name
        expected = quantize_weight_blocks(model.get_submodule(name).weight, UE8M0_WEIGHT_BLOCK_RULE)
        assert torch.equal(weight_fp8.view(torch.uint8), expected[0].view(torch.uint8))
        assert torch.equal(loaded.get_submodule(name).weight, _dequantized(weight_fp8, weight_scale_inv))
    batch = models.batch()
    assert abs(models.loss(loaded, batch) / models.loss(model, batch) - 1) < MAX_LOSS_CHANGE


def test_an_unknown_format_names_the_formats(tmp_path):
    formats = "fp8_block, fp8_block_ue8m0, nvfp4, nvfp4_modelopt, mxfp4, mxfp8"
    with pytest.raises(ValueError, match=f"format='nvfp8' must be one of {formats}"):
        fp8train.save_pretrained_quantized(models.llama(), tmp_path / "x", format="nvfp8")
    assert not (tmp_path / "x").exists()


def test_plain_model_keeps_its_head_and_what_loaders_misread_or_refuse_in_high_precision(tmp_path):
    model = models.llama(hidden_size=64, intermediate_size=200, num_key_value_heads=2)
    written = fp8train.save_pretrained_fp8(model, tmp_path / "fp8")
    kept, layer = dict(written.high_precision_modules), "model.layers.0."
    assert "output head" in kept["lm_head"]
    assert "out_features=200 ends in a partial block" in kept[layer + "mlp.gate_proj"]
    assert "in_features=200 ends in a partial block" in kept[layer + "mlp.down_proj"]
    assert "out_features=32 is not a multiple of 128, which vLLM needs" in kept[layer + "self_attn.k_proj"]
    # o_proj (64 x 64) is one partial block: every loader reads it, and it is not fused.
    assert written.fp8_modules == (layer + "self_attn.o_proj",)
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    loaded = _load(tmp_path / "fp8")
    o_proj = layer + "self_attn.o_proj"
    weight_fp8, weight_scale_inv = tensors[o_proj + ".weight"], tensors[o_proj + ".weight_scale_inv"]
    assert weight_scale_inv.shape == (1, 1)
    assert torch.equal(loaded.get_submodule(o_proj).weight, _dequantized(weight_fp8, weight_scale_inv))
    for name in kept:
        assert torch.equal(loaded.get_submodule(name).weight, model.get_submodule(name).weight)
    batch = models.batch()
    assert abs(models.loss(loaded, batch) / models.loss(model, batch) - 1) < MAX_LOSS_CHANGE


def test_converted_model_writes_what_trained_in_fp8_tied_and_filtered_ones_stay(tmp_path):
    model = fp8train.convert_to_float8_training(
        models.llama(num_key_value_heads=2, tie=True),
        "blockwise",
        module_filter_fn=lambda module, name: not name.endswith("o_proj"),
    )
    written = fp8train.save_pretrained_fp8(
        model, tmp_path / "fp8", module_filter_fn=lambda module, name: not name.endswith("up_proj")
    )
    kept = dict(written.high_precision_modules)
    assert "not converted" in kept["model.layers.0.self_attn.o_proj"]
    assert kept["model.layers.0.mlp.up_proj"] == "excluded by module_filter_fn"
    assert "not converted" in kept["model.layers.0.self_attn.k_proj"]  # 64 rows: blockwise skipped it
    assert kept["lm_head"] == "its weight is tied to another module's"
    layer = "model.layers.0."
    # vLLM fuses q, k, v (and gate, up) into one layer of one precision.
    assert kept[layer + "self_attn.q_proj"] == (
        f"vLLM fuses it with {layer}self_attn.k_proj, which stays in high precision, into one layer"
    )
    assert kept[layer + "mlp.gate_proj"].startswith(f"vLLM fuses it with {layer}mlp.up_proj")
    assert written.fp8_modules == (layer + "mlp.down_proj",)
    assert [name for name, _ in written.high_precision_modules] == [
        layer + p for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj")
    ] + ["lm_head"]
    assert written.summary().startswith(f"{tmp_path / 'fp8'}: 1 Linear(s)")


def test_a_bfloat16_model_in_small_shards(tmp_path):
    model = models.llama().to(torch.bfloat16)
    written = fp8train.save_pretrained_fp8(model, tmp_path / "fp8", max_shard_size="100KB")
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(tmp_path / "fp8" / shard))
    assert len(set(index["weight_map"].values())) > 1
    assert tensors["lm_head.weight"].dtype == torch.bfloat16 and tensors["model.norm.weight"].dtype == torch.bfloat16
    loaded = _load(tmp_path / "fp8")
    name = written.fp8_modules[0]
    expected = _dequantized(tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"]).to(torch.bfloat16)
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded.get_submodule(name).weight, expected)
    batch = models.batch()
    assert abs(models.loss(loaded, batch) / models.loss(model, batch) - 1) < MAX_LOSS_CHANGE


def test_fused_experts_and_conv1d_stay_in_high_precision(tmp_path):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, num_local_experts=2, num_experts_per_tok=1,
    )
    moe = transformers.MixtralForCausalLM(config)
    written = fp8train.save_pretrained_fp8(moe, tmp_path / "moe")
    assert dict(written.high_precision_modules)["model.layers.0.mlp.experts"] == (
        "MixtralExperts: the format holds nn.Linear weights only"
    )
    loaded = _load(tmp_path / "moe")
    assert torch.equal(loaded.model.layers[0].mlp.experts.down_proj, moe.model.layers[0].mlp.experts.down_proj)
    in_fp8, info = _load_as_on_an_fp8_gpu(tmp_path / "moe")  # without the listing, FP8Experts
    assert type(in_fp8.model.layers[0].mlp.experts) is type(moe.model.layers[0].mlp.experts)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    batch = models.batch()
    assert abs(models.loss(loaded, batch) / models.loss(moe, batch) - 1) < MAX_LOSS_CHANGE
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=128, n_layer=1, n_head=4, vocab_size=256))
    with pytest.raises(ValueError, match="no Linear of GPT2LMHeadModel .*c_attn: Conv1D: the format holds nn.Linear"):
        fp8train.save_pretrained_fp8(gpt2, tmp_path / "gpt2")


def test_directory_rules_and_overwrite(tmp_path):
    model = models.llama()
    target = tmp_path / "fp8"
    target.mkdir()
    fp8train.save_pretrained_fp8(model, target)  # an empty directory is fine
    with pytest.raises(FileExistsError, match="exists and is not empty; pass overwrite=True"):
        fp8train.save_pretrained_fp8(model, target)
    (target / "stale.txt").write_text("old")
    fp8train.save_pretrained_fp8(model, target, overwrite=True)
    assert not (target / "stale.txt").exists() and (target / "config.json").is_file()
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="is a file"):
        fp8train.save_pretrained_fp8(model, tmp_path / "file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "fp8"]


def test_a_crash_while_writing_leaves_no_checkpoint(tmp_path, monkeypatch):
    def crash(path, config):
        raise OSError("disk full")

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text("the previous checkpoint")
    monkeypatch.setattr(fp8_checkpoint, "_add_quantization_config", crash)
    with pytest.raises(OSError, match="disk full"):
        fp8train.save_pretrained_fp8(models.llama(), tmp_path / "fp8")
    with pytest.raises(OSError, match="disk full"):
        fp8train.save_pretrained_fp8(models.llama(), tmp_path / "old", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["old"]  # no staging directory left either
    assert (tmp_path / "old" / "config.json").read_text() == "the previous checkpoint"


def test_errors_name_the_problem_and_the_fix(tmp_path):
    with pytest.raises(TypeError, match=r"PreTrainedModel, got Linear; unwrap .*model._orig_mod.*fp8train export-fp8"):
        fp8train.save_pretrained_fp8(torch.nn.Linear(128, 128), tmp_path / "a")
    model = models.llama()
    with pytest.raises(TypeError, match=r"module_filter_fn=3 must be a callable \(module, fqn\) -> bool"):
        fp8train.save_pretrained_fp8(model, tmp_path / "a", module_filter_fn=3)
    with pytest.raises(TypeError, match="overwrite='yes' must be True or False"):
        fp8train.save_pretrained_fp8(model, tmp_path / "a", overwrite="yes")
    with pytest.raises(ValueError, match="no Linear of LlamaForCausalLM can be written in FP8: .*excluded"):
        fp8train.save_pretrained_fp8(model, tmp_path / "a", module_filter_fn=lambda module, name: False)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj: .*NaN or an infinity"):
        fp8train.save_pretrained_fp8(model, tmp_path / "a")
    quantized = models.llama()
    quantized.config.quantization_config = fp8_checkpoint.quantization_config([])
    with pytest.raises(ValueError, match="already quantized"):
        fp8train.save_pretrained_fp8(quantized, tmp_path / "a")
    assert list(tmp_path.iterdir()) == []


def test_sharded_weights_are_refused(tmp_path):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = models.llama()
        layer = model.model.layers[0].mlp.up_proj
        mesh = init_device_mesh("cpu", (1,))
        layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.data, mesh, [Shard(0)]))
        with pytest.raises(TypeError, match="up_proj.weight is a DTensor, a shard of the weight; gather the full"):
            fp8train.save_pretrained_fp8(model, tmp_path / "fp8")
    finally:
        dist.destroy_process_group()
    assert list(tmp_path.iterdir()) == []


def test_the_serving_page_example_runs(tmp_path, monkeypatch, capsys):
    page = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    examples = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(examples) == 2  # the second continues the first
    monkeypatch.chdir(tmp_path)
    exec(compile("\n".join(examples), "<docs/serving.md examples>", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    losses = re.search(r"loss trained (\S+), served from the FP8 checkpoint (\S+)", out)
    trained, served = float(losses[1]), float(losses[2])
    assert abs(served / trained - 1) < MAX_LOSS_CHANGE
    assert "llama-fp8: 7 Linear(s) in block-scaled E4M3; in high precision: lm_head (the output" in out
    assert "llama-nvfp4-w4a4: 7 Linear(s) in NVFP4 (compressed-tensors, W4A4)" in out


FRAMEWORKS = ("transformers", "peft", "accelerate", "lightning")


def _imports_run_at_import(tree: ast.AST):
    """The import statements of a module that run when it is imported (not inside functions)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _imports_run_at_import(node)


def test_no_module_of_fp8train_imports_a_framework_when_imported():
    """Frameworks are imported inside functions only, so ``import fp8train`` and its lazy
    ``save_pretrained_fp8`` import none (the slow test below checks it in a fresh process),
    but by the module that exists for one (``fp8train.lightning`` subclasses Lightning's
    plugin; only a Lightning user imports it)."""
    source = Path(fp8train.__file__).parent
    for path in sorted(source.rglob("*.py")):
        for node in _imports_run_at_import(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            framework = [n for n in names if n.split(".")[0] in FRAMEWORKS and n.split(".")[0] != path.stem]
            assert not framework, f"{path.relative_to(source)} imports {framework} at module level"


@pytest.mark.slow
def test_import_fp8train_imports_no_transformers_until_save_pretrained_fp8_is_used():
    code = (
        "import sys, fp8train\n"
        "assert 'transformers' not in sys.modules and 'save_pretrained_fp8' in fp8train.__all__\n"
        "assert fp8train.save_pretrained_fp8.__module__ == 'fp8train.integrations.fp8_checkpoint'\n"
        "assert 'transformers' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_summary_groups_the_high_precision_modules_by_reason(tmp_path):
    written = fp8_checkpoint.FP8Checkpoint(
        path=tmp_path,
        fp8_modules=("a",),
        high_precision_modules=tuple((f"m{i}", "why") for i in range(5)) + (("head", "other"),),
    )
    assert written.summary() == (
        f"{tmp_path}: 1 Linear(s) in block-scaled E4M3; in high precision: m0, m1, m2 and 2 more (why); head (other)"
    )


def _load_as_on_an_fp8_gpu(path):
    """``from_pretrained(path)`` as transformers loads on an SM 9.0 GPU (kept in FP8), on the CPU."""
    with mock.patch("torch.cuda.is_available", return_value=True), mock.patch(
        "torch.cuda.get_device_capability", return_value=(9, 0)
    ):
        return transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)


def test_the_fp8_loading_path_keeps_exactly_the_written_modules_in_fp8(tmp_path):
    """transformers' loader as on an SM 8.9+ GPU (told so: this tests the loading, not the
    kernels): FP8Linear for the FP8 modules, with the file's bytes, every key found."""
    model = fp8train.convert_to_float8_training(models.llama(num_key_value_heads=2), "blockwise")
    written = fp8train.save_pretrained_fp8(model, tmp_path / "fp8")
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    loaded, info = _load_as_on_an_fp8_gpu(tmp_path / "fp8")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    fp8_linears = [name for name, module in loaded.named_modules() if type(module).__name__ == "FP8Linear"]
    assert tuple(fp8_linears) == written.fp8_modules and len(fp8_linears) == 4
    for name in fp8_linears:
        module = loaded.get_submodule(name)
        assert torch.equal(module.weight.view(torch.uint8), tensors[f"{name}.weight"].view(torch.uint8))
        assert torch.equal(module.weight_scale_inv, tensors[f"{name}.weight_scale_inv"])
