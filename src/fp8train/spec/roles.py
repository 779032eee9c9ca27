"""The operands of a Linear layer's training step and the three GEMMs that use them.

Notation (NUMERICS.md): ``y = x W^T + b`` with ``x[M,K]`` (leading dims flattened),
``W[N,K]``, ``dy[M,N]``. GEMMs are named by their output and written ``a @ b^T`` with
both operands "K-last" (their contraction dim last)::

    output      y  = x  @ W^T     a = x  (last-dim usage),  b = W  (last-dim usage)
    grad_input  dx = dy @ W       a = dy (last-dim usage),  b = W  (first-dim usage)
    grad_weight dW = dy^T @ x     a = dy (first-dim usage), b = x  (first-dim usage)

A tensor's *last-dim usage* has its scaling groups along its last dim (``axis=-1``); its
*first-dim usage* along its first dim (``axis=0``), transposed into the GEMM.
"""

from __future__ import annotations

import enum

__all__ = ["Role", "Gemm", "Usage", "LAST_DIM", "FIRST_DIM"]


class Role(enum.Enum):
    """A tensor quantized in a training step. ``index`` is its column in delayed scaling's
    ``fp8_scale`` and ``fp8_amax_history`` buffers."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"

    index: int  # column of this role in delayed-scaling state (0, 1, 2), set below

    # Members are compared by identity, so they hash by it: Enum's own __hash__ is a Python
    # call (hash of the name) on every lookup, several per quantization (issue 38).
    __hash__ = object.__hash__

    @property
    def is_forward(self) -> bool:
        """Quantized in the forward pass (input, weight) rather than the backward."""
        return self is not Role.GRAD_OUTPUT

    @classmethod
    def coerce(cls, role: "Role | str") -> "Role":
        """``role`` as a :class:`Role`, accepting its value (``"input"``, ...).

        Raises:
            ValueError: an unknown role name.
        """
        if isinstance(role, Role):
            return role
        try:
            return cls(role)
        except ValueError:
            valid = ", ".join(r.value for r in cls)
            raise ValueError(f"role={role!r} is not one of {valid}") from None


for _index, _role in enumerate(Role):
    _role.index = _index  # a plain attribute: read on every quantization of delayed scaling

LAST_DIM = -1
"""``axis`` of a last-dim usage: scaling groups along the tensor's last dim."""
FIRST_DIM = 0
"""``axis`` of a first-dim usage: scaling groups along the tensor's first (flattened) dim."""


class Gemm(enum.Enum):
    """The three GEMMs of a Linear layer, named by their output."""

    OUTPUT = "output"
    GRAD_INPUT = "grad_input"
    GRAD_WEIGHT = "grad_weight"

    __hash__ = object.__hash__  # as Role's

    @property
    def usages(self) -> tuple["Usage", "Usage"]:
        """``(a, b)`` operand slots of ``a @ b^T``."""
        a, b = (usage for usage in Usage if usage.gemm is self)
        return a, b


class Usage(enum.Enum):
    """One operand slot of one GEMM: which role enters it, and along which axis its
    scaling groups run (the GEMM contracts that axis). Members are in ``(a, b)`` order.

    Attributes:
        gemm: the GEMM this slot belongs to.
        role: the tensor in this slot.
        axis: :data:`LAST_DIM` or :data:`FIRST_DIM`.
    """

    OUTPUT_INPUT = (Gemm.OUTPUT, Role.INPUT, LAST_DIM)
    OUTPUT_WEIGHT = (Gemm.OUTPUT, Role.WEIGHT, LAST_DIM)
    GRAD_INPUT_GRAD_OUTPUT = (Gemm.GRAD_INPUT, Role.GRAD_OUTPUT, LAST_DIM)
    GRAD_INPUT_WEIGHT = (Gemm.GRAD_INPUT, Role.WEIGHT, FIRST_DIM)
    GRAD_WEIGHT_GRAD_OUTPUT = (Gemm.GRAD_WEIGHT, Role.GRAD_OUTPUT, FIRST_DIM)
    GRAD_WEIGHT_INPUT = (Gemm.GRAD_WEIGHT, Role.INPUT, FIRST_DIM)

    gemm: Gemm
    role: Role
    axis: int

    __hash__ = object.__hash__  # as Role's

    def __init__(self, gemm: Gemm, role: Role, axis: int) -> None:
        # Plain attributes (not properties over .value): read on every quantization.
        self.gemm, self.role, self.axis = gemm, role, axis
