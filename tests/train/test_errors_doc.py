"""docs/errors.md covers every public name and every TrainingArguments field."""

import dataclasses
import inspect
from pathlib import Path

import fp8train
import fp8train.parallel

ERRORS_DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"
# Constants and modules have no arguments to check.
NO_ARGUMENTS = {"E4M3", "E5M2", "E8M0", "GRANULARITIES", "recipes", "Format", "optim", "quant"}


def test_every_public_callable_has_a_row():
    text = ERRORS_DOC.read_text()
    names = [n for n in fp8train.__all__ if n not in NO_ARGUMENTS]
    names += [f"quant.{n}" for n in fp8train.quant.__all__ if n not in NO_ARGUMENTS]
    names += [f"parallel.{n}" for n in ("enable_fp8_all_gather", "precompute_fp8_scales_for_fsdp")]
    assert all(callable(_resolve(n)) for n in names)
    missing = [n for n in names if f"`{n}" not in text]
    assert not missing, f"docs/errors.md has no row for {missing}"


def _resolve(name: str) -> object:
    """The object a public name (``"Trainer"``, ``"quant.quantize"``) refers to."""
    value = fp8train
    for part in name.split("."):
        value = getattr(value, part)
    return value


def test_every_training_argument_has_a_row():
    text = ERRORS_DOC.read_text()
    missing = [f.name for f in dataclasses.fields(fp8train.TrainingArguments) if f"`{f.name}`" not in text]
    assert not missing, f"docs/errors.md has no row for the fields {missing}"


def test_recipe_classes_are_covered_by_name():
    text = ERRORS_DOC.read_text()
    recipe_classes = [n for n in fp8train.__all__ if inspect.isclass(getattr(fp8train, n)) and issubclass(getattr(fp8train, n), fp8train.Recipe)]
    assert all(f"`{n}`" in text for n in recipe_classes if n != "Recipe")
