"""One Markdown table: what every report of the package (``compare``, ``inspect``,
``selfcheck``, the benchmarks) renders its rows with."""

from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["markdown_table"]

_RULES = {"l": "---", "r": "---:", "c": ":---:"}
"""A column's cell in the rule under the header, by alignment: ``l`` is Markdown's default
(left), written as plain ``---``."""


def _cell(value: object) -> str:
    # A `|` in a cell would end it; a newline would end the row.
    return str(value).replace("|", "\\|").replace("\n", "<br>")


def markdown_table(headers: Sequence[object], rows: Iterable[Sequence[object]], align: str | None = None) -> str:
    """A Markdown (GitHub) table, one line per row, without a trailing newline::

        | recipe | SQNR |
        |---|---:|
        | tensorwise | 31.2 |

    Args:
        headers: the column names.
        rows: one sequence of cells per row, as many as ``headers``; each cell is written
            as ``str(cell)``, a ``|`` in it escaped as ``\\|`` and a newline as ``<br>``.
            No rows: the header and its rule only.
        align: one letter per column, ``l`` (left, Markdown's default, ``---``), ``r``
            (right, ``---:``) or ``c`` (centred, ``:---:``); default all ``l``.

    Raises:
        ValueError: no headers, an ``align`` of another length or with another letter,
            or a row with another number of cells than ``headers``.
    """
    if not headers:
        raise ValueError("markdown_table needs at least one header")
    align = "l" * len(headers) if align is None else align
    if len(align) != len(headers) or not set(align) <= set(_RULES):
        raise ValueError(
            f"align {align!r} must give one of l, r, c per column ({len(headers)} headers: {list(headers)})"
        )
    lines = [_row(headers), "|" + "|".join(_RULES[letter] for letter in align) + "|"]
    for index, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"row {index} has {len(row)} cells, the headers {len(headers)}: {list(row)}")
        lines.append(_row(row))
    return "\n".join(lines)


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(_cell(cell) for cell in cells) + " |"
