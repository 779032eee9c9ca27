"""The ``fp8train`` command line (:mod:`.cli`, the entry point), one module per command,
each owning its sub-parser and what it runs: ``train`` (:mod:`.train_command`),
``compare`` (:mod:`.compare`, with its multi-seed report in :mod:`.compare_seeds`),
``inspect`` (:mod:`.inspect_command`), ``export`` (:mod:`.export_command`) and
``selfcheck`` (:mod:`.selfcheck`); the settings every training command reads, and its
one-line errors, in :mod:`.flags`."""
