"""Run by ``torchrun --nproc-per-node 2`` (gloo, CPU) from ``test_ddp_any_loop.py``: a
converted tiny Llama with delayed scaling, trained by the stock transformers ``Trainer`` and
then by accelerate, neither inside ``fp8train.autocast``. Rank 0 prints, per framework, how
many delayed-scaling buffers differ between the ranks and how many there are (JSON)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for ``tests``

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fp8train  # noqa: E402
from tests.integrations.test_transformers import tiny_llama, token_dataset  # noqa: E402

RECIPE = fp8train.DelayedScaling(amax_history_len=4)
STATE_NAMES = ("fp8_scale", "fp8_amax_history")


def differing_buffers(model: torch.nn.Module) -> list[int]:
    """``[buffers that differ between the ranks, delayed-scaling buffers]``."""
    buffers = {name: b.detach().cpu() for name, b in model.named_buffers() if name.endswith(STATE_NAMES)}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, buffers)
    differ = [name for name in buffers if not all(torch.equal(other[name], buffers[name]) for other in gathered)]
    return [len(differ), len(buffers)]


def with_trainer(output_dir: str) -> list[int]:
    import transformers

    model = fp8train.convert_to_float8_training(tiny_llama(), RECIPE)
    args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3, seed=0,
        use_cpu=True, ddp_backend="gloo", save_strategy="no", report_to=[], disable_tqdm=True,
    )  # fmt: skip
    transformers.Trainer(model=model, args=args, train_dataset=token_dataset(16)).train()
    return differing_buffers(model)


def with_accelerate() -> list[int]:
    import accelerate

    accelerator = accelerate.Accelerator(cpu=True)
    model = fp8train.convert_to_float8_training(tiny_llama(), RECIPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(token_dataset(16), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    return differing_buffers(accelerator.unwrap_model(model))


def main() -> None:
    with tempfile.TemporaryDirectory() as output_dir:
        report = {"trainer": with_trainer(output_dir), "accelerate": with_accelerate()}
    if dist.get_rank() == 0:
        print(json.dumps(report))
    # Explicitly: a process group left to the interpreter's exit can abort a rank as gloo's
    # threads are torn down ("terminate called without an active exception"; seen once).
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
