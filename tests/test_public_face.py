"""fp8train's public face: training at the top level, the numerics kit in ``fp8train.quant``,
and the kit's old top-level names still importable for one release, warning once each
(``fp8train/__init__.py``, ``fp8train/moved_names.py``)."""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import fp8train
import fp8train.quant

from .helpers.repository_text import lines_matching

ROOT = Path(__file__).resolve().parents[1]

TOP_LEVEL = {
    "recipes", "Recipe", "TensorwiseScaling", "DelayedScaling", "RowwiseScaling", "BlockScaling",
    "MXFP8Scaling", "NVFP4Scaling", "MXFP4Scaling", "Format",
    "convert_to_float8_training", "conversion_report", "convert_to_linear", "drop_fp8_state",
    "Float8Linear", "Float8ModuleConfig", "store_frozen_weights_in_fp8", "restore_high_precision_weights",
    "autocast", "detect_nonfinite", "NonFiniteError", "inspect", "Trainer", "TrainingArguments",
    "optim", "save_pretrained_fp8", "save_pretrained_quantized", "calibrate_input_amax",
    "quant",
}
KIT = {
    "quantize", "QuantizedTensor", "GRANULARITIES", "cast_to_fp8", "E4M3", "E5M2", "E8M0", "FloatFormat",
    "scaled_mm", "amax_to_scale", "delayed_scaling_update", "blockwise_to_gemm_layout",
    "blockwise_from_gemm_layout", "swizzle_mx_scales", "unswizzle_mx_scales",
}
"""The kit: every one of these was a top-level name before 0.1.0's move."""
REMOVED_IN = "0.2.0"


@pytest.fixture
def fresh_warnings():
    """Every moved name warns once more, and every warning is recorded."""
    fp8train._MOVED_TO_QUANT.forget()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    fp8train._MOVED_TO_QUANT.forget()


def test_the_top_level_is_exactly_the_training_face():
    assert set(fp8train.__all__) == TOP_LEVEL
    assert len(fp8train.__all__) == len(TOP_LEVEL)


def test_the_kit_is_exactly_fp8train_quant():
    assert set(fp8train.quant.__all__) == KIT
    assert len(fp8train.quant.__all__) == len(KIT)


def test_every_public_name_resolves_without_a_warning(fresh_warnings):
    for name in fp8train.__all__:
        assert getattr(fp8train, name) is not None, name
    for name in fp8train.quant.__all__:
        assert getattr(fp8train.quant, name) is not None, name
    assert fresh_warnings == []


def test_dir_lists_the_face_and_not_the_moved_names():
    listed = set(dir(fp8train))
    assert TOP_LEVEL <= listed
    assert not KIT & listed


@pytest.mark.parametrize("name", sorted(KIT))
def test_a_moved_name_is_the_same_object_and_warns_once_naming_the_fix(name, fresh_warnings):
    first = getattr(fp8train, name)
    again = getattr(fp8train, name)
    assert first is again is getattr(fp8train.quant, name)
    assert len(fresh_warnings) == 1
    warning = fresh_warnings[0]
    assert warning.category is FutureWarning
    message = str(warning.message)
    assert f"fp8train.{name} moved to fp8train.quant.{name}" in message
    assert f"`from fp8train.quant import {name}`" in message
    assert f"goes away in fp8train {REMOVED_IN}" in message
    assert warning.filename == __file__  # the warning points at the line that used the name


def test_from_import_of_a_moved_name_works_and_warns_at_the_import(fresh_warnings):
    namespace = {}
    exec(compile("from fp8train import quantize, scaled_mm", __file__, "exec"), namespace)
    assert namespace["quantize"] is fp8train.quant.quantize
    assert namespace["scaled_mm"] is fp8train.quant.scaled_mm
    assert [str(w.message).split(" moved")[0] for w in fresh_warnings] == ["fp8train.quantize", "fp8train.scaled_mm"]
    assert {w.filename for w in fresh_warnings} == {__file__}


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match=r"module 'fp8train' has no attribute 'quantise'"):
        fp8train.quantise  # noqa: B018
    with pytest.raises(ImportError, match=r"cannot import name 'quantise'"):
        exec("from fp8train import quantise", {})


@pytest.mark.heavy  # a subprocess or a JAX compile of seconds: CI's second leg runs it (default run under 6 minutes)
def test_python_shows_the_warning_by_default_once_per_name():
    """A FutureWarning, not a DeprecationWarning: the default filters show it outside
    ``__main__`` too (here in a module the script imports), and once per name."""
    script = (
        "import sys, types\n"
        "user = types.ModuleType('user_code')\n"
        "exec('import fp8train\\ndef use():\\n    a = fp8train.quantize\\n    b = fp8train.quantize\\n"
        "    return fp8train.E4M3', user.__dict__)\n"
        "user.use(); user.use()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("FutureWarning: fp8train.quantize moved to fp8train.quant.quantize") == 1
    assert result.stderr.count("FutureWarning: fp8train.E4M3 moved to fp8train.quant.E4M3") == 1


# The prose and code that may still name the old places: the note that lists them, and this test.
MAY_NAME_THE_OLD_PLACES = {ROOT / "docs" / "errors.md", Path(__file__)}


def test_nothing_in_the_repository_uses_an_old_top_level_name():
    old_name = re.compile(r"\bfp8train\.(" + "|".join(sorted(KIT)) + r")\b")
    uses = lines_matching(old_name, MAY_NAME_THE_OLD_PLACES)
    assert not uses, f"these lines name a moved name at the top level: use fp8train.quant: {uses}"
