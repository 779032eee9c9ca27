"""Lightning and Fabric: precision plugins that train a model in FP8 with fp8train.

``L.Trainer(plugins=[FP8Precision("mxfp8")])`` and
``L.Fabric(plugins=[FabricFP8Precision("mxfp8")])`` convert the model with
:func:`fp8train.convert_to_float8_training` and run its forward under ``torch.autocast``
(bfloat16 by default, on the device the model is on) and :func:`fp8train.autocast`, the
shape of Lightning's own ``TransformerEnginePrecision`` (see ``docs/lightning.md``).

Two classes because Lightning has two plugin interfaces: the Trainer calls
``backward(loss, lightning_module, optimizer)`` and ``optimizer_step(optimizer, model,
closure)``, Fabric ``backward(loss, module)`` and ``optimizer_step(optimizer)``. As in
Lightning's ``TransformerEnginePrecision``, the Trainer's class is the Fabric one with the
Trainer's hooks. ``FP8Precision`` handed to Fabric says to use ``FabricFP8Precision``;
the Trainer refuses a ``FabricFP8Precision`` itself (not one of its plugin types).

Checkpoints of the Trainer: Lightning loads a checkpoint's weights into the model *before*
the plugin converts it (``trainer.fit(ckpt_path=...)`` on a single device or DDP), so the
state that only a converted model has (delayed scaling's scales and histories) travels in
the checkpoint's own entry (:data:`CHECKPOINT_KEY`), out of its ``state_dict``, and goes
back into the model once it is converted. The checkpoint's ``state_dict`` is the plain
model's: ``LightningModule.load_from_checkpoint`` gives a high-precision model.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
from torch import nn

from ..nn.autocast import autocast as fp8_autocast
from ..nn.config import Float8ModuleConfig
from ..nn.convert import convert_to_float8_training
from ..nn.modules.base import Float8Module
from ..quant.gemm import bf16 as bf16_gemm
from ..quant.gemm.bf16 import bf16_matmuls_via_float32, bf16_via_float32
from ..spec.checks import ArgumentTypeError, check_callable
from ..spec.recipes import Recipe

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning_utilities.core.apply_func import apply_to_collection
except ImportError as error:  # pragma: no cover - lightning is an optional dependency
    raise ModuleNotFoundError(
        f"fp8train.lightning needs Lightning ({error}): pip install lightning"
    ) from error

__all__ = ["FP8Precision", "FabricFP8Precision", "CHECKPOINT_KEY"]

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "fp8train_state"
"""The entry of a Trainer checkpoint that holds the converted model's own state."""

AUTOCAST_DTYPES = (torch.bfloat16, None)
WEIGHTS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, None)


def _check_dtype(name: str, dtype: Any, choices: tuple, fix: str) -> torch.dtype | None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(f"{name}={dtype!r} must be a torch.dtype or None")
    if dtype not in choices:
        raise ValueError(f"{name}={dtype!r} is not supported: {fix}")
    return dtype


def _check_device_type(device_type: Any) -> str | None:
    if device_type is None:
        return None
    if not isinstance(device_type, str):
        raise ArgumentTypeError(f"device_type={device_type!r} must be a device type such as 'cuda' or 'cpu', or None")
    try:
        available = torch.amp.is_autocast_available(device_type)
    except RuntimeError:  # not a device type at all
        available = False
    if not available:
        raise ValueError(
            f"device_type={device_type!r} has no torch.autocast: use 'cuda', 'cpu' (or another type "
            "torch.autocast knows), or None to take the model's"
        )
    return device_type


def _convert_fp_tensors(data: Any, dtype: torch.dtype) -> Any:
    """``data`` with its floating-point tensors (in any collection) cast to ``dtype``."""
    return apply_to_collection(
        data, torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t
    )


class FabricFP8Precision(FabricPrecision):
    """Fabric's plugin for FP8 training with fp8train: ``L.Fabric(plugins=[FabricFP8Precision("mxfp8")])``.

    ``fabric.setup(model)`` converts ``model`` with :func:`fp8train.convert_to_float8_training`
    (a model that already holds FP8 modules is left as it is, after checking their recipe);
    every forward runs under ``torch.autocast(device_type, autocast_dtype)`` and
    :func:`fp8train.autocast`, so delayed scaling updates its forward scales once per forward.
    Inputs are left as they are (cast to ``weights_dtype`` where given), floating-point
    outputs are cast to the default dtype (float32), as Fabric's mixed precision does.

    Args:
        recipe: a :class:`~fp8train.spec.recipes.Recipe` or a recipe name (``"mxfp8"``,
            ``"delayed"``, ...).
        module_filter_fn: ``(module, fqn) -> bool``; ``False`` keeps the module in high
            precision (see :func:`fp8train.convert_to_float8_training`; ``fqn`` is relative to
            the module handed to Lightning).
        autocast_dtype: ``torch.bfloat16`` (default), or ``None`` to run the ops outside the
            FP8 GEMMs in the parameters' dtype.
        weights_dtype: cast the model's parameters and buffers to this dtype before converting
            (``torch.bfloat16``: bf16 weights and optimizer state, as ``"bf16-true"``), or
            ``None`` (default) to keep them (float32 master weights).
        device_type: the ``torch.autocast`` device type, or ``None`` (default) for the type of
            the device the converted model's parameters are on at each forward.
        backend: the FP8 GEMM backend (``"auto"``, ``"emulated"``, ``"hardware"``).
        save_fp8_activations: see :class:`~fp8train.nn.config.Float8ModuleConfig`.

    Raises:
        ValueError: an unknown recipe name or backend; ``autocast_dtype=torch.float16`` (it
            needs a gradient scaler) or another unsupported dtype; a ``device_type`` without
            ``torch.autocast``.
        TypeError: ``recipe`` neither a Recipe nor a name, ``module_filter_fn`` not callable,
            a dtype that is not a ``torch.dtype``, ``device_type`` not a string.
    """

    precision = "fp8-mixed"

    def __init__(
        self,
        recipe: Recipe | str,
        *,
        module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
        autocast_dtype: torch.dtype | None = torch.bfloat16,
        weights_dtype: torch.dtype | None = None,
        device_type: str | None = None,
        backend: str = "auto",
        save_fp8_activations: bool = True,
    ) -> None:
        self.config = Float8ModuleConfig(recipe=recipe, backend=backend, save_fp8_activations=save_fp8_activations)
        self.module_filter_fn = check_callable(
            "module_filter_fn", module_filter_fn, allow_none=True, signature="(module, fqn) -> bool"
        )
        self.autocast_dtype = _check_dtype(
            "autocast_dtype", autocast_dtype, AUTOCAST_DTYPES,
            "use torch.bfloat16, or None for no torch.autocast (float16 needs a gradient scaler, which "
            "this plugin does not run)",
        )
        self.weights_dtype = _check_dtype(
            "weights_dtype", weights_dtype, WEIGHTS_DTYPES, "use torch.float32, torch.bfloat16, torch.float16 or None"
        )
        self.device_type = _check_device_type(device_type)
        self._module: nn.Module | None = None  # the module this plugin converted last
        self._fp8_state_keys: frozenset[str] = frozenset()  # its state_dict keys conversion added

    @property
    def recipe(self) -> Recipe:
        """The recipe the plugin converts with."""
        return self.config.recipe

    def convert_module(self, module: nn.Module) -> nn.Module:
        """``module`` converted for FP8 training (in place), once: a module this plugin
        converted before (``trainer.fit`` then ``trainer.test``) is returned as it is.

        Raises:
            ValueError: ``module`` already holds FP8 modules of another recipe, or holds
                some and ``weights_dtype`` is set (cast it before converting it instead).
        """
        if module is self._module:
            return module
        converted = [(fqn, m) for fqn, m in module.named_modules() if isinstance(m, Float8Module)]
        if converted:
            self._check_converted(converted)
            logger.info("FP8Precision: the model already holds FP8 modules; it is not converted again")
            self._fp8_state_keys = frozenset()
        else:
            if self.weights_dtype is not None:
                module = module.to(dtype=self.weights_dtype)
            plain_keys = set(module.state_dict().keys())
            module = convert_to_float8_training(module, config=self.config, module_filter_fn=self.module_filter_fn)
            self._fp8_state_keys = frozenset(module.state_dict().keys() - plain_keys)
        self._module = module
        return module

    def _check_converted(self, converted: list[tuple[str, nn.Module]]) -> None:
        fqn = converted[0][0]
        if self.weights_dtype is not None:
            raise ValueError(
                f"weights_dtype={self.weights_dtype} but the model already holds FP8 modules ({fqn!r}): cast the "
                "model before converting it and leave weights_dtype out, or let the plugin convert it"
            )
        for fqn, fp8_module in converted:
            if fp8_module.recipe != self.recipe:
                raise ValueError(
                    f"module {fqn!r} was converted with recipe {fp8_module.recipe.name!r} but the plugin's recipe is "
                    f"{self.recipe.name!r}: give the plugin the recipe the model was converted with, or let the "
                    "plugin convert it"
                )

    def _autocast_device_type(self) -> str:
        if self.device_type is not None:
            return self.device_type
        parameter = next(self._module.parameters(), None) if self._module is not None else None
        if parameter is None:
            raise RuntimeError(
                "FP8Precision cannot tell the device type of the model (no converted model with parameters): "
                "pass device_type='cuda' or 'cpu'"
            )
        return parameter.device.type

    def forward_context(self) -> contextlib.AbstractContextManager:
        """``torch.autocast`` (where ``autocast_dtype`` is set) and ``fp8train.autocast()``;
        on a CPU without native bf16, where bf16 is in play (autocast or bf16 weights), the
        bf16 matmuls as float32 GEMMs of bf16 operands rounded once, as the trainer runs
        them (:mod:`fp8train.quant.gemm.bf16`: bf16's numerics without its slow fallback)."""
        stack = contextlib.ExitStack()
        if self.weights_dtype is not None:
            stack.enter_context(_default_dtype(self.weights_dtype))
        if self.autocast_dtype is not None or self.weights_dtype is not None:
            route = bf16_via_float32(self._autocast_device_type(), bf16_gemm.NATIVE_BF16_GEMM)
            stack.enter_context(bf16_matmuls_via_float32(route))
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(self._autocast_device_type(), dtype=self.autocast_dtype))
        stack.enter_context(fp8_autocast())
        return stack

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """New tensors in ``weights_dtype`` where it is set."""
        return _default_dtype(self.weights_dtype) if self.weights_dtype is not None else contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    def convert_input(self, data: Any) -> Any:
        return data if self.weights_dtype is None else _convert_fp_tensors(data, self.weights_dtype)

    def convert_output(self, data: Any) -> Any:
        return _convert_fp_tensors(data, torch.get_default_dtype())


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class FP8Precision(pl.plugins.precision.Precision, FabricFP8Precision):
    """The Trainer's plugin for FP8 training with fp8train:
    ``L.Trainer(plugins=[FP8Precision("mxfp8")])`` (for ``L.Fabric`` use
    :class:`FabricFP8Precision`, which takes the same arguments).

    Everything :class:`FabricFP8Precision` does, and: one ``fp8train.autocast()`` holds the
    whole optimizer step (``training_step``, backward and ``optimizer.step``), so delayed
    scaling updates once per step (with gradient accumulation, once per micro-batch's
    forward, as fp8train's own Trainer does); its checkpoints carry the converted model's
    own state under :data:`CHECKPOINT_KEY` and ``trainer.fit(ckpt_path=...)`` resumes
    exactly (see the module's docstring).

    Raises:
        as :class:`FabricFP8Precision`; also, at ``L.Fabric(...).setup``, ``TypeError``
        naming :class:`FabricFP8Precision`.
    """

    def convert_module(self, module: nn.Module) -> nn.Module:
        if not isinstance(module, pl.LightningModule):
            raise TypeError(
                f"FP8Precision is L.Trainer's plugin and got a {type(module).__name__}, not a LightningModule: "
                "with L.Fabric use fp8train.lightning.FabricFP8Precision"
            )
        return super().convert_module(module)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        with fp8_autocast():
            return super().optimizer_step(optimizer, model, closure, **kwargs)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Move the converted model's own state out of ``checkpoint["state_dict"]`` into
        ``checkpoint[CHECKPOINT_KEY]``."""
        state_dict = checkpoint.get("state_dict", {})
        fp8_state = {key: state_dict.pop(key) for key in sorted(self._fp8_state_keys) if key in state_dict}
        if fp8_state:
            checkpoint[CHECKPOINT_KEY] = fp8_state

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Load ``checkpoint[CHECKPOINT_KEY]`` into the converted model.

        Raises:
            ValueError: the checkpoint holds FP8 state this model has no place for (another recipe).
        """
        fp8_state = checkpoint.get(CHECKPOINT_KEY)
        if not fp8_state:
            if self._fp8_state_keys:
                logger.info("FP8Precision: the checkpoint holds no FP8 state; delayed scaling starts afresh")
            return
        unexpected = sorted(fp8_state.keys() - self._fp8_state_keys)
        if self._module is None or unexpected:
            raise ValueError(
                f"the checkpoint holds FP8 state this model does not have ({', '.join(unexpected[:3]) or 'no model'}"
                f"{', ...' if len(unexpected) > 3 else ''}): resume with the recipe it was trained with "
                f"(this plugin's is {self.recipe.name!r})"
            )
        self._module.load_state_dict(fp8_state, strict=False)
