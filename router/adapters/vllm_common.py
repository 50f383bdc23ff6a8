"""The prefill-leg rewrite shared by both vLLM protocols (PROTOCOLS.md section 2)."""

from __future__ import annotations

from typing import Any

from router.errors import InvalidRequest
from router.schemas import ParsedRequest

__all__ = ["check_single_sequence", "vllm_prefill_body"]

_MIN_TOKEN_FIELDS = ("min_tokens", "min_completion_tokens")


def vllm_prefill_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The client's body as a one-token, non-streaming prefill request.

    ``min_tokens`` / ``min_completion_tokens`` go too: vLLM refuses ``min_tokens`` above
    ``max_tokens=1`` with a 400. The decode leg gets the client's body, so they still apply.
    """
    prefill = dict(body)
    prefill["stream"] = False
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill.pop("stream_options", None)
    for name in _MIN_TOKEN_FIELDS:
        prefill.pop(name, None)
    prefill["kv_transfer_params"] = kv_transfer_params
    return prefill


def check_single_sequence(request: ParsedRequest, protocol: str) -> None:
    """vLLM keys a KV transfer per request: batched prompts and n > 1 would share one id."""
    if request.batch is not None:
        raise InvalidRequest(
            f"batched prompts are not supported by the {protocol} PD protocol; "
            "send one prompt per request",
            param="prompt",
        )
    if request.n != 1:
        raise InvalidRequest(f"n > 1 is not supported by the {protocol} PD protocol", param="n")
