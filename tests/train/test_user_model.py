"""``--model module:function``: the model-factory contract of ``model_setup`` (both return
forms, when the factory is called, seeded initialization), ``fp8train train`` and
``compare --seeds`` on a user's model, and the error for every bad factory."""

import importlib
import json
import logging
import sys
import textwrap
import uuid

import pytest
import torch

from fp8train.train.arguments import TrainingArguments
from fp8train.train.commands.cli import main
from fp8train.train.data import TokenWindows
from fp8train.train.model import GPT
from fp8train.train.user_model import FACTORY_KEYS, model_setup

from .commands.test_cli import _assert_one_line_error, _run

DATA_BYTES = 8_000
SEQ_LEN = 32

# A byte-level model in the bare-module form: forward(inputs, targets) returns the loss.
# BUILT records each new model's first weight, to see which runs share an initialization.
BYTE_MODEL = """
    import torch.nn.functional as F
    from torch import nn

    BUILT = []


    class ByteModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(256, 128)
            self.hidden = nn.Linear(128, 128)
            self.head = nn.Linear(128, 256)

        def forward(self, inputs, targets):
            logits = self.head(F.gelu(self.hidden(self.embed(inputs))))
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


    def build():
        model = ByteModel()
        BUILT.append(model.hidden.weight.detach().clone())
        return model
"""

# The dict form: a classifier with its own loss and random data (drawn when called).
CLASSIFIER = """
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import TensorDataset

    CALLS = []


    def cross_entropy(model, inputs, targets):
        return F.cross_entropy(model(inputs), targets)


    def build():
        CALLS.append(1)
        inputs = torch.randn(320, 128)
        labels = (inputs @ torch.randn(128, 16)).argmax(dim=1)
        return {
            "model": nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 16)),
            "loss_fn": cross_entropy,
            "train_dataset": TensorDataset(inputs[:256], labels[:256]),
            "eval_dataset": TensorDataset(inputs[256:], labels[256:]),
        }
"""


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    """``factory_module(source)``: the name of a new module holding ``source``, written to
    ``tmp_path``, which becomes the current directory (as for a user's ``models.py``)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # model_setup puts the cwd first: undone after
    names = []

    def make(source: str) -> str:
        name = f"user_models_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        names.append(name)
        return name

    yield make
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def data_file(corpus_file):
    return str(corpus_file(DATA_BYTES))


def _args(**overrides) -> TrainingArguments:
    return TrainingArguments(**{"seq_len": SEQ_LEN, "device": "cpu", **overrides})


# ---------------------------------------------------------------------------- the contract


def test_default_setup_is_the_embedded_gpt_on_text(data_file):
    setup = model_setup(_args(data=data_file, n_layer=1, n_head=2))
    model = setup.model_factory()
    assert isinstance(model, GPT) and setup.model_factory() is not model
    assert isinstance(setup.train_dataset, TokenWindows) and isinstance(setup.eval_dataset, TokenWindows)
    inputs, targets = setup.train_dataset[0]
    assert inputs.shape == (SEQ_LEN,) and inputs.dtype == torch.int64
    assert setup.loss_fn(model, inputs[None], targets[None]).dim() == 0
    assert setup.description == "default GPT n_layer=1 n_head=2 n_embd=128 on corpus.txt, 32-byte sequences"


def test_bare_module_factory_trains_on_the_text_data(factory_module, data_file, tmp_path):
    name = factory_module(BYTE_MODEL)
    setup = model_setup(_args(model=f"{name}:build", data=data_file))
    built = sys.modules[name].BUILT
    assert len(built) == 1  # called once up front, to check what it returns
    assert str(tmp_path) in sys.path  # the current directory, first, as uvicorn does
    first, second = setup.model_factory(), setup.model_factory()
    assert first is not second and len(built) == 3  # and once per run
    assert isinstance(setup.train_dataset, TokenWindows)
    inputs, targets = (torch.stack(pair) for pair in zip(setup.train_dataset[0], setup.train_dataset[1]))
    assert setup.loss_fn(first, inputs, targets).dim() == 0
    assert setup.description == f"{name}:build on corpus.txt, 32-byte sequences"


def test_dict_factory_brings_its_loss_and_datasets(factory_module):
    name = factory_module(CLASSIFIER)
    setup = model_setup(_args(model=f"{name}:build"))
    assert len(setup.train_dataset) == 256 and len(setup.eval_dataset) == 64
    model = setup.model_factory()
    inputs, labels = setup.train_dataset[:8]
    assert setup.loss_fn(model, inputs, labels).dim() == 0
    assert setup.description == f"{name}:build with its own loss_fn on its own datasets (256 train, 64 eval examples)"
    # The up-front call runs seeded with args.seed: its random data is reproducible.
    again, other_seed = model_setup(_args(model=f"{name}:build")), model_setup(_args(model=f"{name}:build", seed=1))
    assert torch.equal(again.train_dataset.tensors[0], setup.train_dataset.tensors[0])
    assert not torch.equal(other_seed.train_dataset.tensors[0], setup.train_dataset.tensors[0])


def test_train_dataset_alone_means_no_validation(factory_module):
    name = factory_module("""
        import torch
        from torch import nn
        from torch.utils.data import TensorDataset

        def build():
            return {"model": nn.Linear(4, 4), "loss_fn": lambda model, inputs, targets: model(inputs).sum(),
                    "train_dataset": TensorDataset(torch.zeros(8, 4), torch.zeros(8, 4))}
    """)
    setup = model_setup(_args(model=f"{name}:build"))
    assert setup.eval_dataset is None and "(8 train, no eval examples)" in setup.description


def test_a_user_model_skips_the_default_models_width_check():
    with pytest.raises(ValueError, match="n_embd=96"):
        TrainingArguments(n_embd=96, n_head=2, fp8_recipe="blockwise")
    assert TrainingArguments(n_embd=96, n_head=2, fp8_recipe="blockwise", model="models:build").model == "models:build"


# ---------------------------------------------------------------------------- the command line


def test_fp8train_train_with_a_dict_factory(factory_module, capsys, caplog, tmp_path):
    name = factory_module(CLASSIFIER)
    argv = ["train", "--model", f"{name}:build", "--fp8_recipe", "rowwise", "--steps", "3", "--batch_size", "16",
            "--eval_batches", "1", "--device", "cpu", "--save_checkpoints", "false",
            "--output_dir", str(tmp_path / "run")]
    with caplog.at_level(logging.INFO):
        code, out, err = _run(argv, capsys)
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and "val_loss" in records[-1]
    assert "FP8 training (rowwise): converted 2/2 matmul modules, 100.0% of matmul parameters in FP8" in caplog.text
    assert "final train loss" in out


def test_compare_seeds_with_a_user_model_starts_each_seed_from_its_own_init(factory_module, data_file, tmp_path):
    name = factory_module(BYTE_MODEL)
    output_dir = tmp_path / "compare"
    argv = ["compare", "--seeds", "2", "--recipes", "bf16,tensorwise", "--model", f"{name}:build", "--data", data_file,
            "--seq_len", str(SEQ_LEN), "--batch_size", "4", "--steps", "2", "--eval_batches", "1", "--device", "cpu",
            "--output_dir", str(output_dir)]
    assert main(argv) == 0
    # One call up front, then runs in order: seed 0 bf16, seed 0 tensorwise, seed 1 bf16, seed 1 tensorwise.
    _, bf16_0, tensorwise_0, bf16_1, tensorwise_1 = sys.modules[name].BUILT
    assert torch.equal(bf16_0, tensorwise_0) and torch.equal(bf16_1, tensorwise_1)
    assert not torch.equal(bf16_0, bf16_1)
    results = json.loads((output_dir / "results.json").read_text())
    assert results["model"].startswith(f"{name}:build on corpus.txt")
    assert results["aggregates"]["tensorwise"]["converted_layers"] == 2
    assert f"model: {name}:build" in (output_dir / "report.md").read_text()


def test_a_missing_module_is_a_one_line_error(capsys, tmp_path):
    code, _, err = _run(["train", "--model", "no_such_module_xyz:build", "--output_dir", str(tmp_path)], capsys)
    _assert_one_line_error(code, err, "train", "no module named 'no_such_module_xyz'", "current directory")


def test_a_failing_factory_is_a_one_line_error(factory_module, capsys, tmp_path):
    name = factory_module("def build():\n    return 1 / 0\n")
    code, _, err = _run(["compare", "--model", f"{name}:build", "--recipes", "bf16", "--output_dir",
                         str(tmp_path / "out")], capsys)
    _assert_one_line_error(code, err, "compare", "calling build() raised ZeroDivisionError", f"{name}.py:2")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("spec, fragment", [
    ("models", "must be module:function"),
    ("models:", "must be module:function"),
    (":build", "must be module:function"),
    ("models:build:now", "must be module:function"),
    ("my-models:build", "must be module:function"),
    ("models.py:build", "names a file"),
    ("src/models:build", "names a file"),
])
def test_the_spec_must_be_module_colon_function(spec, fragment):
    with pytest.raises(ValueError, match=f"model='{spec}' {fragment}"):
        TrainingArguments(model=spec)


MODULE = "import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\n"


@pytest.mark.parametrize("source, attribute, error, fragment", [
    ("import no_such_dependency_xyz\n", "build", ValueError,
     r"importing '{name}' failed: ModuleNotFoundError: No module named 'no_such_dependency_xyz' \(at {name}.py:1\)"),
    ("x = 1\nraise RuntimeError('boom')\n", "build", ValueError,
     r"importing '{name}' failed: RuntimeError: boom \(at {name}.py:2\)"),
    ("def build(:\n    pass\n", "build", ValueError, r"importing '{name}' failed: SyntaxError"),
    ("def build(): pass\ndef helper(): pass\n", "biuld", ValueError,
     r"has no attribute 'biuld'; its functions: build, helper"),
    ("build = 3\n", "build", TypeError, "names an object of type int, not a function"),
    (MODULE + "build = nn.Linear(2, 2)\n", "build", TypeError, "is a Linear instance; name a function that builds"),
    ("def build(width):\n    pass\n", "build", TypeError,
     r"build\(\) must take no arguments \(missing a required argument: 'width'\)"),
    ("def build():\n    return []\n", "build", TypeError, "returned a list; return an nn.Module, or a dict"),
    (MODULE + "def build():\n    return {'model': nn.Linear(2, 2), 'optimizer': 1}\n", "build", ValueError,
     "unknown key\\(s\\) 'optimizer'; the keys are " + ", ".join(FACTORY_KEYS)),
    (MODULE + "def build():\n    return {'loss_fn': print}\n", "build", ValueError, "returned a dict without 'model'"),
    (MODULE + "def build():\n    return {'model': 'gpt'}\n", "build", TypeError,
     "'model': a str; it must be an nn.Module"),
    (MODULE + "def build():\n    return {'model': nn.Linear(2, 2), 'loss_fn': 'ce'}\n", "build", TypeError,
     "'loss_fn': a str; it must be a callable"),
    (MODULE + "def build():\n    return {'model': nn.Linear(2, 2), 'train_dataset': iter([])}\n", "build", TypeError,
     "'train_dataset': a list_iterator; it must be a map-style dataset"),
    (MODULE + "def build():\n    return {'model': nn.Linear(2, 2), 'train_dataset': TensorDataset(torch.zeros(0))}\n",
     "build", ValueError, "returned an empty 'train_dataset'"),
    (MODULE + "def build():\n    return {'model': nn.Linear(2, 2), 'eval_dataset': TensorDataset(torch.zeros(2))}\n",
     "build", ValueError, "returned eval_dataset without train_dataset"),
    (MODULE + "def build():\n    return nn.Sequential(nn.Linear(2, 2))\n", "build", TypeError,
     r"Sequential.forward cannot take \(inputs, targets\)"),
])
def test_bad_factories_are_named_with_the_fix(source, attribute, error, fragment, factory_module):
    name = factory_module(source)
    with pytest.raises(error, match=f"model='{name}:{attribute}'.*" + fragment.format(name=name)):
        model_setup(_args(model=f"{name}:{attribute}"))


def test_a_loss_that_is_not_a_scalar_is_named(factory_module):
    name = factory_module(MODULE + """
        class Logits(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(256, 8)

            def forward(self, inputs, targets=None):
                return self.embed(inputs)


        def bare():
            return Logits()


        def with_loss():
            return {"model": Logits(), "loss_fn": lambda model, inputs, targets: model(inputs)}
    """.replace("\n        ", "\n"))
    inputs = torch.zeros(2, 4, dtype=torch.long)
    bare = model_setup(_args(model=f"{name}:bare"))
    with pytest.raises(TypeError, match=r"the model returned a tensor of shape \(2, 4, 8\), not the scalar loss; "
                                        r"without a loss_fn, forward\(inputs, targets\) must return the loss"):
        bare.loss_fn(bare.model_factory(), inputs, inputs)
    with_loss = model_setup(_args(model=f"{name}:with_loss"))
    with pytest.raises(TypeError, match=r"loss_fn returned a tensor of shape \(2, 4, 8\), not the scalar loss$"):
        with_loss.loss_fn(with_loss.model_factory(), inputs, inputs)
