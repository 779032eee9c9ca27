"""The Python calls of one Float8Linear forward+backward per recipe and quantize path, pinned
as "at most": the host cost a GPU's kernels cannot hide (issue 38; the rule is
``tests/helpers/host_calls.py``'s). A change that adds calls fails here; one that removes some lowers
the limit with it. Issue 38's targets: 250 for the FP8 recipes, 400 for MXFP8 and 4-bit.

Measured with ``PYTHONPATH=src python benchmarks/bench_host.py`` (the same harness)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.host_calls import count_host_calls

# 16 tokens x 256 in x 256 out, float32, bias, one thread; {recipe: (default path, reference path)}.
# The limits are the counts plus 10, never above issue 38's target where a count meets it (250
# for the FP8 recipes, 400 for MXFP8 and 4-bit): the full suite has counted a few more than this
# file alone (blockwise's one more; delayed's backward end once walked every state still
# registered, and after tensorwise's reference step its reference path counted 248: the
# reference quantizer's memo compared the two recipes' equal rules).
MAX_HOST_CALLS = {
    "tensorwise": (207, 203),  # 197, 193 measured; 217, 217 at this session's start (2026-11-29, 916e456); 1302, 1065 in issue 38
    "delayed": (237, 225),  # 227, 215; 247, 239; 1785, 1324
    "rowwise": (226, 218),  # 216, 214; 238, 240; 1558, 1502
    "rowwise_with_gw_hp": (184, 182),  # 174, 175; 188, 193; 1133, 950
    "blockwise": (227, 247),  # 220, 245; 242, 271; 1470, 1417 (the reference path within its target since 2026-11-29)
    "mxfp8": (228, 314),  # 218, 307 (E8M0 codes from the kernels, decoded by the values kernel); 260, 333; 1672, 1622
    "nvfp4": (271, 371),  # 264, 364 (the host alpha reads two amaxes a GEMM); 278, 388; 2061, 1537
    "mxfp4": (253, 360),  # 246, 353; 268, 377; 1953, 1694
}
KERNEL_COLUMN = {"auto": 0, "reference": 1}


@pytest.mark.parametrize("kernel", sorted(KERNEL_COLUMN))
def test_host_calls_per_linear_step_stay_within_their_limits(kernel):
    limits = {recipe: pair[KERNEL_COLUMN[kernel]] for recipe, pair in MAX_HOST_CALLS.items()}
    counts = {recipe: count_host_calls(recipe, kernel) for recipe in limits}
    over = {recipe: (count, limits[recipe]) for recipe, count in counts.items() if count > limits[recipe]}
    assert not over, f"more Python calls per Float8Linear forward+backward ({kernel} path) than pinned: {over}"


def test_the_count_sees_nn_linear_as_a_few_dozen_calls():
    assert 20 <= count_host_calls(None) <= 80  # 55 with torch 2.11


def test_bench_host_writes_the_table_as_json(tmp_path, capsys):
    from benchmarks.bench_host import main

    results = main(["--recipes", "tensorwise", "--repeats", "3", "--out", str(tmp_path / "host.json")])
    written = json.loads((tmp_path / "host.json").read_text())
    assert written["calls"] == results["calls"]
    assert written["calls"]["reference"]["tensorwise"] == count_host_calls("tensorwise", "reference")
    assert "| tensorwise " in capsys.readouterr().out
