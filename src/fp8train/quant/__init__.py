"""PyTorch numerics: dtypes and casts (:mod:`.cast`), scales (:mod:`.scaling`), the
quantized tensor (:mod:`.tensor`), quantization (:mod:`.quantize`), layouts
(:mod:`.layouts`), the scaled GEMM (:mod:`.gemm`, with the :mod:`.emulated` and
:mod:`.hardware` backends) and prequantized weights (:mod:`.weight`). The public names
are re-exported by :mod:`fp8train`."""
