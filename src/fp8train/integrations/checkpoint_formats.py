"""The quantized checkpoint formats :func:`~fp8train.save_pretrained_quantized` writes: for
each, which Linears it can hold, how one Linear's weight is written and the
``quantization_config`` its loader reads.

* ``fp8_block``: block-scaled E4M3, one float32 ``weight_scale_inv`` per 128x128 block
  (DeepSeek-V3, Qwen3-FP8; transformers' ``FineGrainedFP8Config``, vLLM's ``fp8``).
* ``fp8_block_ue8m0``: the same layout with every block's ``weight_scale_inv`` a power of two
  (rounded up: nothing saturates) and ``"scale_fmt": "ue8m0"`` in the config, as
  DeepSeek-V3.1 and later and GLM-5 write it: what Blackwell's block-scaled GEMMs take.
* ``nvfp4``, ``mxfp4``, ``mxfp8``: compressed-tensors checkpoints, as llm-compressor writes
  them and vLLM loads them (:mod:`fp8train.integrations.compressed_tensors_formats`).
* ``nvfp4_modelopt``: NVFP4 as NVIDIA ModelOpt writes it, vLLM's ``modelopt_fp4``
  (:mod:`fp8train.integrations.modelopt_format`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch

from ..spec.checks import check_choice
from ..spec.rule import QuantRule
from .block_fp8 import BLOCK_SIZE, UE8M0_WEIGHT_BLOCK_RULE, WEIGHT_BLOCK_RULE, quantize_weight_blocks
from .compressed_tensors_formats import MXFP4_FORMAT, MXFP8_FORMAT, NVFP4_FORMAT
from .format_base import CheckpointFormat
from .modelopt_format import NVFP4_MODELOPT_FORMAT

__all__ = ["CheckpointFormat", "BlockFP8Format", "CHECKPOINT_FORMATS", "checkpoint_format"]


@dataclass(frozen=True, kw_only=True)
class BlockFP8Format(CheckpointFormat):
    """Block-scaled E4M3 with float32 ``weight_scale_inv`` (``quant_method: "fp8"``).

    Attributes:
        rule: how a weight's 128x128 blocks are quantized.
        scale_fmt: the config's ``scale_fmt`` (``"ue8m0"``), or ``None`` for none.
    """

    rule: QuantRule
    scale_fmt: str | None = None

    def keep_reason(self, out_features: int, in_features: int, fused_group: tuple[str, ...]) -> str | None:
        for dim_name, size in (("out_features", out_features), ("in_features", in_features)):
            if size > BLOCK_SIZE and size % BLOCK_SIZE:
                return (
                    f"{dim_name}={size} ends in a partial block after a whole one, which transformers' "
                    f"dequantizing loader misreads (it takes the block from the scale grid)"
                )
        if fused_group and out_features % BLOCK_SIZE:
            return (
                f"out_features={out_features} is not a multiple of {BLOCK_SIZE}, which vLLM needs of each "
                f"part of a layer it fuses ({', '.join(fused_group)})"
            )
        return None

    def weight_tensors(self, weight: torch.Tensor, fused_amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``weight`` (E4M3 ``[out, in]``) and ``weight_scale_inv`` (float32 ``[ceil(out/128),
        ceil(in/128)]``), as :func:`~fp8train.integrations.block_fp8.quantize_weight_blocks`
        (block scales only: ``fused_amax`` is not used)."""
        weight_fp8, weight_scale_inv = quantize_weight_blocks(weight, self.rule)
        return {"weight": weight_fp8, "weight_scale_inv": weight_scale_inv}

    def quantization_config(self, high_precision_modules: list[str]) -> dict:
        config = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK_SIZE, BLOCK_SIZE],
            "modules_to_not_convert": list(high_precision_modules),
        }
        if self.scale_fmt is not None:
            config["scale_fmt"] = self.scale_fmt
        return config


CHECKPOINT_FORMATS: Mapping[str, CheckpointFormat] = MappingProxyType(
    {
        "fp8_block": BlockFP8Format(name="fp8_block", words="block-scaled E4M3", rule=WEIGHT_BLOCK_RULE),
        "fp8_block_ue8m0": BlockFP8Format(
            name="fp8_block_ue8m0", words="block-scaled E4M3 with power-of-two (UE8M0) scales",
            rule=UE8M0_WEIGHT_BLOCK_RULE, scale_fmt="ue8m0",
        ),
        "nvfp4": NVFP4_FORMAT,
        "nvfp4_modelopt": NVFP4_MODELOPT_FORMAT,
        "mxfp4": MXFP4_FORMAT,
        "mxfp8": MXFP8_FORMAT,
    }
)
"""Every format, by name."""


def checkpoint_format(name: str) -> CheckpointFormat:
    """The format named ``name``.

    Raises:
        ValueError: an unknown name (the message lists the formats).
    """
    return CHECKPOINT_FORMATS[check_choice("format", name, tuple(CHECKPOINT_FORMATS))]
