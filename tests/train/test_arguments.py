"""``TrainingArguments``: frozen, keyword-only, and every bad value is a ``ValueError``
naming the field before any work starts."""

import dataclasses

import pytest

from fp8train.spec.recipes import RECIPE_NAMES
from fp8train.train.arguments import MIXED_PRECISION, TrainingArguments

FIELD_NAMES = [f.name for f in dataclasses.fields(TrainingArguments)]


def test_defaults():
    args = TrainingArguments()
    assert (args.steps, args.batch_size, args.seq_len, args.grad_accumulation_steps) == (150, 16, 128, 1)
    assert (args.learning_rate, args.warmup_steps, args.min_lr_ratio) == (3e-3, 15, 0.1)
    assert (args.weight_decay, args.max_grad_norm) == (0.1, 1.0)
    assert (args.mixed_precision, args.fp8_recipe, args.fp8_dim_alignment, args.fp8_backend) == (
        "bf16", None, None, "auto"
    )
    assert (args.n_layer, args.n_head, args.n_embd) == (2, 4, 128)
    assert (args.output_dir, args.data, args.device, args.seed) == ("runs/train", None, "auto", 0)
    assert (args.save_checkpoints, args.resume, args.torch_compile, args.checkpoint_interval) == (True, False, False, 0)


def test_frozen_and_keyword_only():
    args = TrainingArguments()
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.steps = 5
    with pytest.raises(TypeError):
        TrainingArguments("runs/x")


@pytest.mark.parametrize("name", ["steps", "batch_size", "seq_len", "grad_accumulation_steps", "eval_batches",
                                  "log_interval", "n_layer", "n_head", "n_embd"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_counts_are_rejected(name, value):
    with pytest.raises(ValueError, match=f"{name}={value}"):
        TrainingArguments(**{name: value})


@pytest.mark.parametrize("name", ["steps", "batch_size", "seq_len", "warmup_steps", "checkpoint_interval"])
@pytest.mark.parametrize("value", [True, 2.5, "4"])
def test_counts_must_be_ints_not_bools_floats_or_strings(name, value):
    with pytest.raises(ValueError, match=name):
        TrainingArguments(**{name: value})


@pytest.mark.parametrize("name", ["warmup_steps", "eval_interval", "checkpoint_interval", "seed"])
def test_negative_non_negative_counts_are_rejected(name):
    with pytest.raises(ValueError, match=f"{name}=-1"):
        TrainingArguments(**{name: -1})
    TrainingArguments(**{name: 0})  # zero is allowed


@pytest.mark.parametrize("name", ["learning_rate", "weight_decay", "max_grad_norm", "min_lr_ratio"])
def test_negative_numbers_are_rejected(name):
    with pytest.raises(ValueError, match=f"{name}=-0.001"):
        TrainingArguments(**{name: -1e-3})
    TrainingArguments(**{name: 0.0})


def test_min_lr_ratio_above_one_is_rejected():
    with pytest.raises(ValueError, match="min_lr_ratio=1.5"):
        TrainingArguments(min_lr_ratio=1.5)
    assert TrainingArguments(min_lr_ratio=1).min_lr_ratio == 1


@pytest.mark.parametrize(
    "name, bad, good",
    [
        ("mixed_precision", "fp32", MIXED_PRECISION),
        ("device", "tpu", ("cpu", "cuda", "auto")),
        ("fp8_backend", "cublas", ("auto", "emulated", "hardware")),
    ],
)
def test_choices_are_validated_and_listed(name, bad, good):
    with pytest.raises(ValueError, match=f"{name}='{bad}'") as error:
        TrainingArguments(**{name: bad})
    for choice in good:
        assert choice in str(error.value)
        TrainingArguments(**{name: choice})


def test_n_head_must_divide_n_embd():
    with pytest.raises(ValueError, match="n_head=3 must divide n_embd=128"):
        TrainingArguments(n_head=3)


def test_unknown_recipe_lists_valid_names():
    with pytest.raises(ValueError, match="unknown FP8 recipe 'fp4'") as error:
        TrainingArguments(fp8_recipe="fp4")
    for name in RECIPE_NAMES:
        assert name in str(error.value)


@pytest.mark.parametrize("name", RECIPE_NAMES + ("current",))
def test_default_model_suits_every_recipe(name):
    assert TrainingArguments(fp8_recipe=name).fp8_recipe == name


@pytest.mark.parametrize("text", ["none", "None", "NONE", "bf16", ""])
def test_no_fp8_spellings_normalise_to_none(text):
    assert TrainingArguments(fp8_recipe=text).fp8_recipe is None


def test_blockwise_needs_n_embd_multiple_of_128_and_says_which():
    with pytest.raises(ValueError, match="n_embd=96 is not a multiple of 128") as error:
        TrainingArguments(n_embd=96, n_head=4, fp8_recipe="blockwise")
    assert "use n_embd=128" in str(error.value)
    # The block size is not an alignment check one can turn off.
    with pytest.raises(ValueError, match="n_embd=96"):
        TrainingArguments(n_embd=96, n_head=4, fp8_recipe="blockwise", fp8_dim_alignment=0)


@pytest.mark.parametrize("name", ["mxfp8", "tensorwise", "rowwise", "delayed"])
def test_n_embd_96_suits_recipes_with_alignment_up_to_32(name):
    assert TrainingArguments(n_embd=96, n_head=4, fp8_recipe=name).n_embd == 96


def test_misaligned_width_can_turn_the_alignment_check_off():
    with pytest.raises(ValueError, match="n_embd=100 is not a multiple of 16") as error:
        TrainingArguments(n_embd=100, n_head=4, fp8_recipe="tensorwise")
    assert "fp8_dim_alignment=0" in str(error.value)
    assert TrainingArguments(n_embd=100, n_head=4, fp8_recipe="tensorwise", fp8_dim_alignment=0).n_embd == 100


@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_fp8_dim_alignment_must_be_a_non_negative_int(value):
    with pytest.raises(ValueError, match="fp8_dim_alignment"):
        TrainingArguments(fp8_dim_alignment=value)


def test_help_has_text_for_every_field():
    help_texts = TrainingArguments.help()
    assert list(help_texts) == FIELD_NAMES
    for name, text in help_texts.items():
        assert isinstance(text, str) and text.strip(), name


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"fp8_recipe": "delayed", "data": "corpus.txt", "steps": 7, "learning_rate": 1e-4, "resume": True},
        {"fp8_recipe": "none", "mixed_precision": "no", "fp8_dim_alignment": 0, "n_embd": 96, "n_head": 2},
    ],
)
def test_to_dict_round_trips(kwargs):
    args = TrainingArguments(**kwargs)
    as_dict = args.to_dict()
    assert list(as_dict) == FIELD_NAMES
    assert TrainingArguments(**as_dict) == args
