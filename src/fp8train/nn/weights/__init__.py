"""The FP8 weight: a module's weight held only quantized, in the operands its recipe's plan
needs. The stored-weight types (:mod:`.float8_weight`: ``Float8Weight``; :mod:`.transposed`:
Conv1D's ``[in, out]`` weight; :mod:`.experts`: one ``Float8Weight`` per expert), a
trainable one's link to its master in the optimizer (:mod:`.master`), how a stored weight
follows delayed scaling's weight scale (:mod:`.delayed_scale`), and one module's stored
weights: storing and restoring them, its ``state_dict`` (:mod:`.module_weights`), and which
of an attention's weights are stored (:mod:`.attention`). The model walks that store them
are :mod:`fp8train.nn.store_weights`; FSDP2's shard of one is
:mod:`fp8train.parallel.fp8_weight_shard`, beside the gather it needs."""
