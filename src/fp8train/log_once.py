"""``OnceLogger``: a logger that says each distinct message once.

What the library tells a user once per process (which GEMM backend runs a recipe, why a
gather falls back to high precision) goes through one of these, one per module that says
such things, so that a message repeated every step is logged the first time only. It sits
in ``quant``, the lowest layer that logs this way (the GEMM dispatch, ``quant/gemm``);
``parallel`` uses it too.
"""

from __future__ import annotations

import logging

__all__ = ["OnceLogger"]


class OnceLogger:
    """Logs each distinct message once, at INFO, on the logger ``name``.

    The messages already said are this object's own: two ``OnceLogger`` instances (two
    modules) each say a message once.
    """

    def __init__(self, name: str) -> None:
        self.logger = logging.getLogger(name)
        self._said: set[str] = set()
        self._on_forget: list = []

    def info(self, message: str) -> None:
        """Log ``message`` unless this logger has said it before."""
        if message in self._said:
            return
        self._said.add(message)
        self.logger.info("%s", message)

    def forget(self) -> None:
        """Forget what was said, so that every message is logged once more (a test that
        checks the first time), and run the callbacks of :meth:`on_forget`."""
        self._said.clear()
        for callback in self._on_forget:
            callback()

    def on_forget(self, callback) -> None:
        """Run ``callback()`` at each :meth:`forget`: a cache of choices whose building said
        something (a layer's bound kernels log their GEMM backend once, when bound) empties,
        so that its next use builds, and says it, again."""
        self._on_forget.append(callback)
