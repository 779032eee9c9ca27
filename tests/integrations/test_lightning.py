"""fp8train.lightning: the Trainer's and Fabric's FP8 precision plugins, against the real
Lightning. Each run is held bit for bit to the loop fp8train's docs prescribe (convert, then
``torch.autocast(bf16)`` and ``fp8train.autocast()`` around the forward), and resuming from a
checkpoint to the run that never stopped."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8train
from fp8train.nn.autocast import current_state
from tests.spec.test_torch_free import _imported_modules

L = pytest.importorskip("lightning")
from fp8train.lightning import CHECKPOINT_KEY, FabricFP8Precision, FP8Precision  # noqa: E402

NUM_BATCHES, BATCH_SIZE, DIM, HIDDEN = 2, 32, 32, 64
LEARNING_RATE = 1e-2


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH_SIZE, DIM, generator=generator), torch.randn(BATCH_SIZE, DIM, generator=generator))
        for _ in range(NUM_BATCHES)
    ]


def _loss(net: nn.Module, batch) -> torch.Tensor:
    inputs, targets = batch
    return F.mse_loss(net(inputs).float(), targets)


class TinyModule(L.LightningModule):
    """Two Linears; records each step's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = _loss(self.net, batch)
        self.losses.append(loss.detach())
        return loss

    def validation_step(self, batch, batch_idx):
        return _loss(self.net, batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LEARNING_RATE)


def _loader():
    return torch.utils.data.DataLoader(_batches(), batch_size=None)


def _trainer(plugin, max_epochs: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], max_epochs=max_epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )


def _reference(recipe: str, num_epochs: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The losses and final state of the loop fp8train documents, by hand."""
    net = fp8train.convert_to_float8_training(_net(), recipe)
    optimizer = torch.optim.AdamW(net.parameters(), lr=LEARNING_RATE)
    losses = []
    for _ in range(num_epochs):
        for batch in _batches():
            with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast():
                loss = _loss(net, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    return losses, net.state_dict()


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("recipe", ["mxfp8", pytest.param("delayed", marks=pytest.mark.slow)])
def test_trainer_runs_the_documented_fp8_loop_bit_for_bit(recipe):
    module = TinyModule()
    _trainer(FP8Precision(recipe), max_epochs=2).fit(module, _loader())
    assert all(isinstance(layer, fp8train.Float8Linear) for layer in (module.net[0], module.net[2]))
    expected_losses, expected_state = _reference(recipe, num_epochs=2)
    torch.testing.assert_close(torch.stack(module.losses), torch.stack(expected_losses), rtol=0, atol=0)
    _assert_same(module.net.state_dict(), expected_state)


@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param("mxfp8", marks=pytest.mark.slow),
        "delayed",
        # issue 22's case: the forward update pending at the save must not be lost
        pytest.param(
            fp8train.DelayedScaling(amax_history_len=16, amax_compute_algo="most_recent"),
            marks=pytest.mark.slow, id="delayed-most_recent",
        ),
    ],
)
def test_trainer_resumes_bit_identically(recipe, tmp_path):
    trainer = _trainer(FP8Precision(recipe), max_epochs=1)
    trainer.fit(TinyModule(), _loader())
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed = TinyModule()
    _trainer(FP8Precision(recipe), max_epochs=2).fit(resumed, _loader(), ckpt_path=tmp_path / "epoch1.ckpt")

    # The run that never stopped (the Trainer's own is held to it bit for bit above).
    expected_losses, expected_state = _reference(recipe, num_epochs=2)
    assert len(resumed.losses) == NUM_BATCHES
    torch.testing.assert_close(torch.stack(resumed.losses), torch.stack(expected_losses[NUM_BATCHES:]), rtol=0, atol=0)
    _assert_same(resumed.net.state_dict(), expected_state)


class StepObservingModule(TinyModule):
    """Records whether an ``fp8train.autocast`` is active after each backward and at each batch's end."""

    def __init__(self) -> None:
        super().__init__()
        self.inside_after_backward: list[bool] = []
        self.inside_at_batch_end: list[bool] = []

    def on_after_backward(self) -> None:
        self.inside_after_backward.append(current_state() is not None)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.inside_at_batch_end.append(current_state() is not None)


def test_one_fp8_autocast_holds_the_whole_step():
    module = StepObservingModule()
    _trainer(FP8Precision("delayed"), max_epochs=1).fit(module, _loader())
    assert module.inside_after_backward == [True] * NUM_BATCHES  # the backward is in the step's autocast
    assert module.inside_at_batch_end == [False] * NUM_BATCHES  # which has ended (and updated) by then


@pytest.mark.slow
def test_gradient_accumulation_updates_at_each_forward():
    module = TinyModule()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, plugins=[FP8Precision("delayed")], max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
    )
    trainer.fit(module, _loader())
    net = fp8train.convert_to_float8_training(_net(), "delayed")
    optimizer = torch.optim.AdamW(net.parameters(), lr=LEARNING_RATE)
    losses = []
    for _ in range(2):
        for batch in _batches():
            with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast():
                loss = _loss(net, batch)
            (loss / 2).backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(torch.stack(module.losses), torch.stack(losses), rtol=0, atol=0)
    _assert_same(module.net.state_dict(), net.state_dict())


class RankCheckingModule(TinyModule):
    """At the end of training, checks that every rank holds the same FP8 state and weights."""

    def on_train_end(self) -> None:
        for name, tensor in self.net.state_dict().items():
            gathered = self.all_gather(tensor)
            assert torch.equal(gathered[0], gathered[1]), f"{name} differs between the ranks"


@pytest.mark.slow
def test_ddp_ranks_keep_the_same_delayed_state():
    # Each rank trains on its own batch (Lightning's distributed sampler): the amaxes differ,
    # and only their reduction keeps the scales and histories the same.
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", plugins=[FP8Precision("delayed")], max_epochs=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(RankCheckingModule(), _loader())


def test_checkpoint_state_dict_is_the_plain_models(tmp_path):
    module = TinyModule()
    trainer = _trainer(FP8Precision("delayed"), max_epochs=1)
    trainer.fit(module, _loader())
    trainer.validate(module, _loader(), verbose=False)  # a second setup: not converted again
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    fp8_keys = {key for key in module.state_dict() if key.rpartition(".")[2] in ("fp8_scale", "fp8_amax_history")}
    assert fp8_keys and set(checkpoint[CHECKPOINT_KEY]) == fp8_keys
    assert not fp8_keys & set(checkpoint["state_dict"])
    plain = TinyModule.load_from_checkpoint(tmp_path / "last.ckpt")  # a high-precision model
    assert type(plain.net[0]) is nn.Linear
    torch.testing.assert_close(plain.net[0].weight, module.net[0].weight, rtol=0, atol=0)


def test_resuming_with_another_recipe_says_so(tmp_path):
    trainer = _trainer(FP8Precision("delayed"), max_epochs=1)
    trainer.fit(TinyModule(), _loader())
    trainer.save_checkpoint(tmp_path / "delayed.ckpt")
    with pytest.raises(ValueError, match="resume with the recipe it was trained with .*'mxfp8'"):
        _trainer(FP8Precision("mxfp8"), max_epochs=2).fit(TinyModule(), _loader(), ckpt_path=tmp_path / "delayed.ckpt")


def test_a_model_converted_before_keeps_its_conversion():
    module = TinyModule()
    fp8train.convert_to_float8_training(module.net, "mxfp8", module_filter_fn=lambda m, fqn: fqn != "2")
    plugin = FP8Precision("mxfp8")
    assert plugin.convert_module(module) is module
    assert type(module.net[2]) is nn.Linear  # not converted again
    assert plugin.convert_module(module) is module  # a second setup (fit, then test) neither


def test_module_filter_fn_and_weights_dtype():
    module = TinyModule()
    plugin = FP8Precision("delayed", module_filter_fn=lambda m, fqn: fqn != "net.2", weights_dtype=torch.bfloat16)
    _trainer(plugin, max_epochs=1).fit(module, _loader())
    assert isinstance(module.net[0], fp8train.Float8Linear) and type(module.net[2]) is nn.Linear
    assert module.net[0].weight.dtype == torch.bfloat16
    assert module.net[0].fp8_scale.dtype == torch.float32  # delayed scaling's state stays float32
    assert torch.isfinite(torch.stack(module.losses)).all()


def _fabric_losses(fabric: L.Fabric, net: nn.Module, optimizer, num_epochs: int) -> list[torch.Tensor]:
    losses = []
    for _ in range(num_epochs):
        for batch in _batches():
            loss = _loss(net, batch)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("recipe", [pytest.param("mxfp8", marks=pytest.mark.slow), "delayed"])
def test_fabric_runs_the_documented_fp8_loop_and_resumes(recipe, tmp_path):
    def setup():
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricFP8Precision(recipe)])
        net = _net()
        net, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=LEARNING_RATE))
        return fabric, net, optimizer

    expected_losses, expected_state = _reference(recipe, num_epochs=2)
    fabric, net, optimizer = setup()
    losses = _fabric_losses(fabric, net, optimizer, num_epochs=1)
    fabric.save(tmp_path / "fabric.ckpt", {"model": net, "optimizer": optimizer})
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected_losses[:NUM_BATCHES]), rtol=0, atol=0)

    fabric, resumed, optimizer = setup()
    fabric.load(tmp_path / "fabric.ckpt", {"model": resumed, "optimizer": optimizer})
    resumed_losses = _fabric_losses(fabric, resumed, optimizer, num_epochs=1)
    torch.testing.assert_close(torch.stack(resumed_losses), torch.stack(expected_losses[NUM_BATCHES:]), rtol=0, atol=0)
    _assert_same(resumed.module.state_dict(), expected_state)

@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(recipe="fp9"), ValueError, "fp9"),
        (dict(recipe=3), TypeError, "recipe=3 must be a Recipe or a recipe name"),
        (dict(autocast_dtype=torch.float16), ValueError, "float16 needs a gradient scaler"),
        (dict(autocast_dtype="bf16"), TypeError, "autocast_dtype='bf16' must be a torch.dtype or None"),
        (dict(weights_dtype=torch.int8), ValueError, "weights_dtype=torch.int8 is not supported"),
        (dict(device_type="gpu"), ValueError, "device_type='gpu' has no torch.autocast: use 'cuda', 'cpu'"),
        (dict(device_type=0), TypeError, "device_type=0 must be a device type"),
        (dict(module_filter_fn="net.2"), TypeError, "module_filter_fn"),
        (dict(backend="fast"), ValueError, "backend"),
    ],
)
@pytest.mark.parametrize("plugin_class", [FP8Precision, FabricFP8Precision])
def test_bad_arguments_are_named(plugin_class, kwargs, error, match):
    kwargs = {"recipe": "mxfp8", **kwargs}
    with pytest.raises(error, match=match):
        plugin_class(kwargs.pop("recipe"), **kwargs)


def test_trainer_plugin_refuses_fabric():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FP8Precision("mxfp8")])
    with pytest.raises(TypeError, match="with L.Fabric use fp8train.lightning.FabricFP8Precision"):
        fabric.setup(_net())


def test_trainer_refuses_the_fabric_plugin():
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    expected = "invalid type for plugin <fp8train.integrations.lightning.FabricFP8Precision"
    with pytest.raises(MisconfigurationException, match=expected):
        _trainer(FabricFP8Precision("mxfp8"), max_epochs=1)


def test_a_model_converted_with_another_recipe_is_refused():
    module = TinyModule()
    fp8train.convert_to_float8_training(module.net, "delayed")
    expected = "'net.0' was converted with recipe 'delayed' but the plugin's recipe is 'mxfp8'"
    with pytest.raises(ValueError, match=expected):
        FP8Precision("mxfp8").convert_module(module)
    with pytest.raises(ValueError, match="weights_dtype=torch.bfloat16 but the model already holds FP8 modules"):
        FP8Precision("delayed", weights_dtype=torch.bfloat16).convert_module(module)


def test_device_type_without_a_model_is_asked_for():
    plugin = FabricFP8Precision("mxfp8")
    with pytest.raises(RuntimeError, match="pass device_type='cuda' or 'cpu'"):
        plugin.forward_context().__enter__()
    with FabricFP8Precision("mxfp8", device_type="cpu").forward_context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert current_state() is not None
    with FabricFP8Precision("mxfp8", device_type="cpu", autocast_dtype=None).forward_context():
        assert not torch.is_autocast_enabled("cpu") and current_state() is not None


@pytest.mark.parametrize("native", [True, False])
def test_bf16_matmuls_take_the_float32_route_on_a_cpu_without_native_bf16(native, monkeypatch):
    from fp8train.quant.gemm import bf16 as bf16_gemm

    monkeypatch.setattr(bf16_gemm, "NATIVE_BF16_GEMM", native)
    with FabricFP8Precision("mxfp8", device_type="cpu").forward_context():
        assert bf16_gemm.matmul_via_float32_active() is not native
    with FabricFP8Precision("mxfp8", device_type="cpu", autocast_dtype=None).forward_context():
        assert not bf16_gemm.matmul_via_float32_active()  # all float32: nothing to route


DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "lightning.md"


def _doc_examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_docs_have_a_trainer_and_a_fabric_example():
    examples = _doc_examples()
    assert [("FP8Precision(" in e, "FabricFP8Precision(" in e) for e in examples] == [(True, False), (True, True)]


@pytest.mark.parametrize("index", range(len(_doc_examples())))
def test_docs_example_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples write their checkpoints here
    exec(compile(_doc_examples()[index], f"<docs/lightning.md example {index}>", "exec"), {"__name__": "__main__"})


def test_only_fp8train_lightning_imports_lightning():
    # So ``import fp8train`` does not: no other module imports Lightning or the plugins' module.
    package = pathlib.Path(fp8train.__file__).parent
    own = {package / "lightning.py", package / "integrations" / "lightning.py"}
    importers = []
    for path in sorted(package.rglob("*.py")):
        parts = ["fp8train", *path.relative_to(package).parts[:-1]]
        modules = _imported_modules(path.read_text(), parts)
        if path not in own and any(
            m.split(".")[0] == "lightning" or m.startswith(("fp8train.lightning", "fp8train.integrations.lightning"))
            for m in modules
        ):
            importers.append(str(path.relative_to(package)))
    assert importers == []


@pytest.mark.slow
def test_import_fp8train_does_not_import_lightning():
    code = "import sys, fp8train; print(sorted(m for m in sys.modules if m.split('.')[0] == 'lightning'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
