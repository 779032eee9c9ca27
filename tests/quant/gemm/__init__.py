"""Tests of fp8train.quant.gemm: the GEMM backends and their dispatch."""
