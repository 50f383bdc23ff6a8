"""The benchmarks' own tests: their math, parsers and CLIs, and small runs of the real thing."""
