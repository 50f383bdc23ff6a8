"""The router under load: req/s, latency and CPU per request, end-to-end TTFT, HTTP client cost."""
