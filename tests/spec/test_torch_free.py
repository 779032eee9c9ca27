"""The specification imports no array framework, so a second frontend can share it; and
lower layers never import higher ones. The JAX frontend (``fp8train.jax``) sits beside the
PyTorch layers: it imports the specification only, and the core package never imports it."""

import ast
import importlib.util
import pathlib
import subprocess
import sys

import pytest

import fp8train

PACKAGE = pathlib.Path(fp8train.__file__).parent
LAYERS = ("spec", "quant", "nn", "diagnostics", "parallel", "optim", "integrations", "train")
"""Lowest first; ``integrations`` (other frameworks' glue) sits below ``train``, whose
``export-fp8`` command uses it."""
FRONTENDS = {"jax": {"spec"}}
"""Frontends beside the PyTorch layers, and the layers each may import (besides itself)."""


def test_spec_imports_without_torch():
    # Block torch, then load fp8train.spec without running fp8train/__init__ (which is the
    # PyTorch frontend) by registering a bare package.
    code = f"""
import sys, types
sys.modules["torch"] = None
package = types.ModuleType("fp8train")
package.__path__ = [{str(PACKAGE)!r}]
sys.modules["fp8train"] = package
import fp8train.spec as spec
recipe = spec.from_name("blockwise")
assert recipe.operand_plan.alignment == 128
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def _imported_modules(source: str, package: list[str]) -> set[str]:
    """The modules ``source`` (a module of ``package``) imports, by full name: ``import a.b``
    gives ``a.b``; ``from a.b import c`` gives ``a.b`` and ``a.b.c`` (``c`` may be a module:
    ``from .. import train``); relative imports are resolved against ``package``."""
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            modules |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return modules


def _layers_of(modules: set[str]) -> set[str]:
    """The layers (and frontends) of fp8train that ``modules`` belong to."""
    layers = {parts[1] for parts in (m.split(".") for m in modules) if parts[0] == "fp8train" and len(parts) > 1}
    return layers & (set(LAYERS) | set(FRONTENDS))


def _imported_layers(path: pathlib.Path) -> set[str]:
    """The layers a module inside ``fp8train/<layer>/`` imports from."""
    package = ["fp8train", *path.relative_to(PACKAGE).parts[:-1]]
    return _layers_of(_imported_modules(path.read_text(), package))


@pytest.mark.parametrize(
    "source, layers",
    [
        ("import fp8train.train", {"train"}),
        ("import fp8train.parallel.fsdp as fsdp", {"parallel"}),
        ("import os, fp8train.nn.modules.linear", {"nn"}),
        ("from fp8train import train", {"train"}),
        ("from fp8train.train.trainer import Trainer", {"train"}),
        ("from .. import train", {"train"}),
        ("from ..parallel import fsdp", {"parallel"}),
        ("from . import amax", {"nn"}),
        ("from ..optim import AdamW", {"optim"}),
        ("def f():\n    import fp8train.train.commands.cli", {"train"}),
        ("import fp8train", set()),
        ("import torch.nn", set()),
    ],
)
def test_every_kind_of_import_names_its_layer(source, layers):
    # As written in fp8train/nn/some_module.py.
    assert _layers_of(_imported_modules(source, ["fp8train", "nn"])) == layers


def test_lower_layers_never_import_higher_ones():
    for rank, layer in enumerate(LAYERS):
        for path in sorted((PACKAGE / layer).rglob("*.py")):  # wings (subpackages) too
            higher = _imported_layers(path) & set(LAYERS[rank + 1 :])
            assert not higher, f"{path.relative_to(PACKAGE)} imports the higher layer(s) {sorted(higher)}"


def _imported_packages(path: pathlib.Path) -> set[str]:
    """Top-level packages ``path`` imports absolutely (``torch``, ``jax``, ...)."""
    packages = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            packages |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            packages.add(node.module.split(".")[0])
    return packages


def test_frontends_import_only_the_spec_and_never_torch():
    for frontend, allowed in FRONTENDS.items():
        for path in sorted((PACKAGE / frontend).rglob("*.py")):
            layers = _imported_layers(path) - {frontend}
            assert layers <= allowed, f"{path.relative_to(PACKAGE)} imports {sorted(layers - allowed)}"
            assert "torch" not in _imported_packages(path), f"{path.relative_to(PACKAGE)} imports torch"
    for layer in LAYERS:
        for path in sorted((PACKAGE / layer).rglob("*.py")):  # wings (subpackages) too
            imported = _imported_packages(path) | _imported_layers(path)
            assert not imported & {"jax", "flax", "optax"}, f"{path.relative_to(PACKAGE)} imports a JAX package"


@pytest.mark.heavy  # a subprocess, process group or JAX compile of seconds: CI's second leg runs it (default run under 6 minutes)
def test_core_package_imports_without_jax_or_training_frameworks():
    code = """
import sys
for name in ("jax", "jaxlib", "flax", "optax", "transformers", "accelerate", "peft", "lightning"):
    sys.modules[name] = None
import fp8train
assert fp8train.recipes.from_name("mxfp8").alignment == 32
assert not [m for m in ("jax", "flax") if sys.modules.get(m) is not None]
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.heavy  # a subprocess, process group or JAX compile of seconds: CI's second leg runs it (default run under 6 minutes)
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="the JAX frontend needs jax ('fp8train[jax]')")
def test_jax_frontend_runs_without_torch():
    code = f"""
import sys, types
sys.modules["torch"] = None
package = types.ModuleType("fp8train")
package.__path__ = [{str(PACKAGE)!r}]
sys.modules["fp8train"] = package
import jax.numpy as jnp
import fp8train.jax as fj
qa = fj.quantize(jnp.ones((32, 64)), "mx")
assert qa.data.shape == (32, 64)
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_no_private_names_imported_across_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.relative_to(PACKAGE)} imports private {private} from {node.module}"


def test_recipes_module_keeps_its_public_name():
    import fp8train.recipes as recipes
    from fp8train.recipes import DelayedScaling

    assert recipes is fp8train.recipes is fp8train.spec.recipes
    assert DelayedScaling is fp8train.DelayedScaling
