"""Delayed scaling on a real model (transformers' Llama), step by step, against an
independent reference of the update rule written here from the recipe's description:

    every step, each module records amax(input), amax(weight), amax(grad_output);
    amax = max(history), scale = fp8_max / amax / 2**margin (where amax is finite and > 0,
    else unchanged), the history rolls; a tensor whose current amax is 0 keeps both.

The reference sees only the tensors (through hooks) and keeps its own history in NumPy
float32, so a mistake in fp8train's recording, reduction, roll or timing shows as a
mismatch at the first step it happens.
"""

import numpy as np
import pytest
import torch

import fp8train
from fp8train.nn.modules.linear import Float8Linear
from fp8train.recipes import DelayedScaling

transformers = pytest.importorskip("transformers")

FP8_MAX = np.array([448.0, 448.0, 57344.0], dtype=np.float32)  # HYBRID: E4M3 forward, E5M2 grad_output
STEPS = 6


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=256, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class _Reference:
    """One module's delayed-scaling state, kept in NumPy float32."""

    def __init__(self, history_len: int, margin: int) -> None:
        self.history = np.zeros((history_len, 3), dtype=np.float32)
        self.scale = np.ones(3, dtype=np.float32)
        self.margin = margin
        self.current = np.zeros(3, dtype=np.float32)

    def record(self, role: int, tensor: torch.Tensor) -> None:
        self.current[role] = max(self.current[role], np.float32(tensor.detach().abs().max().item()))

    def update(self) -> None:
        self.history[0] = self.current
        for role in range(3):
            if self.current[role] == 0:  # did not run: neither rescaled nor rolled
                continue
            amax = self.history[:, role].max()
            if np.isfinite(amax) and amax > 0:
                self.scale[role] = np.float32(np.float32(FP8_MAX[role] / amax) / np.float32(2.0**self.margin))
            self.history[:, role] = np.roll(self.history[:, role], -1)
            self.history[0, role] = 0
        self.current[:] = 0


@pytest.mark.parametrize("history_len, margin", [(4, 0), (1024, 1)])
def test_delayed_state_follows_the_reference_step_by_step(history_len, margin):
    model = _llama()
    recipe = DelayedScaling(amax_history_len=history_len, margin=margin)
    fp8train.convert_to_float8_training(model, recipe)
    modules = {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert len(modules) == 8  # q, k, v, o, gate, up, down, lm_head
    references = {name: _Reference(history_len, margin) for name in modules}

    def forward_hook(name):
        def hook(module, args, output):
            references[name].record(0, args[0])
            references[name].record(1, module.weight)
            output.register_hook(lambda grad: references[name].record(2, grad))

        return hook

    for name, module in modules.items():
        module.register_forward_hook(forward_hook(name))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        ids = torch.randint(0, 256, (4, 32), generator=generator)
        with fp8train.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        for name, module in modules.items():
            reference = references[name]
            reference.update()
            np.testing.assert_array_equal(module.fp8_scale.numpy(), reference.scale, err_msg=f"step {step}: {name}")
            np.testing.assert_array_equal(module.fp8_amax_history.numpy(), reference.history, err_msg=f"step {step}: {name}")
    assert torch.isfinite(loss)
