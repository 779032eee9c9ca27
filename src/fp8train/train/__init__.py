"""The product: the training loop and what it is built from (``trainer``, ``trainer_setup``,
``arguments``, ``data``, ``model``, ``user_model``, ``high_precision``), what a run records
(``metrics``, ``memory``), its checkpoints (``checkpoint``, ``rng``), what it does with a
non-finite step (``nonfinite_step``), and the ``fp8train`` command line (the wing
:mod:`.commands`: one module per command). ``fp8train.Trainer`` and
``fp8train.TrainingArguments`` are the public names."""
