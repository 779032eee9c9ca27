"""Bad arguments to TrainingArguments and Trainer: typed errors before any work starts."""

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fp8train import Trainer, TrainingArguments

DATA = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(learning_rate=math.nan), ValueError, r"learning_rate=nan must be a finite number >= 0"),
        (dict(weight_decay=math.inf), ValueError, r"weight_decay=inf must be a finite number >= 0"),
        (dict(learning_rate="3e-4"), TypeError, r"learning_rate='3e-4' must be a number"),
        (dict(steps=10.0), TypeError, r"steps=10.0 must be an int"),
        (dict(resume=1), TypeError, r"resume=1 must be True or False"),
        (dict(torch_compile="false"), TypeError, r"torch_compile='false' must be True or False"),
        (dict(output_dir=None), TypeError, r"output_dir must be a string, got NoneType"),
        (dict(output_dir=""), ValueError, r"output_dir='' is empty"),
        (dict(data=""), ValueError, r"data='' is empty"),
        (dict(fp8_recipe=8), TypeError, r"fp8_recipe must be a string, got int"),
        (dict(save_total_limit=0), ValueError, r"save_total_limit=0 must be an int >= 1"),
        (dict(dist_timeout=0), ValueError, r"dist_timeout=0 must be a finite number > 0"),
        (dict(dist_timeout=math.inf), ValueError, r"dist_timeout=inf must be a finite number > 0"),
        (dict(device="tpu"), ValueError, r"device='tpu' must be one of auto, cpu, cuda"),
    ],
)
def test_bad_training_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        TrainingArguments(**kwargs)


def test_paths_may_be_pathlib_paths(tmp_path):
    args = TrainingArguments(output_dir=tmp_path / "run", data=Path("corpus.txt"))
    assert args.output_dir == str(tmp_path / "run") and args.data == "corpus.txt"


def _loss(model, inputs, targets):
    return nn.functional.cross_entropy(model(inputs), targets)


@pytest.mark.parametrize(
    "model, args, train, kwargs, error, match",
    [
        ("mlp", None, DATA, {}, TypeError, r"model='mlp' must be a callable returning an nn.Module"),
        (nn.Linear(4, 2), {"steps": 1}, DATA, {}, TypeError, r"args must be a TrainingArguments, got dict"),
        (nn.Linear(4, 2), None, [1, 2, 3].__iter__(), {}, TypeError, r"train_dataset must be a map-style dataset"),
        (nn.Linear(4, 2), None, DATA, dict(eval_dataset=42), TypeError, r"eval_dataset must be a map-style dataset"),
        (nn.Linear(4, 2), None, DATA, dict(loss_fn="mse"), TypeError, r"loss_fn='mse' must be a callable"),
        (nn.Linear(4, 2), None, TensorDataset(torch.zeros(0, 4)), {}, ValueError, r"train_dataset is empty"),
        (lambda: "not a module", None, DATA, {}, TypeError, r"model\(\) must be an nn.Module"),
    ],
)
def test_bad_trainer_arguments(model, args, train, kwargs, error, match, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), device="cpu") if args is None else args
    with pytest.raises(error, match=match):
        Trainer(model, args, train, loss_fn=kwargs.pop("loss_fn", _loss), **kwargs)


def test_cuda_device_on_a_machine_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"device='cuda' but this machine has no CUDA device: use device='cpu'"):
        Trainer(nn.Linear(4, 2), TrainingArguments(output_dir=str(tmp_path), device="cuda"), DATA, loss_fn=_loss)
