"""Save and load an FP8-trained transformers model, with or without its FP8 state.

A converted model's ``state_dict`` holds delayed scaling's state (``fp8_scale``,
``fp8_amax_history`` of every converted module) beside its weights. transformers'
``save_pretrained`` writes it into ``model.safetensors``, which is what the ``Trainer``'s
checkpoints need (its resume loads that file into the converted model, state included).
But ``from_pretrained`` of a plain model class reports every key its class does not
declare (only the class attribute ``_keys_to_ignore_on_load_unexpected`` silences one, and
a directory cannot add to it), so such a directory loads with an "UNEXPECTED keys" report,
and its FP8 state is dropped.

:func:`save_pretrained` writes the high-precision model where transformers reads it (a
plain ``from_pretrained`` loads it without a report) and the FP8 state beside it, in
:data:`FP8_STATE_FILE`; :func:`from_pretrained` loads either kind of directory, converts,
and restores the FP8 state, without the report. See ``docs/transformers.md``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

import safetensors
import safetensors.torch
import torch
from torch import nn

from ..nn.convert import convert_to_float8_training, drop_fp8_state
from ..spec.checks import check_type
from ..spec.recipes import Recipe

__all__ = ["FP8_STATE_FILE", "save_pretrained", "from_pretrained", "load_fp8_state"]

FP8_STATE_FILE = "fp8_state.safetensors"
"""The file beside transformers' weights that :func:`save_pretrained` writes the FP8 state to."""

_WEIGHTS_FILE, _WEIGHTS_INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# transformers logs its load report on this logger (transformers.modeling_utils).
_LOAD_REPORT_LOGGER = "transformers.modeling_utils"


def _fp8_state(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``state_dict`` that :func:`~fp8train.nn.convert.drop_fp8_state` drops."""
    kept = drop_fp8_state(state_dict)
    return {key: value for key, value in state_dict.items() if key not in kept}


def _check_pretrained_model(model: object) -> None:
    if not isinstance(model, nn.Module) or not callable(getattr(model, "save_pretrained", None)):
        raise TypeError(
            f"model={type(model).__name__} must be a transformers PreTrainedModel (an nn.Module with "
            "save_pretrained); for any other module save model.state_dict() with torch.save"
        )


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, **kwargs) -> None:
    """``model.save_pretrained(save_directory, **kwargs)`` without the FP8 state, which goes
    to :data:`FP8_STATE_FILE` in the same directory (where the model has any).

    ``AutoModelForCausalLM.from_pretrained(save_directory)`` then gives the high-precision
    model with the trained weights and no load report; :func:`from_pretrained` gives it back
    converted, FP8 state included. A stale :data:`FP8_STATE_FILE` of a model without FP8
    state is removed.

    Args:
        model: a converted (or plain) transformers ``PreTrainedModel``.
        save_directory: the directory to write.
        **kwargs: passed to ``model.save_pretrained`` (a ``state_dict`` given there is
            split the same way; ``is_main_process=False`` writes no FP8 state either).

    Raises:
        TypeError: ``model`` has no ``save_pretrained``.
        ValueError: ``push_to_hub=True`` (transformers would push the directory without
            :data:`FP8_STATE_FILE`).
    """
    _check_pretrained_model(model)
    if kwargs.get("push_to_hub"):
        raise ValueError(
            "push_to_hub=True would push the directory without its FP8 state: save it, then upload the "
            "directory (huggingface_hub.upload_folder)"
        )
    state_dict = kwargs.pop("state_dict", None)
    if state_dict is None:
        state_dict = model.state_dict()
    model.save_pretrained(save_directory, state_dict=drop_fp8_state(state_dict), **kwargs)
    if not kwargs.get("is_main_process", True):
        return
    fp8_state = {key: tensor.detach().cpu().contiguous() for key, tensor in _fp8_state(state_dict).items()}
    path = Path(save_directory) / FP8_STATE_FILE
    if fp8_state:
        safetensors.torch.save_file(fp8_state, path, metadata={"format": "pt"})
    elif path.exists():
        path.unlink()


def _read_fp8_state(directory: Path) -> dict[str, torch.Tensor]:
    """The FP8 state a directory holds: all of :data:`FP8_STATE_FILE`, else the FP8 entries
    of transformers' safetensors weights (a ``Trainer`` checkpoint, a ``save_pretrained`` of
    the converted model); ``{}`` where there is none."""
    if (directory / FP8_STATE_FILE).is_file():
        return safetensors.torch.load_file(directory / FP8_STATE_FILE)
    if (directory / _WEIGHTS_INDEX_FILE).is_file():
        weight_map = json.loads((directory / _WEIGHTS_INDEX_FILE).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = [_WEIGHTS_FILE] if (directory / _WEIGHTS_FILE).is_file() else []
    state = {}
    for file in files:
        with safetensors.safe_open(directory / file, framework="pt") as weights:
            names = _fp8_state(dict.fromkeys(weights.keys()))
            state.update({name: weights.get_tensor(name) for name in names})
    return state


def _check_fp8_state_fits(model: nn.Module, state: dict[str, torch.Tensor], directory: Path) -> None:
    """Raise where ``state`` (read from ``directory``) is not exactly ``model``'s FP8 state."""
    expected = _fp8_state(model.state_dict())
    if not expected:
        raise ValueError(
            f"{directory} holds delayed-scaling state ({len(state)} tensors, e.g. {next(iter(state))!r}) but the "
            "model has none: convert it with the recipe it was trained with (a DelayedScaling, e.g. recipe='delayed') "
            "before loading the state, or load it in high precision (from_pretrained(..., recipe=None))"
        )
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"the FP8 state in {directory} does not match the model's: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]} ({len(missing)} and {len(unexpected)} in all); convert with the same "
            "module_filter_fn as in training"
        )
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise ValueError(
                f"{key} in {directory} has shape {tuple(tensor.shape)} but the model's has "
                f"{tuple(expected[key].shape)}: convert with the recipe it was trained with (the first dim of "
                "fp8_amax_history is its amax_history_len)"
            )


def load_fp8_state(model: nn.Module, directory: str | os.PathLike) -> int:
    """Load the FP8 state of a directory into a converted ``model``, in place.

    The directory is one :func:`save_pretrained` wrote (:data:`FP8_STATE_FILE`), or one
    whose safetensors weights hold the state (a ``Trainer`` checkpoint, a
    ``model.save_pretrained`` of the converted model). Convert ``model`` first, with the
    recipe and ``module_filter_fn`` it was trained with.

    Returns:
        The number of tensors loaded: 0 where the directory holds no FP8 state (a model
        trained without delayed scaling, or never in FP8), which leaves ``model``'s as it is.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``directory`` is not a local directory; it holds FP8 state that is not
            exactly the model's (none, other modules, another ``amax_history_len``).
    """
    check_type("model", model, nn.Module, "an nn.Module")
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(
            f"directory={str(directory)!r} is not a local directory: the FP8 state is read from one "
            "(download a Hub repository first, e.g. huggingface_hub.snapshot_download)"
        )
    state = _read_fp8_state(path)
    if not state:
        return 0
    _check_fp8_state_fits(model, state, path)
    model.load_state_dict(state, strict=False)
    return len(state)


class _HeldLoadReport(logging.Filter):
    """Holds back transformers' load report while a load runs (see :func:`_load_quietly`)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            self.records.append(record)
            return False
        return True


def _reports_more_than_fp8_state(info: dict) -> bool:
    """Whether a load's ``info`` (``output_loading_info``) has keys to report besides FP8 state."""
    other_unexpected = drop_fp8_state(dict.fromkeys(info["unexpected_keys"]))
    return bool(other_unexpected or info["missing_keys"] or info["mismatched_keys"])


def _load_quietly(model_class, pretrained_model_name_or_path, kwargs: dict) -> nn.Module:
    """``model_class.from_pretrained(...)`` whose load report is shown only where the load
    found something other than FP8 state to report (missing, mismatched or other keys), or
    failed (transformers raises after its report, which the error refers to)."""
    if "output_loading_info" in kwargs:
        raise ValueError(
            "output_loading_info is not supported by fp8train's from_pretrained: call "
            "model_class.from_pretrained(..., output_loading_info=True) and then fp8train.convert_to_float8_training"
        )
    logger, held, loaded = logging.getLogger(_LOAD_REPORT_LOGGER), _HeldLoadReport(), None
    logger.addFilter(held)
    try:
        loaded = model_class.from_pretrained(pretrained_model_name_or_path, output_loading_info=True, **kwargs)
    finally:
        logger.removeFilter(held)
        if loaded is None or _reports_more_than_fp8_state(loaded[1]):
            for record in held.records:
                logger.handle(record)
    return loaded[0]


def from_pretrained(
    model_class,
    pretrained_model_name_or_path: str | os.PathLike,
    *,
    recipe: Recipe | str | None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    **kwargs,
) -> nn.Module:
    """Load an FP8-trained transformers model converted, with its FP8 state:
    ``model_class.from_pretrained``, :func:`~fp8train.nn.convert.convert_to_float8_training`,
    :func:`load_fp8_state`, without transformers' report of the FP8 state's keys.

    ``fp8train.integrations.transformers.from_pretrained(AutoModelForCausalLM, path, recipe="delayed")``

    Args:
        model_class: a transformers model class (``AutoModelForCausalLM``, ``LlamaForCausalLM``).
        pretrained_model_name_or_path: a directory (:func:`save_pretrained`'s, a ``Trainer``
            checkpoint, any ``save_pretrained``'s) or a Hub name; the FP8 state is read from a
            local directory only (a Hub model starts with fresh state).
        recipe: the recipe to convert with, as in training; ``None`` loads the model in high
            precision, dropping the directory's FP8 state (without the report).
        module_filter_fn: as in training (see ``convert_to_float8_training``).
        **kwargs: passed to ``model_class.from_pretrained`` (``dtype``, ``device_map``, ...).

    Returns:
        The model, converted where ``recipe`` is given.

    Raises:
        TypeError: ``model_class`` has no ``from_pretrained``.
        ValueError: ``output_loading_info`` in ``kwargs``; the FP8 state does not fit the
            converted model (see :func:`load_fp8_state`); a bad recipe name.
    """
    if not callable(getattr(model_class, "from_pretrained", None)):
        raise TypeError(
            f"model_class={model_class!r} must be a transformers model class with from_pretrained "
            "(AutoModelForCausalLM, LlamaForCausalLM, ...), passed first: from_pretrained(AutoModelForCausalLM, path, ...)"
        )
    model = _load_quietly(model_class, pretrained_model_name_or_path, kwargs)
    if recipe is None:
        return model
    model = convert_to_float8_training(model, recipe, module_filter_fn=module_filter_fn)
    if Path(pretrained_model_name_or_path).is_dir():
        load_fp8_state(model, pretrained_model_name_or_path)
    return model
