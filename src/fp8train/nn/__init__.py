"""PyTorch modules: ``Float8Linear`` (:mod:`.linear`), its autograd (:mod:`.function`),
amax bookkeeping (:mod:`.amax`), delayed-scaling state (:mod:`.delayed`), ``autocast``
(:mod:`.autocast`), model conversion (:mod:`.convert`) and the non-finite detector
(:mod:`.nonfinite`). The public names are re-exported by :mod:`fp8train`."""
