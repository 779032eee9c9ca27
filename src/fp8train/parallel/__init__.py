"""Scale-out: FSDP2 with FP8 all-gather (:mod:`.fsdp`) and the process-group, wrapping and
full-state-dict helpers the trainer uses (:mod:`.distributed`)."""

from .fsdp import (
    Float8AllGatherWeight,
    GatherPlan,
    enable_fp8_all_gather,
    gather_plan,
    precompute_fp8_scales_for_fsdp,
    supports_fp8_all_gather,
)

__all__ = [
    "Float8AllGatherWeight",
    "GatherPlan",
    "enable_fp8_all_gather",
    "gather_plan",
    "precompute_fp8_scales_for_fsdp",
    "supports_fp8_all_gather",
]
