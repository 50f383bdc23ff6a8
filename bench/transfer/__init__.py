"""Moving KV: bytes/s and per-request overhead of the library and the engine vs raw Mooncake."""
