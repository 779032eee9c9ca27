"""The model's output head, and the rule that keeps it in high precision: one rule for
:func:`~fp8train.convert_to_float8_training` (its ``keep_head``) and the trainer
(``high_precision_modules=auto``).

A 4-bit head ruins training: a transformers Llama converted with every Linear in MXFP4,
the head included, ended 150 steps 43.6% above bf16 in validation loss, where keeping the
head in bf16 closed the gap (docs/recipes.md). Peers keep it too (accelerate's float8
filter skips the first and last Linear; torchtitan's NVFP4 converter keeps the head and
the last blocks). So under a 4-bit recipe the head stays in high precision unless the
caller says ``keep_head=False``; under an FP8 recipe it converts unless ``keep_head=True``.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from ..spec.recipes import Recipe
from .converters import matmul_modules

__all__ = ["head_names", "heads_kept", "HEAD_KEPT_REASON", "NO_HEAD_NOTE"]

HEAD_KEPT_REASON = "the output head: kept in high precision under a 4-bit recipe (keep_head=False converts it)"
"""Why :func:`~fp8train.convert_to_float8_training` leaves the head in high precision by
default (its conversion report's reason)."""
NO_HEAD_NOTE = (
    "no output head found (no get_output_embeddings(), no module named lm_head) to keep in high precision; "
    "exclude it with module_filter_fn if the model has one"
)


def head_names(model: nn.Module, linear_subclasses: Sequence[type] = ()) -> list[str]:
    """The qualified names of ``model``'s head, the matmul module that makes its output
    logits: the module ``model.get_output_embeddings()`` returns (transformers' models),
    else the matmul modules named ``lm_head`` (the default GPT, most language models).
    ``[]`` where neither finds one."""
    modules = matmul_modules(model, linear_subclasses)
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    head = get_output_embeddings() if callable(get_output_embeddings) else None
    if isinstance(head, nn.Module):
        found = [name for name, module in modules if module is head]
        if found:
            return found
    return [name for name, _ in modules if name.rpartition(".")[2] == "lm_head"]


def heads_kept(
    model: nn.Module, recipe: Recipe, keep_head: bool | None, linear_subclasses: Sequence[type] = ()
) -> list[str]:
    """The head modules a conversion of ``model`` by ``recipe`` leaves in high precision:
    :func:`head_names` where ``keep_head`` is ``True``, or ``None`` under a recipe that
    keeps it (:attr:`~fp8train.spec.recipe_base.Recipe.keeps_head_in_high_precision`: the
    4-bit ones); else none."""
    keep = recipe.keeps_head_in_high_precision if keep_head is None else keep_head
    return head_names(model, linear_subclasses) if keep else []
