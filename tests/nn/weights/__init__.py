"""Tests of fp8train.nn.weights (weights stored in FP8: frozen, and trainable with their masters) and of the model walks that store them (fp8train.nn.store_weights)."""
