"""What a run trains, and on what: the embedded default GPT on byte-level text, or the
user's own model from a ``module:function`` factory (``--model``).

The factory contract (``TrainingArguments.model = "module:function"``):

- ``module`` is imported with the current directory first on ``sys.path`` (as uvicorn and
  gunicorn do), so ``models.py`` next to the user works as ``models:build``;
  ``function`` may be a dotted attribute (``models:Net.build``) or a class.
- ``function()`` is called with no arguments and returns either an ``nn.Module`` that
  takes ``(inputs, targets)`` of the default text data (``[batch, seq_len]`` int64 byte
  tokens, vocabulary 256) and returns the scalar loss, like the default GPT, or a dict
  with key ``model`` (required) and optional ``loss_fn`` (``(model, inputs, targets) ->
  loss``), ``train_dataset`` and ``eval_dataset`` (map-style datasets of ``(inputs,
  targets)``; without them, the embedded or ``--data`` text at ``--seq_len``; a
  ``train_dataset`` without ``eval_dataset`` means no validation loss).
- It is called once in :func:`model_setup`, with torch seeded to ``args.seed``, to check
  what it returns and to take its ``loss_fn`` and datasets (so the data is the same for
  every seed and recipe); that first model is discarded. It is called again at the start
  of every run, by the Trainer after it seeds, so each seed starts from its own
  initialization and every recipe under one seed from the same one. It must therefore
  build a fresh model on every call.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Dataset

from ..spec.checks import ArgumentTypeError
from .arguments import TrainingArguments
from .data import load_text, split_text
from .model import GPT, GPTConfig
from .trainer import LossFn

__all__ = ["ModelSetup", "model_setup", "build_model", "FACTORY_KEYS"]

# The keys a factory's dict may have; only "model" is required.
FACTORY_KEYS = ("model", "loss_fn", "train_dataset", "eval_dataset")
_RETURNS = "an nn.Module, or a dict with key 'model' and optional 'loss_fn', 'train_dataset', 'eval_dataset'"


@dataclass(frozen=True, kw_only=True)
class ModelSetup:
    """Everything a run needs besides its ``TrainingArguments``.

    Attributes:
        model_factory: zero-argument callable that builds a fresh model; the Trainer calls
            it after seeding, so every seed and recipe starts from that seed's weights.
        loss_fn: ``(model, inputs, targets) -> loss`` (a scalar tensor), the Trainer's
            ``loss_fn``.
        train_dataset: map-style dataset of ``(inputs, targets)`` pairs.
        eval_dataset: the same for validation, or None (no validation loss).
        description: the model and its data in one phrase, for reports, e.g.
            ``"default GPT n_layer=2 n_head=4 n_embd=128 on the embedded English text
            (pydoc_data), 128-byte sequences"`` or ``"models:build with its own loss_fn on
            its own datasets (512 train, 64 eval examples)"``.
    """

    model_factory: Callable[[], nn.Module]
    loss_fn: LossFn
    train_dataset: Dataset
    eval_dataset: Dataset | None
    description: str


def forward_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``model(inputs, targets)``: the loss of a model that computes its own, like the
    default GPT (and the Trainer's default ``loss_fn``)."""
    return model(inputs, targets)


def build_model(args: TrainingArguments) -> GPT:
    """The default GPT of ``args`` (``n_layer``, ``n_head``, ``n_embd``, block size ``seq_len``)."""
    return GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.seq_len))


def model_setup(args: TrainingArguments) -> ModelSetup:
    """The model, loss and data of ``args``: the default GPT when ``args.model`` is None,
    else the ``module:function`` factory's (the module docstring gives the contract).

    Raises:
        ValueError: the module cannot be imported (naming it and the error), has no such
            attribute, the factory needs arguments or raised, or its dict has unknown keys
            or no ``model``; the text data is missing, empty or too short (``--data``).
        ArgumentTypeError: the attribute is not callable, or the factory returned
            something other than an nn.Module or a dict, or a dict entry of the wrong kind.
    """
    if args.model is None:
        train_dataset, eval_dataset = split_text(load_text(args.data), args.seq_len)
        return ModelSetup(
            model_factory=lambda: build_model(args),
            loss_fn=forward_loss,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            description=f"default GPT n_layer={args.n_layer} n_head={args.n_head} n_embd={args.n_embd} "
            f"on {_text_name(args)}",
        )
    spec = args.model
    factory = load_factory(spec)
    # Seeded, so data the factory draws at random is the same on every invocation.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        parts = _factory_parts(spec, _call(factory, spec))
    if "eval_dataset" in parts and "train_dataset" not in parts:
        raise ValueError(
            f"model={spec!r} returned eval_dataset without train_dataset; return both, or neither to train on "
            "the text data"
        )
    for name in ("train_dataset", "eval_dataset"):
        if name in parts:
            _check_dataset(spec, name, parts[name])
    if "train_dataset" in parts:
        train_dataset, eval_dataset = parts["train_dataset"], parts.get("eval_dataset")
        evaluated = f", {len(eval_dataset)} eval" if eval_dataset is not None else ", no eval"
        data = f"its own datasets ({len(train_dataset)} train{evaluated} examples)"
    else:
        train_dataset, eval_dataset = split_text(load_text(args.data), args.seq_len)
        data = _text_name(args)
    if "loss_fn" not in parts:
        _check_forward_takes_targets(spec, parts["model"])
    user_loss, source = parts.get("loss_fn", forward_loss), "loss_fn" if "loss_fn" in parts else "the model"

    def loss_fn(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # A wrong loss would fail deep in backward() with a message about gradients.
        return _checked_loss(spec, source, user_loss(model, inputs, targets))

    return ModelSetup(
        model_factory=lambda: _factory_parts(spec, _call(factory, spec))["model"],
        loss_fn=loss_fn,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        description=spec + (" with its own loss_fn" if "loss_fn" in parts else "") + f" on {data}",
    )


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable that ``"module:function"`` names, imported with the current directory
    first on ``sys.path``.

    Raises:
        ValueError: the module is not found or fails to import, or has no such attribute.
        ArgumentTypeError: the attribute is not callable, is a model instance, or needs
            arguments.
    """
    module_name, _, attribute = spec.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name + ".").startswith(error.name + "."):
            raise ValueError(
                f"model={spec!r}: no module named {error.name!r} in the current directory ({cwd}) or the installed "
                f"packages; run from the directory that holds {module_name.split('.')[0]}.py, or install its package"
            ) from None
        raise ValueError(f"model={spec!r}: importing {module_name!r} failed: {_describe(error)}") from error
    except Exception as error:  # a SyntaxError, or whatever the module's own code raises
        raise ValueError(f"model={spec!r}: importing {module_name!r} failed: {_describe(error)}") from error
    target = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            functions = sorted(
                name for name, value in vars(module).items()
                if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_")
            )
            found = f"its functions: {', '.join(functions)}" if functions else "it defines no public functions"
            raise ValueError(
                f"model={spec!r}: module {module_name!r} ({getattr(module, '__file__', None) or 'no file'}) has no "
                f"attribute {attribute!r}; {found}"
            )
        target = getattr(target, part)
    if isinstance(target, nn.Module):
        raise ArgumentTypeError(
            f"model={spec!r} is a {type(target).__name__} instance; name a function that builds one, since every "
            "run needs a freshly initialized model"
        )
    if not callable(target):
        raise ArgumentTypeError(
            f"model={spec!r} names an object of type {type(target).__name__}, not a function; name a zero-argument "
            f"function that returns {_RETURNS}"
        )
    try:
        inspect.signature(target).bind()
    except TypeError as error:
        raise ArgumentTypeError(
            f"model={spec!r}: {attribute}() must take no arguments ({error}); wrap it in a function that passes them"
        ) from None
    except ValueError:  # no signature to read (some builtins): the call will tell
        pass
    return target


def _call(factory: Callable[[], Any], spec: str) -> Any:
    try:
        return factory()
    except Exception as error:
        raise ValueError(f"model={spec!r}: calling {spec.partition(':')[2]}() raised {_describe(error)}") from error


def _factory_parts(spec: str, returned: Any) -> dict[str, Any]:
    """What the factory returned, as a dict with ``model`` (checked) and the optional keys."""
    if isinstance(returned, nn.Module):
        return {"model": returned}
    if not isinstance(returned, dict):
        raise ArgumentTypeError(f"model={spec!r} returned a {type(returned).__name__}; return {_RETURNS}")
    unknown = [key for key in returned if key not in FACTORY_KEYS]
    if unknown:
        raise ValueError(
            f"model={spec!r} returned a dict with unknown key(s) {', '.join(map(repr, unknown))}; "
            f"the keys are {', '.join(FACTORY_KEYS)}"
        )
    if "model" not in returned:
        raise ValueError(f"model={spec!r} returned a dict without 'model'; add 'model': the nn.Module to train")
    if not isinstance(returned["model"], nn.Module):
        raise ArgumentTypeError(
            f"model={spec!r} returned 'model': a {type(returned['model']).__name__}; it must be an nn.Module"
        )
    if "loss_fn" in returned and not callable(returned["loss_fn"]):
        raise ArgumentTypeError(
            f"model={spec!r} returned 'loss_fn': a {type(returned['loss_fn']).__name__}; it must be a callable "
            "(model, inputs, targets) -> loss"
        )
    return dict(returned)


def _check_dataset(spec: str, name: str, dataset: Any) -> None:
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ArgumentTypeError(
            f"model={spec!r} returned {name!r}: a {type(dataset).__name__}; it must be a map-style dataset of "
            "(inputs, targets) pairs (with __len__ and __getitem__), e.g. a TensorDataset"
        )
    if len(dataset) == 0:
        raise ValueError(f"model={spec!r} returned an empty {name!r}")


def _check_forward_takes_targets(spec: str, model: nn.Module) -> None:
    """Without a ``loss_fn``, the Trainer calls ``model(inputs, targets)`` for the loss."""
    try:
        inspect.signature(model.forward).bind(None, None)
    except TypeError:
        raise ArgumentTypeError(
            f"model={spec!r}: {type(model).__name__}.forward cannot take (inputs, targets); without a loss_fn the "
            "model must return the loss from forward(inputs, targets), or return a dict with 'model' and "
            "'loss_fn': (model, inputs, targets) -> loss"
        ) from None
    except ValueError:  # no signature to read
        pass


def _checked_loss(spec: str, source: str, loss: Any) -> torch.Tensor:
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        is_tensor = isinstance(loss, torch.Tensor)
        what = f"a tensor of shape {tuple(loss.shape)}" if is_tensor else f"a {type(loss).__name__}"
        fix = "" if source == "loss_fn" else "; without a loss_fn, forward(inputs, targets) must return the loss"
        raise ArgumentTypeError(f"model={spec!r}: {source} returned {what}, not the scalar loss{fix}")
    return loss


def _text_name(args: TrainingArguments) -> str:
    text = f"{Path(args.data).name}" if args.data is not None else "the embedded English text (pydoc_data)"
    return f"{text}, {args.seq_len}-byte sequences"


def _describe(error: BaseException) -> str:
    """``Type: message (at file.py:line)``, one line, the place being the innermost frame."""
    message = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {message[0]}" if message else type(error).__name__
    frames = traceback.extract_tb(error.__traceback__)
    # The innermost frame of the user's code: not fp8train's, nor the interpreter's or
    # installed libraries' (torch), unless there is nothing else.
    libraries = (sys.prefix, sys.base_prefix, str(Path(__file__).resolve().parents[1]))
    own = [frame for frame in frames if not frame.filename.startswith(libraries) and not frame.filename.startswith("<")]
    frame = (own or frames or [None])[-1]
    if frame is not None and not isinstance(error, SyntaxError):  # a SyntaxError names its own place
        text += f" (at {Path(frame.filename).name}:{frame.lineno})"
    return text
