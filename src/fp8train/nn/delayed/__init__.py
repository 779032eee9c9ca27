"""Delayed scaling across a step: each converted module's state (:mod:`.state`:
``DelayedScalingState``, its buffers and flags), the registry of live states (:mod:`.registry`,
and what a backward's end owes them), amax recording
and the MAX all-reduce that keeps a NaN (:mod:`.amax`, which the ``parallel`` layer's
gathers share), and a step's updates, batched across ranks (:mod:`.reduction`).
``fp8train.autocast`` (:mod:`fp8train.nn.autocast`) ends a step here; how a weight stored
in FP8 follows the weight scale is :mod:`fp8train.nn.weights.delayed_scale`."""
