"""Which matmul modules the trainer keeps in high precision (``high_precision_modules``), and
why: the patterns a user names, the 4-bit recipes' default (the model's head), and the
modules a recipe cannot convert (their dims).

The choice reaches :func:`~fp8train.convert_to_float8_training` as its ``module_filter_fn``;
the reasons go into the line the trainer logs after converting (:func:`summary`).

Matching rule: patterns are comma-separated ``fnmatch`` globs (``*`` any run of characters,
dots included; ``?`` one character; ``[seq]``), case-sensitive. A pattern names a matmul
module when it matches, as a whole, the module's qualified name or any run of consecutive
dot-separated parts of it: ``lm_head`` names ``lm_head`` and ``model.lm_head``,
``layers.11`` every module inside ``model.layers.11`` (a block), ``layers.1*`` those of
layers 1 and 10-19, ``attn`` every module inside an ``attn``; ``fc`` names ``blocks.0.fc``
but not ``blocks.0.fc_proj``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from ..nn.convert import matmul_modules
from ..nn.head import head_names, heads_kept
from ..nn.report import CONVERTED, EXCLUDED, HEAD, ConversionReport
from ..spec.recipes import Recipe

__all__ = [
    "AUTO", "NONE", "HighPrecisionModules", "parse_patterns", "select_high_precision", "head_names", "summary",
    "describe_setting", "check_patterns",
]

AUTO = "auto"
"""The default: the model's head under a 4-bit recipe, nothing under an FP8 recipe. Also a
pattern list's item (``auto,layers.11``: the default and that block)."""
NONE = "none"
"""Keep nothing in high precision on purpose (``""`` says the same): every module that can
convert converts, the 4-bit recipes' head included."""
HEAD_REASON = f"the head: a 4-bit recipe's default, high_precision_modules={AUTO!r}"
_NAMES_LISTED = 8


def parse_patterns(text: str) -> tuple[str, ...]:
    """``high_precision_modules``' text as its items: ``()`` for ``none`` (or ``""``), else
    the comma-separated patterns, ``auto`` among them where given.

    Raises:
        ValueError: an empty item between commas, or ``none`` beside other items.
    """
    if text.strip().lower() in ("", NONE):
        return ()
    items = tuple(item.strip() for item in text.split(","))
    if "" in items:
        raise ValueError(
            f"high_precision_modules={text!r} has an empty pattern between commas; give comma-separated module "
            f"name patterns (e.g. 'lm_head,layers.11.*'), {AUTO!r}, or {NONE!r}"
        )
    if any(item.lower() == NONE for item in items):
        raise ValueError(
            f"high_precision_modules={text!r} names {NONE!r} beside patterns; {NONE!r} alone keeps no module in high "
            "precision, patterns name the ones to keep"
        )
    return tuple(AUTO if item.lower() == AUTO else item for item in items)


def _name_runs(fqn: str) -> set[str]:
    """Every run of consecutive dot-separated parts of ``fqn`` (the name itself included)."""
    parts = fqn.split(".")
    return {".".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)}


def _matches(pattern: str, fqn: str) -> bool:
    return any(fnmatch.fnmatchcase(run, pattern) for run in _name_runs(fqn))


@dataclass(frozen=True)
class HighPrecisionModules:
    """The matmul modules a conversion leaves in high precision on purpose.

    Attributes:
        reasons: ``{qualified name: why}`` of each, in the model's module order.
        note: a remark for the summary (the 4-bit default found no head), or ``""``.
        keeps_head: whether ``auto`` is among the patterns: the conversion's ``keep_head``
            is then its default (the head stays under a 4-bit recipe), else ``False``
            (the patterns decide).
    """

    reasons: dict[str, str]
    note: str = ""
    keeps_head: bool = True

    def converts(self, module: nn.Module, fqn: str) -> bool:
        """``convert_to_float8_training``'s ``module_filter_fn``: ``False`` keeps ``fqn``."""
        return fqn not in self.reasons

    @property
    def keep_head(self) -> bool | None:
        """``convert_to_float8_training``'s ``keep_head`` for this choice."""
        return None if self.keeps_head else False


def select_high_precision(model: nn.Module, text: str, recipe: Recipe) -> HighPrecisionModules:
    """The modules of ``model`` that ``high_precision_modules=text`` keeps in high precision
    under ``recipe``, each with its reason (see the module docstring for the matching rule).

    Raises:
        ValueError: a pattern that names none of the model's matmul modules (the message
            lists some of their names), or a malformed ``text`` (:func:`parse_patterns`).
    """
    patterns = parse_patterns(text)
    names = [name for name, _ in matmul_modules(model)]
    reasons: dict[str, str] = {}
    note = ""
    if AUTO in patterns and recipe.keeps_head_in_high_precision:
        heads = heads_kept(model, recipe, keep_head=None)  # the library's own rule (fp8train.nn.head)
        reasons.update((name, HEAD_REASON) for name in heads)
        if not heads:
            note = (
                f"{recipe.name}: no head found (no get_output_embeddings(), no module named lm_head) to keep in high "
                "precision; name it with high_precision_modules if the model has one"
            )
    for pattern in patterns:
        if pattern == AUTO:
            continue
        matched = [name for name in names if _matches(pattern, name)]
        if not matched:
            listed = ", ".join(names[:_NAMES_LISTED])
            listed += f", ... ({len(names)} in all)" if len(names) > _NAMES_LISTED else ""
            raise ValueError(
                f"high_precision_modules pattern {pattern!r} names none of the model's matmul modules "
                f"({listed or 'it has none'}); a pattern is an fnmatch glob matched against a qualified module name "
                "or a run of its dot-separated parts (e.g. 'lm_head', 'layers.11', 'blocks.*.fc')"
            )
        for name in matched:
            reasons.setdefault(name, f"pattern {pattern!r}")
    kept = {name: reasons[name] for name in names if name in reasons}
    return HighPrecisionModules(kept, note, keeps_head=AUTO in patterns)


def summary(report: ConversionReport, chosen: HighPrecisionModules) -> str:
    """The trainer's conversion line: how many matmul modules run the recipe, and every one
    that stays in high precision with why (a pattern, the 4-bit head, or what stops it
    converting), e.g. ``nvfp4: 4/5 matmul modules converted; in high precision: lm_head
    (the head: a 4-bit recipe's default, high_precision_modules='auto'), blocks.0.fc
    (pattern 'blocks.*.fc')``."""
    kept = []
    for module in report.modules:
        if module.status == CONVERTED:
            continue
        reason = chosen.reasons.get(module.fqn) if module.status in (EXCLUDED, HEAD) else module.reason
        kept.append(f"{module.name} ({reason or module.reason})")
    line = f"{report.recipe}: {report.num_converted}/{report.num_matmul_modules} matmul modules converted"
    line += f"; in high precision: {', '.join(kept)}" if kept else "; none in high precision"
    return line + (f"; {chosen.note}" if chosen.note else "")


def describe_setting(text: str) -> str:
    """``high_precision_modules=text`` in words, for a report."""
    patterns = parse_patterns(text)
    if not patterns:
        return "none (every module that converts runs the recipe, the 4-bit recipes' head included)"
    named = [pattern for pattern in patterns if pattern != AUTO]
    parts = ["the model's head under a 4-bit recipe (auto)"] if AUTO in patterns else []
    parts += [f"modules matching {', '.join(repr(p) for p in named)}"] if named else []
    return " and ".join(parts)


def check_patterns(model: nn.Module, text: str, recipes: list[Recipe]) -> None:
    """Raise as :func:`select_high_precision` would for ``model`` under any of ``recipes``,
    before a run that trains several (``compare``) starts the first.

    Raises:
        ValueError: a pattern names none of ``model``'s matmul modules.
    """
    for recipe in recipes:
        select_high_precision(model, text, recipe)
