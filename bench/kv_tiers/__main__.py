"""``python -m bench.kv_tiers``: the tiered KV cache benchmark (``bench.kv_tiers.main``)."""

from __future__ import annotations

from bench.kv_tiers.main import main

if __name__ == "__main__":
    main()
