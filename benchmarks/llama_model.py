"""A small transformers Llama on the byte-level text, as a ``--model`` factory for
``benchmarks/delayed_gap.py`` and the command line (run from ``benchmarks/``)."""

import torch.nn.functional as F
import transformers


def build():
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(config)

    def loss_fn(model, inputs, targets):
        logits = model(input_ids=inputs).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return {"model": model, "loss_fn": loss_fn}
