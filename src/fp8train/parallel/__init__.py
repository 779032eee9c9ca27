"""Scale-out: FSDP2 with FP8 all-gather (:mod:`.fsdp`), tensor and sequence parallelism
with FP8 all-gather of activations (:mod:`.tensor_parallel`, :mod:`.sequence_gather`; the
shared shard quantization in :mod:`.gather`) and the process-group, wrapping and
full-state-dict helpers the trainer uses (:mod:`.distributed`)."""

from .fsdp import (
    Float8AllGatherWeight,
    Float8WeightShard,
    GatherPlan,
    enable_fp8_all_gather,
    gather_plan,
    precompute_fp8_scales_for_fsdp,
    supports_fp8_all_gather,
)
from .tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

__all__ = [
    "Float8AllGatherWeight",
    "Float8WeightShard",
    "Float8ColwiseParallel",
    "Float8RowwiseParallel",
    "PrepareFloat8ModuleInput",
    "GatherPlan",
    "enable_fp8_all_gather",
    "gather_plan",
    "precompute_fp8_scales_for_fsdp",
    "supports_fp8_all_gather",
]
