"""The trainer's CUDA graphs (``cuda_graphs``), on a CPU: which runs capture their steps, and
that a run through the graph's flow (static batches, warm-up, replays) trains exactly as an
eager one. The replay here is the step run eagerly on the static batches (the stand-in of
tests/nn/test_step_graph.py); on a GPU the suite compares real replays with eager steps."""

import logging

import pytest
import torch

from fp8train.nn.step_graph import StepGraph
from fp8train.quant.kernels import use_quant_settings
from fp8train.train.arguments import TrainingArguments
from fp8train.train.commands.compare import build_model
from fp8train.train.trainer import Trainer
from fp8train.train.trainer_setup import cuda_graphs_reason, use_cuda_graphs

from ..nn.test_step_graph import EagerCapture, gpu_conversions  # noqa: F401 (a fixture)
from ._trainer_helpers import _args

CUDA = torch.device("cuda", 0)


def test_cuda_graphs_is_one_of_three_choices():
    with pytest.raises(ValueError, match="cuda_graphs"):
        TrainingArguments(cuda_graphs="yes")


@pytest.mark.parametrize(
    "overrides, device, strategy, reason",
    [
        ({}, CUDA, "none", None),
        ({"cuda_graphs": "true"}, CUDA, "none", None),
        ({"cuda_graphs": "false"}, CUDA, "none", "cuda_graphs='false'"),
        ({}, torch.device("cpu"), "none", "the run is on cpu, not CUDA"),
        ({}, CUDA, "ddp", "strategy='ddp', tp=1: a distributed step's collectives run from Python hooks"),
    ],
)
def test_which_runs_capture_their_steps(overrides, device, strategy, reason):
    args = TrainingArguments(**overrides)
    assert cuda_graphs_reason(args, device, strategy) == reason
    assert use_cuda_graphs(args, device, strategy) == (reason is None)


def test_true_where_a_run_cannot_capture_is_an_error_naming_why():
    with pytest.raises(ValueError, match=r"cuda_graphs='true' cannot be honoured: the run is on cpu, not CUDA"):
        use_cuda_graphs(TrainingArguments(cuda_graphs="true"), torch.device("cpu"), "none")


def test_auto_on_a_gpu_says_once_why_a_distributed_run_is_eager(caplog):
    with caplog.at_level(logging.INFO, logger="fp8train.train.trainer_setup"):
        assert not use_cuda_graphs(TrainingArguments(), CUDA, "fsdp2")
        assert not use_cuda_graphs(TrainingArguments(), torch.device("cpu"), "none")  # a CPU run: nothing to say
    assert [r.getMessage() for r in caplog.records] == [
        "fp8train: CUDA graphs off, every step runs eagerly: strategy='fsdp2', tp=1: a distributed step's "
        "collectives run from Python hooks"
    ]


def _trainer(tmp_path, datasets, **overrides) -> Trainer:
    args = _args(tmp_path, steps=7, eval_interval=0, save_checkpoints=False, **overrides)
    train, val = datasets
    return Trainer(lambda: build_model(args), args, train, val)


@pytest.mark.parametrize(
    "overrides",
    [  # two whole runs each, seconds: the recipes beyond the default under -m heavy (CI's second leg)
        pytest.param({"fp8_recipe": "delayed"}, marks=pytest.mark.heavy),
        pytest.param({"fp8_recipe": "mxfp8", "grad_accumulation_steps": 2}, marks=pytest.mark.heavy),
        {},
    ],
)
def test_a_run_through_the_graph_flow_trains_as_an_eager_run(tmp_path, datasets, overrides, gpu_conversions):
    with use_quant_settings(quantize_kernel="reference"):  # the path a GPU takes
        eager = _trainer(tmp_path / "eager", datasets, **overrides).train()
        graphed_trainer = _trainer(tmp_path / "graphed", datasets, **overrides)
        trainable = [p for p in graphed_trainer.model.parameters() if p.requires_grad]
        graphed_trainer.step_graph = StepGraph(
            graphed_trainer._static_step, graphed_trainer.eager_model, trainable, capture=EagerCapture
        )
        graphed = graphed_trainer.train()
    assert graphed_trainer.step_graph.reason is None
    assert graphed_trainer.step_graph.captured is not None  # steps 5 to 7 replayed
    assert graphed["losses"] == eager["losses"]
    assert graphed["final_val_loss"] == eager["final_val_loss"]
