"""tools/snapshot.py compare: identical snapshots pass; any one changed bit (a flipped
mantissa bit, the sign of a zero, a NaN's payload), a missing key, another dtype or shape
fails with a non-zero exit status and count. Small synthetic snapshots, no recording."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[1] / "tools" / "snapshot.py"


@pytest.fixture(scope="module")
def snapshot_tool():
    spec = importlib.util.spec_from_file_location("snapshot_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "tensorwise/linear/step1/loss": torch.tensor(1.5),
        "tensorwise/linear/step1/grad/0.weight": torch.linspace(-1, 1, 12).reshape(3, 4),
        "zeros": torch.zeros(4),
        "nan": torch.tensor([float("nan"), 1.0]),
        "codes": torch.arange(8, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "fp4": torch.arange(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        "count": torch.tensor(3, dtype=torch.int64),
    }


def _flip_bit(tensor: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    """A copy of a float32 tensor with one bit of one element flipped."""
    bits = tensor.clone().reshape(-1).view(torch.int32)
    bits[index] ^= 1 << bit
    return bits.view(torch.float32).reshape(tensor.shape)


def _compare(tool, tmp_path: Path, a: dict, b: dict, capsys) -> tuple[int, str]:
    tool.save_snapshot(tmp_path / "a.pt", a, num_steps=3)
    tool.save_snapshot(tmp_path / "b.pt", b, num_steps=3)
    status = tool.main(["compare", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")])
    return status, capsys.readouterr().out


def test_identical_snapshots_have_no_differences(snapshot_tool, tmp_path, capsys):
    status, out = _compare(snapshot_tool, tmp_path, _tensors(), _tensors(), capsys)
    assert status == 0
    assert out.strip() == f"0 differences in {len(_tensors())} tensors"


def _nan_with_payload() -> torch.Tensor:
    bits = torch.tensor([0x7FC00001], dtype=torch.int32)  # a quiet NaN of another payload
    return torch.cat([bits.view(torch.float32), torch.tensor([1.0])])


CHANGES = {
    "one mantissa bit": ("tensorwise/linear/step1/grad/0.weight", lambda t: _flip_bit(t, 5, 0), "bits"),
    "-0.0 for 0.0": ("zeros", lambda t: torch.tensor([0.0, -0.0, 0.0, 0.0]), "bits"),
    "a NaN's payload": ("nan", lambda t: _nan_with_payload(), "bits"),
    "an FP8 code": ("codes", lambda t: torch.tensor([0, 1, 2, 3, 4, 5, 6, 9], dtype=torch.uint8).view(t.dtype), "bits"),
    "a 4-bit code pair": ("fp4", lambda t: torch.tensor([0, 1, 2, 4], dtype=torch.uint8).view(t.dtype), "bits"),
    "the dtype": ("tensorwise/linear/step1/loss", lambda t: t.double(), "dtype"),
    "the shape": ("tensorwise/linear/step1/grad/0.weight", lambda t: t.reshape(4, 3), "shape"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_one_changed_tensor_is_one_difference(snapshot_tool, tmp_path, capsys, change):
    key, modify, kind = CHANGES[change]
    changed = _tensors()
    changed[key] = modify(changed[key])
    status, out = _compare(snapshot_tool, tmp_path, _tensors(), changed, capsys)
    assert status == 1
    assert out.splitlines()[-1] == f"1 differences in {len(_tensors())} tensors"
    [difference] = snapshot_tool.compare_snapshots(_tensors(), changed)
    assert (difference.key, difference.kind) == (key, kind)
    assert key in out


def test_a_flipped_bit_names_how_many_elements_differ(snapshot_tool):
    a = torch.linspace(-1, 1, 12).reshape(3, 4)
    difference = snapshot_tool.compare_tensors("w", a, _flip_bit(a, 5, 0))
    assert difference.detail.startswith("1 of 12 elements, max |A-B| ")


@pytest.mark.parametrize("side", ["A", "B"])
def test_a_missing_key_is_a_difference(snapshot_tool, tmp_path, capsys, side):
    fewer = _tensors()
    del fewer["count"]
    a, b = (fewer, _tensors()) if side == "B" else (_tensors(), fewer)
    status, out = _compare(snapshot_tool, tmp_path, a, b, capsys)
    assert status == 1
    assert f"only in {side}" in out
    assert out.splitlines()[-1] == f"1 differences in {len(_tensors())} tensors"


def test_a_file_that_is_not_a_snapshot_is_refused(snapshot_tool, tmp_path):
    torch.save({"w": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="is not a snapshot written by tools/snapshot.py record"):
        snapshot_tool.load_snapshot(tmp_path / "other.pt")


def test_a_missing_file_exits_with_usage_error(snapshot_tool, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        snapshot_tool.main(["compare", str(tmp_path / "none.pt"), str(tmp_path / "none.pt")])
    assert exit_info.value.code == 2
