"""What a trainer is built from: the device from the launcher's local rank, read once at
the edge and passed down."""

import torch

from fp8train.train.arguments import TrainingArguments
from fp8train.train.trainer_setup import local_rank_from_env, training_device


def test_local_rank_is_read_from_the_launcher_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_rank_from_env() == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert local_rank_from_env() == 0


def test_the_device_takes_the_local_rank_it_is_given(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "5")  # not read: the caller passes the rank down
    assert training_device(TrainingArguments(device="cuda"), 2) == torch.device("cuda", 2)
    assert training_device(TrainingArguments(device="cpu"), 2) == torch.device("cpu")
    assert training_device(TrainingArguments(device="cuda")) == torch.device("cuda", 0)
