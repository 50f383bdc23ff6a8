"""pd-router: an OpenAI-compatible prefill/decode disaggregation router."""

from __future__ import annotations

from router.app import create_app
from router.settings import RouterSettings

__all__ = ["RouterSettings", "create_app"]
