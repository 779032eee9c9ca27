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
# The limits are the counts plus 10 (the full suite counted blockwise's one more than this file
# alone: 251); delayed at issue 38's 250 (its counts plus 5): its backward's end once walked
# every delayed state still registered (7 more in the full suite), now queued only where owed;
# after tensorwise's reference step in the same process its reference path counts 248 (the
# reference quantizer's memo compares the two recipes' equal rules: one __eq__ a quantization).
MAX_HOST_CALLS = {
    "tensorwise": (234, 234),  # 224, 224 measured (reference 239 before the lean reference operands); 324, 415 at this session's start; issue 38 found 1302, 1065
    "delayed": (368, 346),  # 348, 326 measured (reference 338 before the same); 596, 610 at this session's start; issue 38 found 1785, 1324
    "rowwise": (255, 250),  # 245, 247 measured (reference 300 before the same); 414, 603 at this session's start; issue 38 found 1558, 1502
    "rowwise_with_gw_hp": (205, 210),  # 195, 200 measured (reference 230 before the same); 317, 419 at this session's start; issue 38 found 1133, 950
    "blockwise": (260, 281),  # 242, 271 measured (reference 344 before the same, 284 before compact block scales); 414, 581 at this session's start; issue 38 found 1470, 1417
    "mxfp8": (278, 343),  # 260, 333 measured (reference 384 before the same, 339 before compact block scales); 528, 825 at this session's start; issue 38 found 1672, 1622
    "nvfp4": (296, 400),  # 331, 396 measured; 681, 873 at this session's start; issue 38 found 2061, 1537
    "mxfp4": (286, 397),  # 319, 387 measured; 625, 963 at this session's start; issue 38 found 1953, 1694
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
