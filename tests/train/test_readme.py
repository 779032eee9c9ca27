"""The README's commands and examples are part of the product: keep them true."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.tolerances import MAX_VAL_GAP_PERCENT

ROOT = Path(__file__).resolve().parents[2]
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


# One fresh interpreter runs every example, each in its own namespace, as a user pasting
# them one after the other would: one start-up (torch, fp8train) instead of one per example.
_RUN_EXAMPLES = """
import json, sys, traceback
blocks = json.loads(sys.stdin.read())
for index, code in enumerate(blocks):
    try:
        exec(compile(code, f"<README example {index}>", "exec"), {"__name__": "__main__"})
        error = None
    except BaseException:
        error = traceback.format_exc()
    print("README-EXAMPLE-RESULT " + json.dumps({"index": index, "error": error}), flush=True)
"""


@pytest.fixture(scope="module")
def example_results() -> dict[int, str | None]:
    """``{index: None or the traceback}`` of every README Python example."""
    result = subprocess.run(
        [sys.executable, "-c", _RUN_EXAMPLES],
        input=json.dumps(_python_blocks()),
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    marker = "README-EXAMPLE-RESULT "
    lines = [json.loads(line[len(marker):]) for line in result.stdout.splitlines() if line.startswith(marker)]
    return {line["index"]: line["error"] for line in lines}


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_python_example_runs(index, example_results):
    assert index in example_results, "the example runner stopped before this example"
    assert example_results[index] is None, example_results[index]


def _main_command_args() -> list[str]:
    main_command = _bash_blocks()[0].split("&&")[-1].strip()
    assert main_command.startswith("fp8train ")
    return main_command.split()[1:]


# The README's main command at a size that fits the default suite; the full default
# runs under `pytest -m slow`.
TINY_RUN = ["--steps", "4", "--n_layer", "1", "--seq_len", "32", "--batch_size", "4", "--eval_batches", "1"]


def test_readme_main_command_runs(tmp_path):
    args = [*_main_command_args(), *TINY_RUN, "--output_dir", str(tmp_path)]
    result = subprocess.run([sys.executable, "-m", "fp8train", *args], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    for name in ("report.md", "loss_curves.png", "results.json"):
        assert (tmp_path / name).is_file(), name
    assert "| mxfp8 |" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_readme_main_command_at_its_default(tmp_path):
    """The command exactly as the README gives it (it writes to runs/compare)."""
    result = subprocess.run(
        [sys.executable, "-m", "fp8train", *_main_command_args()], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    results = json.loads((tmp_path / "runs" / "compare" / "results.json").read_text())
    for name, run in results["runs"].items():
        assert abs(run["val_gap_percent"]) < MAX_VAL_GAP_PERCENT or name == "bf16", (name, run["val_gap_percent"])

