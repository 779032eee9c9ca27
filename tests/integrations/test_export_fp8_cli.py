"""``fp8train export-fp8``: a trainer checkpoint of a transformers model, written in FP8 and
loaded by transformers with the loss of the trained model; the runs it refuses."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from fp8train.integrations.calibration import calibrate_input_amax  # noqa: E402
from fp8train.nn.convert import convert_to_float8_training  # noqa: E402
from fp8train.train.arguments import TrainingArguments  # noqa: E402
from fp8train.train.checkpoint import CheckpointContents, CheckpointError, write_checkpoint  # noqa: E402
from fp8train.train.commands.cli import main  # noqa: E402
from fp8train.train.commands.export_command import run_export_fp8  # noqa: E402
from fp8train.train.data import load_text, split_text  # noqa: E402
from fp8train.train.rng import capture_rng_state  # noqa: E402
from fp8train.train.trainer_setup import sample_batch  # noqa: E402

from . import tiny_llama_factory  # noqa: E402

FACTORY = "tests.integrations.tiny_llama_factory:build"
MAX_LOSS_CHANGE = 0.01


def _train(tmp_path, *flags: str) -> str:
    run = str(tmp_path / "run")
    argv = ["train", "--steps", "2", "--batch_size", "2", "--seq_len", "32", "--eval_batches", "1",
            "--warmup_steps", "1", "--device", "cpu", "--output_dir", run, *flags]
    assert main(argv) == 0
    return run


def _write_trainer_checkpoint(run, module: torch.nn.Module, **arguments) -> None:
    """A checkpoint as the Trainer writes it (its own writer), without the training."""
    contents = CheckpointContents(
        model=module.state_dict(), optimizer={}, scheduler={}, scaler={}, rng=capture_rng_state(),
        config=TrainingArguments(**arguments).to_dict(),
        trainer={"step": 1, "data_position": 1, "losses": {}, "val_losses": {}},
    )
    write_checkpoint(run, contents)


def _losses(batch, *models) -> list[float]:
    with torch.no_grad():
        return [tiny_llama_factory.loss_fn(m, batch[:, :-1], batch[:, 1:]).item() for m in models]


def test_export_fp8_of_a_trainer_checkpoint_loads_in_transformers(tmp_path, capsys):
    trained = convert_to_float8_training(tiny_llama_factory.build()["model"], "tensorwise")
    _write_trainer_checkpoint(tmp_path / "run", trained, model=FACTORY, fp8_recipe="tensorwise")
    assert main(["export-fp8", str(tmp_path / "run"), str(tmp_path / "fp8")]) == 0
    assert "7 Linear(s) in block-scaled E4M3; in high precision: lm_head (the output head" in capsys.readouterr().out
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    losses = _losses(torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0)), trained, loaded)
    assert abs(losses[1] / losses[0] - 1) < MAX_LOSS_CHANGE
    # The checkpoint directory itself works too, and an existing output needs --overwrite.
    assert main(["export-fp8", str(tmp_path / "run" / "checkpoint-1"), str(tmp_path / "fp8")]) == 2
    assert "exists and is not empty; pass overwrite=True" in capsys.readouterr().err
    assert main(["export-fp8", str(tmp_path / "run" / "checkpoint-1"), str(tmp_path / "fp8"), "--overwrite"]) == 0


def test_export_format_writes_the_ue8m0_variant_and_refuses_an_unknown_one(tmp_path, capsys):
    trained = convert_to_float8_training(tiny_llama_factory.build()["model"], "nvfp4")
    _write_trainer_checkpoint(tmp_path / "run", trained, model=FACTORY, fp8_recipe="nvfp4")
    argv = ["export", str(tmp_path / "run"), str(tmp_path / "ue8m0"), "--format", "fp8_block_ue8m0"]
    assert main(argv) == 0
    assert "7 Linear(s) in block-scaled E4M3 with power-of-two (UE8M0) scales" in capsys.readouterr().out
    config = json.loads((tmp_path / "ue8m0" / "config.json").read_text())["quantization_config"]
    assert config["scale_fmt"] == "ue8m0" and config["modules_to_not_convert"] == ["lm_head"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ue8m0")
    losses = _losses(torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0)), trained, loaded)
    assert abs(losses[1] / losses[0] - 1) < MAX_LOSS_CHANGE
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "other"), "--format", "nvfp8"]) == 2
    formats = "fp8_block, fp8_block_ue8m0, nvfp4, nvfp4_modelopt, mxfp4, mxfp8"
    assert f"format='nvfp8' must be one of {formats}" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_export_fp8_refuses_the_default_gpt_and_what_is_no_checkpoint(tmp_path):
    _write_trainer_checkpoint(tmp_path / "run", torch.nn.Linear(1, 1), fp8_recipe="tensorwise")
    with pytest.raises(ValueError, match="fp8train's own GPT .* neither transformers nor vLLM knows"):
        run_export_fp8(tmp_path / "run", tmp_path / "fp8")
    with pytest.raises(CheckpointError, match="neither a checkpoint-<step> directory nor a run directory"):
        run_export_fp8(tmp_path, tmp_path / "fp8")
    with pytest.raises(FileNotFoundError, match="no such checkpoint or run directory"):
        run_export_fp8(tmp_path / "missing", tmp_path / "fp8")
    (tmp_path / "run" / "checkpoint-1" / "model.safetensors").write_bytes(b"damaged")
    with pytest.raises(CheckpointError, match="does not verify: model.safetensors"):
        run_export_fp8(tmp_path / "run" / "checkpoint-1", tmp_path / "fp8")
    assert not (tmp_path / "fp8").exists()


@pytest.mark.slow
def test_export_fp8_after_real_training(tmp_path, capsys):
    run = _train(tmp_path, "--model", FACTORY, "--fp8_recipe", "tensorwise", "--mixed_precision", "no")
    assert main(["export-fp8", run, str(tmp_path / "fp8")]) == 0
    assert "7 Linear(s) in block-scaled E4M3" in capsys.readouterr().out
    trained = convert_to_float8_training(tiny_llama_factory.build()["model"], "tensorwise")
    trained.load_state_dict(load_file(f"{run}/checkpoint-2/model.safetensors"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    losses = _losses(torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0)), trained, loaded)
    assert abs(losses[1] / losses[0] - 1) < MAX_LOSS_CHANGE


def test_export_fp8_says_a_mistake_in_one_line(tmp_path, capsys):
    assert main(["export-fp8", str(tmp_path / "missing"), str(tmp_path / "fp8")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "export-fp8" in err and str(tmp_path / "missing") in err


def test_export_calibrates_w4a4_nvfp4_on_the_runs_validation_batches(tmp_path, capsys):
    trained = convert_to_float8_training(tiny_llama_factory.build()["model"], "nvfp4")
    arguments = dict(model=FACTORY, fp8_recipe="nvfp4", batch_size=2, seq_len=32, seed=5)
    _write_trainer_checkpoint(tmp_path / "run", trained, **arguments)
    argv = ["export", str(tmp_path / "run"), str(tmp_path / "w4a4"), "--format", "nvfp4", "--calibration-batches", "3"]
    assert main(argv) == 0
    assert "7 Linear(s) in NVFP4 (compressed-tensors, W4A4)" in capsys.readouterr().out
    # The reference: the trained model on the three validation batches the trainer draws.
    _, eval_dataset = split_text(load_text(None), 32)
    batches = [sample_batch(eval_dataset, 5, step, 2, stream=1) for step in range(3)]
    amax = calibrate_input_amax(trained, batches, forward=lambda m, b: tiny_llama_factory.loss_fn(m, *b))
    tensors = load_file(tmp_path / "w4a4" / "model.safetensors")
    o_proj = "model.layers.0.self_attn.o_proj"
    assert tensors[f"{o_proj}.input_global_scale"].item() == torch.tensor(2688.0 / amax[o_proj]).item()
    assert "lm_head.input_global_scale" not in tensors


def test_export_refuses_a_calibration_the_format_cannot_hold(tmp_path, capsys):
    trained = convert_to_float8_training(tiny_llama_factory.build()["model"], "nvfp4")
    _write_trainer_checkpoint(tmp_path / "run", trained, model=FACTORY, fp8_recipe="nvfp4")
    argv = ["export", str(tmp_path / "run"), str(tmp_path / "x"), "--format", "mxfp8", "--calibration-batches", "2"]
    assert main(argv) == 2
    assert "calibration_batches=2: format='mxfp8' takes no activation scales" in capsys.readouterr().err
    with pytest.raises(ValueError, match="calibration_batches=-1 must be an int >= 0"):
        run_export_fp8(tmp_path / "run", tmp_path / "x", format="nvfp4", calibration_batches=-1)
    assert not (tmp_path / "x").exists()
