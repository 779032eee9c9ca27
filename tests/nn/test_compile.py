"""torch.compile and converted models (issue 12): no graph breaks in forward or backward for
any recipe, no recompilation beyond the input's own variants, several converted models
compiled in one process, and the same numbers as eager.

The default run only traces (``torch._dynamo.explain``, which also traces each
autograd.Function's backward with its forward: a break there shows): about 20 s on 2 cores.
The rest compiles (slow on 2 cores: about 10 minutes), with backend ``aot_eager`` where the
result must equal eager's bit for bit (graph breaks and recompilations are Dynamo's
whatever the backend; inductor's fusion reorders float32 sums) and inductor where closeness
is the point:

    python -m pytest -q -m slow tests/nn/test_compile.py
"""

from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch
from torch._dynamo.utils import counters

import fp8train
from fp8train.nn.autocast import current_state
from fp8train.spec.recipes import RECIPE_NAMES, NVFP4Scaling
from tests.helpers.tolerances import min_sqnr_db

STEPS = 3  # delayed scaling: the scales evolve over steps, and the state must follow eager's
MIN_SQNR_DB = 30  # inductor against eager: the same arithmetic, float32 sums reordered by fusion


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch, and hitting the recompile limit fails it (rather
    than silently running eager)."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def _mlp(small_model, recipe, dim=128, dtype=None):
    return small_model((dim, 2 * dim), "gelu", (2 * dim, dim), recipe=recipe, backend="auto", dtype=dtype)


@contextlib.contextmanager
def _trainer_contexts(mixed_precision: bool = True):
    """What the trainer runs a forward under: bf16 autocast and ``fp8train.autocast``."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed_precision), fp8train.autocast():
        yield


def _same_draws(recipe: str):
    """``recipe``, or for nvfp4 its variant that rounds to nearest: a compiled graph draws
    stochastic rounding's random numbers in its own order (and inductor from its own
    generator), so only the deterministic plan can match eager bit for bit."""
    return NVFP4Scaling(disable_stochastic_rounding=True) if recipe == "nvfp4" else recipe


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def _break_reasons() -> list[str]:
    return [reason.splitlines()[0] for reason in counters["graph_break"]]


# By default one recipe of each kind of scale (per tensor, delayed, MX blocks, 4 bits with a
# transform and stochastic rounding); rowwise, blockwise and MXFP4 trace the same code paths
# and run under -m slow.
_DEFAULT_COMPILED = {"tensorwise", "delayed"}
_HEAVY_COMPILED = {"mxfp8", "nvfp4"}  # seconds each: CI's second leg (default run under 6 minutes)


@pytest.mark.parametrize(
    "recipe",
    [
        r if r in _DEFAULT_COMPILED else pytest.param(r, marks=pytest.mark.heavy if r in _HEAVY_COMPILED else pytest.mark.slow)
        for r in RECIPE_NAMES
    ],
)
@pytest.mark.parametrize(
    "contexts", ["trainer", pytest.param("none", marks=pytest.mark.slow)]
)
def test_forward_has_no_graph_breaks(recipe, contexts, small_model):
    """Forward, and with it every autograd.Function's backward (Dynamo traces both at the
    ``apply``; a break in either would make the whole Function run eagerly)."""
    model = _mlp(small_model, recipe)
    x = torch.randn(2, 40, 128)  # 80 tokens: padded to every recipe's block
    with _trainer_contexts() if contexts == "trainer" else contextlib.nullcontext():
        explanation = torch._dynamo.explain(model)(x)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), [
        b.reason.splitlines()[0] for b in explanation.break_reasons
    ]


def _train_step(model, x, inside_autocast=True, compiled_autograd=False):
    with fp8train.autocast() if inside_autocast else contextlib.nullcontext():
        out = model(x)
    backward = (
        torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager"))
        if compiled_autograd
        else contextlib.nullcontext()
    )
    with backward:
        out.float().square().mean().backward()
    return out


def _assert_same_state(eager, compiled, step):
    for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(p_compiled.grad, p_eager.grad), f"step {step}: grad of {name}"
    for (name, b_eager), b_compiled in zip(eager.named_buffers(), compiled.buffers()):
        assert torch.equal(b_compiled, b_eager), f"step {step}: {name}"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_training_steps_have_no_graph_breaks_and_match_eager_bitwise(recipe, small_model):
    """Forward and backward (the autograd.Function's backward is traced with its forward),
    compiled once for all steps, with eager's outputs, gradients and delayed-scaling state."""
    eager = _mlp(small_model, _same_draws(recipe))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)  # a break raises
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(2, 64, 128, generator=generator)
        out_eager, out_compiled = _train_step(eager, x), _train_step(compiled, x)
        assert torch.equal(out_compiled, out_eager), f"step {step}"
        _assert_same_state(eager, compiled_model, step)
    assert counters["stats"]["unique_graphs"] == 1  # no recompilation from one step to the next


@pytest.mark.slow
@pytest.mark.parametrize("inside_autocast", [True, False], ids=["in_autocast", "no_autocast"])
@pytest.mark.parametrize("compiled_autograd", [False, True], ids=["", "compiled_autograd"])
def test_delayed_scaling_state_follows_eager(inside_autocast, compiled_autograd, small_model):
    """Delayed scaling's buffers change in place between forward and backward eagerly; the
    compiled backward holds them as saved tensors, so its forward update waits for the
    backward (or the next forward): the same numbers at every step, also for a forward with
    grad but no backward and one without grad."""
    eager = _mlp(small_model, "delayed")
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    generator = torch.Generator().manual_seed(1)
    for step, kind in enumerate(("train", "train", "no_backward", "no_grad", "train", "train")):
        x = torch.randn(2, 64, 128, generator=generator)
        if kind == "train":
            outs = [_train_step(model, x, inside_autocast, compiled_autograd and model is compiled) for model in (eager, compiled)]
        else:
            with torch.set_grad_enabled(kind != "no_grad"), fp8train.autocast() if inside_autocast else contextlib.nullcontext():
                outs = [eager(x), compiled(x)]
        assert torch.equal(outs[1], outs[0]), f"step {step} ({kind})"
        for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled_model.parameters()):
            assert torch.equal(p_compiled.grad, p_eager.grad), f"step {step}: grad of {name}"
    with torch.no_grad(), fp8train.autocast() if inside_autocast else contextlib.nullcontext():
        eager(x), compiled(x)  # applies an update still pending (compiled autograd: every one)
    _assert_same_state(eager, compiled_model, "end")
    assert _graph_breaks() == 0, _break_reasons()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_backward_under_compiled_autograd_has_no_graph_breaks(recipe, small_model):
    eager = _mlp(small_model, _same_draws(recipe))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    x = torch.randn(2, 64, 128)
    for step in range(2):
        _train_step(eager, x)
        _train_step(compiled, x, compiled_autograd=True)
        for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled_model.parameters()):
            assert torch.equal(p_compiled.grad, p_eager.grad), f"step {step}: grad of {name}"
    assert counters["compiled_autograd"]["captures"] >= 1
    assert _graph_breaks() == 0, _break_reasons()


@pytest.mark.slow
def test_token_counts_share_one_dynamic_graph(small_model):
    """The token count is the one dim that varies: after its first change the graph is
    recompiled once with it dynamic, aligned to the block or not (the forward pads always)."""
    compiled = torch.compile(_mlp(small_model, "blockwise"), backend="aot_eager")
    for tokens in (256, 300, 200, 333, 1000):
        _train_step(compiled, torch.randn(tokens, 128))
    assert _graph_breaks() == 0, _break_reasons()
    assert counters["frames"]["total"] == 2


@pytest.mark.slow
def test_two_converted_models_stay_compiled(small_model):
    """Two models of different widths, dtypes and recipes, each training and evaluating,
    compiled in one process: within the recompile limit (a hit fails the test, see the
    fixture), with no graph break."""
    models = [
        (_mlp(small_model, "tensorwise", dim=128), torch.float32, 128),
        (_mlp(small_model, "mxfp8", dim=256, dtype=torch.bfloat16), torch.bfloat16, 256),
    ]
    compiled = [(torch.compile(model, backend="aot_eager"), dtype, dim) for model, dtype, dim in models]
    for step in range(STEPS):
        for model, dtype, dim in compiled:
            x = torch.randn(64, dim, dtype=dtype)
            _train_step(model, x)
            with torch.no_grad(), fp8train.autocast():
                model(x)
    assert _graph_breaks() == 0, _break_reasons()
    assert counters["frames"]["total"] == 4  # per model: one training graph, one without grad


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "mxfp8"])
def test_conv1d_and_attention_train_compiled_as_eager(recipe):
    """The other converted modules (GPT-2's Conv1D, nn.MultiheadAttention) share the
    Linear's forward: no graph break, eager's numbers (delayed: one state for several GEMMs)."""
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn = conv1d(256, 128)
            self.attn = torch.nn.MultiheadAttention(256, 4, batch_first=True)
            self.proj = torch.nn.Linear(256, 128)

        def forward(self, x):
            h = self.c_attn(x)
            return self.proj(self.attn(h, h, h, need_weights=False)[0])

    torch.manual_seed(0)
    eager = fp8train.convert_to_float8_training(Block(), recipe)
    assert {type(m).__name__ for m in eager.modules()} >= {"Float8Conv1D", "Float8MultiheadAttention"}
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(2, 64, 128, generator=generator)
        assert torch.equal(_train_step(compiled, x), _train_step(eager, x)), f"step {step}"
        _assert_same_state(eager, compiled_model, step)
    assert _graph_breaks() == 0, _break_reasons()
    assert counters["frames"]["total"] == 1


@pytest.mark.slow
def test_default_model_forward_has_no_graph_breaks():
    from fp8train.train.arguments import TrainingArguments
    from fp8train.train.user_model import build_model

    torch.manual_seed(0)
    args = TrainingArguments()
    model = fp8train.convert_to_float8_training(build_model(args), "tensorwise")
    inputs = torch.randint(0, model.config.vocab_size, (2, args.seq_len))
    with _trainer_contexts():
        explanation = torch._dynamo.explain(model)(inputs, inputs)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), [
        b.reason.splitlines()[0] for b in explanation.break_reasons
    ]


def test_autocast_state_is_per_thread():
    """The state is a thread-local (``torch.compile`` cannot trace a ContextVar): another
    thread sees none of this thread's autocast, as with a context variable."""
    seen = []
    with fp8train.autocast(enabled=False) as state:
        thread = threading.Thread(target=lambda: seen.append(current_state()))
        thread.start()
        thread.join()
        assert current_state() == state
    assert seen == [None] and current_state() is None


# ---------------------------------------------------------------------------- inductor (slow)


def _sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    noise = (ref - out).square().sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(ref.square().sum() / noise))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_inductor_matches_eager(recipe, small_model):
    """Inductor's fused kernels round some float32 sums (bias gradients, GELU) differently
    from eager, an ulp here and there; FP8 quantization then flips a few codes, and delayed
    scaling feeds its scales forward: close, not equal."""
    eager = _mlp(small_model, recipe)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model)
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(2, 64, 128, generator=generator)
        out_eager, out_compiled = _train_step(eager, x), _train_step(compiled, x)
        assert _sqnr_db(out_eager, out_compiled) > min_sqnr_db(recipe, MIN_SQNR_DB), f"step {step}"
        for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled_model.parameters()):
            assert _sqnr_db(p_eager.grad, p_compiled.grad) > min_sqnr_db(recipe, MIN_SQNR_DB), f"step {step}: grad of {name}"
    assert _graph_breaks() == 0, _break_reasons()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_default_model_trains_compiled_without_graph_breaks(recipe):
    from fp8train.train.arguments import TrainingArguments
    from fp8train.train.user_model import build_model

    torch.manual_seed(0)
    args = TrainingArguments()
    model = fp8train.convert_to_float8_training(build_model(args), recipe)
    compiled = torch.compile(model, backend="aot_eager")  # inductor: test_inductor_matches_eager
    inputs = torch.randint(0, model.config.vocab_size, (2, args.seq_len))
    for _ in range(2):
        with _trainer_contexts():
            loss = compiled(inputs, inputs)
        loss.backward()
        with torch.no_grad(), _trainer_contexts():
            compiled(inputs, inputs)
    assert torch.isfinite(loss)
    assert _graph_breaks() == 0, _break_reasons()
    assert counters["frames"]["total"] == 2


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_tracing_a_step_warns_nothing_about_cached_helpers(recipe, small_model, monkeypatch):
    """The host-cost caches (a delayed recipe's format maxima, the off-CUDA reason) are
    bypassed while Dynamo traces: their ``functools`` wrappers would make it warn to users."""
    import warnings

    from torch._dynamo import utils as dynamo_utils

    monkeypatch.setattr(dynamo_utils, "warn_once_cache", set())  # every message warns afresh
    model = _mlp(small_model, recipe)
    x = torch.randn(2, 40, 128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="eager")
        with fp8train.autocast():
            compiled(x).sum().backward()
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]
