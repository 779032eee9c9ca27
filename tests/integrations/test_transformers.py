"""fp8train with transformers: the stock ``Trainer`` (FP8 forwards, gradient checkpointing,
bf16, bit-identical resume) and ``fp8train.integrations.transformers``' save and load."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

import fp8train
from fp8train.integrations import transformers as fp8_transformers

transformers = pytest.importorskip("transformers")

NUM_LINEARS = 2 * 7 + 1  # two decoder layers of seven Linears, and the head
TRAINER_QUIET = {"report_to": [], "disable_tqdm": True, "logging_steps": 1, "use_cpu": True}


def tiny_llama(seed: int = 0) -> "transformers.LlamaForCausalLM":
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def token_dataset(num_rows: int = 8, seq_len: int = 32) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 256, (num_rows, seq_len), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def count_fp8_forwards(model: torch.nn.Module) -> list[int]:
    """A one-element list counting the forwards of ``model``'s Float8Linear modules."""
    count = [0]
    for module in model.modules():
        if isinstance(module, fp8train.Float8Linear):
            module.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def train(recipe, output_dir: Path, *, max_steps: int, resume: Path | None = None, **arguments):
    """A converted tiny Llama trained by a stock Trainer (checkpoints every 2 steps):
    the model, the Trainer, and the number of FP8 forwards."""
    model = fp8train.convert_to_float8_training(tiny_llama(), recipe)
    forwards = count_fp8_forwards(model)
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=2, learning_rate=1e-3,
        save_strategy="steps", save_steps=2, seed=0, **TRAINER_QUIET, **arguments,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=token_dataset())
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return model, trainer, forwards[0]


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def assert_state_dicts_equal(expected: torch.nn.Module, actual: torch.nn.Module) -> None:
    expected, actual = expected.state_dict(), actual.state_dict()
    assert expected.keys() == actual.keys()
    differ = [key for key in expected if not torch.equal(expected[key], actual[key])]
    assert not differ, f"{len(differ)} differ, e.g. {differ[:3]}"


def check_resume_is_bit_identical(recipe, tmp_path: Path, **arguments) -> None:
    """3 steps straight against 2 steps, then a new converted model resumed for the third."""
    model, trainer, forwards = train(recipe, tmp_path / "a", max_steps=3, **arguments)
    resumed, resumed_trainer, _ = train(
        recipe, tmp_path / "b", max_steps=3, resume=tmp_path / "a" / "checkpoint-2", **arguments
    )
    assert losses(resumed_trainer) == losses(trainer)  # the first two from its checkpoint
    assert_state_dicts_equal(model, resumed)


def test_trainer_runs_fp8_with_activation_checkpointing_bf16_and_resumes_bit_identically(tmp_path):
    model, trainer, forwards = train(
        "tensorwise", tmp_path / "a", max_steps=3, activation_checkpointing=True, bf16=True
    )
    assert model.is_activation_checkpointing
    assert f"converted {NUM_LINEARS}/{NUM_LINEARS} matmul modules" in fp8train.conversion_report(model).summary()
    # Every step runs every Float8Linear forward, and checkpointing's recompute runs
    # decoder layers' ones again, in FP8 too.
    assert forwards > 3 * NUM_LINEARS
    resumed, resumed_trainer, _ = train(
        "tensorwise", tmp_path / "b", max_steps=3, resume=tmp_path / "a" / "checkpoint-2",
        activation_checkpointing=True, bf16=True,
    )  # fmt: skip
    assert losses(resumed_trainer) == losses(trainer)  # the first two from its checkpoint
    assert_state_dicts_equal(model, resumed)


def _train_with_fp8train_adamw(fp8_weights: bool, output_dir: Path):
    """A tiny Llama under delayed scaling, trained by the stock Trainer with gradient
    accumulation and ``fp8train.optim.AdamW`` (handed in: it keeps FP8 weights' masters)."""
    model = fp8train.convert_to_float8_training(tiny_llama(), "delayed", fp8_weights=fp8_weights)
    optimizer = fp8train.optim.AdamW(model.parameters(), lr=1e-3)
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-3, save_strategy="no", seed=0, **TRAINER_QUIET,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=token_dataset(), optimizers=(optimizer, None))
    trainer.train()
    return model, trainer


def test_trainer_trains_fp8_weights_with_gradient_accumulation_bit_identically(tmp_path):
    """The Trainer moves the model (``model.to``), schedules the learning rate and
    accumulates two micro-batches a step (each moves delayed scaling's weight scale, which
    the stored weights follow): the same losses and weights as without ``fp8_weights``."""
    plain, plain_trainer = _train_with_fp8train_adamw(False, tmp_path / "plain")
    model, trainer = _train_with_fp8train_adamw(True, tmp_path / "fp8_weights")
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, fp8train.nn.weights.float8_weight.Float8Weight)
    assert losses(trainer) == losses(plain_trainer)
    assert_state_dicts_equal(plain, model)


@pytest.mark.slow
def test_trainer_resume_is_bit_identical_with_mxfp8(tmp_path):
    check_resume_is_bit_identical("mxfp8", tmp_path)


def test_trainer_resume_is_bit_identical_with_delayed_scaling(tmp_path):
    check_resume_is_bit_identical(fp8train.DelayedScaling(amax_history_len=16), tmp_path)


# ---------------------------------------------------------------- save and load


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def load_reports():
    """The load reports transformers logs while the test runs."""
    records, logger = _Records(), logging.getLogger("transformers.modeling_utils")
    logger.addHandler(records)
    yield records.messages
    logger.removeHandler(records)


@pytest.fixture
def delayed_model():
    """A tiny Llama converted to delayed scaling, trained two steps (its FP8 state moved)."""
    model = fp8train.convert_to_float8_training(tiny_llama(), fp8train.DelayedScaling(amax_history_len=4))
    batch = token_dataset(num_rows=2)[0]
    for _ in range(2):
        with fp8train.autocast():
            model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    return model


def fp8_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    kept = fp8train.drop_fp8_state(model.state_dict())
    return {key: value for key, value in model.state_dict().items() if key not in kept}


def test_save_pretrained_loads_plain_without_a_report_and_back_with_the_fp8_state(
    delayed_model, tmp_path, load_reports
):
    fp8_transformers.save_pretrained(delayed_model, tmp_path)
    assert (tmp_path / fp8_transformers.FP8_STATE_FILE).is_file()

    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert load_reports == []
    assert type(plain.lm_head) is torch.nn.Linear
    trained = fp8train.drop_fp8_state(delayed_model.state_dict())
    assert all(torch.equal(trained[key], value) for key, value in plain.state_dict().items())
    assert plain.state_dict().keys() == trained.keys()
    batch = {key: value[None] for key, value in token_dataset(num_rows=1)[0].items()}
    with torch.no_grad(), fp8train.autocast(enabled=False):  # converted modules run as nn.Linear
        assert torch.equal(plain(**batch).loss, delayed_model(**batch).loss)

    recipe = fp8train.DelayedScaling(amax_history_len=4)
    loaded = fp8_transformers.from_pretrained(transformers.AutoModelForCausalLM, tmp_path, recipe=recipe)
    assert isinstance(loaded.lm_head, fp8train.Float8Linear)
    assert torch.count_nonzero(fp8_state(loaded)["lm_head.fp8_amax_history"]) > 0
    assert_state_dicts_equal(delayed_model, loaded)
    assert load_reports == []


@pytest.mark.parametrize("max_shard_size", ["5GB", "100KB"])
def test_from_pretrained_reads_the_fp8_state_from_transformers_own_files(
    delayed_model, tmp_path, load_reports, max_shard_size
):
    # As the Trainer's checkpoints (and model.save_pretrained) hold it: inside model.safetensors.
    delayed_model.save_pretrained(tmp_path, max_shard_size=max_shard_size)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (max_shard_size == "100KB")
    recipe = fp8train.DelayedScaling(amax_history_len=4)
    loaded = fp8_transformers.from_pretrained(transformers.LlamaForCausalLM, tmp_path, recipe=recipe)
    assert_state_dicts_equal(delayed_model, loaded)
    plain = fp8_transformers.from_pretrained(transformers.LlamaForCausalLM, tmp_path, recipe=None)
    assert type(plain.lm_head) is torch.nn.Linear and not fp8_state(plain)
    assert load_reports == []


def test_from_pretrained_still_reports_what_is_not_fp8_state(delayed_model, tmp_path, load_reports):
    delayed_model.save_pretrained(tmp_path)
    fp8_transformers.from_pretrained(transformers.LlamaForSequenceClassification, tmp_path, recipe=None)
    assert len(load_reports) == 1 and "score.weight" in load_reports[0]


def test_only_the_main_process_writes_the_fp8_state(delayed_model, tmp_path):
    fp8_transformers.save_pretrained(delayed_model, tmp_path, is_main_process=False)
    assert not (tmp_path / fp8_transformers.FP8_STATE_FILE).exists()


def test_from_pretrained_shows_the_report_of_a_load_that_fails(delayed_model, tmp_path, load_reports):
    delayed_model.save_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="look at the above report"):
        fp8_transformers.from_pretrained(transformers.LlamaForCausalLM, tmp_path, recipe=None, vocab_size=512)
    assert len(load_reports) == 1 and "MISMATCH" in load_reports[0]


def test_a_model_without_fp8_state_saves_none_and_removes_a_stale_one(delayed_model, tmp_path):
    fp8_transformers.save_pretrained(delayed_model, tmp_path)
    fp8_transformers.save_pretrained(fp8train.convert_to_float8_training(tiny_llama(), "tensorwise"), tmp_path)
    assert not (tmp_path / fp8_transformers.FP8_STATE_FILE).exists()
    loaded = fp8_transformers.from_pretrained(transformers.LlamaForCausalLM, tmp_path, recipe="delayed")
    assert fp8_transformers.load_fp8_state(loaded, tmp_path) == 0
    assert torch.count_nonzero(fp8_state(loaded)["lm_head.fp8_amax_history"]) == 0


def test_fp8_state_that_does_not_fit_the_model_is_refused(delayed_model, tmp_path):
    fp8_transformers.save_pretrained(delayed_model, tmp_path)
    load = fp8_transformers.from_pretrained
    with pytest.raises(ValueError, match="holds delayed-scaling state .* but the model has none: convert it"):
        load(transformers.LlamaForCausalLM, tmp_path, recipe="tensorwise")
    with pytest.raises(ValueError, match=r"fp8_amax_history in .* has shape \(4, 3\) but the model's has \(1024, 3\)"):
        load(transformers.LlamaForCausalLM, tmp_path, recipe="delayed")
    recipe = fp8train.DelayedScaling(amax_history_len=4)
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['lm_head.fp8_amax_history'.*module_filter_fn"):
        load(transformers.LlamaForCausalLM, tmp_path, recipe=recipe, module_filter_fn=lambda _, fqn: fqn != "lm_head")


def test_bad_arguments_name_the_value_and_the_fix(tmp_path):
    with pytest.raises(TypeError, match=r"model=Linear must be a transformers PreTrainedModel"):
        fp8_transformers.save_pretrained(torch.nn.Linear(16, 16), tmp_path)
    with pytest.raises(ValueError, match=r"push_to_hub=True would push the directory without its FP8 state"):
        fp8_transformers.save_pretrained(tiny_llama(), tmp_path, push_to_hub=True)
    with pytest.raises(ValueError, match=r"directory='.*missing' is not a local directory.*snapshot_download"):
        fp8_transformers.load_fp8_state(torch.nn.Linear(16, 16), tmp_path / "missing")
    with pytest.raises(TypeError, match=r"model_class='.*' must be a transformers model class.*passed first"):
        fp8_transformers.from_pretrained(str(tmp_path), transformers.LlamaForCausalLM, recipe="delayed")
    with pytest.raises(ValueError, match="output_loading_info is not supported"):
        fp8_transformers.from_pretrained(
            transformers.LlamaForCausalLM, tmp_path, recipe="delayed", output_loading_info=True
        )


# ---------------------------------------------------------------- docs/transformers.md

DOC = Path(__file__).resolve().parents[2] / "docs" / "transformers.md"


def test_the_docs_examples_run(tmp_path, monkeypatch):
    from accelerate.state import AcceleratorState, GradientState

    monkeypatch.chdir(tmp_path)  # the examples write their directories here
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 3
    for index, code in enumerate(blocks):
        namespace = {"__name__": "__main__"}
        try:
            exec(compile(code, f"<docs/transformers.md example {index}>", "exec"), namespace)
        finally:  # accelerate's process-wide state: each example starts its own
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
        assert isinstance(namespace["model"].model.layers[0].mlp.up_proj, fp8train.Float8Linear)
    assert (tmp_path / "llama-fp8" / "checkpoint-2" / "model.safetensors").is_file()
    assert (tmp_path / "accelerate-state" / "model.safetensors").is_file()
    assert (tmp_path / "llama-fp8-final" / fp8_transformers.FP8_STATE_FILE).is_file()
    assert type(namespace["plain"].lm_head) is torch.nn.Linear
