"""The tiered KV cache (L1/L2/L3): TTFT per tier, a multi-turn workload, the disk store's speed."""
