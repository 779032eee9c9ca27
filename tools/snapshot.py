"""Prove that a change to fp8train changed no bits: record every tensor of a fixed set of
small seeded CPU training runs before the change and after it, and compare the two.

    python tools/snapshot.py record OUT.pt [--steps N]
    python tools/snapshot.py compare A.pt B.pt

Run both with ``PYTHONPATH=src`` from the root of the tree under test. The usual round:

    git stash                                         # or: git worktree add ../before HEAD
    PYTHONPATH=src python tools/snapshot.py record /tmp/before.pt
    git stash pop
    PYTHONPATH=src python tools/snapshot.py record /tmp/after.pt
    python tools/snapshot.py compare /tmp/before.pt /tmp/after.pt

(with a worktree of the old commit, run the first ``record`` there, with this tree's
``tools/`` if the old commit has none: ``PYTHONPATH=../before/src python tools/snapshot.py
record /tmp/before.pt``).

``record`` (``tools/snapshot_scenarios.py``) runs, on one CPU thread, every recipe of
``fp8train.recipes.RECIPE_NAMES`` through every module kind the converter produces
(``Float8Linear``, GPT-2's ``Conv1D``, ``nn.MultiheadAttention``, Mixtral's fused
experts), with FP8-stored weights (``fp8_weights=True``, ``store_frozen_weights_in_fp8``)
and a low-precision ``fp8train.optim.AdamW``: ``--steps`` training steps (default 3), each
step's loss, output and gradients, the parameters, ``state_dict`` and optimizer state
after them, and one more step after a checkpoint round trip into a fresh model. Then
``fp8train.quant.quantize`` of one tensor by every operand rule of every recipe, and a
``fp8train train`` run of the default model (its checkpoint's tensors). About 15 s warm
and some 450 MiB written; the first run of a tree compiles its numba kernels (a few
minutes, cached after). A recipe added to ``RECIPE_NAMES`` since the first record shows
as keys only in B.

``compare`` compares the two files key by key, bit for bit (the bytes of each tensor, so a
NaN's payload and the sign of a zero count), prints a table of the keys that differ or
are missing from one side, and ``N differences in M tensors``; its exit status is 0 only
when the keys are the same and no tensor differs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = "fp8train-snapshot/1"
DEFAULT_STEPS = 3
# An integer dtype of each element size: a tensor viewed as it compares element by element.
_INTEGER_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Difference:
    """One key that is not the same in both snapshots.

    Attributes:
        key: the tensor's key.
        kind: ``"only in A"``, ``"only in B"``, ``"dtype"``, ``"shape"`` or ``"bits"``.
        detail: what differs (the two dtypes or shapes; how many elements, how far apart).
    """

    key: str
    kind: str
    detail: str = ""


def _as_integers(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of its element size (its bytes where no integer
    dtype has that size), flattened."""
    flat = tensor.detach().contiguous().reshape(-1)
    integer_dtype = _INTEGER_VIEWS.get(flat.element_size(), torch.uint8)
    return flat.view(integer_dtype)


def _bits_detail(a: torch.Tensor, b: torch.Tensor, num_different: int) -> str:
    detail = f"{num_different} of {a.numel()} elements"
    if a.dtype in _FLOAT_DTYPES:
        gap = (a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max().item()
        detail += f", max |A-B| {gap:.3g}"
    return detail


def compare_tensors(key: str, a: torch.Tensor, b: torch.Tensor) -> Difference | None:
    """How ``a`` and ``b`` differ (dtype, shape, or any bit), or ``None`` where they are
    the same bit for bit."""
    if a.dtype != b.dtype:
        return Difference(key, "dtype", f"{a.dtype} vs {b.dtype}")
    if a.shape != b.shape:
        return Difference(key, "shape", f"{tuple(a.shape)} vs {tuple(b.shape)}")
    a_bits, b_bits = _as_integers(a), _as_integers(b)
    if torch.equal(a_bits, b_bits):
        return None
    num_different = int((a_bits != b_bits).sum())
    if a_bits.numel() != a.numel():  # compared as bytes: count bytes
        return Difference(key, "bits", f"{num_different} of {a_bits.numel()} bytes")
    return Difference(key, "bits", _bits_detail(a, b, num_different))


def compare_snapshots(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[Difference]:
    """Every key of ``a`` or ``b`` that is missing from the other or differs, in key order."""
    differences = []
    for key in sorted(a.keys() | b.keys()):
        if key not in b:
            differences.append(Difference(key, "only in A"))
        elif key not in a:
            differences.append(Difference(key, "only in B"))
        else:
            difference = compare_tensors(key, a[key], b[key])
            if difference is not None:
                differences.append(difference)
    return differences


def format_report(differences: list[Difference], num_tensors: int) -> str:
    """A table of ``differences``, their count per scenario (the keys' first two parts,
    e.g. ``delayed/linear``: where to start looking), and the summary line."""
    lines = []
    if differences:
        width = max(len("key"), *(len(d.key) for d in differences))
        lines.append(f"{'key':<{width}}  {'difference':<10}  detail")
        lines.extend(f"{d.key:<{width}}  {d.kind:<10}  {d.detail}" for d in differences)
        per_scenario = Counter("/".join(d.key.split("/")[:2]) for d in differences)
        lines.append("differences per scenario:")
        lines.extend(f"{count:>8}  {scenario}" for scenario, count in sorted(per_scenario.items()))
    lines.append(f"{len(differences)} differences in {num_tensors} tensors")
    return "\n".join(lines)


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def save_snapshot(path: Path, tensors: dict[str, torch.Tensor], num_steps: int) -> None:
    import fp8train

    versions = {"fp8train": fp8train.__version__}
    versions.update({name: _version(name) for name in ("torch", "transformers", "numba")})
    torch.save({"format": FORMAT, "steps": num_steps, "versions": versions, "tensors": tensors}, path)


def load_snapshot(path: Path) -> dict:
    """The file's contents (``format``, ``steps``, ``versions``, ``tensors``).

    Raises:
        ValueError: the file is not a snapshot of this format.
    """
    contents = torch.load(path, weights_only=True)
    if not isinstance(contents, dict) or contents.get("format") != FORMAT:
        raise ValueError(f"{path} is not a snapshot written by tools/snapshot.py record ({FORMAT})")
    return contents


def run_compare(path_a: Path, path_b: Path) -> int:
    """Print the comparison of two snapshot files; 0 when they are the same, else 1."""
    a, b = load_snapshot(path_a), load_snapshot(path_b)
    for field in ("steps", "versions"):
        if a[field] != b[field]:
            print(f"note: {field} differ: A {a[field]}, B {b[field]}")
    differences = compare_snapshots(a["tensors"], b["tensors"])
    print(format_report(differences, len(a["tensors"].keys() | b["tensors"].keys())))
    return 0 if not differences else 1


def run_record(path: Path, num_steps: int) -> int:
    """Record every scenario into ``path``."""
    import snapshot_scenarios  # beside this file: on sys.path when run as a script

    start = time.perf_counter()
    tensors = snapshot_scenarios.record_all(num_steps, log=lambda message: print(message, file=sys.stderr))
    save_snapshot(path, tensors, num_steps)
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    seconds = time.perf_counter() - start
    print(f"recorded {len(tensors)} tensors ({num_bytes / 2**20:.0f} MiB) in {seconds:.1f} s to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tools/snapshot.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    record = commands.add_parser("record", help="run the scenarios and save every tensor to OUT")
    record.add_argument("out", type=Path, metavar="OUT.pt")
    record.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps per scenario (default 3)")
    compare = commands.add_parser("compare", help="compare two snapshots bit for bit (exit 0: identical)")
    compare.add_argument("a", type=Path, metavar="A.pt")
    compare.add_argument("b", type=Path, metavar="B.pt")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "record":
        if args.steps < 1:
            parser.error(f"--steps {args.steps} must be at least 1")
        return run_record(args.out, args.steps)
    for path in (args.a, args.b):
        if not path.is_file():
            parser.error(f"{path} is not a file: record it first with tools/snapshot.py record {path}")
    return run_compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
