"""Optimizers that keep their state in low precision: :class:`AdamW` (``fp8train.optim.AdamW``)."""

from .adamw import AdamW
from .precision import StatePrecision

__all__ = ["AdamW", "StatePrecision"]
