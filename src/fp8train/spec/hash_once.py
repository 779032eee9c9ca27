"""A frozen value's hash, computed once per object (issue 38: the layer's caches are keyed by
rules and plans, looked up on every call).

``__hash__ = hash_once`` in a frozen dataclass's body (the class's own, or ``dataclass``
replaces it) hashes the fields that take part in equality, as the generated hash does, and
keeps the result on the object. Pickling leaves it out (:func:`state_without_hash`, as
``__getstate__``): a string's hash differs between processes.
"""

from __future__ import annotations

from dataclasses import fields

__all__ = ["hash_once", "state_without_hash"]

_KEY = "_hash_once"


def hash_once(self) -> int:
    """The hash of ``self``'s compared fields, computed at the first call."""
    try:
        return self.__dict__[_KEY]
    except KeyError:
        value = hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare))
        self.__dict__[_KEY] = value
        return value


def state_without_hash(self) -> dict:
    """``self``'s pickled state: its attributes, less the kept hash."""
    state = dict(self.__dict__)
    state.pop(_KEY, None)
    return state
