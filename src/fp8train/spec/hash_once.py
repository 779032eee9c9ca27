"""A frozen value's hash, computed once per object (issue 38: the layer's caches are keyed by
rules and plans, looked up on every call).

``__hash__ = hash_once`` in a frozen dataclass's body (the class's own, or ``dataclass``
replaces it) hashes the fields that take part in equality, as the generated hash does, and
keeps the result on the object. Pickling leaves it out (:func:`state_without_hash`, as
``__getstate__``): a string's hash differs between processes.

The same objects may keep what a lower layer derives from them once, under a key starting
with :data:`MEMO_PREFIX` in their ``__dict__`` (read with a subscript, no call: the CPU's
FP8 kernels keep their arguments of a rule so, issue 38); pickling leaves those out too.
"""

from __future__ import annotations

from dataclasses import fields

__all__ = ["hash_once", "state_without_hash", "MEMO_PREFIX"]

_KEY = "_hash_once"
MEMO_PREFIX = "_memo_"
"""The prefix of the ``__dict__`` keys under which an object keeps what is derived from it."""


def hash_once(self) -> int:
    """The hash of ``self``'s compared fields, computed at the first call."""
    try:
        return self.__dict__[_KEY]
    except KeyError:
        value = hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare))
        self.__dict__[_KEY] = value
        return value


def state_without_hash(self) -> dict:
    """``self``'s pickled state: its attributes, less the kept hash and memos."""
    return {key: value for key, value in self.__dict__.items() if key != _KEY and not key.startswith(MEMO_PREFIX)}
