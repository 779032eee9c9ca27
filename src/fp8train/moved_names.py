"""``MovedNames``: public names that left a package's top level, still importable there for
one release with a warning that says where they went; ``MovedModules``: modules that moved
to another package, importable under their old dotted names for one release, with the same
kind of warning.

The warning is a ``FutureWarning``, not a ``DeprecationWarning``: Python's default filters
show a ``FutureWarning`` wherever it comes from, while they hide a ``DeprecationWarning``
unless the line that triggers it is in ``__main__``, so a user whose own module, notebook
helper or library imports the old name would never be told before it goes away.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MovedNames", "MovedModules"]


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


class MovedModules(importlib.abc.MetaPathFinder):
    """Modules importable under an old dotted name: ``{old name: new name}``.

    Installed at the end of ``sys.meta_path`` (:meth:`install`), it is asked only for a name
    no file answers, so it costs nothing to any other import. ``import old`` (``from old
    import x``) gives the very module at its new name, registered under both names, and
    warns once per name per process (a ``FutureWarning`` naming the new module and the
    release that drops the old name).

    Args:
        moves: ``{old module name: new module name}``.
        removed_in: The release in which the old names no longer import, e.g. ``"0.2.0"``.
    """

    def __init__(self, moves: dict[str, str], removed_in: str) -> None:
        self.moves = dict(moves)
        self.removed_in = removed_in

    def message(self, old: str) -> str:
        """What the warning for the module ``old`` says: where it went, the fix, and when it goes."""
        new = self.moves[old]
        package = old.split(".")[0]
        return (
            f"{old} moved to {new}: use `import {new}` (or the public names of `{package}`); "
            f"{old} goes away in {package} {self.removed_in}"
        )

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.moves:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(self, fullname))

    def install(self) -> None:
        """Put this finder last on ``sys.meta_path`` (once)."""
        if self not in sys.meta_path:
            sys.meta_path.append(self)


class _AliasLoader(importlib.abc.Loader):
    """Loads an old module name as the module at its new name (no second copy)."""

    def __init__(self, finder: MovedModules, old: str) -> None:
        self.finder = finder
        self.old = old

    def create_module(self, spec):
        module = importlib.import_module(self.finder.moves[self.old])
        # stacklevel 2: importlib's own frames are skipped, so this names the import's line.
        warnings.warn(self.finder.message(self.old), FutureWarning, stacklevel=2)
        return module

    def exec_module(self, module) -> None:
        """Nothing to run: the module ran at its new name."""

