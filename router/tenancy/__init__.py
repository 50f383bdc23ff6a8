"""Per-tenant limits: requests and tokens per minute and requests in flight, enforced with the
``limits`` library (``router.tenancy.limiter``), and the ``x-ratelimit-*`` headers that report
them to OpenAI clients (``router.tenancy.headers``).

May import: the top level.
"""
