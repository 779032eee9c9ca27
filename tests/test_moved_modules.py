"""Modules that moved in 0.1.0 still import under their old dotted names until 0.2.0: the
very module at the new name, with one ``FutureWarning`` per name per process
(``fp8train/__init__.py`` ``_MOVED_MODULES``, ``fp8train/moved_names.py`` ``MovedModules``)."""

import importlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fp8train

from .helpers.repository_text import lines_matching

ROOT = Path(__file__).resolve().parents[1]
MOVES = fp8train._MOVED_MODULES.moves


def test_the_moves_are_the_restructured_tree():
    # A sample of each wing, so that the table cannot lose a wing unnoticed.
    assert MOVES["fp8train.nn.linear"] == "fp8train.nn.modules.linear"
    assert MOVES["fp8train.nn.experts"] == "fp8train.nn.modules.experts"
    assert MOVES["fp8train.nn.nonfinite"] == "fp8train.diagnostics.nonfinite"
    assert MOVES["fp8train.train.inspector"] == "fp8train.diagnostics.inspector"
    assert MOVES["fp8train.train.cli"] == "fp8train.train.commands.cli"
    assert MOVES["fp8train.quant.log_once"] == "fp8train.log_once"
    assert len(MOVES) == 20


@pytest.mark.parametrize("old", sorted(MOVES))
def test_no_file_answers_an_old_name_and_every_new_one_imports(old):
    # The finder is asked only where no file answers: an old file left behind would be a second copy.
    parts = old.split(".")
    assert not (ROOT / "src").joinpath(*parts[:-1], parts[-1] + ".py").exists()
    assert importlib.util.find_spec(MOVES[old]) is not None


@pytest.mark.heavy  # a subprocess or a JAX compile of seconds: CI's second leg runs it (default run under 6 minutes)
def test_every_old_name_is_the_new_module_and_warns_once_at_the_import_and_keeps_its_names():
    # In a fresh process, each old name imported twice by an import statement: the second
    # import warns no more, and the warning names the statement's line.
    imports = "".join(
        f"    import {old} as module\n    same[{old!r}] = module is sys.modules[{new!r}]\n" for old, new in MOVES.items()
    )
    script = f"""
import json, sys, warnings
import fp8train
same = {{}}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
{textwrap.indent(imports, "    ")}
# The names users took from the old modules, through from-imports (warned above already).
from fp8train.nn.linear import Float8Linear, Float8Module
from fp8train.train.cli import main
from fp8train.nn.modules.base import Float8Module as base
from fp8train.train.commands.cli import main as new_main
assert Float8Linear is fp8train.Float8Linear and Float8Module is base and main is new_main
assert fp8train.nn.linear.Float8Linear is fp8train.Float8Linear
print(json.dumps({{"same": same, "warnings": [[w.category.__name__, str(w.message), w.filename] for w in caught]}}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["same"] == {old: True for old in MOVES}
    assert len(out["warnings"]) == len(MOVES)
    for (category, message, filename), (old, new) in zip(out["warnings"], MOVES.items()):
        assert category == "FutureWarning"
        assert message == (f"{old} moved to {new}: use `import {new}` (or the public names of `fp8train`); "
                           f"{old} goes away in fp8train 0.2.0")
        assert filename == "<string>"  # the line that imported it, not importlib's


def test_a_name_that_never_existed_is_still_a_module_not_found_error():
    with pytest.raises(ModuleNotFoundError, match="fp8train.nn.lineer"):
        importlib.import_module("fp8train.nn.lineer")
    assert fp8train._MOVED_MODULES.find_spec("fp8train.nn.lineer") is None


# The prose and code that may still name the old places: the note that lists them, the table, and this test.
MAY_NAME_THE_OLD_PLACES = {ROOT / "docs" / "errors.md", ROOT / "src" / "fp8train" / "__init__.py", Path(__file__)}


def test_nothing_in_the_repository_uses_an_old_module_name():
    old_name = re.compile(r"(?<![\w.])(" + "|".join(re.escape(m) for m in sorted(MOVES)) + r")(?!\w)")
    uses = lines_matching(old_name, MAY_NAME_THE_OLD_PLACES)
    assert not uses, f"these lines name a module at its old place: {uses}"
