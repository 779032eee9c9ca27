"""``fp8train export`` (``export-fp8``): a trainer checkpoint of a transformers model,
written as a quantized checkpoint transformers and vLLM load, the block-scaled E4M3 one by
default (:func:`fp8train.integrations.fp8_checkpoint.save_pretrained_quantized`, ``--format``).

The model is rebuilt as the trainer built it (the run's ``--model`` factory, converted with
its ``fp8_recipe`` and ``high_precision_modules``), on the CPU, and the checkpoint's
weights are loaded into it, so the Linears that trained in FP8 are the ones written in FP8.
This is the one module of ``train`` that imports ``integrations``.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from ...nn.convert import drop_fp8_state
from ..arguments import TrainingArguments
from ..checkpoint import CheckpointContents, CheckpointError, load_resume_checkpoint, read_checkpoint, verify_checkpoint
from ...spec.checks import check_int
from ..trainer_setup import convert_for_training, sample_batch
from ..user_model import ModelSetup, model_setup
from .flags import main_process_output

__all__ = ["run_export_fp8", "add_parser", "run"]

DEFAULT_MODEL_REFUSAL = (
    "holds fp8train's own GPT (the default model, no --model), which neither transformers nor vLLM "
    "knows, so an FP8 checkpoint of it would load nowhere; train a transformers model "
    "(--model module:function returning a PreTrainedModel) to ship it in FP8"
)


def run_export_fp8(
    source: str | Path,
    save_directory: str | Path,
    *,
    overwrite: bool = False,
    format: str = "fp8_block",
    calibration_batches: int = 0,
):
    """Write the model of a trainer checkpoint as a quantized checkpoint.

    Args:
        source: a ``checkpoint-<step>`` directory, or a run's ``output_dir`` (its newest
            checkpoint that verifies).
        save_directory: where the FP8 checkpoint goes (absent or empty, unless ``overwrite``).
        overwrite: replace a non-empty ``save_directory``.
        format: the checkpoint format (``save_pretrained_quantized``'s).
        calibration_batches: ``"nvfp4"`` and ``"nvfp4_modelopt"`` only: run this many of the
            run's validation batches (its training data if it has none; ``batch_size``
            sequences each, drawn as the trainer draws them) through the trained model and
            write W4A4, each Linear's input scale from the largest ``|input|`` it saw
            (:func:`~fp8train.integrations.calibration.calibrate_input_amax`); 0: weight-only.

    Returns:
        The :class:`~fp8train.integrations.fp8_checkpoint.FP8Checkpoint` written.

    Raises:
        CheckpointError: ``source`` holds no checkpoint that verifies, or its config is not
            one of this fp8train's ``TrainingArguments``.
        ValueError: the run trained the default GPT, or its factory's model is not a
            transformers ``PreTrainedModel``; and as ``save_pretrained_quantized`` (an
            unknown ``format``, or ``calibration_batches`` for a format without activation
            scales, first, before the model is rebuilt).
    """
    from ...integrations.checkpoint_formats import checkpoint_format
    from ...integrations.fp8_checkpoint import save_pretrained_quantized

    check_int("calibration_batches", calibration_batches, minimum=0)
    if calibration_batches:
        try:
            checkpoint_format(format).with_input_amax()
        except ValueError:
            raise ValueError(
                f"calibration_batches={calibration_batches}: format={format!r} takes no activation scales; only "
                "'nvfp4' and 'nvfp4_modelopt' do (W4A4): drop the calibration or choose one of those"
            ) from None
    else:
        checkpoint_format(format)

    path, contents = _read_source(Path(source))
    args = _training_arguments(path, contents)
    if args.model is None:
        raise ValueError(f"checkpoint {path} {DEFAULT_MODEL_REFUSAL}")
    setup = model_setup(args)
    model = _rebuild_model(args, setup, contents.model)
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"checkpoint {path}: --model {args.model} builds a {type(model).__name__}, not a transformers "
            "PreTrainedModel; only transformers models have an FP8 checkpoint format that transformers and vLLM load"
        )
    input_amax = _calibrate(model, args, setup, calibration_batches) if calibration_batches else None
    return save_pretrained_quantized(model, save_directory, format=format, overwrite=overwrite, input_amax=input_amax)


def _calibrate(model: torch.nn.Module, args: TrainingArguments, setup: ModelSetup, count: int) -> dict[str, float]:
    """Each Linear's input amax over ``count`` of the run's validation batches (its training
    batches where it has no validation set), run through the run's ``loss_fn``."""
    from ...integrations.calibration import calibrate_input_amax

    stream, dataset = (1, setup.eval_dataset) if setup.eval_dataset is not None else (0, setup.train_dataset)
    batches = (sample_batch(dataset, args.seed, step, args.batch_size, stream=stream) for step in range(count))
    return calibrate_input_amax(model, batches, forward=lambda m, batch: setup.loss_fn(m, *batch))


def _read_source(source: Path) -> tuple[Path, CheckpointContents]:
    """The checkpoint ``source`` is, or the newest one of the run directory it is."""
    if not source.is_dir():
        raise FileNotFoundError(2, "no such checkpoint or run directory", str(source))
    if (source / "manifest.json").is_file():
        problems = verify_checkpoint(source)
        if problems:
            raise CheckpointError(f"checkpoint {source} does not verify: {'; '.join(problems)}")
        return source, read_checkpoint(source)
    found = load_resume_checkpoint(source)
    if found is None:
        raise CheckpointError(
            f"{source} is neither a checkpoint-<step> directory nor a run directory holding one; "
            "give a trainer checkpoint or the --output_dir of a run that saved one"
        )
    return found


def _training_arguments(path: Path, contents: CheckpointContents) -> TrainingArguments:
    """The run's arguments, for a build on this machine's CPU."""
    names = {field.name for field in dataclasses.fields(TrainingArguments)}
    unknown = sorted(set(contents.config) - names)
    if unknown:
        raise CheckpointError(
            f"{path}/config.json has settings this fp8train does not know ({', '.join(unknown)}); "
            "export with the fp8train version that trained it"
        )
    return TrainingArguments(**{**contents.config, "device": "cpu", "fp8_backend": "auto", "strategy": "none", "tp": 1})


def _rebuild_model(args: TrainingArguments, setup: ModelSetup, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The run's model as the trainer built it, holding ``state_dict``'s weights."""
    torch.manual_seed(args.seed)
    model = setup.model_factory()
    if args.fp8_recipe is not None:
        model = convert_for_training(model, args)
    model.load_state_dict(state_dict if args.fp8_recipe is not None else drop_fp8_state(state_dict))
    return model


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The ``export`` sub-command of ``commands`` (alias ``export-fp8``)."""
    parser = commands.add_parser(
        "export",
        aliases=["export-fp8"],
        help="write a run's transformers model as a quantized checkpoint for transformers and vLLM "
        "(--format; default: block-scaled E4M3)",
        allow_abbrev=False,
    )
    parser.add_argument("checkpoint", type=Path, help="a checkpoint-<step> directory, or a run's output_dir (its newest)")
    parser.add_argument("output", type=Path, help="the FP8 checkpoint directory to write (absent or empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    parser.add_argument(
        "--format", default="fp8_block",
        help="the checkpoint format, one of fp8train.save_pretrained_quantized's (docs/serving.md): fp8_block "
        "(default: E4M3 blocks, float32 scales), fp8_block_ue8m0 (power-of-two scales, scale_fmt ue8m0), "
        "compressed-tensors' nvfp4 (weight-only NVFP4), mxfp4 or mxfp8 (as llm-compressor writes them for vLLM), "
        "or nvfp4_modelopt (weight-only NVFP4 as NVIDIA ModelOpt writes it, vLLM's modelopt_fp4)",
    )
    parser.add_argument(
        "--calibration-batches", type=int, default=0, metavar="N",
        help="nvfp4 and nvfp4_modelopt: write W4A4, each Linear's activation scale from the largest |input| it "
        "sees on N of the run's validation batches (default 0: weight-only)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    main_process_output()
    written = run_export_fp8(
        args.checkpoint, args.output, overwrite=args.overwrite, format=args.format,
        calibration_batches=args.calibration_batches,
    )
    print(written.summary())
    return 0
