"""NVFP4 as NVIDIA ModelOpt writes it (``quant_method: "modelopt"``): the layout of the
nvidia/*-NVFP4 releases and of Megatron-Bridge's NVFP4 export, which vLLM loads as
``modelopt_fp4`` (SGLang and TensorRT-LLM read the ``NVFP4`` variant too). The weights are quantized exactly as in
compressed-tensors' ``nvfp4`` (:mod:`fp8train.integrations.compressed_tensors_formats`,
NUMERICS.md 6); only the names, the global scale's convention and the config differ.

Per Linear written quantized, ``[out, in]`` weight (ModelOpt's ``NVFP4QTensor`` and
``export/unified_export_hf.py``; vLLM's ``ModelOptNvFp4LinearMethod.create_weights``):

* ``weight``: uint8 ``[out, in/2]``, E2M1 codes, element ``2j`` in the low nibble of byte
  ``j`` and ``2j+1`` in the high one, sign in bit 3 (ModelOpt packs
  ``(q[..., 1::2] << 4) | q[..., 0::2]``): fp8train's ``float4_e2m1fn_x2`` bytes as they are.
* ``weight_scale``: ``float8_e4m3fn`` ``[out, in/16]``, one per 16 along ``in``.
* ``weight_scale_2``: float32 scalar (shape ``[]``), the *decode* global scale:
  ``weight = e2m1 * float32(weight_scale) * weight_scale_2``. ModelOpt computes it as
  ``amax / (6 * 448)``; fp8train writes ``gd = 1 / (2688 / amax)``, the scale its block
  scales were computed with (the two agree to one float32 rounding), so the dequantized
  checkpoint is fp8train's dequantization bit for bit.
* ``input_scale``: float32 scalar, ``gd`` of the caller's calibrated input amax
  (ModelOpt's ``amax / (6 * 448)`` for an NVFP4 input quantizer); vLLM quantizes the input
  with ``1 / input_scale`` and scales the GEMM by ``input_scale * weight_scale_2``.

Linears vLLM fuses (``q/k/v_proj``, ``gate/up_proj``) share ``weight_scale_2`` and
``input_scale``, from the largest amax of the group, as ModelOpt's
``preprocess_linear_fusion`` unifies them (vLLM keeps one per fused layer and warns when they
differ). Zero groups get a zero block scale (ModelOpt writes 1.0 there); both dequantize to 0.

Without calibrated input amax the checkpoint is weight-only, ``quant_algo: "W4A16_NVFP4"``
(ModelOpt's ``w4a16_nvfp4``; vLLM's ``ModelOptNvFp4W4A16LinearMethod``, bfloat16
activations); with it, ``"NVFP4"`` (W4A4). Beside ``config.json``'s
``quantization_config`` (ModelOpt's ``convert_hf_quant_config_format``) the directory holds
``hf_quant_config.json`` (its ``get_quant_config``), the file vLLM detects ModelOpt by.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .compressed_tensors_formats import NVFP4_FORMAT
from .format_base import CheckpointFormat

__all__ = ["ModelOptNVFP4Format", "NVFP4_MODELOPT_FORMAT"]

MODELOPT_VERSION = "0.47.0"
"""The ModelOpt release whose export this layout and config were checked against; written
as the ``producer`` (what loaders key the format on is ``quant_method`` and ``quant_algo``)."""

HF_QUANT_CONFIG = "hf_quant_config.json"


@dataclass(frozen=True, kw_only=True)
class ModelOptNVFP4Format(CheckpointFormat):
    """ModelOpt's NVFP4 checkpoint (``quant_method: "modelopt"``).

    Attributes:
        static_input_scales: W4A4 (``quant_algo: "NVFP4"``): each quantized Linear's input is
            quantized under ``input_scale``, from its calibrated amax; ``False``: weight-only
            (``"W4A16_NVFP4"``).
    """

    static_input_scales: bool = False

    @property
    def group_size(self) -> int:
        """Values per ``weight_scale`` along ``in_features``."""
        return NVFP4_FORMAT.group_size

    @property
    def quant_algo(self) -> str:
        """ModelOpt's name of the scheme."""
        return "NVFP4" if self.static_input_scales else "W4A16_NVFP4"

    def keep_reason(self, out_features: int, in_features: int, fused_group: tuple[str, ...]) -> str | None:
        return NVFP4_FORMAT.keep_reason(out_features, in_features, fused_group)

    def weight_tensors(self, weight: torch.Tensor, fused_amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``weight`` uint8 ``[out, in/2]``, ``weight_scale`` E4M3 ``[out, in/16]`` and
        ``weight_scale_2`` float32 ``[]`` (see the module's docstring); the global scale from
        ``fused_amax`` where given, else from the weight's own amax."""
        tensors = NVFP4_FORMAT.weight_tensors(weight, fused_amax)
        encode_scale = tensors["weight_global_scale"].reshape(())
        return {
            "weight": tensors["weight_packed"],
            "weight_scale": tensors["weight_scale"],
            "weight_scale_2": 1.0 / encode_scale,  # gd, as nvfp4_global_scales computes it from ge
        }

    def with_input_amax(self) -> ModelOptNVFP4Format:
        return replace(self, words="NVFP4 (ModelOpt, W4A4)", static_input_scales=True)

    def input_tensors(self, input_amax: torch.Tensor) -> dict[str, torch.Tensor]:
        """``input_scale``: float32 ``[]``, the decode scale ``1 / (2688 / input_amax)``."""
        encode_scale = NVFP4_FORMAT.input_tensors(input_amax)["input_global_scale"].reshape(())
        return {"input_scale": 1.0 / encode_scale}

    def hf_quant_config(self, high_precision_modules: list[str]) -> dict:
        """``hf_quant_config.json``, as ModelOpt's ``get_quant_config`` writes it."""
        return {
            "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
            "quantization": {
                "quant_algo": self.quant_algo,
                "kv_cache_quant_algo": None,
                "group_size": self.group_size,
                "exclude_modules": list(high_precision_modules),
            },
        }

    def quantization_config(self, high_precision_modules: list[str]) -> dict:
        """``config.json``'s ``quantization_config``, as ModelOpt's
        ``convert_hf_quant_config_format`` derives it from :meth:`hf_quant_config`: one
        compressed-tensors-style ``config_groups`` entry targeting ``Linear``, ``ignore`` (the
        high-precision modules), ``quant_algo``, ``producer``, ``quant_method: "modelopt"``."""
        args = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": self.group_size}
        group = {"weights": args, "targets": ["Linear"]}
        if self.static_input_scales:
            group = {"input_activations": dict(args), **group}
        return {
            "config_groups": {"group_0": group},
            "ignore": list(high_precision_modules),
            "quant_algo": self.quant_algo,
            "producer": self.hf_quant_config(high_precision_modules)["producer"],
            "quant_method": "modelopt",
        }

    def extra_files(self, high_precision_modules: list[str]) -> dict[str, dict]:
        return {HF_QUANT_CONFIG: self.hf_quant_config(high_precision_modules)}


NVFP4_MODELOPT_FORMAT = ModelOptNVFP4Format(name="nvfp4_modelopt", words="NVFP4 (ModelOpt, weight-only)")
