"""What one training step of the trainer's default model keeps for its backward, and its peak memory.

    python benchmarks/bench_saved_activations.py [--recipes ...] [--batch_size 16] [--out benchmarks/results_saved_activations.json]

Builds the default GPT exactly as ``fp8train train`` does with its defaults (float32
parameters, ``torch.autocast`` bfloat16 around the model, every Linear converted with
``convert_to_float8_training``, the ``auto`` backend: emulated on a CPU) and runs one
forward and backward for the bf16 baseline (no conversion) and for each recipe, with
``save_fp8_activations`` True and False. Prints a Markdown table and writes JSON. Columns:

* Linear inputs saved: bytes the Linear layers keep of their inputs for the backward
  (the high-precision input, or its FP8 grad_weight operand with its scales).
* all saved: bytes of every tensor the step's autograd graph keeps for the backward.
* peak: the most bytes allocated by PyTorch's CPU allocator during the step (forward and
  backward, gradients included) and live at once, above those live when it started. On a
  CPU the emulated FP8 GEMMs add float32 temporaries that hardware GEMMs do not.

How the saved bytes are counted (:class:`SavedTensorCounter`): every tensor saved for
backward passes through ``torch.autograd.graph.saved_tensors_hooks``; tensors an autograd
Function keeps as ``ctx`` attributes instead (which those hooks never see) are found by
walking the graph each Linear's forward adds. A storage is counted whole (a saved view
keeps its whole storage alive) and once in each sum; parameters and buffers are not
counted (they live anyway). Inside a Linear layer, a tensor shaped like the weight,
``(N, K)`` or ``(K, N)``, is the weight's (a bf16 copy, an FP8 copy); everything else it
keeps is its input's, even where another op keeps the same storage too (attention keeps
its output, the projection's input, for its own backward): "Linear inputs" is what the
layers hold, "all saved" what the step holds. ``tests/nn/test_saved_activations.py``
checks these numbers against hand-computed ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
from dataclasses import dataclass

import torch
from torch import nn

import fp8train
from fp8train import TrainingArguments
from fp8train.quant import QuantizedTensor
from fp8train.recipes import RECIPE_NAMES
from fp8train.train.commands.compare import build_model
from fp8train.diagnostics.markdown import markdown_table

BASELINE = "bf16"
# Scale groups run along up to 128 tokens; see SavedTensorCounter.
TOKEN_BLOCK, MX_BLOCK = 128, 32


@dataclass(frozen=True)
class SavedBytes:
    """Bytes an autograd graph keeps for the backward (parameters and buffers not counted).

    Attributes:
        linear_input: what the Linear layers keep of their inputs (storages other ops
            keep too included).
        linear_weight: what they keep of their weights beyond the parameters (16-bit or FP8 copies).
        total: every tensor the graph keeps, each storage once.
    """

    linear_input: int
    linear_weight: int
    total: int


def _storage(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _tensors_of(value) -> list[torch.Tensor]:
    """The tensors a ctx attribute holds: itself, or a QuantizedTensor's data, scales (and
    NVFP4's global amax) and the emulated GEMM's converted copy."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, QuantizedTensor):
        cache = value.gemm_cache
        held = [value.data, value.scale_inv, value.global_amax]
        held += [cache.values, cache.out_scale] if cache is not None else []
        return [t for t in held if t is not None]
    return []


def _dims(*sizes: int) -> set[int]:
    """The dimensions of a saved operand's codes for these sizes: as they are, or halved
    (4-bit codes, two to a byte)."""
    return {size // d for size in sizes for d in (1, 2)}


def _check_distinguishable(name: str, module: nn.Linear, tokens: int) -> None:
    """Inputs and weights are told apart by the shape of their codes: the token count
    (and its half) must not be a feature count (nor its half), and needs no padding."""
    if tokens % TOKEN_BLOCK or not _dims(tokens).isdisjoint(_dims(module.in_features, module.out_features)):
        raise ValueError(
            f"{name} sees {tokens} tokens: SavedTensorCounter tells a Linear's input from its weight by shape, "
            f"so the tokens must be a multiple of {TOKEN_BLOCK} and neither they nor their half may equal "
            f"in_features={module.in_features} or out_features={module.out_features} or their halves; "
            "change the batch size"
        )


_CODE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float4_e2m1fn_x2)  # FP8 codes, packed 4-bit codes


class SavedTensorCounter:
    """Count the bytes a forward keeps for its backward, split into what the ``nn.Linear``
    layers (``Float8Linear`` included) keep of their inputs and weights.

    Use it around the forward only; read :meth:`saved_bytes` before the backward::

        with SavedTensorCounter(model) as counter:
            loss = model(inputs)
        saved = counter.saved_bytes()
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._kept = {_storage(t)[0] for t in (*model.parameters(), *model.buffers())}
        # kind ("input", "weight", "other", "total") -> {storage data_ptr: nbytes}
        self._storages: dict[str, dict[int, int]] = {kind: {} for kind in ("input", "weight", "other", "total")}
        self._active: list[tuple[nn.Linear, int]] = []  # (layer, its token count)
        self._last_kind, self._scales_to_come = "other", 0
        self._handles: list = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def __enter__(self) -> "SavedTensorCounter":
        for name, module in self._model.named_modules():
            if isinstance(module, nn.Linear):
                self._handles.append(module.register_forward_pre_hook(self._enter_linear(name)))
                self._handles.append(module.register_forward_hook(self._leave_linear))
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def saved_bytes(self) -> SavedBytes:
        """What the forward(s) run inside the counter keep."""
        linear_input, linear_weight, total = (sum(self._storages[k].values()) for k in ("input", "weight", "total"))
        return SavedBytes(linear_input=linear_input, linear_weight=linear_weight, total=total)

    def _enter_linear(self, name: str):
        def hook(module: nn.Linear, args) -> None:
            tokens = args[0].numel() // module.in_features
            _check_distinguishable(name, module, tokens)
            self._active.append((module, tokens))

        return hook

    def _leave_linear(self, module: nn.Linear, args, output: torch.Tensor) -> None:
        # ctx attributes of the autograd nodes this layer added (down to its input's node).
        stop = {t.grad_fn for t in args if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        nodes, seen = [output.grad_fn], set()
        while nodes:
            node = nodes.pop()
            if node is None or node in stop or node in seen:
                continue
            seen.add(node)
            for value in getattr(node, "__dict__", {}).values():
                tensors = _tensors_of(value)
                # A QuantizedTensor by the shape of its values (4-bit data is packed).
                shape = value.unpacked_shape_2d if isinstance(value, QuantizedTensor) else None
                kind = self._kind(tensors[0], shape) if tensors else None
                for t in tensors:
                    self._record(t, kind)
            nodes.extend(next_node for next_node, _ in node.next_functions)
        self._active.pop()

    def _kind(self, t: torch.Tensor, shape: tuple[int, ...] | None = None) -> str:
        """``weight`` for a tensor of the active layer whose every dimension is a feature
        count (or half of one: packed codes), ``input`` for any other. The scales saved
        right after quantized codes (one; two after packed 4-bit codes, with NVFP4's
        global amax) go with them."""
        if not self._active:
            return "other"
        if self._scales_to_come and shape is None:
            self._scales_to_come -= 1
            return self._last_kind
        module = self._active[-1][0]
        self._last_kind = "weight" if set(shape or t.shape) <= _dims(module.in_features, module.out_features) else "input"
        if shape is None and t.dtype in _CODE_DTYPES:
            self._scales_to_come = 2 if t.dtype == torch.float4_e2m1fn_x2 else 1
        return self._last_kind

    def _record(self, t: torch.Tensor, kind: str) -> None:
        ptr, nbytes = _storage(t)
        if nbytes and ptr not in self._kept:
            self._storages[kind][ptr] = self._storages["total"][ptr] = nbytes

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._record(t, self._kind(t))
        return t


def peak_allocated_bytes(fn) -> int:
    """The most bytes PyTorch's CPU allocator had allocated at once while ``fn()`` ran,
    counting only allocations made during the call (those live before it are not counted).

    From the profiler's allocation records, which is how ``torch.profiler``'s own memory
    timeline works (no CPU allocator statistics exist). Their ``total_allocated`` is a
    process-wide running sum that never forgets a tensor freed while no profiler ran, so
    the peak is taken relative to its value when ``fn`` started.
    """
    from torch._C._profiler import _EventType  # the record type; no public name in torch 2.13

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            records.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
        nodes.extend(node.children)
    if not records:
        return 0
    records.sort()
    _, first_size, first_total = records[0]
    start = first_total - first_size  # before the first record (a free has a negative size)
    return max(total for _, _, total in records) - start


@dataclass(frozen=True)
class Config:
    """One measured model: ``recipe`` None for the bf16 baseline."""

    recipe: str | None
    save_fp8_activations: bool = True

    @property
    def label(self) -> str:
        return self.recipe or BASELINE


def build(config: Config, args: TrainingArguments) -> nn.Module:
    """The default GPT of ``args``, converted as the trainer converts it."""
    torch.manual_seed(args.seed)
    model = build_model(args)
    if config.recipe is not None:
        model = fp8train.convert_to_float8_training(
            model,
            config.recipe,
            dim_alignment=args.fp8_dim_alignment,
            backend=args.fp8_backend,
            save_fp8_activations=config.save_fp8_activations,
        )
    return model


def forward_step(model: nn.Module, config: Config, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The trainer's forward (``torch.autocast`` bfloat16, ``fp8train.autocast``): the loss."""
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(enabled=config.recipe is not None):
        return model(*batch)


def make_batch(args: TrainingArguments, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(inputs, targets)`` token ids of ``args``' batch shape (bytes saved and
    allocated do not depend on the values)."""
    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.batch_size, args.seq_len)
    return tuple(torch.randint(0, vocab_size, shape, generator=generator) for _ in range(2))


def saved_bytes_of_step(model: nn.Module, config: Config, batch) -> SavedBytes:
    """What one forward keeps for its backward (which then runs, freeing it)."""
    with SavedTensorCounter(model) as counter:
        loss = forward_step(model, config, batch)
    saved = counter.saved_bytes()
    loss.backward()
    return saved


def measure(config: Config, args: TrainingArguments) -> dict:
    """Saved bytes and peak memory of one training step of ``config``'s model."""
    model = build(config, args)
    batch = make_batch(args, model.config.vocab_size)
    forward_step(model, config, batch).backward()  # warm-up: lazy state, delayed scaling's first scales
    model.zero_grad(set_to_none=True)
    saved = saved_bytes_of_step(model, config, batch)
    model.zero_grad(set_to_none=True)  # the measured step allocates its gradients afresh

    def step() -> None:
        forward_step(model, config, batch).backward()

    return {
        "model": config.label,
        "save_fp8_activations": config.save_fp8_activations if config.recipe else None,
        "tokens": args.batch_size * args.seq_len,
        **{f"{key}_saved_bytes": value for key, value in dataclasses.asdict(saved).items()},
        "peak_bytes": peak_allocated_bytes(step),
    }


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row with its bytes over the bf16 baseline's (the first row)."""
    baseline = rows[0]
    assert baseline["model"] == BASELINE, baseline
    for row in rows:
        for key in ("linear_input_saved_bytes", "total_saved_bytes", "peak_bytes"):
            row[key.replace("bytes", "ratio")] = round(row[key] / baseline[key], 3)
    return rows


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f}"


def print_table(rows: list[dict]) -> None:
    headers = ("model", "save_fp8_activations", "Linear inputs saved (MiB)", "x bf16", "all saved (MiB)", "x bf16",
               "peak (MiB)", "x bf16")
    cells = [
        (r["model"], "" if r["save_fp8_activations"] is None else r["save_fp8_activations"],
         _mib(r["linear_input_saved_bytes"]), f"{r['linear_input_saved_ratio']:.2f}", _mib(r["total_saved_bytes"]),
         f"{r['total_saved_ratio']:.2f}", _mib(r["peak_bytes"]), f"{r['peak_ratio']:.2f}")
        for r in rows
    ]
    print(markdown_table(headers, cells, align="llrrrrrr"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = TrainingArguments()
    parser.add_argument("--recipes", nargs="+", default=list(RECIPE_NAMES), choices=RECIPE_NAMES)
    parser.add_argument("--batch_size", type=int, default=defaults.batch_size, help="sequences per step")
    parser.add_argument("--out", default="benchmarks/results_saved_activations.json", help="JSON output path")
    cli = parser.parse_args()
    args = dataclasses.replace(defaults, batch_size=cli.batch_size, device="cpu")

    configs = [Config(None)] + [Config(recipe, save) for recipe in cli.recipes for save in (True, False)]
    rows = add_ratios([measure(config, args) for config in configs])
    print_table(rows)
    report = {
        "benchmark": "one training step of the default GPT: bytes saved for backward and peak CPU allocation",
        "model": {key: getattr(args, key) for key in ("n_layer", "n_head", "n_embd", "seq_len", "batch_size")},
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "results": rows,
    }
    with open(cli.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {cli.out}")


if __name__ == "__main__":
    main()
