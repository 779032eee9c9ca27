"""The example of docs/optim.md runs and prints what the page says."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "optim.md"


def test_docs_example_runs_and_prints_what_the_page_says(capsys):
    example = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)[0]  # the second: FP8 weights
    exec(compile(example, "<docs/optim.md example>", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out.splitlines()
    documented = re.search(r"\n# (optimizer state: .*)\n", example).group(1)
    assert printed[-1] == documented
    losses = [float(line.rpartition(" ")[2]) for line in printed[:-1]]
    assert len(losses) == 5 and losses[-1] < 0.6 * losses[0]
