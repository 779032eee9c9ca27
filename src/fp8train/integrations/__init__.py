"""fp8train inside other frameworks' training loops: the top layer, beside ``train``.

Each module here is one framework's glue (``transformers``: save and load a converted
transformers model; ``lightning``: Lightning's and Fabric's precision plugins). Import the
module you need; this package imports none of them, so ``import fp8train`` never imports a
framework it does not need.
"""
