"""Metrics, traces, logs, receipts and the recent-traffic window.

May import: fleet, kv_cache, upstream (scrape-time gauges), the top level.
"""
