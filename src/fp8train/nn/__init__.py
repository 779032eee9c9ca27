"""PyTorch modules: ``Float8Linear`` (:mod:`.linear`), its options (:mod:`.config`), its
autograd (:mod:`.function`), delayed scaling across a step (the wing :mod:`.delayed`: state,
amaxes, a step's updates across ranks), ``autocast`` (:mod:`.autocast`), weights held in FP8
(the wing :mod:`.weights`; the model walks that store them, :mod:`.store_weights`), model
conversion (:mod:`.converters`, :mod:`.convert`) and the non-finite detector
(:mod:`.nonfinite`). The public names are re-exported by :mod:`fp8train`."""
