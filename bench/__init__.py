"""The benchmarks, by suite (``python -m bench`` lists them) and their shared ``common`` harness."""
