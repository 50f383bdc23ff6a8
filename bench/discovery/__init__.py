"""The registry: per-request worker selection, watch propagation, registration throughput."""
