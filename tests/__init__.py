"""fp8train test suite, laid out like the package: spec, quant, nn, parallel, train."""
