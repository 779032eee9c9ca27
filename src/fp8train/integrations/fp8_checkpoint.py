"""Ship in FP8: write a transformers model as the block-scaled E4M3 checkpoint that
transformers (``FineGrainedFP8Config``) and vLLM load, the format of DeepSeek-V3 and Qwen3-FP8
(``save_pretrained_fp8``), or in another of :mod:`fp8train.integrations.checkpoint_formats`
(``save_pretrained_quantized``: ``fp8_block_ue8m0``, its power-of-two-scaled variant; the
compressed-tensors ``nvfp4``, ``mxfp4`` and ``mxfp8`` of
:mod:`fp8train.integrations.compressed_tensors_formats` and ModelOpt's ``nvfp4_modelopt`` of
:mod:`fp8train.integrations.modelopt_format`, whose tensors and config differ from what follows).

For every Linear written in FP8 the checkpoint holds ``<name>.weight`` as
``float8_e4m3fn`` and ``<name>.weight_scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]``
(:mod:`fp8train.integrations.block_fp8`); every other tensor is what ``save_pretrained``
writes, in the model's own dtype; ``config.json`` gains::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

Which Linears: those fp8train converted to FP8 for training (any recipe), or every
``nn.Linear`` in a model that was never converted; never the output head. The rest stay in
high precision and are named in ``modules_to_not_convert`` (the loader would otherwise
swap them for FP8 layers and find no scales), each with its reason in the returned
:class:`FP8Checkpoint`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from ..nn.convert import drop_fp8_state
from ..nn.converters import matmul_modules
from ..nn.modules.base import Float8Module
from ..nn.modules.linear import Float8Linear
from ..spec.checks import ArgumentTypeError, check_bool, check_callable
from .calibration import input_scale_tensors
from .checkpoint_formats import CheckpointFormat, checkpoint_format
from .fused_layers import fused_amax, fused_group, fused_group_reasons

__all__ = ["FP8Checkpoint", "save_pretrained_fp8", "save_pretrained_quantized", "quantization_config"]

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]

SUMMARY_NAMES = 3
"""Names listed per reason in :meth:`FP8Checkpoint.summary`."""


@dataclass(frozen=True, kw_only=True)
class FP8Checkpoint:
    """What :func:`save_pretrained_fp8` wrote.

    Attributes:
        path: the checkpoint directory.
        fp8_modules: qualified names of the Linears written quantized (in the format).
        high_precision_modules: ``(qualified name, reason)`` of every matmul module written
            in high precision (the config's ``modules_to_not_convert``).
        format: the checkpoint format's name (``"fp8_block"``, ``"nvfp4"``, ...).
        calibrated_inputs: the checkpoint holds each quantized Linear's input scale from the
            caller's ``input_amax`` (NVFP4 W4A4).
    """

    path: Path
    fp8_modules: tuple[str, ...]
    high_precision_modules: tuple[tuple[str, str], ...]
    format: str = "fp8_block"
    calibrated_inputs: bool = False

    def summary(self) -> str:
        """One line: how many modules went to FP8, and which stayed in high precision, by
        reason (the first few names of each)."""
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.high_precision_modules:
            by_reason.setdefault(reason, []).append(name)
        groups = []
        for reason, names in by_reason.items():
            more = f" and {len(names) - SUMMARY_NAMES} more" if len(names) > SUMMARY_NAMES else ""
            groups.append(f"{', '.join(names[:SUMMARY_NAMES])}{more} ({reason})")
        kept = "; ".join(groups) or "none"
        fmt = checkpoint_format(self.format)
        words = (fmt.with_input_amax() if self.calibrated_inputs else fmt).words
        return f"{self.path}: {len(self.fp8_modules)} Linear(s) in {words}; in high precision: {kept}"


def quantization_config(modules_to_not_convert: list[str], format: str = "fp8_block") -> dict:
    """The ``quantization_config`` of ``config.json`` (transformers' ``FineGrainedFP8Config``)
    for the checkpoint ``format``."""
    return checkpoint_format(format).quantization_config(modules_to_not_convert)


def save_pretrained_fp8(
    model: nn.Module,
    save_directory: str | os.PathLike,
    *,
    module_filter_fn: ModuleFilter | None = None,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
) -> FP8Checkpoint:
    """Write ``model`` as a block-scaled E4M3 checkpoint for inference with transformers or
    vLLM: :func:`save_pretrained_quantized` with ``format="fp8_block"`` (its arguments,
    returns and errors)."""
    return save_pretrained_quantized(
        model, save_directory, format="fp8_block", module_filter_fn=module_filter_fn, overwrite=overwrite,
        max_shard_size=max_shard_size,
    )


def save_pretrained_quantized(
    model: nn.Module,
    save_directory: str | os.PathLike,
    *,
    format: str = "fp8_block",
    module_filter_fn: ModuleFilter | None = None,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
    input_amax: Mapping[str, float | torch.Tensor] | None = None,
) -> FP8Checkpoint:
    """Write ``model`` as a quantized checkpoint for inference with transformers or vLLM, in
    ``format`` (:mod:`fp8train.integrations.checkpoint_formats`; docs/serving.md): ``"fp8_block"``,
    ``"fp8_block_ue8m0"``, compressed-tensors' ``"nvfp4"``, ``"mxfp4"``, ``"mxfp8"``, or ModelOpt's
    ``"nvfp4_modelopt"``.

    The model is not changed (converted or not, it keeps training). The directory is written
    under a hidden staging name beside ``save_directory`` and renamed into place, so a crash
    never leaves a half-written checkpoint. Save the tokenizer into the same directory
    yourself. Call it on one process (rank 0) with the whole model (not FSDP shards).

    Args:
        model: a transformers ``PreTrainedModel``, converted by
            :func:`~fp8train.convert_to_float8_training` (any recipe) or not.
        format: the checkpoint format's name.
        save_directory: the checkpoint directory; it must not exist or be empty, unless
            ``overwrite``.
        module_filter_fn: ``(module, qualified name) -> bool``, as for
            ``convert_to_float8_training``: a Linear it rejects stays in high precision.
        overwrite: replace an existing, non-empty ``save_directory``.
        max_shard_size: the largest safetensors shard, as for ``save_pretrained``.
        input_amax: ``"nvfp4"`` and ``"nvfp4_modelopt"`` only: each quantized Linear's largest
            ``|input|`` on calibration data, by name (positive, finite). Given, the checkpoint is
            W4A4 (``NVFP4``: ``input_global_scale = 448 * 6 / amax``, or ModelOpt's ``input_scale``
            ``= 1 / that``); ``None``: weight-only (``NVFP4A16``, ModelOpt's ``W4A16_NVFP4``).

    Returns:
        An :class:`FP8Checkpoint`: the path, the FP8 modules, the high-precision ones and why.

    Raises:
        TypeError: ``model`` is not a transformers ``PreTrainedModel``; a weight is sharded
            (a ``DTensor``); ``module_filter_fn`` is not callable.
        ValueError: an unknown ``format``; the model is already quantized; no Linear can be
            written in FP8; a weight holds a NaN or an infinity; a wrong ``input_amax``.
        FileExistsError: ``save_directory`` is a file, or a non-empty directory without
            ``overwrite=True``.
    """
    fmt = checkpoint_format(format) if input_amax is None else checkpoint_format(format).with_input_amax()
    _check_model(model)
    check_callable("module_filter_fn", module_filter_fn, allow_none=True, signature="(module, fqn) -> bool")
    check_bool("overwrite", overwrite)
    target = Path(save_directory)
    _check_target(target, overwrite)
    fp8_modules, high_precision = _select_modules(model, module_filter_fn, fmt)
    state_dict = _fp8_state_dict(model, fp8_modules, fmt, input_amax)
    kept_names = [name for name, _ in high_precision]
    config = fmt.quantization_config(kept_names)

    def write(staging: Path) -> None:
        model.save_pretrained(staging, state_dict=state_dict, max_shard_size=max_shard_size)
        _add_quantization_config(staging / "config.json", config)
        for filename, content in fmt.extra_files(kept_names).items():  # ModelOpt's hf_quant_config.json
            (staging / filename).write_text(json.dumps(content, indent=2) + "\n")

    _write_atomically(target, write)
    checkpoint = FP8Checkpoint(
        path=target, fp8_modules=tuple(name for name, _ in fp8_modules), high_precision_modules=tuple(high_precision),
        format=fmt.name, calibrated_inputs=input_amax is not None,
    )
    logger.debug("%s", checkpoint.summary())  # the caller has it (the CLI prints it)
    return checkpoint


def _check_model(model: nn.Module) -> None:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ArgumentTypeError(
            f"save_pretrained_fp8 writes a transformers PreTrainedModel, got {type(model).__name__}; unwrap a "
            "wrapped one (DDP: model.module, torch.compile: model._orig_mod, accelerate: "
            "accelerator.unwrap_model(model)); for a trainer checkpoint use `fp8train export-fp8`"
        )
    if getattr(model.config, "quantization_config", None) is not None:
        raise ValueError(
            f"{type(model).__name__} is already quantized (its config has a quantization_config); "
            "save the high-precision (or fp8train-converted) model instead"
        )


def _check_target(target: Path, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"save_directory={str(target)!r} is a file; give a directory path")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(
            f"save_directory={str(target)!r} exists and is not empty; pass overwrite=True to replace it "
            "or choose a new directory"
        )


def _select_modules(
    model: nn.Module, module_filter_fn: ModuleFilter | None = None, fmt: CheckpointFormat | None = None
) -> tuple[list[tuple[str, nn.Linear]], list[tuple[str, str]]]:
    """Split ``model``'s matmul modules into those written quantized in ``fmt`` (default
    ``fp8_block``) and those kept in high precision, with the reason for each kept one (see
    :func:`save_pretrained_quantized`).

    Raises:
        ValueError: none can be written in FP8 (naming each module's reason).
    """
    fmt = checkpoint_format("fp8_block") if fmt is None else fmt
    converted = any(isinstance(m, Float8Module) for m in model.modules())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = _tied_weights(model)
    visible = _loader_visible_modules(model)
    reasons: dict[str, str | None] = {}
    for name, module in visible:
        reason = _keep_reason(name, module, fmt, converted=converted, is_head=module is head, tied=tied)
        if reason is None and module_filter_fn is not None and not module_filter_fn(module, name):
            reason = "excluded by module_filter_fn"
        reasons[name] = reason
    reasons.update(fused_group_reasons(reasons))
    fp8 = [(name, module) for name, module in visible if reasons[name] is None]
    kept = [(name, reasons[name]) for name, _ in visible if reasons[name] is not None]
    if not fp8:
        listed = "; ".join(f"{name}: {reason}" for name, reason in kept)
        raise ValueError(f"no Linear of {type(model).__name__} can be written in FP8: {listed or 'it has none'}")
    return fp8, kept


def _loader_visible_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """fp8train's matmul modules, and every module transformers' FP8 loader would swap:
    an ``nn.Linear`` or one whose name ends in ``experts`` (fused MoE experts)."""
    matmul = {name for name, _ in matmul_modules(model)}
    visible: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer, _ in visible):
            continue
        if name in matmul or type(module) is nn.Linear or name.rpartition(".")[2] == "experts":
            visible.append((name, module))
    return visible


def _keep_reason(
    name: str, module: nn.Module, fmt: CheckpointFormat, *, converted: bool, is_head: bool, tied: set[int]
) -> str | None:
    """Why ``module`` stays in high precision, or ``None`` to write it quantized in ``fmt``."""
    if type(module) not in (nn.Linear, Float8Linear):
        return f"{type(module).__name__}: the format holds nn.Linear weights only"
    if converted and not isinstance(module, Float8Linear):
        return "trained in high precision (not converted to FP8)"
    if id(module.weight) in tied:
        return "its weight is tied to another module's"
    if is_head:
        return "the output head, which vLLM runs in high precision (as FP8 checkpoints keep it)"
    return fmt.keep_reason(module.out_features, module.in_features, fused_group(name))


def _tied_weights(model: nn.Module) -> set[int]:
    """``id`` of every parameter that more than one module holds."""
    seen: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        seen[id(parameter)] = seen.get(id(parameter), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _fp8_state_dict(
    model: nn.Module,
    fp8_modules: list[tuple[str, nn.Linear]],
    fmt: CheckpointFormat,
    input_amax: Mapping[str, float | torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """``model``'s state dict without delayed-scaling state, each quantized Linear's weight
    replaced by the tensors ``fmt`` writes for it (E4M3 blocks and their ``weight_scale_inv``, ...)
    and, with ``input_amax``, its input's (``input_global_scale``, ``input_scale``)."""
    state_dict = drop_fp8_state(model.state_dict())
    for name, module in fp8_modules:
        if type(module.weight.data) is not torch.Tensor:
            raise TypeError(
                f"{name}.weight is a {type(module.weight.data).__name__}, a shard of the weight; gather the full "
                "model first (e.g. torch.distributed.checkpoint's get_model_state_dict with full_state_dict=True "
                "loaded into an unsharded model) and call save_pretrained_fp8 on rank 0"
            )
    group_amax = fused_amax({name: module.weight.detach().abs().amax().float() for name, module in fp8_modules})
    for name, module in fp8_modules:
        try:
            tensors = fmt.weight_tensors(module.weight, group_amax.get(name))
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
        del state_dict[f"{name}.weight"]  # a format may name its quantized weight otherwise (weight_packed)
        state_dict.update((f"{name}.{suffix}", tensor) for suffix, tensor in tensors.items())
    if input_amax is not None:
        state_dict.update(input_scale_tensors(input_amax, [name for name, _ in fp8_modules], fmt))
    return state_dict


def _add_quantization_config(config_path: Path, config: dict) -> None:
    text = json.loads(config_path.read_text())
    text["quantization_config"] = config
    config_path.write_text(json.dumps(text, indent=2, sort_keys=True) + "\n")


def _write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(staging)`` on a fresh hidden directory beside ``target``, then rename it
    to ``target`` (an existing ``target`` is moved aside first and removed after)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        write(staging)
        for path in staging.iterdir():
            _fsync(path)
        if target.exists():
            old = staging.with_suffix(".old")
            os.rename(target, old)
            os.rename(staging, target)
            shutil.rmtree(old)
        else:
            os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
