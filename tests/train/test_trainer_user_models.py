"""``Trainer`` with a user's own model, loss and dataset."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from fp8train.train.arguments import TrainingArguments
from fp8train.train.trainer import Trainer

from ._trainer_helpers import TRAIN_STEPS, _mean


# ---------------------------------------------------------------------------- user models

NUM_CLASSES = 16
NUM_EXAMPLES = 512
# A linearly separable 16-class task: over 12 steps at lr 1e-2 the mean cross-entropy of
# the last 4 steps is ~0.75 under that of the first 4 (~2.7, near ln 16).
MIN_CLASSIFIER_LOSS_DROP = 0.3
# The classifier: small_model(*CLASSIFIER, seed=None), unseeded like a user's own model
# (the Trainer seeds before it calls a model factory).
CLASSIFIER = ((128, 128), "gelu", (128, NUM_CLASSES))


def _classification_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(NUM_EXAMPLES, 128, generator=generator)
    teacher = torch.randn(128, NUM_CLASSES, generator=generator)
    return TensorDataset(inputs, (inputs @ teacher).argmax(dim=1))


def _cross_entropy(model, inputs, targets):
    return F.cross_entropy(model(inputs), targets)


def test_user_model_with_its_own_loss_trains_in_fp8(tmp_path, small_model):
    args = TrainingArguments(
        output_dir=str(tmp_path), steps=TRAIN_STEPS, batch_size=64, learning_rate=1e-2, warmup_steps=2,
        fp8_recipe="rowwise", device="cpu", save_checkpoints=False,
    )
    trainer = Trainer(small_model(*CLASSIFIER, seed=None), args, _classification_data(), loss_fn=_cross_entropy)
    result = trainer.train()
    assert (result["converted_layers"], result["total_linear_layers"]) == (2, 2)
    losses = result["losses"]
    assert all(math.isfinite(loss) for loss in losses)
    assert _mean(losses[-4:]) < _mean(losses[:4]) - MIN_CLASSIFIER_LOSS_DROP, losses
    assert result["val_losses"] == {} and math.isnan(result["final_val_loss"])


def test_model_factory_is_built_after_seeding(tmp_path, small_model):
    calls = []

    def factory():
        calls.append(1)
        return small_model(*CLASSIFIER, seed=None)

    dataset = _classification_data()

    def initial_weights(seed: int) -> dict:
        torch.manual_seed(1234 + len(calls))  # global RNG state before the Trainer must not matter
        args = TrainingArguments(output_dir=str(tmp_path), seed=seed, fp8_recipe="rowwise", device="cpu")
        return Trainer(factory, args, dataset, loss_fn=_cross_entropy).model.state_dict()

    first, again, other_seed = initial_weights(0), initial_weights(0), initial_weights(1)
    assert len(calls) == 3
    assert first.keys() == again.keys() == other_seed.keys()
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["0.weight"], other_seed["0.weight"])


def test_empty_train_dataset_is_an_error(tmp_path, small_model):
    empty = TensorDataset(torch.empty(0, 128), torch.empty(0, dtype=torch.long))
    with pytest.raises(ValueError, match="train_dataset is empty"):
        Trainer(
            small_model(*CLASSIFIER, seed=None),
            TrainingArguments(output_dir=str(tmp_path), device="cpu"),
            empty,
            loss_fn=_cross_entropy,
        )


def test_model_with_no_convertible_linear_is_an_error(tmp_path, small_model):
    model = small_model((100, 100), "gelu", (100, NUM_CLASSES), seed=None)
    args = TrainingArguments(output_dir=str(tmp_path), fp8_recipe="blockwise", device="cpu")
    with pytest.raises(
        ValueError,
        match=r"converted none of the model's 2 matmul modules: 0 \(in_features=100, out_features=100 are not both "
        r"multiples of 128\); 2 \(in_features=100, out_features=",
    ):
        Trainer(model, args, _classification_data(), loss_fn=_cross_entropy)
