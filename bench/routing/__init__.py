"""Routing policies' TTFT, throughput and cache hits on realistic traces; the KV index's cost."""
