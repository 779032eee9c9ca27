"""Train a small byte-level Flax transformer on fp8train's embedded text with every FP8
recipe and against bf16, from the same initialization and batches; print the loss table.

    python examples/jax_train.py                       # every recipe and bf16, 300 steps
    python examples/jax_train.py --recipes bf16,mxfp8 --steps 50

Every projection of the model (attention in/out, MLP) is an ``fp8train.jax.Dense``; the
embedding and the output head stay in high precision. Activations are bfloat16, parameters
float32, optimizer AdamW (optax). Delayed scaling carries its ``fp8_state`` collection
through each step with ``fp8train.jax.update_fp8_state`` (docs/jax.md).
"""

from __future__ import annotations

import argparse
import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8train.jax as fj
from fp8train.spec.recipes import RECIPE_NAMES, from_name
from fp8train.train.data import embedded_text


class Block(nn.Module):
    d_model: int
    num_heads: int
    recipe: object

    @nn.compact
    def __call__(self, x):
        batch, seq, _ = x.shape
        head_dim = self.d_model // self.num_heads
        dense = lambda features: fj.Dense(features, recipe=self.recipe, dtype=jnp.bfloat16)  # noqa: E731
        h = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        q, k, v = jnp.split(dense(3 * self.d_model)(h).reshape(batch, seq, 3 * self.num_heads, head_dim), 3, axis=2)
        mask = nn.make_causal_mask(jnp.ones((batch, seq)), dtype=jnp.bool_)
        attention = nn.dot_product_attention(q, k, v, mask=mask, dtype=jnp.bfloat16)
        x = x + dense(self.d_model)(attention.reshape(batch, seq, self.d_model))
        h = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        return x + dense(self.d_model)(nn.gelu(dense(4 * self.d_model)(h)))


class ByteTransformer(nn.Module):
    """A GPT-style byte-level language model."""

    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    seq_len: int = 128
    recipe: object = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(256, self.d_model, dtype=jnp.bfloat16)(tokens)
        x = x + self.param("position", nn.initializers.normal(0.02), (self.seq_len, self.d_model))[: tokens.shape[1]]
        for _ in range(self.num_layers):
            x = Block(self.d_model, self.num_heads, self.recipe)(x)
        return nn.Dense(256, dtype=jnp.float32)(nn.LayerNorm()(x.astype(jnp.float32)))


def batches(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int):
    """Random windows of ``seq_len + 1`` bytes, the same sequence for every run."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - seq_len - 1, batch_size)
        windows = np.stack([tokens[s : s + seq_len + 1] for s in starts])
        yield windows[:, :-1], windows[:, 1:]


def cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def train(recipe_name: str, args, train_tokens, val_tokens) -> dict:
    recipe = None if recipe_name == "bf16" else from_name(recipe_name)
    model = ByteTransformer(args.d_model, args.num_heads, args.num_layers, args.seq_len, recipe)
    sample = jnp.zeros((args.batch_size, args.seq_len), jnp.int32)
    variables = model.init(jax.random.key(args.seed), sample)
    params = variables["params"]
    fp8_state = variables.get(fj.FP8_STATE, {})
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, min(20, args.steps // 4), max(args.steps, 2), args.lr / 10), weight_decay=0.01)
    opt_state = tx.init(params)
    delayed = recipe is not None and recipe.operand_plan.delayed

    # nvfp4 rounds grad_output stochastically: a key per step (unused by the other recipes).
    rngs = lambda step: {fj.STOCHASTIC_ROUNDING: jax.random.fold_in(jax.random.key(args.seed), step)}  # noqa: E731

    @jax.jit
    def train_step(params, fp8_state, opt_state, inputs, targets, step):
        def loss_fn(params, fp8_state):
            variables = {"params": params, fj.FP8_STATE: fp8_state}
            return cross_entropy(model.apply(variables, inputs, rngs=rngs(step)), targets)

        loss, (grads, recorded) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, fp8_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        if delayed:
            fp8_state = fj.update_fp8_state(fp8_state, recorded, recipe)
        return optax.apply_updates(params, updates), fp8_state, opt_state, loss

    @jax.jit
    def eval_loss(params, fp8_state, inputs, targets):
        return cross_entropy(model.apply({"params": params, fj.FP8_STATE: fp8_state}, inputs, rngs=rngs(args.steps)), targets)

    losses, start = [], None
    for step, (inputs, targets) in zip(range(args.steps), batches(train_tokens, args.batch_size, args.seq_len, args.seed)):
        params, fp8_state, opt_state, loss = train_step(params, fp8_state, opt_state, inputs, targets, step)
        losses.append(float(loss))
        if step == 0:
            start = time.perf_counter()  # after the compile
    seconds_per_step = (time.perf_counter() - start) / max(1, args.steps - 1)
    val_batches = batches(val_tokens, args.batch_size, args.seq_len, args.seed + 1)
    val = np.mean([float(eval_loss(params, fp8_state, *next(val_batches))) for _ in range(args.eval_batches)])
    tail = losses[-min(20, len(losses)) :]
    return {"recipe": recipe_name, "train_loss": float(np.mean(tail)), "val_loss": float(val),
            "seconds_per_step": seconds_per_step, "finite": bool(np.isfinite(losses).all())}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default="bf16," + ",".join(RECIPE_NAMES), help="comma-separated; bf16 is the baseline")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--d_model", type=int, default=128, help="a multiple of 128 for blockwise")
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval_batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    data = np.frombuffer(embedded_text().encode("utf-8"), dtype=np.uint8).astype(np.int32)
    split = int(len(data) * 0.9)
    results = []
    for name in args.recipes.split(","):
        results.append(train(name.strip(), args, data[:split], data[split:]))
        print(f"{name}: train {results[-1]['train_loss']:.4f}, val {results[-1]['val_loss']:.4f}", flush=True)
    baseline = next((r for r in results if r["recipe"] == "bf16"), None)
    print(f"\n{args.steps} steps, batch {args.batch_size} x {args.seq_len} bytes, d_model {args.d_model}, "
          f"{args.num_layers} layers, jax {jax.__version__} on {jax.devices()[0].platform}\n")
    print("| recipe | train loss (last 20 steps) | val loss | val gap to bf16 | s/step |")
    print("|---|---|---|---|---|")
    for r in results:
        gap = f"{r['val_loss'] - baseline['val_loss']:+.4f}" if baseline else "n/a"
        print(f"| {r['recipe']} | {r['train_loss']:.4f} | {r['val_loss']:.4f} | {gap} | {r['seconds_per_step']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
