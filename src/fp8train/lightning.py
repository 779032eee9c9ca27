"""``fp8train.lightning``: FP8 training in Lightning (``L.Trainer(plugins=[FP8Precision("mxfp8")])``)
and Fabric (``L.Fabric(plugins=[FabricFP8Precision("mxfp8")])``); see ``docs/lightning.md``.

Importing it imports Lightning; ``import fp8train`` does not. The plugins live in
:mod:`fp8train.integrations.lightning`.
"""

from .integrations.lightning import CHECKPOINT_KEY, FabricFP8Precision, FP8Precision

__all__ = ["FP8Precision", "FabricFP8Precision", "CHECKPOINT_KEY"]
