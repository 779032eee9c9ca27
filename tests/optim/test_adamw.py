"""fp8train.optim.AdamW: torch.optim.AdamW's numbers where every dtype is float32, the memory
of each precision, resume, per-group settings, and the errors."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

import fp8train.optim
from fp8train.optim import AdamW, StatePrecision

SHAPES = ((64, 130), (7,), (3, 4, 5))
LOW_PRECISION = dict(
    master_weight_dtype=torch.bfloat16, exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.bfloat16
)


def _params(dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in SHAPES]


def _set_grads(params_list, step, skip=()):
    """The same gradients on each list of parameters (float32 values, in each parameter's dtype)."""
    generator = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(p.shape, generator=generator) for p in params_list[0]]
    for params in params_list:
        for index, (param, grad) in enumerate(zip(params, grads)):
            param.grad = None if index in skip else grad.to(param.dtype)


def _groups(params):
    return [
        {"params": params[:1], "lr": 3e-3, "weight_decay": 0.1, "betas": (0.8, 0.99)},
        {"params": params[1:], "weight_decay": 0.0},
    ]


def test_float32_state_equals_torch_adamw_bit_for_bit():
    # Groups with their own hyperparameters, an LR schedule, clip_grad_norm_, and a
    # parameter without a gradient at some steps.
    ours, theirs = _params(), _params()
    optimizer = AdamW(_groups(ours), lr=1e-2, eps=1e-6)
    reference = torch.optim.AdamW(_groups(theirs), lr=1e-2, eps=1e-6, foreach=False)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1 / (1 + step)) for o in (optimizer, reference)]
    for step in range(6):
        _set_grads([ours, theirs], step, skip=(2,) if step < 2 else ())
        for params in (ours, theirs):
            nn.utils.clip_grad_norm_(params, max_norm=5.0)
        optimizer.step()
        reference.step()
        for schedule in schedules:
            schedule.step()
    for mine, torchs in zip(ours, theirs):
        assert torch.equal(mine, torchs)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[mine][key], reference.state[torchs][key]), key


@pytest.mark.parametrize(
    "settings",
    [{}, {**LOW_PRECISION, "stochastic_rounding": False}, dict(exp_avg_dtype=torch.bfloat16, stochastic_rounding=False)],
    ids=["float32", "bf16_master_fp8_m", "bf16_moment"],
)
def test_chunked_update_gives_the_whole_tensors_bits(settings, monkeypatch):
    """A parameter larger than a chunk is updated in chunks that end on FP8 moment blocks
    (61 x 67 = 4087 elements, chunks of 3 x 128 = 384, the last one 247, mid-block); rounded to
    nearest, the masters, moments and FP8 scales equal a one-piece update's. (Stochastic
    rounding draws chunk by chunk: other draws, as reproducible.)"""
    dtype = torch.bfloat16 if settings.get("master_weight_dtype") == torch.bfloat16 else torch.float32
    runs = []
    for chunk in (400, 1 << 30):
        monkeypatch.setattr(fp8train.optim.chunks, "CHUNK_ELEMENTS", chunk)
        torch.manual_seed(0)  # the stochastic rounding's draws
        params = [nn.Parameter(torch.randn(61, 67, generator=torch.Generator().manual_seed(0)).to(dtype))]
        optimizer = AdamW(params, lr=1e-2, **settings)
        for step in range(3):
            params[0].grad = torch.randn(61, 67, generator=torch.Generator().manual_seed(step)).to(dtype)
            optimizer.step()
        runs.append((params, optimizer))
    (chunked, chunked_opt), (whole, whole_opt) = runs
    for mine, reference in zip(chunked, whole):
        assert torch.equal(mine, reference)
        for key, value in whole_opt.state[reference].items():
            assert torch.equal(chunked_opt.state[mine][key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key


def test_a_non_contiguous_parameter_is_updated_whole(monkeypatch):
    monkeypatch.setattr(fp8train.optim.chunks, "CHUNK_ELEMENTS", 128)
    ours = nn.Parameter(torch.randn(130, 64).t())  # no flat view
    theirs = nn.Parameter(ours.detach().clone())
    optimizer, reference = AdamW([ours], lr=1e-2), torch.optim.AdamW([theirs], lr=1e-2, foreach=False)
    for step in range(2):
        ours.grad = torch.randn(130, 64, generator=torch.Generator().manual_seed(step)).t()
        theirs.grad = ours.grad.clone()
        optimizer.step()
        reference.step()
    assert torch.equal(ours, theirs)


def test_a_parameter_without_gradient_is_skipped():
    params = _params()
    before = params[1].detach().clone()
    optimizer = AdamW(params, **LOW_PRECISION | {"master_weight_dtype": None})
    _set_grads([params], 0, skip=(1,))
    optimizer.step()
    assert torch.equal(params[1], before)
    assert params[1] not in optimizer.state and params[0] in optimizer.state


def test_float32_master_of_bfloat16_parameters_is_torch_adamw_on_float32():
    # The master follows torch.optim.AdamW on float32 copies exactly; the parameter is the
    # master rounded to nearest.
    ours = _params(torch.bfloat16)
    theirs = [nn.Parameter(p.detach().float()) for p in ours]
    optimizer = AdamW(ours, lr=1e-2, master_weight_dtype=torch.float32)
    reference = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    for step in range(4):
        _set_grads([ours, theirs], step)
        for param in theirs:  # the bfloat16 gradient's values
            param.grad = param.grad.bfloat16().float()
        optimizer.step()
        reference.step()
    for mine, torchs in zip(ours, theirs):
        assert torch.equal(optimizer.state[mine]["master"], torchs)
        assert torch.equal(mine, torchs.to(torch.bfloat16))


@pytest.mark.parametrize(
    "param_dtype, settings, numel, expected_bytes",
    [
        # float32 moments: 4 + 4 B/param.
        (torch.float32, {}, 1000, 8000),
        # FP8 m: ceil(1000/128) = 8 blocks of 128 codes + a float32 scale; bf16 v: 2 B/param.
        (torch.float32, {"exp_avg_dtype": torch.float8_e4m3fn, "exp_avg_sq_dtype": torch.bfloat16}, 1000,
         8 * 128 + 8 * 4 + 2000),
        # bfloat16 parameters with a float32 master (4) and bfloat16 moments (2 + 2).
        (torch.bfloat16, {"master_weight_dtype": torch.float32, "exp_avg_dtype": torch.bfloat16,
                          "exp_avg_sq_dtype": torch.bfloat16}, 1024, 8 * 1024),
        # The target: bfloat16 master is the parameter itself, FP8 m, bfloat16 v:
        # 1 + 4/128 + 2 = 3.03 B/param.
        (torch.bfloat16, LOW_PRECISION, 1024, 1024 + 8 * 4 + 2048),
        (torch.float32, {"exp_avg_dtype": torch.float8_e4m3fn, "fp8_block_size": 256}, 256, 256 + 4 + 1024),
    ],
)  # fmt: skip
def test_state_bytes_per_parameter(param_dtype, settings, numel, expected_bytes):
    param = nn.Parameter(torch.randn(numel).to(param_dtype))
    optimizer = AdamW([param], **settings)
    param.grad = torch.randn_like(param)
    optimizer.step()
    assert optimizer.state_bytes() == expected_bytes
    assert StatePrecision(**settings).state_bytes_per_param(param_dtype, numel) == expected_bytes


@pytest.mark.parametrize(
    "param_dtype, settings",
    [(torch.float32, {}), (torch.bfloat16, LOW_PRECISION), (torch.bfloat16, {"master_weight_dtype": torch.float32})],
)
def test_resume_from_state_dict_is_bit_identical(param_dtype, settings):
    def run(params, optimizer, steps):
        for step in steps:
            _set_grads([params], step)
            optimizer.step()

    params = _params(param_dtype)
    optimizer = AdamW(params, lr=1e-2, **settings)
    run(params, optimizer, range(3))
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}, buffer)
    saved_params = [p.detach().clone() for p in params]
    run(params, optimizer, range(3, 6))

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed_params = [nn.Parameter(p) for p in saved_params]
    resumed = AdamW(resumed_params, lr=1.0)  # settings come from the checkpoint's groups
    resumed.load_state_dict(checkpoint["optimizer"])
    torch.set_rng_state(checkpoint["rng"])  # stochastic rounding draws from it
    run(resumed_params, resumed, range(3, 6))
    for mine, theirs in zip(params, resumed_params):
        assert torch.equal(mine, theirs)
        for key, value in optimizer.state[mine].items():
            assert resumed.state[theirs][key].dtype == value.dtype, key
            assert torch.equal(resumed.state[theirs][key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key


def test_loads_a_torch_adamw_state_dict_and_continues_like_it():
    ours, theirs = _params(), _params()
    reference = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    _set_grads([theirs], 0)
    reference.step()
    for mine, torchs in zip(ours, theirs):
        mine.data.copy_(torchs.detach())
    optimizer = AdamW(ours, lr=1e-2)
    optimizer.load_state_dict(reference.state_dict())
    for step in (1, 2):
        _set_grads([ours, theirs], step)
        optimizer.step()
        reference.step()
    assert all(torch.equal(mine, torchs) for mine, torchs in zip(ours, theirs))
    reference.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match=r"amsgrad=True, which fp8train.optim.AdamW does not do"):
        AdamW(_params()).load_state_dict(reference.state_dict())


def test_groups_keep_their_own_precision():
    params = _params()
    optimizer = AdamW([{"params": params[:1], "exp_avg_dtype": torch.float8_e4m3fn}, {"params": params[1:]}])
    _set_grads([params], 0)
    optimizer.step()
    assert optimizer.state[params[0]]["exp_avg"].dtype == torch.float8_e4m3fn
    assert optimizer.state[params[1]]["exp_avg"].dtype == torch.float32
    assert "exp_avg_scale_inv" not in optimizer.state[params[1]]


def test_stochastic_rounding_follows_torch_manual_seed():
    def run(seed):
        torch.manual_seed(seed)
        params = _params(torch.bfloat16)
        optimizer = AdamW(params, lr=1e-4, **LOW_PRECISION)
        for step in range(2):
            _set_grads([params], step)
            optimizer.step()
        return torch.cat([p.detach().reshape(-1) for p in params])

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


# Loss of a least-squares fit after STEPS steps, relative to float32 AdamW's.
STEPS = 60
MAX_LOSS_RATIO = {"fp8_m_bf16_v": 1.3, "bf16_master_stochastic": 1.3}  # measured: 1.15, 1.14


@pytest.mark.parametrize("name", sorted(MAX_LOSS_RATIO))
def test_low_precision_state_trains_like_float32(name):
    settings = {
        "fp8_m_bf16_v": {"exp_avg_dtype": torch.float8_e4m3fn, "exp_avg_sq_dtype": torch.bfloat16},
        "bf16_master_stochastic": LOW_PRECISION,
    }[name]
    param_dtype = torch.bfloat16 if settings.get("master_weight_dtype") == torch.bfloat16 else torch.float32

    def final_loss(settings, dtype):
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn(256, 64, generator=generator)
        targets = inputs @ (0.1 * torch.randn(64, 16, generator=generator))
        torch.manual_seed(0)
        layer = nn.Linear(64, 16).to(dtype)
        optimizer = AdamW(layer.parameters(), lr=1e-2, **settings)
        for _ in range(STEPS):
            loss = nn.functional.mse_loss(layer(inputs.to(dtype)).float(), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return loss.item()

    baseline = final_loss({}, torch.float32)
    assert baseline < 0.01  # it learns (the targets' variance is 0.64)
    assert final_loss(settings, param_dtype) < MAX_LOSS_RATIO[name] * baseline


@pytest.mark.parametrize(
    "settings, error, match",
    [
        ({"master_weight_dtype": torch.float16}, ValueError,
         r"master_weight_dtype=torch.float16 is not supported; use one of None, torch.float32, torch.bfloat16"),
        ({"exp_avg_dtype": torch.float8_e5m2}, ValueError,
         r"exp_avg_dtype=torch.float8_e5m2 is not supported; use one of torch.float32, torch.bfloat16, "
         r"torch.float8_e4m3fn"),
        ({"exp_avg_sq_dtype": torch.float8_e4m3fn}, ValueError,
         r"exp_avg_sq_dtype=torch.float8_e4m3fn is not supported; use one of torch.float32, torch.bfloat16"),
        ({"exp_avg_dtype": "bf16"}, ValueError, r"exp_avg_dtype='bf16' \(a str\) is not supported"),
        ({"master_weight_dtype": torch.bfloat16}, ValueError,
         r"master_weight_dtype=torch.bfloat16 is narrower than a torch.float32 parameter"),
        ({"stochastic_rounding": "yes"}, TypeError, r"stochastic_rounding='yes' must be True or False"),
        ({"fp8_block_size": 0}, ValueError, r"fp8_block_size=0 must be an int >= 1"),
        ({"lr": -1.0}, ValueError, r"lr=-1.0"),
        ({"lr": "1e-3"}, TypeError, r"lr='1e-3' must be a finite number >= 0"),
        ({"fp8_block_size": 2.0}, TypeError, r"fp8_block_size=2.0 must be an int >= 1"),
        ({"betas": (0.9, 1.0)}, ValueError, r"betas\[1\]=1.0 must be in \[0, 1\)"),
        ({"betas": 0.9}, ValueError, r"betas=0.9 must be a pair"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_naming_the_value(settings, error, match):
    with pytest.raises(error, match=match):
        AdamW([nn.Parameter(torch.zeros(4))], **settings)


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match=r"real floating-point parameters, got a torch.int64 parameter"):
        AdamW([torch.zeros(4, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"got a torch.complex64 parameter"):
        AdamW([nn.Parameter(torch.zeros(4, dtype=torch.complex64))])
    optimizer = AdamW([nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match=r"torch.float32 parameter.*use master_weight_dtype=None or torch.float32"):
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "master_weight_dtype": torch.bfloat16})


def test_sparse_gradients_are_refused():
    embedding = nn.Embedding(10, 4, sparse=True)
    optimizer = AdamW(embedding.parameters())
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match=r"does not take sparse gradients \(parameter 0 of group 0, shape \(10, 4\)\)"):
        optimizer.step()


def test_the_hooks_for_a_weight_held_elsewhere():
    # What FP8-weight modules build on: a subclass keeps the weight's value in the state and
    # gives the module a rounded copy after each step. Here the "module's copy" is bfloat16.
    class ExternalMaster(AdamW):
        def _master_for(self, param, state):
            return state.setdefault("held", param.detach().float())

        def _write_back(self, param, master):
            param.copy_(master.to(param.dtype))

    param = nn.Parameter(torch.randn(32).bfloat16())
    reference = nn.Parameter(param.detach().float())
    optimizer, torch_optimizer = ExternalMaster([param], lr=1e-2), torch.optim.AdamW([reference], lr=1e-2, foreach=False)
    for step in range(3):
        grad = torch.randn(32, generator=torch.Generator().manual_seed(step))
        param.grad, reference.grad = grad.bfloat16(), grad.bfloat16().float()
        optimizer.step()
        torch_optimizer.step()
    assert torch.equal(optimizer.state[param]["held"], reference)
    assert torch.equal(param, reference.bfloat16())


def test_module_is_reachable_as_fp8train_optim():
    assert fp8train.optim.AdamW is AdamW
    assert math.isclose(AdamW([nn.Parameter(torch.zeros(1))]).defaults["weight_decay"], 1e-2)
