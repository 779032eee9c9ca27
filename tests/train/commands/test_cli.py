"""The ``fp8train`` command line, called in-process: help, one-line errors with exit code
2, config files, and tiny ``train`` and ``compare`` runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8train.spec.recipes import RECIPE_NAMES
from fp8train.train.arguments import TrainingArguments
from fp8train.train.commands import cli, flags
from fp8train.train.commands.cli import main
from fp8train.train.trainer_setup import describe_bf16_matmuls

USAGE_ERROR = 2
DATA_BYTES = 8_000
STEPS = 6
NUM_LINEAR_LAYERS = 5  # n_layer=1: qkv, proj, fc, fc_proj, lm_head
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY_FLAGS = [
    "--n_layer", "1", "--n_embd", "128", "--n_head", "2", "--seq_len", "32", "--batch_size", "4",
    "--eval_batches", "1", "--warmup_steps", "2", "--device", "cpu", "--log_interval", "2",
]
SUBPROCESS_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def data_file(corpus_file) -> Path:
    return corpus_file(DATA_BYTES)


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """``main(argv)``'s exit code (argparse's own errors exit with SystemExit), stdout, stderr."""
    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_one_line_error(code: int, err: str, command: str, *fragments: str) -> None:
    assert code == USAGE_ERROR
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"fp8train {command}: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)


def _printed_config(out: str) -> dict:
    """The resolved-config JSON object at the start of the command's stdout."""
    config, _ = json.JSONDecoder().raw_decode(out.lstrip())
    return config


def _words(text: str) -> str:
    return " ".join(text.split())


# ---------------------------------------------------------------------------- help


def test_train_help_lists_every_field_with_its_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # no line wrapping inside help texts
    code, out, _ = _run(["train", "--help"], capsys)
    assert code == 0
    help_text = _words(out)
    for name, text in TrainingArguments.help().items():
        assert f"--{name}" in help_text, name
        assert _words(text) in help_text, name
    assert "--config" in help_text


@pytest.mark.heavy  # a subprocess or a JAX compile of seconds: CI's second leg runs it (default run under 6 minutes)
def test_module_entry_point_runs():
    done = subprocess.run(
        [sys.executable, "-m", "fp8train", "--help"], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    for command in ("train", "compare", "selfcheck"):
        assert command in done.stdout


@pytest.mark.heavy  # a subprocess: moved out of the README's command to keep it under 6 minutes (CI's second leg runs it)
def test_module_entry_point_exits_with_the_usage_error_code():
    done = subprocess.run(
        [sys.executable, "-m", "fp8train", "selfcheck", "--rows", "100"],
        capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
    )
    _assert_one_line_error(done.returncode, done.stderr, "selfcheck", "--rows 100", "multiple of 128")


# ---------------------------------------------------------------------------- bad input


def test_unknown_flag_is_a_usage_error_naming_it(capsys):
    code, _, err = _run(["train", "--stepz", "3"], capsys)
    assert code == USAGE_ERROR
    assert "--stepz" in err and "Traceback" not in err


def test_bad_value_type_is_a_usage_error(capsys):
    code, _, err = _run(["train", "--steps", "abc"], capsys)
    assert code == USAGE_ERROR
    assert "--steps" in err and "'abc' is not a valid int" in err


def test_bad_boolean_is_a_usage_error(capsys):
    code, _, err = _run(["train", "--resume", "maybe"], capsys)
    assert code == USAGE_ERROR
    assert "--resume" in err and "'maybe' is not a boolean" in err


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--n_embd", "96", "--fp8_recipe", "blockwise"], ("n_embd=96", "128")),
        (["--steps", "0"], ("steps=0",)),
        (["--fp8_recipe", "fp4"], ("unknown FP8 recipe 'fp4'",) + RECIPE_NAMES),
        (["--mixed_precision", "fp32"], ("mixed_precision='fp32'",)),
        (["--high_precision_modules", "lm_head,,fc"], ("high_precision_modules='lm_head,,fc'", "empty pattern")),
        # Not under torchrun (which starts a group of one process as of N).
        (["--strategy", "fsdp2"], ("strategy='fsdp2' needs a process group", "torchrun --nproc-per-node 1")),
    ],
)
def test_invalid_settings_are_one_line_errors(flags, fragments, capsys, tmp_path):
    code, out, err = _run(["train", "--output_dir", str(tmp_path), *flags], capsys)
    _assert_one_line_error(code, err, "train", *fragments)
    assert not list(tmp_path.iterdir())  # nothing started


def test_missing_data_file_is_a_one_line_error(capsys, tmp_path):
    missing = tmp_path / "missing.txt"
    code, _, err = _run(["train", "--data", str(missing), "--output_dir", str(tmp_path / "run")], capsys)
    _assert_one_line_error(code, err, "train", str(missing), "does not exist")


def test_empty_data_file_is_a_one_line_error(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    code, _, err = _run(["train", "--data", str(empty), "--output_dir", str(tmp_path / "run")], capsys)
    _assert_one_line_error(code, err, "train", str(empty), "empty")


def test_selfcheck_rows_must_be_a_multiple_of_128(capsys):
    code, _, err = _run(["selfcheck", "--rows", "100"], capsys)
    _assert_one_line_error(code, err, "selfcheck", "--rows 100")


# ---------------------------------------------------------------------------- config files

CONFIG_TEXT = {
    ".toml": 'steps = 2\nlearning_rate = 0.001\nfp8_recipe = "tensorwise"\nseed = 7\nsave_checkpoints = false\n',
    ".yaml": "steps: 2\nlearning_rate: 0.001\nfp8_recipe: tensorwise\nseed: 7\nsave_checkpoints: false\n",
}


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_config_file_is_read_and_flags_override_it(suffix, capsys, tmp_path, data_file):
    config = tmp_path / f"settings{suffix}"
    config.write_text(CONFIG_TEXT[suffix])
    output_dir = tmp_path / "run"
    argv = ["train", "--config", str(config), "--steps", "3", "--data", str(data_file),
            "--output_dir", str(output_dir), *TINY_FLAGS]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    printed = _printed_config(out)
    assert (printed["steps"], printed["seed"]) == (3, 7)  # the flag beats the file
    assert printed["learning_rate"] == 0.001
    assert (printed["fp8_recipe"], printed["save_checkpoints"]) == ("tensorwise", False)
    assert json.loads((output_dir / "config.json").read_text()) == printed
    assert len((output_dir / "metrics.jsonl").read_text().splitlines()) == 3


def test_yaml_config_accepts_scientific_notation(capsys, tmp_path):
    config = tmp_path / "settings.yaml"
    config.write_text("learning_rate: 3e-4\nfp8_recipe: nonexistent\n")
    _, _, err = _run(["train", "--config", str(config), "--output_dir", str(tmp_path)], capsys)
    # The learning rate passes; the bad recipe is what is reported.
    assert "unknown FP8 recipe" in err, err


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_unknown_config_key_is_a_usage_error_naming_it(suffix, capsys, tmp_path):
    config = tmp_path / f"settings{suffix}"
    config.write_text("stepz = 3\n" if suffix == ".toml" else "stepz: 3\n")
    code, _, err = _run(["train", "--config", str(config), "--output_dir", str(tmp_path)], capsys)
    _assert_one_line_error(code, err, "train", "unknown key 'stepz'")


def test_bad_value_in_config_is_a_usage_error(capsys, tmp_path):
    config = tmp_path / "settings.toml"
    config.write_text('steps = "many"\n')
    code, _, err = _run(["train", "--config", str(config), "--output_dir", str(tmp_path)], capsys)
    _assert_one_line_error(code, err, "train", "steps: 'many' is not a valid int")


@pytest.mark.parametrize("name, text, fragment", [
    ("missing.toml", None, "does not exist"),
    ("settings.json", "{}", "must end in .toml, .yaml or .yml"),
    ("broken.toml", "steps = = 3\n", "broken.toml"),
    ("list.yaml", "- 1\n- 2\n", "key = value"),
])
def test_unreadable_config_is_a_usage_error(name, text, fragment, capsys, tmp_path):
    config = tmp_path / name
    if text is not None:
        config.write_text(text)
    code, _, err = _run(["train", "--config", str(config), "--output_dir", str(tmp_path / "run")], capsys)
    _assert_one_line_error(code, err, "train", fragment)


# ---------------------------------------------------------------------------- train


def test_train_writes_outputs_and_prints_the_resolved_config(capsys, tmp_path, data_file):
    output_dir = tmp_path / "run"
    argv = ["train", "--data", str(data_file), "--output_dir", str(output_dir), "--steps", "4",
            "--checkpoint_interval", "2", "--fp8_recipe", "rowwise", *TINY_FLAGS]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    printed = _printed_config(out)
    expected = TrainingArguments(
        output_dir=str(output_dir), data=str(data_file), steps=4, checkpoint_interval=2, fp8_recipe="rowwise",
        n_layer=1, n_embd=128, n_head=2, seq_len=32, batch_size=4, eval_batches=1, warmup_steps=2,
        device="cpu", log_interval=2,
    )
    assert printed == expected.to_dict()
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert len((output_dir / "metrics.jsonl").read_text().splitlines()) == 4
    assert "final train loss" in out and str(output_dir) in out


# ---------------------------------------------------------------------------- compare

COMPARE_RECIPES = ("bf16", "tensorwise", "mxfp8")


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory, data_file):
    output_dir = tmp_path_factory.mktemp("compare")
    argv = ["compare", "--recipes", ",".join(COMPARE_RECIPES), "--data", str(data_file),
            "--output_dir", str(output_dir), "--steps", str(STEPS), *TINY_FLAGS]
    # capsys is function-scoped; the printed output is checked through the files.
    code = main(argv)
    return code, output_dir


def _report_rows(report: str) -> dict[str, list[str]]:
    rows = {}
    for line in report.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in COMPARE_RECIPES:
            rows[cells[0]] = cells
    return rows


def test_compare_writes_a_report_row_per_recipe(compare_run):
    code, output_dir = compare_run
    assert code == 0
    report = (output_dir / "report.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| recipe"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    assert "train gap to bf16" in columns and "val gap to bf16" in columns
    rows = _report_rows(report)
    assert list(rows) == list(COMPARE_RECIPES)
    gap, converted = columns.index("train gap to bf16"), columns.index("converted Linear layers")
    assert rows["bf16"][gap] == "-"
    assert rows["bf16"][converted] == f"0/{NUM_LINEAR_LAYERS}"
    for name in COMPARE_RECIPES[1:]:
        assert len(rows[name]) == len(columns)
        cell = rows[name][gap]
        assert cell[0] in "+-" and cell.endswith("%"), cell
        float(cell[:-1])
        assert rows[name][converted] == f"{NUM_LINEAR_LAYERS}/{NUM_LINEAR_LAYERS}"
    assert "loss_curves.png" in report


def test_compare_writes_a_png_plot(compare_run):
    _, output_dir = compare_run
    assert (output_dir / "loss_curves.png").read_bytes().startswith(PNG_SIGNATURE)


def test_compare_results_json_holds_every_run(compare_run):
    _, output_dir = compare_run
    results = json.loads((output_dir / "results.json").read_text())
    assert results["recipes"] == list(COMPARE_RECIPES)
    assert set(results["runs"]) == set(COMPARE_RECIPES)
    assert results["config"]["steps"] == STEPS
    for name, run in results["runs"].items():
        assert len(run["losses"]) == STEPS, name
        assert run["converted_layers"] == (0 if name == "bf16" else NUM_LINEAR_LAYERS)
    assert results["runs"]["bf16"]["train_gap_percent"] == 0
    # compare does not checkpoint by default, and each recipe gets its own directory.
    for name in COMPARE_RECIPES:
        assert (output_dir / name / "metrics.jsonl").is_file()
        assert not list((output_dir / name).glob("checkpoint-*"))


def test_compare_report_is_printed(capsys, tmp_path, data_file):
    argv = ["compare", "--recipes", "tensorwise,bf16", "--data", str(data_file), "--output_dir", str(tmp_path),
            "--steps", "2", *TINY_FLAGS]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    printed = _printed_config(out)
    assert printed["recipes"] == ["bf16", "tensorwise"]  # the baseline first
    assert printed["save_checkpoints"] is False
    assert "| tensorwise |" in out and "report.md" in out


def test_compare_needs_the_bf16_baseline(capsys, tmp_path):
    code, _, err = _run(["compare", "--recipes", "tensorwise", "--output_dir", str(tmp_path)], capsys)
    _assert_one_line_error(code, err, "compare", "bf16")


def test_compare_unknown_recipe_lists_valid_names(capsys, tmp_path):
    code, _, err = _run(["compare", "--recipes", "bf16,fp4", "--output_dir", str(tmp_path)], capsys)
    _assert_one_line_error(code, err, "compare", "'fp4'", *RECIPE_NAMES)


def test_compare_repeated_recipe_is_an_error(capsys, tmp_path):
    code, _, err = _run(["compare", "--recipes", "bf16,mxfp8,mxfp8", "--output_dir", str(tmp_path)], capsys)
    _assert_one_line_error(code, err, "compare", "twice")


def test_compare_rejects_recipe_that_does_not_fit_the_width(capsys, tmp_path, data_file):
    argv = ["compare", "--recipes", "bf16,blockwise", "--data", str(data_file), "--output_dir", str(tmp_path),
            "--steps", "2", *TINY_FLAGS, "--n_embd", "96"]
    code, _, err = _run(argv, capsys)
    assert code == USAGE_ERROR
    assert "n_embd=96" in err and "blockwise" in err and "Traceback" not in err


def test_compare_rejects_recipe_that_does_not_fit_the_width_before_training(capsys, tmp_path, data_file):
    argv = ["compare", "--recipes", "bf16,blockwise", "--data", str(data_file), "--output_dir", str(tmp_path),
            "--steps", "2", *TINY_FLAGS, "--n_embd", "96"]
    code, _, _ = _run(argv, capsys)
    assert code == USAGE_ERROR
    assert not (tmp_path / "bf16").exists()  # no run was started



@pytest.mark.parametrize(
    "command, recipe_flags", [("train", ["--fp8_recipe", "nvfp4"]), ("compare", ["--recipes", "bf16,nvfp4"])]
)
def test_high_precision_modules_names_must_match_before_anything_trains(command, recipe_flags, capsys, tmp_path,
                                                                        data_file):
    argv = [command, *recipe_flags, "--high_precision_modules", "lm_head,block.0", "--data", str(data_file),
            "--output_dir", str(tmp_path), "--steps", "2", *TINY_FLAGS]
    code, _, err = _run(argv, capsys)
    _assert_one_line_error(code, err, command, "pattern 'block.0' names none", "blocks.0.attn.qkv")
    assert not list(tmp_path.iterdir())  # no run was started


def test_an_empty_high_precision_modules_flag_keeps_nothing(tmp_path):
    args = cli.build_parser().parse_args(["train", "--high_precision_modules", "", "--output_dir", str(tmp_path)])
    assert flags.resolve_training(args, {}).high_precision_modules == ""


def test_a_closed_stdout_ends_the_command_quietly(monkeypatch, capfd):
    """`fp8train selfcheck | head`: the reader leaves early; no traceback, no "bug" line."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    monkeypatch.setattr(sys, "stdout", os.fdopen(write_end, "w"))

    def print_a_lot(args):
        print("row\n" * 100_000, flush=True)  # more than a pipe holds: EPIPE
        return 0

    monkeypatch.setattr(cli, "_run", print_a_lot)
    assert cli.main(["selfcheck"]) == cli.EXIT_BROKEN_PIPE
    assert "internal error" not in capfd.readouterr().err


def test_compare_under_torchrun_writes_its_report_from_rank_0_alone(tmp_path, data_file, monkeypatch):
    # Every rank holds the same results; two writing results.json at once left it corrupt
    # ("Extra data" when read back). A rank other than 0 returns them and writes nothing.
    import fp8train.train.commands.compare as compare

    monkeypatch.setattr(compare, "is_main_process", lambda: False)
    tiny = dict(n_layer=1, n_embd=128, n_head=2, seq_len=32, batch_size=4, eval_batches=1, warmup_steps=2, device="cpu")
    training = TrainingArguments(
        output_dir=str(tmp_path / "compare"), steps=2, data=str(data_file), save_checkpoints=False, **tiny
    )
    results = compare.run_compare(["bf16", "tensorwise"], training)
    assert set(results["runs"]) == {"bf16", "tensorwise"}
    assert results["bf16_matmuls"] == describe_bf16_matmuls(training)  # this machine's route, named
    assert not any((tmp_path / "compare" / name).exists() for name in ("results.json", "report.md", "loss_curves.png"))
