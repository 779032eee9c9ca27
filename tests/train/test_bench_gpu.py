"""benchmarks/bench_gpu.py on the CPU (``--device cpu --quick``): every section reports a
row per case, each ratio is over the baseline measured in the same run, and a failing
``fp8train compare`` costs only its own rows."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_gpu import main, parse_options

import gpu_sections  # benchmarks/ is on sys.path once benchmarks.bench_gpu is imported

STATUSES = {"ok", "skipped", "error"}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("bench") / "results_gpu.json"
    # Eager only: compiling (aot_eager) would take most of the test's time; the ratios of
    # compiled rows are checked on rows of their own below.
    argv = ["--device", "cpu", "--quick", "--recipes", "tensorwise,mxfp8", "--skip-compile", "--skip-compare"]
    main([*argv, "--json", str(path)])
    return json.loads(path.read_text())


def _ok(rows: list[dict]) -> list[dict]:
    return [row for row in rows if row["status"] == "ok"]


def test_every_section_reports_each_case_with_a_status(report):
    assert {"machine", "options", "seconds", "linear", "scaled_mm", "compare", "counts", "optimizer"} <= set(report)
    for name in ("linear", "scaled_mm", "compare", "counts", "optimizer"):
        for row in report[name]:
            assert row["status"] in STATUSES, (name, row)
            assert row["status"] != "error" or row["error"], row
            assert row["status"] != "skipped" or row["reason"], row
    assert report["compare"] == [{"recipe": "-", "status": "skipped", "reason": "--skip-compare"}]


def test_the_optimizer_row_is_over_this_runs_fused_adamw(report):
    rows = {row["implementation"]: row for row in report["optimizer"]}
    fused, ours = rows["torch AdamW(fused=True)"], rows["fp8train.optim.AdamW"]
    assert fused["status"] == ours["status"] == "ok"
    assert fused["values"] == ours["values"] == 4 * 256 * 256 + 2 * 256 * 512
    assert fused["vs_fused"] == 1.0 and ours["vs_fused"] == ours["ms"] / fused["ms"]
    assert ours["gvalues_per_s"] == ours["values"] / ours["ms"] / 1e6


def test_linear_ratios_are_over_this_runs_bf16(report):
    rows = report["linear"]
    cases = {(r["implementation"], r["recipe"], r["mode"]): r for r in rows}
    assert {key for key in cases if key[0] != "torchao"} == {
        ("torch", "bf16", "eager"), ("fp8train", "tensorwise", "eager"), ("fp8train", "mxfp8", "eager")
    }
    assert {(r["recipe"], r["mode"]) for r in rows if r["implementation"] == "torchao"} == {
        ("tensorwise", "eager"), ("rowwise", "eager")
    }
    bf16 = cases[("torch", "bf16", "eager")]["ms"]
    for row in rows:
        assert row["status"] == "ok" or row["implementation"] == "torchao", row
    for row in _ok(rows):
        assert row["ms"] > 0 and row["tflops"] > 0, row
        assert row["vs_bf16"] == row["ms"] / bf16, row


def test_compiled_rows_are_also_over_compiled_bf16():
    rows = [
        {"size": "s", "recipe": recipe, "mode": mode, "status": status, "ms": ms}
        for recipe, mode, status, ms in [
            ("bf16", "eager", "ok", 2.0), ("bf16", "compiled", "ok", 1.0), ("tensorwise", "eager", "ok", 3.0),
            ("tensorwise", "compiled", "ok", 1.5), ("rowwise", "compiled", "error", None),
        ]
    ]
    rows = {(r["recipe"], r["mode"]): r for r in gpu_sections.with_linear_ratios(rows)}
    assert rows[("tensorwise", "eager")]["vs_bf16"] == 1.5 and "vs_bf16_compiled" not in rows[("tensorwise", "eager")]
    assert rows[("tensorwise", "compiled")]["vs_bf16"] == 0.75 and rows[("tensorwise", "compiled")]["vs_bf16_compiled"] == 1.5
    assert "vs_bf16" not in rows[("rowwise", "compiled")]


def test_scaled_mm_runs_the_cpu_families_right_and_skips_the_others(report):
    rows = {row["family"]: row for row in report["scaled_mm"]}
    bf16 = rows["bf16"]
    assert bf16["status"] == "ok"
    for family in ("tensorwise", "rowwise"):  # PyTorch's CPU _scaled_mm, with fp8train's arguments
        row = rows[family]
        assert row["status"] == "ok", row
        assert row["vs_bf16"] == row["tflops"] / bf16["tflops"]
        assert row["max_rel_err_vs_emulated"] < 1e-5, row
    for family in ("blockwise 1x128 x 128x128", "mxfp8", "nvfp4", "mxfp4"):
        assert rows[family]["status"] == "skipped" and "cpu" in rows[family]["reason"], rows[family]


def test_counts_per_step(report):
    rows = {row["recipe"]: row for row in report["counts"]}
    assert set(rows) == {"bf16", "tensorwise", "mxfp8"}
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["aten_ops"] > 0 and row["kernels"] == row["launches"] == row["syncs"] == 0, row
    assert rows["tensorwise"]["aten_ops"] > rows["bf16"]["aten_ops"]


def _runs(*recipes: str, tokens: dict) -> dict:
    return {name: {"tokens_per_second": tokens[name], "final_val_loss": 1.0, "val_gap_percent": 0.0}
            for name in ("bf16", *recipes)}


def test_compare_rows_are_over_the_bf16_of_their_own_run(monkeypatch):
    """One compare of every recipe; where it fails, each recipe in its own beside bf16, a
    failing recipe an error row of its own."""
    options = parse_options(["--device", "cpu", "--quick", "--recipes", "tensorwise,mxfp8", "--compare-modes", "eager"])
    calls = []

    def fake(options, device, recipes, mode):
        calls.append(list(recipes))
        if len(recipes) > 1 or recipes == ["mxfp8"]:
            raise RuntimeError("fp8train compare exited 1: boom")
        return _runs(*recipes, tokens={"bf16": 100.0, "tensorwise": 150.0})

    monkeypatch.setattr(gpu_sections, "run_compare", fake)
    rows = {row["recipe"]: row for row in gpu_sections.compare_section(options, "cpu")}
    assert calls == [["tensorwise", "mxfp8"], ["tensorwise"], ["mxfp8"]]
    assert rows["tensorwise"]["status"] == "ok" and rows["tensorwise"]["vs_bf16"] == 1.5
    assert rows["mxfp8"] == {**rows["mxfp8"], "status": "error", "error": "fp8train compare exited 1: boom"}
    assert rows["bf16"]["vs_bf16"] == 1.0

    monkeypatch.setattr(gpu_sections, "run_compare", lambda o, d, r, m: _runs(*r, tokens={"bf16": 80.0, "tensorwise": 40.0, "mxfp8": 20.0}))
    rows = {row["recipe"]: row for row in gpu_sections.compare_section(options, "cpu")}
    assert [rows[name]["vs_bf16"] for name in ("bf16", "tensorwise", "mxfp8")] == [1.0, 0.5, 0.25]
