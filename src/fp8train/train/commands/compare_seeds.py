"""Statistics of ``fp8train compare --seeds N``: mean and spread of each recipe's final
losses over seeds, its gap to bf16 paired by seed, bf16's seed-to-seed noise floor, and
whether each mean gap is within that noise. Pure Python on the runs' result dicts (no
training, no torch), so every number can be checked by hand.

Definitions (the report states them too):

- The paired gap of recipe ``r`` under seed ``s`` is ``100 * (L[r, s] - L[bf16, s]) /
  L[bf16, s]`` percent, for the final train and the final validation loss: both runs
  start from seed ``s``'s initialization and see its batches, so the seed's own luck
  cancels.
- ``std`` is the sample standard deviation (``n - 1`` in the denominator); ``se`` of the
  gaps is ``std / sqrt(n)``.
- The noise floor is the std of bf16's final validation loss over seeds, in % of its
  mean: how much one bf16 run differs from another (the train loss when there is no
  validation loss).
- A recipe's mean gap is *within noise* when ``|mean| <= NOISE_STANDARD_ERRORS * se`` of
  its paired gaps on that same loss, else *beyond noise*.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from ..high_precision import describe_setting
from ...diagnostics.markdown import markdown_table
from ..memory import state_bytes_per_parameter

__all__ = ["NOISE_STANDARD_ERRORS", "gap_percent", "summarize", "summarize_seeds", "format_seeds_report"]

# |mean paired gap| above this many standard errors is "beyond noise". With 3 seeds (2
# degrees of freedom) that is a two-sided t-test at about 82% confidence, with 5 about 88%:
# a screen, not a proof; more seeds make it sharper.
NOISE_STANDARD_ERRORS = 2.0
WITHIN, BEYOND = "within noise", "beyond noise"
_LOSSES = ("train", "val")
_THRESHOLD = f"{NOISE_STANDARD_ERRORS:g} x"


def gap_percent(final: float, reference: float) -> float:
    """``100 * (final - reference) / reference``: positive when ``final`` is the higher loss."""
    return 100 * (final - reference) / reference if reference else math.nan


def summarize(values: Sequence[float]) -> dict[str, float]:
    """``{"n", "mean", "std", "se", "min", "max"}`` of ``values``: ``std`` is the sample
    standard deviation (``n - 1``), ``se = std / sqrt(n)``; NaN where undefined (one value,
    or a NaN among them)."""
    n = len(values)
    if n == 0 or any(math.isnan(v) for v in values):
        return {"n": n, "mean": math.nan, "std": math.nan, "se": math.nan, "min": math.nan, "max": math.nan}
    mean = math.fsum(values) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan
    return {"n": n, "mean": mean, "std": std, "se": std / math.sqrt(n), "min": min(values), "max": max(values)}


def _verdict(gaps: Mapping[str, float]) -> str | None:
    if math.isnan(gaps["mean"]) or math.isnan(gaps["se"]):
        return None
    return WITHIN if abs(gaps["mean"]) <= NOISE_STANDARD_ERRORS * gaps["se"] else BEYOND


def summarize_seeds(runs: Mapping[str, Mapping[str, Mapping]], baseline: str) -> dict:
    """Aggregates of ``runs[recipe][seed]`` (a Trainer result with ``final_train_loss``,
    ``final_val_loss``, ``tokens_per_second``, ``converted_layers``,
    ``total_linear_layers``), every recipe run under the same seeds as ``baseline``.

    Returns:
        ``{"noise_floor": {"loss", "mean", "std", "percent"}, "aggregates": {recipe:
        {"final_train_loss", "final_val_loss", "train_gap_percent", "val_gap_percent"
        (each a :func:`summarize` dict), "verdict" (WITHIN, BEYOND, or None for the
        baseline or when undefined), "tokens_per_second" (mean), "converted_layers",
        "total_linear_layers"}}}``. ``noise_floor["loss"]`` is ``"val"``, or ``"train"``
        when bf16 has no finite validation loss; the verdict judges the gap on that loss.

    Raises:
        ValueError: a recipe's seeds differ from the baseline's.
    """
    seeds = list(runs[baseline])
    reference = runs[baseline]
    noise_loss = "val" if all(math.isfinite(reference[s]["final_val_loss"]) for s in seeds) else "train"
    bf16 = summarize([reference[s][f"final_{noise_loss}_loss"] for s in seeds])
    noise_floor = {"loss": noise_loss, "mean": bf16["mean"], "std": bf16["std"],
                   "percent": 100 * bf16["std"] / bf16["mean"] if bf16["mean"] else math.nan}
    aggregates = {}
    for name, by_seed in runs.items():
        if sorted(by_seed) != sorted(seeds):
            raise ValueError(f"recipe {name!r} ran seeds {sorted(by_seed)}, the baseline {sorted(seeds)}")
        entry: dict = {}
        for loss in _LOSSES:
            key = f"final_{loss}_loss"
            entry[key] = summarize([by_seed[s][key] for s in seeds])
            entry[f"{loss}_gap_percent"] = summarize([gap_percent(by_seed[s][key], reference[s][key]) for s in seeds])
        entry["verdict"] = None if name == baseline else _verdict(entry[f"{noise_loss}_gap_percent"])
        entry["tokens_per_second"] = summarize([by_seed[s]["tokens_per_second"] for s in seeds])["mean"]
        for key in ("converted_layers", "total_linear_layers", "state_bytes"):  # the same under every seed
            entry[key] = by_seed[seeds[0]].get(key)
        aggregates[name] = entry
    return {"noise_floor": noise_floor, "aggregates": aggregates}


# ---------------------------------------------------------------------------- the report


def _loss(stats: Mapping[str, float]) -> str:
    return "-" if math.isnan(stats["mean"]) else f"{stats['mean']:.4f} ± {stats['std']:.4f}"


def _gap(stats: Mapping[str, float]) -> str:
    return "-" if math.isnan(stats["mean"]) else f"{stats['mean']:+.2f}% ± {stats['std']:.2f}%"


def _range(stats: Mapping[str, float], unit: str = "") -> str:
    if math.isnan(stats["mean"]):
        return "-"
    if unit:
        return f"{stats['min']:+.2f}{unit} – {stats['max']:+.2f}{unit}"
    return f"{stats['min']:.4f} – {stats['max']:.4f}"


def format_seeds_report(results: Mapping) -> str:
    """The Markdown report of a compare over several seeds: ``results`` holds ``config``,
    ``model`` (the setup's description), ``recipes`` (bf16 first), ``seeds``, ``runs``
    (``[recipe][str(seed)]``) and the :func:`summarize_seeds` entries."""
    num_seeds, loss = len(results["seeds"]), results["noise_floor"]["loss"]
    lines = [
        *_explanation(results),
        _mean_table(results),
        "",
        f"Range (min – max over the {num_seeds} seeds):",
        "",
        _range_table(results),
        "",
        f"Final {loss} loss of every run:",
        "",
        _runs_table(results),
        "",
        "![loss curves](loss_curves.png)",
        "",
    ]
    return "\n".join(lines)


def _explanation(results: Mapping) -> list[str]:
    """The title and what the numbers mean: the setup, pairing, the noise floor, the verdict."""
    config, seeds, noise = results["config"], results["seeds"], results["noise_floor"]
    baseline, num_seeds, loss = results["recipes"][0], len(seeds), noise["loss"]
    return [
        f"# fp8train compare, {num_seeds} seeds",
        "",
        f"{config['steps']} steps, batch size {config['batch_size']}, model: {results['model']}; "
        f"seeds {', '.join(map(str, seeds))}. Each recipe trains once per seed; under one seed every recipe "
        "starts from the same initialization and sees the same batches, and the seed changes both. "
        "Non-Linear ops run under bf16 autocast. "
        f"Kept in high precision: {describe_setting(config['high_precision_modules'])}. "
        + (f"Matmuls: {results['bf16_matmuls']}." if results.get("bf16_matmuls") else ""),
        "",
        f"Losses are mean ± sample std over the {num_seeds} seeds. Gaps are paired by seed: a recipe's final loss "
        f"under seed s against {baseline}'s under seed s, in % of {baseline}'s (positive: higher loss), then "
        "mean ± sample std over the seeds.",
        "",
        f"**Noise floor**: {baseline}'s final {loss} loss varies from seed to seed by {noise['std']:.4f} "
        f"(sample std), {noise['percent']:.2f}% of its mean {noise['mean']:.4f}: a gap of that size between two "
        "single runs that also differ in the seed could be noise. (The seed also draws the validation batches, "
        "so this includes the spread of that sample; more --eval_batches narrow it.)",
        "",
        f"**Within or beyond noise**: a recipe's mean {loss} gap is *within noise* when |mean| <= {_THRESHOLD} its "
        f"standard error (the std of its {num_seeds} paired gaps / sqrt({num_seeds})), else *beyond noise*. "
        f"Pairing cancels most of the seed's luck, so this is sharper than the noise floor; with few seeds it is "
        "a screen, not a proof.",
        "",
    ]


def _mean_table(results: Mapping) -> str:
    """Per recipe: mean ± std of the final losses and of the paired gaps, and the verdict."""
    baseline, loss = results["recipes"][0], results["noise_floor"]["loss"]
    rows = []
    for name in results["recipes"]:
        entry = results["aggregates"][name]
        verdict = "-" if entry["verdict"] is None else (
            f"{entry['verdict']} ({_THRESHOLD} SE = {NOISE_STANDARD_ERRORS * entry[f'{loss}_gap_percent']['se']:.2f}%)"
        )
        gaps = ["-" if name == baseline else _gap(entry[f"{key}_gap_percent"]) for key in _LOSSES]
        rows.append((
            name, _loss(entry["final_train_loss"]), _loss(entry["final_val_loss"]), *gaps, verdict,
            f"{entry['tokens_per_second']:.0f}", f"{entry['converted_layers']}/{entry['total_linear_layers']}",
            state_bytes_per_parameter(entry["state_bytes"]) if entry.get("state_bytes") else "-",
        ))
    headers = ("recipe", "final train loss", "final val loss", f"train gap to {baseline}", f"val gap to {baseline}",
               f"{loss} gap vs noise", "tokens/s", "converted Linear layers", "bytes/param (weights + grads + optimizer)")
    return markdown_table(headers, rows, align="lrrrrlrrr")


def _range_table(results: Mapping) -> str:
    """Per recipe: min – max over the seeds of the final losses and of the paired gaps."""
    baseline = results["recipes"][0]
    rows = []
    for name in results["recipes"]:
        entry = results["aggregates"][name]
        gaps = ["-" if name == baseline else _range(entry[f"{key}_gap_percent"], "%") for key in _LOSSES]
        rows.append((name, _range(entry["final_train_loss"]), _range(entry["final_val_loss"]), *gaps))
    headers = ("recipe", "final train loss", "final val loss", f"train gap to {baseline}", f"val gap to {baseline}")
    return markdown_table(headers, rows, align="lrrrr")


def _runs_table(results: Mapping) -> str:
    """Every run's final loss (the loss the noise floor judges), recipe by seed."""
    seeds, key = results["seeds"], f"final_{results['noise_floor']['loss']}_loss"
    rows = [
        (name, *(f"{results['runs'][name][str(seed)][key]:.4f}" for seed in seeds)) for name in results["recipes"]
    ]
    return markdown_table(("recipe", *(f"seed {seed}" for seed in seeds)), rows, align="l" + "r" * len(seeds))
