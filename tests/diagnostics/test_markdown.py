"""``markdown_table``, the one table every report renders with: cells, escaping, alignment,
no rows, and the errors for a table that does not fit together."""

import pytest

from fp8train.diagnostics.markdown import markdown_table


def test_a_table_is_a_header_a_rule_and_a_line_per_row():
    table = markdown_table(("recipe", "SQNR"), [("tensorwise", 31.2), ("mxfp8", "n/a")])
    assert table == "| recipe | SQNR |\n|---|---|\n| tensorwise | 31.2 |\n| mxfp8 | n/a |"


def test_alignment_writes_the_rule_left_right_and_centred():
    table = markdown_table(("a", "b", "c"), [(1, 2, 3)], align="lrc")
    assert table.splitlines()[1] == "|---|---:|:---:|"


def test_a_pipe_in_a_cell_is_escaped_and_a_newline_becomes_a_break():
    table = markdown_table(("name", "note"), [("a|b", "two\nlines")])
    assert table.splitlines()[2] == "| a\\|b | two<br>lines |"
    # Still two cells: every unescaped `|` is a column border.
    assert table.splitlines()[2].replace("\\|", "").count("|") == 3


def test_no_rows_leaves_the_header_and_its_rule():
    assert markdown_table(("layer", "x"), [], align="lr") == "| layer | x |\n|---|---:|"


def test_rows_may_be_a_generator():
    assert markdown_table(("n",), ((i,) for i in range(2))).splitlines()[2:] == ["| 0 |", "| 1 |"]


def test_a_row_of_another_width_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"row 1 has 3 cells, the headers 2"):
        markdown_table(("a", "b"), [(1, 2), (1, 2, 3)])


@pytest.mark.parametrize("align", ["lr", "lrx", "lrrr"])
def test_an_alignment_that_does_not_fit_the_headers_is_refused(align):
    with pytest.raises(ValueError, match=r"align .* must give one of l, r, c per column \(3 headers"):
        markdown_table(("a", "b", "c"), [], align=align)


def test_a_table_needs_headers():
    with pytest.raises(ValueError, match="at least one header"):
        markdown_table((), [])
