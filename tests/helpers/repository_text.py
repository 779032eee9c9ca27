"""The repository's own text, searched line by line: the tests that keep old names out of it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lines_matching(pattern: re.Pattern, skip: set[Path]) -> list[str]:
    """``path:line`` of every line matching ``pattern`` in the README, pyproject.toml, the docs
    and every Python file of src/, tests/, benchmarks/, examples/ and tools/, but ``skip``."""
    files = [ROOT / "README.md", ROOT / "pyproject.toml", *(ROOT / "docs").glob("*.md")]
    for folder in ("src", "tests", "benchmarks", "examples", "tools"):
        files += (ROOT / folder).rglob("*.py")
    return [
        f"{path.relative_to(ROOT)}:{number}"
        for path in files
        if path not in skip
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
