"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``), as llm-compressor
writes them and vLLM (and compressed-tensors' own decompression) load them: NVFP4, MXFP4 and
MXFP8 weights, quantized by fp8train's own rules (NUMERICS.md 3 and 6), the ones training
used.

Per Linear written quantized, ``[out, in]`` weight:

==========  =====================================  ==========================================
format      tensors                                 config group (``weights``; activations)
==========  =====================================  ==========================================
``nvfp4``   ``weight_packed`` uint8 ``[out, in/2]``  ``nvfp4-pack-quantized``: 4-bit float,
            ``weight_scale`` E4M3 ``[out, in/16]``   ``tensor_group``, group 16, E4M3 scales;
            ``weight_global_scale`` f32 ``[1]``      activations in high precision (``NVFP4A16``);
            (``input_global_scale`` f32 ``[1]``)     with calibrated ``input_amax``: NVFP4
                                                    activations in 1x16 groups (``NVFP4``)
``mxfp4``   ``weight_packed`` uint8 ``[out, in/2]``  ``mxfp4-pack-quantized``: 4-bit float,
            ``weight_scale`` uint8 ``[out, in/32]``  ``group`` 32, uint8 (E8M0) scales; dynamic
                                                    MXFP4 activations (``MXFP4``)
``mxfp8``   ``weight`` E4M3 ``[out, in]``            ``mxfp8-quantized``: 8-bit float, ``group``
            ``weight_scale`` uint8 ``[out, in/32]``  32, uint8 scales; dynamic MXFP8 activations
==========  =====================================  ==========================================

Conventions, where compressed-tensors' differ from fp8train's:

* Packing: E2M1 code of element ``2j`` in the low nibble of byte ``j``, ``2j+1`` in the high
  one, sign in bit 3: fp8train's ``float4_e2m1fn_x2`` bytes are compressed-tensors'
  ``pack_fp4_to_uint8``'s, written as they are.
* NVFP4 global scale: compressed-tensors stores the *encode* scale and divides by it,
  ``weight = e2m1 * (weight_scale / weight_global_scale)``, with
  ``weight_global_scale = 448 * 6 / amax(weight)`` (its ``generate_gparam``): fp8train's
  ``ge`` (``nvfp4_global_scales``), written as it is, the one the block scales were computed
  with. (``generate_gparam`` evaluates it as ``2688 * float32(1 / amax)``, PyTorch's
  scalar-by-tensor division, which differs from the once-rounded quotient in the last bit
  for about a quarter of amaxes.) ``input_global_scale`` likewise, from the caller's
  calibrated input amax. fp8train multiplies by ``gd = 1/ge``
  instead, so the two dequantizations agree to one float32 rounding (exactly where ``ge`` is
  a power of two), and after the rounding to bfloat16 that compressed-tensors' decompression
  ends in, in all but rare ties.
* NVFP4 block scales are Transformer Engine's (``e4m3(amax_block * (ge * float32(1/6)))``,
  1x16 along ``in``; a model trained with 16x16 weight tiles is requantized in 1x16 groups from
  its high-precision weights); llm-compressor computes ``e4m3(ge * (amax_block / 6))``, which
  can round differently in the last bit. Both are valid scales of one layout.
* Linears that vLLM fuses into one layer (``q/k/v_proj``, ``gate/up_proj``) share one NVFP4
  global scale, from the amax over all of them: vLLM keeps one global scale per fused layer.
* MX scales: fp8train's exponent is ``amax / max`` rounded *up* to a power of two (nothing
  saturates); llm-compressor rounds ``amax`` to the nearest power of two and lets the top
  values saturate. The loader reads any E8M0 exponent: ``scale = 2 ** (weight_scale - 127)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..quant.quantize import quantize
from ..quant.scaling import nvfp4_global_scales
from ..spec.rule import QuantRule
from .format_base import CheckpointFormat, checked_weight

__all__ = ["CompressedTensorsFormat", "NVFP4_FORMAT", "MXFP4_FORMAT", "MXFP8_FORMAT"]

QUANT_METHOD = "compressed-tensors"


@dataclass(frozen=True, kw_only=True)
class CompressedTensorsFormat(CheckpointFormat):
    """A compressed-tensors checkpoint with one config group: every ``Linear`` not ignored.

    Attributes:
        rule: fp8train's rule for a weight (1xN groups along ``in_features``).
        compression_format: compressed-tensors' ``format`` (its ``CompressionFormat``).
        dynamic_activations: the config quantizes activations dynamically, with the weights'
            scheme (MX); ``False`` leaves them in high precision (NVFP4 weight-only).
        static_input_scales: NVFP4's W4A4 scheme (compressed-tensors' ``NVFP4``): each
            Linear's input quantized in 1x16 groups under the global scale
            ``input_global_scale`` from its calibrated amax (:meth:`with_input_amax`).
    """

    rule: QuantRule
    compression_format: str
    dynamic_activations: bool
    static_input_scales: bool = False

    @property
    def group_size(self) -> int:
        """Values per scale along ``in_features``."""
        return self.rule.granularity.along

    def keep_reason(self, out_features: int, in_features: int, fused_group: tuple[str, ...]) -> str | None:
        if in_features % self.group_size:
            return f"in_features={in_features} is not a multiple of the format's group of {self.group_size}"
        return None

    def weight_tensors(self, weight: torch.Tensor, fused_amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The Linear's tensors (see the module's table); NVFP4's global scale from
        ``fused_amax`` where given, else from the weight's own amax."""
        weight = checked_weight(weight)
        rows = weight.shape[0]
        # Scales never span rows, so zero rows pad out_features to what quantize() tiles.
        padding = -rows % self.rule.granularity.block
        padded = torch.nn.functional.pad(weight, (0, 0, 0, padding)) if padding else weight
        two_level = self.rule.granularity.two_level_scales
        quantized = quantize(padded, self.rule, axis=-1, global_amax=fused_amax if two_level else None)
        data, scale_inv = quantized.data[:rows], quantized.scale_inv[:rows]
        if self.rule.granularity.fp4:
            tensors = {"weight_packed": data.view(torch.uint8).contiguous()}
        else:
            tensors = {"weight": data.contiguous()}
        if two_level:
            tensors["weight_scale"] = scale_inv.contiguous()
            encode_scale = nvfp4_global_scales(quantized.global_amax)[0]
            tensors["weight_global_scale"] = encode_scale.to(torch.float32).reshape(1)
        else:
            tensors["weight_scale"] = scale_inv.view(torch.uint8).contiguous()  # E8M0: the biased exponent
        return tensors

    def with_input_amax(self) -> CompressedTensorsFormat:
        if not self.rule.granularity.two_level_scales:
            return super().with_input_amax()  # the MX formats scale their activations dynamically
        return replace(self, words="NVFP4 (compressed-tensors, W4A4)", static_input_scales=True)

    def input_tensors(self, input_amax: torch.Tensor) -> dict[str, torch.Tensor]:
        """``input_global_scale``: float32 ``[1]``, ``448 * 6 / input_amax`` (the encode
        scale, as ``weight_global_scale``)."""
        return {"input_global_scale": nvfp4_global_scales(input_amax)[0].to(torch.float32).reshape(1)}

    def _scheme_args(self) -> dict:
        """compressed-tensors' ``QuantizationArgs`` of the weights, as JSON."""
        granularity = self.rule.granularity
        return {
            "num_bits": granularity.data_bits,
            "type": "float",
            "symmetric": True,
            "group_size": self.group_size,
            "strategy": "tensor_group" if granularity.two_level_scales else "group",
            "dynamic": False,
            "scale_dtype": "torch.float8_e4m3fn" if granularity.two_level_scales else "torch.uint8",
        }

    def quantization_config(self, high_precision_modules: list[str]) -> dict:
        """compressed-tensors' ``QuantizationConfig`` as its ``ModelCompressor`` writes it:
        ``quant_method``, ``format``, ``quantization_status``, one ``config_groups`` entry
        targeting ``Linear``, and ``ignore`` (the high-precision modules, by name)."""
        weights = self._scheme_args()
        activations = {**weights, "dynamic": True} if self.dynamic_activations else None
        if self.static_input_scales:  # global scale from calibration, block scales computed at run time
            activations = {**weights, "dynamic": "local", "observer": "static_minmax"}
        return {
            "quant_method": QUANT_METHOD,
            "format": self.compression_format,
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": activations,
                    "output_activations": None,
                    "format": None,
                }
            },
            "ignore": list(high_precision_modules),
            "kv_cache_scheme": None,
        }


NVFP4_FORMAT = CompressedTensorsFormat(
    name="nvfp4", words="NVFP4 (compressed-tensors, weight-only)", rule=QuantRule(granularity="nvfp4"),
    compression_format="nvfp4-pack-quantized", dynamic_activations=False,
)
MXFP4_FORMAT = CompressedTensorsFormat(
    name="mxfp4", words="MXFP4 (compressed-tensors)", rule=QuantRule(granularity="mxfp4"),
    compression_format="mxfp4-pack-quantized", dynamic_activations=True,
)
MXFP8_FORMAT = CompressedTensorsFormat(
    name="mxfp8", words="MXFP8 (compressed-tensors)", rule=QuantRule(granularity="mx"),
    compression_format="mxfp8-quantized", dynamic_activations=True,
)
