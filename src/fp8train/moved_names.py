"""``MovedNames``: public names that left a package's top level, still importable there for
one release with a warning that says where they went.

The warning is a ``FutureWarning``, not a ``DeprecationWarning``: Python's default filters
show a ``FutureWarning`` wherever it comes from, while they hide a ``DeprecationWarning``
unless the line that triggers it is in ``__main__``, so a user whose own module, notebook
helper or library imports the old name would never be told before it goes away.
"""

from __future__ import annotations

import importlib
import warnings

__all__ = ["MovedNames"]


class MovedNames:
    """Names of the package ``old_module`` that now live in ``new_module``.

    Each old name resolves to the very object at its new place; the first time per name
    per process it warns (a ``FutureWarning`` naming the new place and the release that
    drops the old name). The names already warned about are this object's own.

    Args:
        old_module: The package the names left, e.g. ``"fp8train"``.
        new_module: The module that holds them now, e.g. ``"fp8train.quant"``.
        names: The moved names.
        removed_in: The release whose ``old_module`` no longer has them, e.g. ``"0.2.0"``.
    """

    def __init__(self, old_module: str, new_module: str, names: tuple[str, ...], removed_in: str) -> None:
        self.old_module = old_module
        self.new_module = new_module
        self.names = frozenset(names)
        self.removed_in = removed_in
        self._warned: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def message(self, name: str) -> str:
        """What the warning for ``name`` says: where it went, the fix, and when it goes."""
        package = self.old_module.split(".")[0]
        return (
            f"{self.old_module}.{name} moved to {self.new_module}.{name}: "
            f"use `from {self.new_module} import {name}`; "
            f"{self.old_module}.{name} goes away in {package} {self.removed_in}"
        )

    def resolve(self, name: str) -> object:
        """The object ``name`` refers to now, warning the first time (call it from the old
        package's module ``__getattr__``, so that the warning points at the caller's line)."""
        value = getattr(importlib.import_module(self.new_module), name)
        if name not in self._warned:
            # stacklevel 3: past this method and the package's __getattr__, to the line
            # that named the old place (import machinery frames are skipped).
            warnings.warn(self.message(name), FutureWarning, stacklevel=3)
            # Recorded only once the warning returns: where warnings are errors, every
            # use of the old name fails, not only the first.
            self._warned.add(name)
        return value

    def forget(self) -> None:
        """Forget which names were warned about, so that each warns once more (a test that
        checks the first time)."""
        self._warned.clear()
