"""What every checkpoint format of :mod:`fp8train.integrations.checkpoint_formats` knows
about itself: which Linears it can hold, the tensors one Linear's weight becomes, and the
``quantization_config`` of ``config.json`` its loader reads (and any file it reads beside)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CheckpointFormat", "checked_weight"]


@dataclass(frozen=True, kw_only=True)
class CheckpointFormat:
    """One checkpoint format (a frozen value; each kind of format is a subclass).

    Attributes:
        name: what ``save_pretrained_quantized(format=...)`` takes.
        words: the format in words, for summaries.
    """

    name: str
    words: str

    def keep_reason(self, out_features: int, in_features: int, fused_group: tuple[str, ...]) -> str | None:
        """Why a Linear of this shape stays in high precision in this format, or ``None`` to
        write it quantized. ``fused_group``: the Linears vLLM fuses it with (``()``: none)."""
        raise NotImplementedError

    def weight_tensors(self, weight: torch.Tensor, fused_amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The tensors one Linear's ``[out, in]`` weight (finite, of a shape
        :meth:`keep_reason` accepts) becomes, by key suffix (``weight``, ``weight_scale``, ...).
        ``fused_amax``: the float32 amax over the Linears vLLM fuses with this one (``None``:
        not fused), which a format with one scale per weight uses for all of them.

        Raises:
            ValueError: ``weight`` is not 2-D or holds a NaN or an infinity.
        """
        raise NotImplementedError

    def with_input_amax(self) -> CheckpointFormat:
        """This format with every quantized Linear's input quantized by a scale from its
        calibrated amax (``save_pretrained_quantized(input_amax=...)``).

        Raises:
            ValueError: the format takes no calibrated activation scales.
        """
        raise ValueError(
            f"format={self.name!r} takes no input_amax (calibrated activation ranges); only 'nvfp4' and "
            "'nvfp4_modelopt' do, for their W4A4 schemes: pass input_amax=None"
        )

    def input_tensors(self, input_amax: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors a Linear's calibrated float32 input amax becomes, by key suffix (a
        format of :meth:`with_input_amax`)."""
        raise NotImplementedError

    def quantization_config(self, high_precision_modules: list[str]) -> dict:
        """The ``quantization_config`` of ``config.json``, naming the Linears written in high
        precision (``modules_to_not_convert``, or compressed-tensors' ``ignore``)."""
        raise NotImplementedError

    def extra_files(self, high_precision_modules: list[str]) -> dict[str, dict]:
        """The JSON files the checkpoint holds beside ``config.json``, by file name (ModelOpt's
        ``hf_quant_config.json``); none by default."""
        return {}


def checked_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` detached, checked to be what every format writes: a 2-D ``[out, in]``
    tensor of finite values.

    Raises:
        ValueError: ``weight`` is not 2-D, or holds a NaN or an infinity.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight of shape {tuple(weight.shape)} must be 2-D [out_features, in_features]")
    weight = weight.detach()
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(
            f"weight of shape {tuple(weight.shape)} holds a NaN or an infinity; a quantized checkpoint "
            "needs finite weights (find where they came from with fp8train.detect_nonfinite)"
        )
    return weight
