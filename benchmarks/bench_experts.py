"""FP8 fused MoE experts: a Python loop over experts, as transformers' eager forward
is written, against ``Float8Experts``' grouped routing; forward+backward, emulated.

    python benchmarks/bench_experts.py [--recipes tensorwise rowwise ...] [--repeats 10] [--out results.json]

Both run every expert's two projections through ``Float8LinearFunction`` on the expert's
routed tokens, zero-padded to the recipe's alignment, so their results are identical (the
script checks it). They differ in what surrounds the GEMMs:

* ``loop``: per expert, the eager forward's ``torch.where`` over the routing mask, a gather
  of its tokens, a pad, the two GEMMs, the activation, the router weight and an
  ``index_add_`` into the output; the weight slices by ``gate_up_proj[e]`` (each slice's
  backward writes a zero-filled copy of the whole 3-D gradient);
* ``grouped`` (``Float8Experts``): one stable sort of the routing, one gather of every
  routed token into padded per-expert groups, the parameters split once (``unbind``), one
  activation, one weighting and one ``index_add_`` for all experts.

High-precision references for scale: transformers' own ``eager`` and ``grouped_mm``
experts in float32 (without autocast: CPUs without native bf16 run bf16 GEMMs ~5x slower);
the FP8 runs take bf16 under autocast, as in training. Each time is the median of ``--repeats``,
interleaved (also the best of each, less disturbed by other load on a shared machine).
Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from fp8train.nn.config import Float8ModuleConfig
from fp8train.nn.modules.experts import Float8Experts
from fp8train.nn.delayed import DelayedTensors
from fp8train.nn.function import NO_DELAYED_STATE, Float8LinearFunction, LinearCall
from fp8train.spec.granularities import round_up
from fp8train.diagnostics.markdown import markdown_table

CONFIGS = {
    # name: (experts, top_k, hidden, intermediate, tokens)
    "mixtral-small": (4, 2, 128, 256, 256),
    "many-experts": (64, 8, 128, 128, 256),
}


def loop_forward(module: Float8Experts, hidden_states, top_k_index, top_k_weights):
    """transformers' eager experts loop with each F.linear replaced by a padded FP8 GEMM."""
    plan = module.recipe.operand_plan
    output = torch.zeros_like(hidden_states)
    dtype = torch.get_autocast_dtype("cpu")
    hidden = hidden_states.to(dtype)
    gate_up_proj, down_proj = module.gate_up_proj.to(dtype), module.down_proj.to(dtype)
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=module.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()

    def linear(x, weight, expert, projection):
        rows = x.shape[0]
        padded = F.pad(x, (0, 0, 0, round_up(rows, plan.alignment) - rows))
        delayed, delayed_recipe = NO_DELAYED_STATE, None
        if plan.delayed:  # the module's state, as the grouped path uses it
            scale, history = module.fp8_scale[expert, projection], module.fp8_amax_history[:, expert, projection]
            delayed, delayed_recipe = DelayedTensors(scale, history, None), module.recipe
        call = LinearCall(
            plan=plan, backend=module.backend, save_fp8_input=torch.is_grad_enabled(), delayed_recipe=delayed_recipe
        )
        return Float8LinearFunction.apply(padded, weight, None, call, delayed)[:rows]

    with torch.autocast("cpu", enabled=False):
        for expert in hit:
            expert = expert[0]
            if expert == module.num_experts:
                continue
            slot, token = torch.where(mask[expert])
            gate, up = linear(hidden[token], gate_up_proj[expert], expert, 0).chunk(2, dim=-1)
            out = linear(module.act_fn(gate) * up, down_proj[expert], expert, 1) * top_k_weights[token, slot, None]
            output.index_add_(0, token, out.to(output.dtype))
    return output


def _step(forward, x, index, weights, grad, params, bf16: bool) -> float:
    for p in params:
        p.grad = None
    x.grad = None
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = forward(x, index, weights)
    out.backward(grad)
    return time.perf_counter() - start


def measure(config: str, recipes: list[str], repeats: int, warmup: int) -> list[dict]:
    num_experts, top_k, hidden, intermediate, tokens = CONFIGS[config]
    torch.manual_seed(0)
    cfg = MixtralConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_local_experts=num_experts, num_experts_per_tok=top_k
    )
    experts = MixtralExperts(cfg)
    torch.nn.init.normal_(experts.gate_up_proj, std=hidden**-0.5)
    torch.nn.init.normal_(experts.down_proj, std=intermediate**-0.5)
    x = torch.randn(tokens, hidden, requires_grad=True)
    logits = torch.randn(tokens, num_experts)
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    grad = torch.randn(tokens, hidden)
    params = [experts.gate_up_proj, experts.down_proj]

    def reference(implementation):
        def forward(*args):
            cfg._experts_implementation = implementation
            return experts(*args)

        return forward

    runs = {"hp_eager": reference("eager"), "hp_grouped_mm": reference("grouped_mm")}
    for recipe in recipes:
        module = Float8Experts.from_experts(experts, config=Float8ModuleConfig(recipe=recipe, backend="emulated"))
        runs[f"{recipe}/loop"] = lambda *args, m=module: loop_forward(m, *args)
        runs[f"{recipe}/grouped"] = module
        with torch.autocast("cpu", dtype=torch.bfloat16):
            same = torch.equal(loop_forward(module, x, index, weights), module(x, index, weights))
        assert same, f"{recipe}: loop and grouped differ"
    times = {name: [] for name in runs}
    for repeat in range(warmup + repeats):
        for name, forward in runs.items():
            elapsed = _step(forward, x, index, weights, grad, params, bf16=not name.startswith("hp_"))
            if repeat >= warmup:
                times[name].append(elapsed)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    best = {name: min(t) * 1e3 for name, t in times.items()}
    return [_row(config, recipe, ms, best) for recipe in recipes]


def _row(config: str, recipe: str, ms: dict[str, float], best: dict[str, float]) -> dict:
    """One recipe's JSON row: median and best step times, loop against grouped."""
    num_experts, top_k, hidden, intermediate, tokens = CONFIGS[config]
    loop, grouped = ms[f"{recipe}/loop"], ms[f"{recipe}/grouped"]
    best_loop, best_grouped = best[f"{recipe}/loop"], best[f"{recipe}/grouped"]
    return {
        "config": config,
        "experts": num_experts,
        "top_k": top_k,
        "hidden": hidden,
        "intermediate": intermediate,
        "tokens": tokens,
        "recipe": recipe,
        "loop_ms": round(loop, 2),
        "grouped_ms": round(grouped, 2),
        "loop_over_grouped": round(loop / grouped, 2),
        "best_loop_ms": round(best_loop, 2),
        "best_grouped_ms": round(best_grouped, 2),
        "best_loop_over_grouped": round(best_loop / best_grouped, 2),
        "hp_eager_ms": round(ms["hp_eager"], 2),
        "hp_grouped_mm_ms": round(ms["hp_grouped_mm"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--recipes", nargs="+", default=["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = [row for config in args.configs for row in measure(config, args.recipes, args.repeats, args.warmup)]
    headers = ("config", "recipe", "loop ms", "grouped ms", "loop / grouped", "best of each: loop / grouped",
               "hp eager ms", "hp grouped_mm ms")
    cells = [
        (f"{r['config']} (E={r['experts']}, k={r['top_k']}, T={r['tokens']})", r["recipe"], r["loop_ms"],
         r["grouped_ms"], r["loop_over_grouped"], r["best_loop_over_grouped"], r["hp_eager_ms"], r["hp_grouped_mm_ms"])
        for r in rows
    ]
    print(markdown_table(headers, cells))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
