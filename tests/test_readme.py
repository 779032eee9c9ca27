"""The README's commands and examples are part of the product: keep them true."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_starts_with_run_and_test_commands():
    run_command, test_command = (block.strip() for block in _bash_blocks()[:2])
    assert "pip install" in run_command and "fp8train" in run_command.split("&&")[-1]
    assert "'.[test]'" in test_command and "pytest" in test_command
    # These two commands are the README's first two code blocks.
    fences = re.findall(r"^```(\w*)$", README, flags=re.M)
    opening_fences = fences[0::2]
    assert opening_fences[:2] == ["bash", "bash"]


def test_ci_runs_the_readme_test_command():
    test_command = _bash_blocks()[1].strip()
    # CI builds its own venv, then runs everything after the README's venv activation.
    install_and_test = test_command.split("&&", 2)[2].strip()
    ci_script = (ROOT / ".ci" / "run").read_text()
    assert install_and_test in ci_script


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_python_example_runs(index):
    code = _python_blocks()[index]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_readme_main_command_runs():
    # The installed entry point is `fp8train`; `python -m fp8train` is the same main().
    main_command = _bash_blocks()[0].split("&&")[-1].strip()
    args = main_command.split()[1:]
    result = subprocess.run(
        [sys.executable, "-m", "fp8train", *args], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert "| mxfp8 |" in result.stdout and "SQNR" in result.stdout
