"""What Float8Linear keeps of its input for the backward: the FP8 grad_weight operand
(``save_fp8_activations=True``, the default) or the high-precision input, with results
bit-identical either way; the byte counts of benchmarks/bench_saved_activations.py against
hand-computed ones; activation checkpointing."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from benchmarks.bench_saved_activations import (
    Config,
    SavedTensorCounter,
    build,
    make_batch,
    peak_allocated_bytes,
    saved_bytes_of_step,
)
import fp8train
from fp8train import TrainingArguments
from fp8train.nn.config import Float8ModuleConfig
from fp8train.nn.modules.linear import Float8Linear
from fp8train.quant.operand import quantize_usage
from fp8train.quant.gemm import scaled_mm
from fp8train.spec.recipes import RECIPE_NAMES, from_name
from fp8train.spec.roles import Role, Usage

IN_FEATURES, OUT_FEATURES = 256, 384
NUM_TOKENS = 200  # not a multiple of 16, 32 or 128: the saved input is the padded one
SEQ_LEN, BATCH = 64, 3  # 3-D input, non-contiguous
STEPS = 3  # delayed scaling: scales calibrate and move, identically in both modules
# Hand-computed saved bytes: a [M, K] bfloat16 input, M chosen apart from K and N (see
# SavedTensorCounter) and a multiple of every block, so nothing is padded.
M = 640
FP8_SCALE_BYTES = {  # the grad_weight operand's scales, first-dim usage of x[M, K]
    "tensorwise": 4,  # one float32
    "delayed": 4,
    "rowwise": 4 * IN_FEATURES,  # one float32 per column of x
    "blockwise": 4 * IN_FEATURES * M // 128,  # one float32 per 128x1 block
    "mxfp8": IN_FEATURES * M // 32,  # one E8M0 byte per 32x1 block
    "nvfp4": IN_FEATURES * M // 16 + 4,  # one E4M3 byte per 16x1 block, and the float32 global amax
    "mxfp4": IN_FEATURES * M // 32,  # one E8M0 byte per 32x1 block
}
DATA_BYTES_PER_VALUE = {"nvfp4": 0.5, "mxfp4": 0.5}  # E2M1: two values a byte; FP8: one
# Recipes whose grad_weight operand is the transpose of the forward's own FP8 input: kept in
# FP8 whatever save_fp8_activations says.
REUSES_FORWARD_FP8 = ("tensorwise", "delayed")


def _saves_fp8(recipe: str, save_fp8_activations: bool) -> bool:
    return recipe in FP8_SCALE_BYTES and (save_fp8_activations or recipe in REUSES_FORWARD_FP8)


def _modules(recipe, dtype, bias):
    torch.manual_seed(0)
    config = Float8ModuleConfig(recipe=recipe, backend="emulated")
    fp8 = Float8Linear(IN_FEATURES, OUT_FEATURES, bias=bias, dtype=dtype, config=config)
    hp = copy.deepcopy(fp8)
    hp.save_fp8_activations = False
    assert "save_fp8_activations=True" in repr(fp8) and "save_fp8_activations=False" in repr(hp)
    return fp8, hp


def _inputs(kind, dtype, step):
    generator = torch.Generator().manual_seed(step)
    if kind == "2d":
        x = torch.randn(NUM_TOKENS, IN_FEATURES, generator=generator)
    else:
        x = torch.randn(SEQ_LEN, BATCH, IN_FEATURES, generator=generator).transpose(0, 1)
    grad_output = torch.randn(*x.shape[:-1], OUT_FEATURES, generator=generator)
    return x.to(dtype), grad_output.to(dtype)


def _step(module, x, grad_output, autocast: bool):
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(x)
    out.backward(grad_output.to(out.dtype))
    grads = {"output": out.detach(), "grad_input": x.grad, "grad_weight": module.weight.grad}
    if module.bias is not None:
        grads["grad_bias"] = module.bias.grad
    return grads


@pytest.mark.parametrize("kind", ["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float32_autocast_bf16"])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_fp8_saved_input_gives_bit_identical_results(recipe, dtype, bias, kind):
    autocast = dtype.endswith("autocast_bf16")
    param_dtype = getattr(torch, dtype.removesuffix("_autocast_bf16"))
    fp8, hp = _modules(recipe, param_dtype, bias)
    for step in range(STEPS):
        x, grad_output = _inputs(kind, param_dtype, step)
        torch.manual_seed(step)  # nvfp4's stochastic rounding: the same draws in both
        got = _step(fp8, x, grad_output, autocast)
        torch.manual_seed(step)
        expected = _step(hp, x, grad_output, autocast)
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"step {step}: {name}"
    for (name, got), expected in zip(fp8.named_buffers(), hp.buffers()):
        assert torch.equal(got, expected), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_grad_weight_is_that_of_the_high_precision_input_quantized(recipe, dtype):
    """Independently of the saving: grad_weight equals the FP8 GEMM of the first-dim usages
    quantized from the high-precision input and grad_output, with this step's scales."""
    fp8, _ = _modules(recipe, dtype, bias=False)
    plan = fp8.recipe.operand_plan
    generator = torch.Generator().manual_seed(0)
    for _ in range(STEPS):  # delayed: scales away from 1
        x = torch.randn(M, IN_FEATURES, generator=generator).to(dtype).requires_grad_(True)
        grad_output = torch.randn(M, OUT_FEATURES, generator=generator).to(dtype)
        fp8.weight.grad = None
        out = fp8(x)
        # This step's scales: forward ones are updated before the forward uses them,
        # grad_output's after the backward uses it.
        scale = fp8.fp8_scale.clone() if plan.delayed else None
        rng_state = torch.get_rng_state()  # stochastic rounding's draws (nvfp4's grad_output)
        out.backward(grad_output)
    if not plan.quantizes_usage(Usage.GRAD_WEIGHT_INPUT):
        expected = (grad_output.t() @ x.detach()).to(dtype)
    else:
        input_scale, grad_output_scale = (
            (None, None) if scale is None else (scale[Role.INPUT.index], scale[Role.GRAD_OUTPUT.index])
        )
        # The backward quantizes grad_output for grad_input first: replay its draws.
        torch.set_rng_state(rng_state)
        quantize_usage(plan, Usage.GRAD_INPUT_GRAD_OUTPUT, grad_output, grad_output_scale)
        grad_output_t = quantize_usage(plan, Usage.GRAD_WEIGHT_GRAD_OUTPUT, grad_output, grad_output_scale)
        input_t = quantize_usage(plan, Usage.GRAD_WEIGHT_INPUT, x.detach(), input_scale)
        expected = scaled_mm(grad_output_t, input_t, dtype, backend="emulated")
    assert torch.equal(fp8.weight.grad, expected)


def _linear_input_bytes(module: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(Linear-input bytes, all bytes) ``module`` keeps for the backward of ``module(x)``."""
    with SavedTensorCounter(module) as counter:
        out = module(x)
    saved = counter.saved_bytes()
    out.sum().backward()
    return saved.linear_input, saved.total


def test_a_plain_linear_saves_its_bfloat16_input():
    """The bytes every recipe's count below is held against (measured once: not a recipe's)."""
    torch.manual_seed(0)
    x = torch.randn(M, IN_FEATURES, dtype=torch.bfloat16, requires_grad=True)
    assert _linear_input_bytes(nn.Linear(IN_FEATURES, OUT_FEATURES, dtype=torch.bfloat16), x)[0] == 2 * M * IN_FEATURES


@pytest.mark.parametrize("save_fp8_activations", [True, False])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_saved_input_bytes_match_hand_computed(recipe, save_fp8_activations):
    torch.manual_seed(0)
    x = torch.randn(M, IN_FEATURES, dtype=torch.bfloat16, requires_grad=True)
    module = Float8Linear(
        IN_FEATURES,
        OUT_FEATURES,
        dtype=torch.bfloat16,
        config=Float8ModuleConfig(recipe=recipe, save_fp8_activations=save_fp8_activations),
    )
    bf16_bytes = 2 * M * IN_FEATURES  # a plain Linear's (test_a_plain_linear_saves_its_bfloat16_input)
    # The values (one byte each in FP8, half a byte in E2M1), and the scales.
    fp8_bytes = int(M * IN_FEATURES * DATA_BYTES_PER_VALUE.get(recipe, 1)) + FP8_SCALE_BYTES.get(recipe, 0)
    saved, total = _linear_input_bytes(module, x)
    assert saved == (fp8_bytes if _saves_fp8(recipe, save_fp8_activations) else bf16_bytes)
    if _saves_fp8(recipe, save_fp8_activations):
        assert saved <= 0.6 * bf16_bytes
    if _saves_fp8(recipe, save_fp8_activations) and not _saves_fp8(recipe, False):
        # The whole graph keeps the FP8 operand in place of the high-precision input.
        hp_module = Float8Linear(
            IN_FEATURES, OUT_FEATURES, dtype=torch.bfloat16,
            config=Float8ModuleConfig(recipe=recipe, save_fp8_activations=False),
        )
        hp_module.load_state_dict(module.state_dict())
        assert total == _linear_input_bytes(hp_module, x)[1] - bf16_bytes + fp8_bytes


@pytest.mark.parametrize("save_fp8_activations", [True, False])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_high_precision_input_is_released(recipe, save_fp8_activations):
    module = Float8Linear(
        IN_FEATURES,
        OUT_FEATURES,
        config=Float8ModuleConfig(recipe=recipe, backend="emulated", save_fp8_activations=save_fp8_activations),
    )
    leaf = torch.randn(M, IN_FEATURES, requires_grad=True)
    x = leaf * 2  # an activation: only the graph could keep it alive
    input_alive = weakref.ref(x)
    out = module(x)
    del x  # freed by its reference count alone, if nothing but the graph could hold it (no gc pass: ~1 s)
    assert (input_alive() is None) == _saves_fp8(recipe, save_fp8_activations)
    out.sum().backward()
    assert leaf.grad is not None


def test_frozen_weight_keeps_nothing_of_the_input():
    module = Float8Linear(IN_FEATURES, OUT_FEATURES, config=Float8ModuleConfig(recipe="rowwise", backend="emulated"))
    module.weight.requires_grad_(False)
    x = torch.randn(M, IN_FEATURES, requires_grad=True)
    assert _linear_input_bytes(module, x)[0] == 0
    assert x.grad is not None


def test_default_model_saved_bytes_match_hand_computed():
    """The benchmark's counts for the trainer's default GPT (one block, 5 x 128 tokens)."""
    args = dataclasses.replace(TrainingArguments(), n_layer=1, batch_size=5)
    tokens, width = args.batch_size * args.seq_len, args.n_embd
    # qkv, proj, fc read n_embd features, fc_proj 4 n_embd, lm_head n_embd.
    sum_in_features = args.n_layer * (3 * width + 4 * width) + width
    saved = {}
    for config in (Config(None), Config("rowwise"), Config("rowwise", save_fp8_activations=False), Config("mxfp8")):
        model = build(config, args)
        saved[config] = saved_bytes_of_step(model, config, make_batch(args, model.config.vocab_size))
    bf16 = saved[Config(None)]
    assert bf16.linear_input == 2 * tokens * sum_in_features  # bfloat16 copies under torch.autocast
    assert saved[Config("rowwise")].linear_input == tokens * sum_in_features + 4 * sum_in_features
    assert saved[Config("mxfp8")].linear_input == tokens * sum_in_features + tokens // 32 * sum_in_features
    # High precision saves what nn.Linear saves, so the step keeps the same tensors.
    assert saved[Config("rowwise", save_fp8_activations=False)] == bf16
    assert saved[Config("rowwise")].total < bf16.total


def test_peak_allocated_bytes_matches_hand_computed():
    mib = 2**20

    def allocate(free_first: bool) -> None:
        first = torch.empty(mib, dtype=torch.uint8)
        second = torch.empty(mib, dtype=torch.uint8)
        if free_first:
            del first
        third = torch.empty(mib, dtype=torch.uint8)
        del third, second

    before = torch.empty(4 * mib, dtype=torch.uint8)  # live before: not counted
    assert peak_allocated_bytes(lambda: allocate(free_first=True)) == 2 * mib
    assert peak_allocated_bytes(lambda: allocate(free_first=False)) == 3 * mib
    kept = []
    assert peak_allocated_bytes(lambda: kept.append(torch.empty(mib, dtype=torch.uint8))) == mib
    kept.clear()  # freed while no profiler runs: the next measurement must not see it
    assert peak_allocated_bytes(lambda: allocate(free_first=True)) == 2 * mib
    del before


def test_counter_refuses_ambiguous_shapes():
    module = Float8Linear(IN_FEATURES, OUT_FEATURES, recipe="rowwise")
    with pytest.raises(ValueError, match=r"sees 384 tokens: .* change the batch size"):
        _linear_input_bytes(module, torch.randn(OUT_FEATURES, IN_FEATURES, requires_grad=True))


# What runs around the forward: nothing, fp8train.autocast (delayed scaling updates the
# forward scales at its exit, before the backward's recompute), or that and torch.autocast.
CONTEXTS = ("plain", "fp8_autocast", "fp8_autocast_bf16")


def _forward_context(context: str):
    stack = contextlib.ExitStack()
    if context != "plain":
        stack.enter_context(fp8train.autocast())
    if context.endswith("bf16"):
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
    return stack


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_activation_checkpointing_gives_identical_grads(recipe, use_reentrant, context, small_model):
    """Outputs, gradients and (delayed scaling) scales and amax histories after several
    steps match those without checkpointing bit for bit: the recompute neither records an
    amax again nor quantizes with the scales an autocast's exit updated since."""
    model = small_model((128, 256), "gelu", (256, 128), recipe=recipe, backend="emulated")
    checkpointed = copy.deepcopy(model)
    for step in range(STEPS):
        x = torch.randn(3, 128, 128, generator=torch.Generator().manual_seed(step), requires_grad=True)
        x_checkpointed = x.detach().requires_grad_(True)
        with _forward_context(context):
            out = model(x)
        with SavedTensorCounter(checkpointed) as counter, _forward_context(context):
            out_checkpointed = checkpoint(checkpointed, x_checkpointed, use_reentrant=use_reentrant)
        # Everything the layers keep of their inputs goes through saved_tensors_hooks, so
        # checkpointing drops it (a tensor held on ctx would stay).
        assert counter.saved_bytes().linear_input == 0
        assert torch.equal(out_checkpointed, out)
        torch.manual_seed(step)  # nvfp4's stochastic rounding: the same draws in both backwards
        out.float().square().mean().backward()
        torch.manual_seed(step)
        out_checkpointed.float().square().mean().backward()
        assert torch.equal(x_checkpointed.grad, x.grad)
        for (name, p), p_checkpointed in zip(model.named_parameters(), checkpointed.parameters()):
            assert torch.equal(p_checkpointed.grad, p.grad), f"step {step}: {name}"
        for (name, b), b_checkpointed in zip(model.named_buffers(), checkpointed.buffers()):
            assert torch.equal(b_checkpointed, b), f"step {step}: {name}"
    if recipe == "delayed":  # the state moved: the comparison is not of initial values
        assert all(not torch.equal(b, torch.ones_like(b)) for name, b in model.named_buffers() if "scale" in name)


def test_evaluation_without_grad_only_reads_the_delayed_state():
    """Outside a checkpoint, a forward without grad records nothing (reentrant
    checkpointing's forward, also without grad, does)."""
    module = Float8Linear(IN_FEATURES, OUT_FEATURES, config=Float8ModuleConfig(recipe="delayed", backend="emulated"))
    x = torch.randn(M, IN_FEATURES, requires_grad=True)
    with torch.no_grad():
        module(x)
    assert not module.fp8_amax_history.any() and not module.delayed_state.forward_pending
    checkpoint(module, x, use_reentrant=True).sum().backward()
    # Recorded, and (no autocast) rolled by the end of the backward.
    assert module.fp8_amax_history[-1, Role.INPUT.index] == x.detach().abs().amax()
    assert not module.delayed_state.forward_pending


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_option_is_not_state(recipe):
    fp8 = Float8Linear(IN_FEATURES, OUT_FEATURES, config=Float8ModuleConfig(recipe=recipe, save_fp8_activations=False))
    plain = nn.Linear(IN_FEATURES, OUT_FEATURES)
    assert fp8.state_dict().keys() == plain.state_dict().keys()
    fp8.load_state_dict(plain.state_dict())
    assert copy.deepcopy(fp8).save_fp8_activations is False
    converted = Float8Linear.from_linear(
        plain, config=Float8ModuleConfig(recipe=from_name(recipe), save_fp8_activations=False)
    )
    assert converted.save_fp8_activations is False and converted.weight is plain.weight


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_the_backward_keeps_the_weights_codes_not_their_converted_copy(recipe):
    """Where the backward reuses the forward's quantized weight (symmetric scaling), the
    graph keeps its codes and scales, not the emulated GEMM's float32 conversion of them
    (4 bytes a parameter, which lived until the graph was dropped: the next step's forward)."""
    module = Float8Linear(IN_FEATURES, OUT_FEATURES, config=Float8ModuleConfig(recipe=recipe, backend="emulated"))
    x = torch.randn(M, IN_FEATURES, requires_grad=True)
    with SavedTensorCounter(module) as counter:
        out = module(x)
    scale_bytes = 4 * (OUT_FEATURES // 128) * (IN_FEATURES // 128) if recipe == "blockwise" else 4
    assert counter.saved_bytes().linear_weight == OUT_FEATURES * IN_FEATURES + scale_bytes
    out.sum().backward()
    assert x.grad is not None
