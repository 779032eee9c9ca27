"""A ``--model`` factory for the trainer: a tiny transformers Llama on the default byte data
(every Linear dim a multiple of 128)."""

import torch.nn.functional as F
import transformers


def loss_fn(model, inputs, targets):
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build():
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256,
    )
    return {"model": transformers.LlamaForCausalLM(config), "loss_fn": loss_fn}
