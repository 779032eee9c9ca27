"""The quantized checkpoint formats :func:`~fp8train.save_pretrained_quantized` writes: for
each, how one Linear's weight is written and the ``quantization_config`` its loader reads.

* ``fp8_block``: block-scaled E4M3, one float32 ``weight_scale_inv`` per 128x128 block
  (DeepSeek-V3, Qwen3-FP8; transformers' ``FineGrainedFP8Config``, vLLM's ``fp8``).
* ``fp8_block_ue8m0``: the same layout with every block's ``weight_scale_inv`` a power of two
  (rounded up: nothing saturates) and ``"scale_fmt": "ue8m0"`` in the config, as
  DeepSeek-V3.1 and later and GLM-5 write it: what Blackwell's block-scaled GEMMs take.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch

from ..spec.checks import check_choice
from ..spec.rule import QuantRule
from .block_fp8 import BLOCK_SIZE, UE8M0_WEIGHT_BLOCK_RULE, WEIGHT_BLOCK_RULE, quantize_weight_blocks

__all__ = ["CheckpointFormat", "CHECKPOINT_FORMATS", "checkpoint_format"]


@dataclass(frozen=True, kw_only=True)
class CheckpointFormat:
    """One checkpoint format.

    Attributes:
        name: what ``save_pretrained_quantized(format=...)`` takes.
        words: the format in words, for summaries.
        rule: how a weight's blocks are quantized.
        scale_fmt: the config's ``scale_fmt`` (``"ue8m0"``), or ``None`` for none.
    """

    name: str
    words: str
    rule: QuantRule
    scale_fmt: str | None = None

    def weight_tensors(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors one Linear's ``[out, in]`` weight becomes, by key suffix
        (``weight``, ``weight_scale_inv``).

        Raises:
            ValueError: as :func:`~fp8train.integrations.block_fp8.quantize_weight_blocks`.
        """
        weight_fp8, weight_scale_inv = quantize_weight_blocks(weight, self.rule)
        return {"weight": weight_fp8, "weight_scale_inv": weight_scale_inv}

    def quantization_config(self, modules_to_not_convert: list[str]) -> dict:
        """The ``quantization_config`` of ``config.json``."""
        config = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK_SIZE, BLOCK_SIZE],
            "modules_to_not_convert": list(modules_to_not_convert),
        }
        if self.scale_fmt is not None:
            config["scale_fmt"] = self.scale_fmt
        return config


CHECKPOINT_FORMATS: Mapping[str, CheckpointFormat] = MappingProxyType(
    {
        "fp8_block": CheckpointFormat(name="fp8_block", words="block-scaled E4M3", rule=WEIGHT_BLOCK_RULE),
        "fp8_block_ue8m0": CheckpointFormat(
            name="fp8_block_ue8m0", words="block-scaled E4M3 with power-of-two (UE8M0) scales",
            rule=UE8M0_WEIGHT_BLOCK_RULE, scale_fmt="ue8m0",
        ),
    }
)
"""Every format, by name."""


def checkpoint_format(name: str) -> CheckpointFormat:
    """The format named ``name``.

    Raises:
        ValueError: an unknown name (the message lists the formats).
    """
    return CHECKPOINT_FORMATS[check_choice("format", name, tuple(CHECKPOINT_FORMATS))]
