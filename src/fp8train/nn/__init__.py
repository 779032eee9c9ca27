"""PyTorch modules: ``Float8Linear`` (:mod:`.linear`), its options (:mod:`.config`), its
autograd (:mod:`.function`), amax bookkeeping (:mod:`.amax`), delayed-scaling state
(:mod:`.delayed`) and a step's updates (:mod:`.amax_reduction`), ``autocast``
(:mod:`.autocast`), model conversion (:mod:`.converters`, :mod:`.convert`) and the
non-finite detector (:mod:`.nonfinite`). The public names are re-exported by :mod:`fp8train`."""
