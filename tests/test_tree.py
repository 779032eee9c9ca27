"""The tree stays as a newcomer can read it (docs/architecture.md, "Reading the tree"): few
files at each layer's top, no import cycle, no import up the layers, no function over 60
lines and no file over 400. The figures come from ``tools/tree.py``, which prints them."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("tree", ROOT / "tools" / "tree.py")
tree = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tree)

MAX_FILES_AT_TOP = {"nn": 13, "train": 13, "quant": 14}
"""Issue 37's targets, ``__init__.py`` included."""


@pytest.fixture(scope="module")
def figures():
    return tree.figures()


def test_the_layers_are_the_layering_tests(figures):
    import tests.spec.test_torch_free as layering

    assert tree.LAYERS == layering.LAYERS


@pytest.mark.parametrize("layer, limit", sorted(MAX_FILES_AT_TOP.items()))
def test_each_crowded_layer_keeps_few_files_at_its_top(figures, layer, limit):
    (found,) = [f for f in figures["layers"] if f["layer"] == layer]
    assert found["files_at_top"] <= limit, f"{layer}/ has {found['files_at_top']} files at its top (at most {limit})"


def test_no_cycle_and_no_upward_import(figures):
    assert figures["cycles"] == []
    assert figures["upward_imports"] == []


def test_no_function_over_60_lines_and_no_file_over_400(figures):
    assert figures["long_functions"] == []
    assert figures["long_files"] == []


def test_the_counts_follow_their_rules(tmp_path, monkeypatch):
    # A package of three modules: a -> b -> c, c -> a via a function-level import (a cycle),
    # and one function of 62 lines whose docstring (3 lines) is not counted.
    package = tmp_path / "fp8train"
    (package / "nn").mkdir(parents=True)
    (package / "spec").mkdir()
    (package / "__init__.py").write_text("")
    (package / "nn" / "__init__.py").write_text("")
    (package / "spec" / "__init__.py").write_text("")
    (package / "nn" / "a.py").write_text("from . import b\nfrom ..spec import c\n")
    (package / "nn" / "b.py").write_text("import fp8train.spec.c\n")
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    (package / "spec" / "c.py").write_text(f'def f():\n    """one\n    two\n    three"""\n{body}\n    from ..nn import a\n')
    monkeypatch.setattr(tree, "PACKAGE", package)
    edges = tree.graph()
    assert edges["fp8train.nn.a"] == {"fp8train.nn.b", "fp8train.spec.c"}
    assert edges["fp8train.nn.b"] == {"fp8train.spec.c"}
    assert edges["fp8train.spec.c"] == {"fp8train.nn.a"}
    assert tree.cycles(edges) == [["fp8train.nn.a", "fp8train.nn.b", "fp8train.spec.c"]]
    assert tree.upward_imports(edges) == ["fp8train.spec.c -> fp8train.nn.a"]
    nn = tree.layer_figures(edges, "nn")
    assert (nn["files_at_top"], nn["files"], nn["arrows"], nn["floors"]) == (3, 3, 1, 2)
    assert tree.long_functions(limit=60) == ["spec/c.py:1 f (61 lines)"]
    assert tree.long_functions(limit=61) == []


def test_the_architecture_doc_shows_the_tree_as_it_is(figures):
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = [line for line in tree.format_report(figures).splitlines() if line.startswith("|")]
    assert "\n".join(rows) in doc, "docs/architecture.md's table (Reading the tree) is not `python tools/tree.py`'s"
