"""``fp8train compare``: train the same model from the same initialization and data order
once per recipe, and report how each FP8 recipe trains next to bf16."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

from .arguments import TrainingArguments
from .data import load_text, split_text
from .model import GPT, GPTConfig
from ..spec.recipes import RECIPE_NAMES, from_name
from .trainer import Trainer

__all__ = ["BASELINE", "DEFAULT_RECIPES", "run_compare", "parse_recipes"]

logger = logging.getLogger(__name__)

BASELINE = "bf16"
DEFAULT_RECIPES = (BASELINE, *RECIPE_NAMES)


def parse_recipes(text: str) -> list[str]:
    """``"bf16,tensorwise,..."`` -> names, validated (``bf16`` is the high-precision baseline).

    Raises:
        ValueError: an unknown recipe, a repeated one, or no bf16 baseline.
    """
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    for name in names:
        if name != BASELINE:
            from_name(name)  # raises, listing the valid names
    if len(set(names)) != len(names):
        raise ValueError(f"--recipes {text!r} names a recipe twice")
    if BASELINE not in names:
        raise ValueError(f"--recipes {text!r} needs the bf16 baseline to compare against; add bf16")
    return [BASELINE] + [name for name in names if name != BASELINE]


def build_model(args: TrainingArguments) -> GPT:
    """The default GPT of ``args``."""
    return GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.seq_len))


def run_compare(recipes: list[str], args: TrainingArguments) -> dict:
    """Train once per recipe under ``args.output_dir/<recipe>``; write ``report.md``,
    ``loss_curves.png`` and ``results.json`` to ``args.output_dir``. Returns the results."""
    output_dir = Path(args.output_dir)
    train, val = split_text(load_text(args.data), args.seq_len)
    # Every run's settings are built (and validated) before the first one trains.
    run_args = {
        name: dataclasses.replace(
            args, output_dir=str(output_dir / name), fp8_recipe=None if name == BASELINE else name, resume=False
        )
        for name in recipes
    }
    runs = {}
    for name, settings in run_args.items():
        logger.info("compare: training %s", name)
        runs[name] = dict(Trainer(lambda: build_model(settings), settings, train, val).train())
    baseline = runs[BASELINE]
    for run in runs.values():
        for key in ("train", "val"):
            final, reference = run[f"final_{key}_loss"], baseline[f"final_{key}_loss"]
            run[f"{key}_gap_percent"] = 100 * (final - reference) / reference if reference else math.nan
    results = {"config": args.to_dict(), "recipes": recipes, "runs": runs}
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(results, indent=2))
    (output_dir / "report.md").write_text(format_report(results))
    plot_loss_curves(results, output_dir / "loss_curves.png")
    return results


def format_report(results: dict) -> str:
    """The Markdown report: one row per recipe."""
    config = results["config"]
    lines = [
        "# fp8train compare",
        "",
        f"{config['steps']} steps, batch {config['batch_size']} x {config['seq_len']} tokens, "
        f"model n_layer={config['n_layer']} n_embd={config['n_embd']}, data: "
        f"{config['data'] or 'embedded English text (pydoc_data)'}, seed {config['seed']}. "
        "Every run starts from the same initialization and sees the same batches; "
        "non-Linear ops run under bf16 autocast. Gaps are relative to bf16 (positive: higher loss).",
        "",
        "| recipe | final train loss | final val loss | train gap to bf16 | val gap to bf16 | tokens/s | converted Linear layers |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in results["recipes"]:
        run = results["runs"][name]
        gap = lambda key: "-" if name == BASELINE else f"{run[key]:+.2f}%"  # noqa: E731
        lines.append(
            f"| {name} | {run['final_train_loss']:.4f} | {run['final_val_loss']:.4f} | {gap('train_gap_percent')} | "
            f"{gap('val_gap_percent')} | {run['tokens_per_second']:.0f} | "
            f"{run['converted_layers']}/{run['total_linear_layers']} |"
        )
    lines += ["", "![loss curves](loss_curves.png)", ""]
    return "\n".join(lines)


def plot_loss_curves(results: dict, path: Path) -> None:
    """Loss per step of every recipe, and each FP8 recipe's relative gap to bf16."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, window = results["runs"], 10
    smooth = lambda xs: [sum(xs[max(0, i - window + 1) : i + 1]) / len(xs[max(0, i - window + 1) : i + 1]) for i in range(len(xs))]  # noqa: E731
    figure, (ax_loss, ax_gap) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    baseline = smooth(runs[BASELINE]["losses"])
    for index, name in enumerate(results["recipes"]):
        color = plt.get_cmap("tab10")(index % 10)  # one color per recipe in both panels
        losses = smooth(runs[name]["losses"])
        steps = range(1, len(losses) + 1)
        ax_loss.plot(steps, losses, label=name, color=color, linewidth=2 if name == BASELINE else 1)
        if name != BASELINE:
            gaps = [100 * (a - b) / b for a, b in zip(losses, baseline)]
            ax_gap.plot(steps, gaps, label=name, color=color, linewidth=1)
    ax_loss.set_ylabel(f"train loss ({window}-step mean)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_gap.axhline(0, color="black", linewidth=0.8)
    ax_gap.set_ylabel("gap to bf16 (%)")
    ax_gap.set_xlabel("step")
    ax_gap.grid(alpha=0.3)
    figure.suptitle("fp8train compare: every recipe from the same initialization and data")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
