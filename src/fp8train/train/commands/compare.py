"""``fp8train compare``: train the same model from the same initialization and data order
once per recipe (once per recipe and seed with ``--seeds N``), and report how each FP8
recipe trains next to bf16."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

from ..arguments import TrainingArguments
from ..memory import state_bytes_per_parameter
from .compare_seeds import format_seeds_report, gap_percent, summarize_seeds
from ..high_precision import AUTO, check_patterns, describe_setting, parse_patterns
from ...diagnostics.markdown import markdown_table
from ...parallel.distributed import close_distributed, is_main_process
from ...spec.checks import check_int
from ...spec.recipe_map import is_recipe_map, recipe_or_map, recipes_of
from ...spec.recipes import RECIPE_NAMES
from ..trainer import Trainer
from ..trainer_setup import describe_bf16_matmuls
from ..user_model import build_model, model_setup
from .flags import UsageError, add_training_flags, converter, main_process_output, resolve_training

__all__ = ["BASELINE", "DEFAULT_RECIPES", "run_compare", "parse_recipes", "split_recipe_list", "add_parser", "run"]

logger = logging.getLogger(__name__)

BASELINE = "bf16"
DEFAULT_RECIPES = (BASELINE, *RECIPE_NAMES)


def parse_recipes(text: str) -> list[str]:
    """``"bf16,tensorwise,..."`` -> names, validated (``bf16`` is the high-precision baseline).

    Raises:
        ValueError: an unknown recipe, a repeated one, or no bf16 baseline.
    """
    names = [name for name in split_recipe_list(text) if name]
    for name in names:
        if name != BASELINE:
            recipe_or_map(name)  # raises, listing the valid names
    if len(set(names)) != len(names):
        raise ValueError(f"--recipes {text!r} names a recipe twice")
    if BASELINE not in names:
        raise ValueError(f"--recipes {text!r} needs the bf16 baseline to compare against; add bf16")
    return [BASELINE] + [name for name in names if name != BASELINE]


def split_recipe_list(text: str) -> list[str]:
    """``text``'s comma-separated items without whitespace, commas inside parentheses kept
    (``hybrid(forward=nvfp4,backward=mxfp8)`` is one item); recipe names lower-cased, a
    recipe map's one-line form as given (its patterns match module names, case and all)."""
    items, depth, current = [], 0, []
    for char in text:
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    items.append("".join(current))
    items = ["".join(item.split()) for item in items]
    return [item if is_recipe_map(item) else item.lower() for item in items]


def run_compare(recipes: list[str], args: TrainingArguments, num_seeds: int = 1) -> dict:
    """Train every recipe (bf16 first) under seeds ``args.seed, ..., args.seed + num_seeds - 1``
    on the model of ``args`` (:func:`~fp8train.train.user_model.model_setup`); write
    ``report.md``, ``loss_curves.png`` and ``results.json`` to ``args.output_dir`` (under
    torchrun, rank 0 alone writes them: every rank holds the same results).

    With one seed, each run is in ``<output_dir>/<recipe>/`` and ``results["runs"][recipe]``
    is its result, with ``train_gap_percent`` and ``val_gap_percent`` against bf16. With
    more, runs are in ``<output_dir>/<recipe>/seed-<s>/``, ``results["runs"][recipe][str(s)]``
    (gaps against bf16's run under the same seed), and ``results`` adds ``seeds``,
    ``noise_floor`` and ``aggregates`` (:func:`~fp8train.train.commands.compare_seeds.summarize_seeds`).

    Raises:
        ValueError: ``num_seeds`` < 1, a recipe that does not suit the model's dims, a
            ``high_precision_modules`` pattern that names none of the model's matmul modules,
            or a model or data that cannot be set up (before anything trains).
    """
    check_int("num_seeds", num_seeds, minimum=1)
    output_dir = Path(args.output_dir)
    seeds = [args.seed + index for index in range(num_seeds)]
    # Every run's settings are built (and validated) before the first one trains.
    run_args = {
        (seed, name): dataclasses.replace(
            args,
            output_dir=str(output_dir / name if num_seeds == 1 else output_dir / name / f"seed-{seed}"),
            fp8_recipe=None if name == BASELINE else name,
            resume=False,
            seed=seed,
        )
        for seed in seeds
        for name in recipes
    }
    setup = model_setup(args)
    bf16_matmuls = describe_bf16_matmuls(args)
    logger.info("compare: %s", bf16_matmuls)
    if set(parse_patterns(args.high_precision_modules)) - {AUTO}:  # named modules: check them on the model now
        fp8_recipes = [r for name in recipes if name != BASELINE for r in recipes_of(recipe_or_map(name))]
        check_patterns(setup.model_factory(), args.high_precision_modules, fp8_recipes)
    runs: dict[str, dict[str, dict]] = {name: {} for name in recipes}
    for index, ((seed, name), settings) in enumerate(run_args.items()):
        logger.info("compare: training %s, seed %d (run %d of %d)", name, seed, index + 1, len(run_args))
        trainer = Trainer(
            setup.model_factory, settings, setup.train_dataset, setup.eval_dataset, loss_fn=setup.loss_fn
        )
        runs[name][str(seed)] = dict(trainer.train())
    for by_seed in runs.values():
        for seed, run in by_seed.items():
            for key in ("train", "val"):
                reference = runs[BASELINE][seed][f"final_{key}_loss"]
                run[f"{key}_gap_percent"] = gap_percent(run[f"final_{key}_loss"], reference)
    results = {"config": args.to_dict(), "model": setup.description, "recipes": recipes, "bf16_matmuls": bf16_matmuls}
    if num_seeds == 1:
        results["runs"] = {name: runs[name][str(args.seed)] for name in recipes}
    else:
        results.update(seeds=seeds, runs=runs, **summarize_seeds(runs, BASELINE))
    if not is_main_process():  # ranks writing one file at once left it corrupt
        return results
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(results, indent=2))
    (output_dir / "report.md").write_text(format_report(results) if num_seeds == 1 else format_seeds_report(results))
    plot_loss_curves(results, output_dir / "loss_curves.png")
    return results


def bf16_matmuls_sentence(results: dict) -> str:
    """How the run's bf16 matmuls ran, as a report's sentence (``""`` for results written
    before it was recorded)."""
    line = results.get("bf16_matmuls")
    return f"Matmuls: {line}; tokens/s compare across recipes." if line else ""


def format_report(results: dict) -> str:
    """The Markdown report: one row per recipe."""
    config = results["config"]
    lines = [
        "# fp8train compare",
        "",
        f"{config['steps']} steps, batch size {config['batch_size']}, model: {results['model']}, "
        f"seed {config['seed']}. "
        "Every run starts from the same initialization and sees the same batches; "
        "non-Linear ops run under bf16 autocast. Gaps are relative to bf16 (positive: higher loss). "
        f"Kept in high precision: {describe_setting(config['high_precision_modules'])}. "
        f"AdamW masters {config.get('optimizer_master_dtype', 'float32')}, "
        f"moments {config.get('optimizer_state_dtype', 'float32')}. "
        f"{bf16_matmuls_sentence(results)}",
        "",
    ]
    rows = []
    for name in results["recipes"]:
        run = results["runs"][name]
        gaps = ["-" if name == BASELINE else f"{run[f'{key}_gap_percent']:+.2f}%" for key in ("train", "val")]
        rows.append((
            name, f"{run['final_train_loss']:.4f}", f"{run['final_val_loss']:.4f}", *gaps,
            f"{run['tokens_per_second']:.0f}", f"{run['converted_layers']}/{run['total_linear_layers']}",
            state_bytes_per_parameter(run["state_bytes"]) if "state_bytes" in run else "-",
        ))
    headers = ("recipe", "final train loss", "final val loss", "train gap to bf16", "val gap to bf16", "tokens/s",
               "converted Linear layers", "bytes/param (weights + grads + optimizer)")
    lines.append(markdown_table(headers, rows, align="lrrrrrrr"))
    lines += ["", "![loss curves](loss_curves.png)", ""]
    return "\n".join(lines)


def _loss_curves(results: dict, name: str) -> list[list[float]]:
    """The per-step train losses of ``name``: one list per seed, in ``results["seeds"]`` order."""
    runs = results["runs"][name]
    return [runs[str(seed)]["losses"] for seed in results["seeds"]] if "seeds" in results else [runs["losses"]]


def plot_loss_curves(results: dict, path: Path) -> None:
    """Loss per step of every recipe, and each FP8 recipe's relative gap to bf16. With
    several seeds: the mean over seeds as a line and the min-max over seeds as a band, the
    gap paired by seed (each seed's run against bf16's run under that seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = 10
    smooth = lambda xs: [sum(xs[max(0, i - window + 1) : i + 1]) / len(xs[max(0, i - window + 1) : i + 1]) for i in range(len(xs))]  # noqa: E731
    figure, (ax_loss, ax_gap) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    baseline = [smooth(losses) for losses in _loss_curves(results, BASELINE)]
    num_seeds = len(baseline)
    for index, name in enumerate(results["recipes"]):
        color = plt.get_cmap("tab10")(index % 10)  # one color per recipe in both panels
        curves = [smooth(losses) for losses in _loss_curves(results, name)]
        panels = [(ax_loss, curves)]
        if name != BASELINE:
            gaps = [[100 * (a - b) / b for a, b in zip(run, reference)] for run, reference in zip(curves, baseline)]
            panels.append((ax_gap, gaps))
        for axis, per_seed in panels:
            steps = range(1, len(per_seed[0]) + 1)
            by_step = list(zip(*per_seed))
            mean = [sum(values) / num_seeds for values in by_step]
            axis.plot(steps, mean, label=name, color=color, linewidth=2 if name == BASELINE else 1)
            if num_seeds > 1:
                low, high = [min(values) for values in by_step], [max(values) for values in by_step]
                axis.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
    ax_loss.set_ylabel(f"train loss ({window}-step mean)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_gap.axhline(0, color="black", linewidth=0.8)
    ax_gap.set_ylabel("gap to bf16 (%)" + (", paired by seed" if num_seeds > 1 else ""))
    ax_gap.set_xlabel("step")
    ax_gap.grid(alpha=0.3)
    if num_seeds > 1:
        figure.suptitle(
            f"fp8train compare, {num_seeds} seeds: line = mean over seeds, shaded band = min-max over seeds\n"
            "every recipe from the same initialization and data under each seed"
        )
    else:
        figure.suptitle("fp8train compare: every recipe from the same initialization and data")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


DEFAULTS = {"output_dir": "runs/compare", "save_checkpoints": False}
"""``compare``'s own defaults, over ``TrainingArguments``'."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The ``compare`` sub-command of ``commands``."""
    parser = commands.add_parser(
        "compare", help="train once per recipe from the same start and report each against bf16", allow_abbrev=False
    )
    parser.add_argument(
        "--recipes",
        default=",".join(DEFAULT_RECIPES),
        help=f"comma-separated recipes, bf16 included (default: {','.join(DEFAULT_RECIPES)})",
    )
    parser.add_argument(
        "--seeds",
        type=converter("int"),
        default=1,
        metavar="N",
        help="train every recipe under seeds seed, ..., seed + N - 1 and report mean, spread and the bf16 noise "
        "floor (default: 1)",
    )
    add_training_flags(parser, DEFAULTS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    main_process, _ = main_process_output()
    recipes = parse_recipes(args.recipes)
    if args.seeds < 1:
        raise UsageError(f"--seeds {args.seeds} must be an int >= 1 (the number of seeds per recipe)")
    training = resolve_training(args, DEFAULTS, extra=("recipes", "seeds"))
    print(json.dumps({"recipes": recipes, "seeds": args.seeds, **training.to_dict()}, indent=2))
    results = run_compare(recipes, training, num_seeds=args.seeds)
    close_distributed()
    if main_process:  # the one rank that wrote the report
        print((Path(training.output_dir) / "report.md").read_text())
        print(f"wrote {training.output_dir}/report.md, loss_curves.png and results.json")
    return 0 if results else 1
