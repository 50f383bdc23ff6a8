"""Shared harness: children, health waits, Prometheus, CPU time, pd-cluster, CLI, stats, tables."""
