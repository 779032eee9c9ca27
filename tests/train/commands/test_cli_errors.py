"""The command line never shows a traceback for a user's mistake (one line on stderr, exit
code 2), and shows one, with a line asking to report it, for a bug (exit code 1)."""

import pytest

import fp8train.train.trainer as trainer_module
from fp8train.train.commands.cli import REPORT_URL

from .test_cli import TINY_FLAGS, _assert_one_line_error, _run

INTERNAL_ERROR = 1
INTERRUPTED = 130


def test_data_path_that_is_a_directory(capsys, tmp_path):
    code, _, err = _run(["train", "--data", str(tmp_path), "--output_dir", str(tmp_path / "out")], capsys)
    _assert_one_line_error(code, err, "train", "is a directory")


def test_non_utf8_data_file(capsys, tmp_path):
    data = tmp_path / "latin1.txt"
    data.write_bytes("caf\xe9 ".encode("latin-1") * 100)
    code, _, err = _run(["train", "--data", str(data), "--output_dir", str(tmp_path / "out")], capsys)
    _assert_one_line_error(code, err, "train", "is not UTF-8 text")


def test_config_path_that_is_a_directory(capsys, tmp_path):
    code, _, err = _run(["train", "--config", str(tmp_path)], capsys)
    _assert_one_line_error(code, err, "train", "is a directory")


def test_non_utf8_config_file(capsys, tmp_path):
    config = tmp_path / "settings.toml"
    config.write_bytes(b"steps = 3\n# \xff\xfe\n")
    code, _, err = _run(["train", "--config", str(config)], capsys)
    _assert_one_line_error(code, err, "train", "is not UTF-8 text")


def test_output_dir_that_is_a_file(capsys, tmp_path):
    occupied = tmp_path / "taken"
    occupied.write_text("not a directory")
    for command in ("train", "compare"):
        code, _, err = _run([command, "--output_dir", str(occupied)], capsys)
        _assert_one_line_error(code, err, command, "is a file")


def test_output_dir_below_a_file(capsys, tmp_path):
    occupied = tmp_path / "taken"
    occupied.write_text("not a directory")
    argv = ["train", "--output_dir", str(occupied / "run"), "--steps", "1", *TINY_FLAGS]
    code, _, err = _run(argv, capsys)
    _assert_one_line_error(code, err, "train", str(occupied / "run"))


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--learning_rate", "nan"], "learning_rate=nan must be a finite number >= 0"),
        (["--max_grad_norm", "inf"], "max_grad_norm=inf must be a finite number >= 0"),
        (["--dist_timeout", "0"], "dist_timeout=0.0 must be a finite number > 0"),
        (["--save_total_limit", "0"], "save_total_limit=0 must be an int >= 1"),
        (["--output_dir", ""], "output_dir='' is empty"),
    ],
)
def test_non_finite_and_out_of_range_values(flags, fragment, capsys):
    code, _, err = _run(["train", *flags], capsys)
    _assert_one_line_error(code, err, "train", fragment)


def test_cuda_device_without_cuda(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code, _, err = _run(["train", "--output_dir", str(tmp_path), *TINY_FLAGS[:-4], "--device", "cuda"], capsys)
    _assert_one_line_error(code, err, "train", "no CUDA device", "device='cpu'")


def test_hardware_backend_without_fp8_hardware(capsys, tmp_path):
    argv = ["train", "--output_dir", str(tmp_path), "--steps", "1", "--fp8_recipe", "tensorwise",
            "--fp8_backend", "hardware", *TINY_FLAGS]
    code, _, err = _run(argv, capsys)
    _assert_one_line_error(code, err, "train", "no FP8 GEMM on this device", "backend='emulated'")


def test_a_bug_shows_its_traceback_and_asks_for_a_report(capsys, tmp_path, monkeypatch):
    def broken(self):
        raise KeyError("internal state")

    monkeypatch.setattr(trainer_module.Trainer, "train", broken)
    code, _, err = _run(["train", "--output_dir", str(tmp_path), *TINY_FLAGS], capsys)
    assert code == INTERNAL_ERROR
    assert "Traceback" in err and "KeyError: 'internal state'" in err
    assert err.strip().splitlines()[-1].startswith("fp8train train: internal error: this is a bug")
    assert REPORT_URL in err


def test_an_interrupt_exits_130_without_a_traceback(capsys, tmp_path, monkeypatch):
    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_module.Trainer, "train", interrupted)
    code, _, err = _run(["train", "--output_dir", str(tmp_path), *TINY_FLAGS], capsys)
    assert code == INTERRUPTED
    assert "Traceback" not in err and err.strip() == "fp8train train: interrupted"


def test_resuming_another_models_checkpoints_is_a_one_line_error(capsys, tmp_path):
    base = ["train", "--output_dir", str(tmp_path), "--steps", "2", "--eval_interval", "0", *TINY_FLAGS]
    code, _, err = _run(base, capsys)
    assert code == 0, err
    wider = [flag if flag != "128" else "256" for flag in base]  # --n_embd 128 -> 256
    code, _, err = _run([*wider, "--resume", "true", "--steps", "3"], capsys)
    _assert_one_line_error(code, err, "train", "checkpoint-2 holds another model's training state", "size mismatch",
                           "choose another --output_dir")


def test_another_ranks_failure_is_one_line_without_the_bug_report(capsys, tmp_path, monkeypatch):
    from fp8train.parallel.distributed import RankFailedError

    def peer_failed(self):
        raise RankFailedError("rank 1 failed: RuntimeError: out of memory; see its output above", rank=0, failed_ranks=[1])

    monkeypatch.setattr(trainer_module.Trainer, "train", peer_failed)
    code, _, err = _run(["train", "--output_dir", str(tmp_path), *TINY_FLAGS], capsys)
    assert code == INTERNAL_ERROR
    assert err.strip() == "fp8train train: error: rank 1 failed: RuntimeError: out of memory; see its output above"
