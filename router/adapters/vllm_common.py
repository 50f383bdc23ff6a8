"""The prefill-leg rewrite shared by both vLLM protocols (docs/concepts/protocols.md section 2)."""

from __future__ import annotations

from typing import Any

from router.errors import InvalidRequest
from router.schemas import Endpoint, ParsedRequest

__all__ = ["check_single_sequence", "finished_without_kv", "vllm_prefill_body"]


def vllm_prefill_body(request: ParsedRequest, kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The client's body as a one-token, non-streaming prefill request.

    ``min_tokens`` is always 1: vLLM refuses ``min_tokens`` above ``max_tokens=1`` (400), and a
    minimum of one token masks the stop tokens (EOS, ``stop_token_ids``) for the prefill's one
    token. vLLM keeps the KV for the decode only when that token ends the request by length: a
    stop token would end it, free the KV and leave the decode waiting for it (480 s). The decode
    samples the real first token with the client's own settings, so the output is unchanged.

    ``/v1/responses`` caps with ``max_output_tokens`` and has no ``min_tokens``: ``ignore_eos``
    does the masking there, and ``store: false`` keeps the one-token response out of a store.
    ``/v1/messages`` has neither: a stop token there ends the request (``completed_by_prefill``).
    """
    prefill = dict(request.body)
    prefill["stream"] = False
    prefill.pop("stream_options", None)
    prefill["kv_transfer_params"] = kv_transfer_params
    if request.endpoint is Endpoint.RESPONSES:
        prefill["max_output_tokens"] = 1
        prefill["ignore_eos"] = True
        prefill["store"] = False
        return prefill
    prefill["max_tokens"] = 1
    if request.endpoint is Endpoint.MESSAGES:
        return prefill
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill.pop("min_completion_tokens", None)
    prefill["min_tokens"] = 1
    return prefill


def finished_without_kv(prefill_answer: Any) -> bool:
    """Whether a vLLM prefill's answer says the request ended on a stop token.

    vLLM's connectors keep the KV for the decode only when the prefill stopped at its length cap.
    ``finish_reason: "stop"`` with a string ``stop_reason`` is a stop string, matched by the
    front end after the engine finished by length (the KV was kept); a token id or null is a stop
    token or EOS (the KV was freed). ``min_tokens: 1`` prevents that on current vLLM; an engine
    that ignores it still must not leave the decode waiting.
    """
    if not isinstance(prefill_answer, dict):
        return False
    kind = prefill_answer.get("object") or prefill_answer.get("type")
    if kind == "response":
        # despite ignore_eos: a client's stop_token_ids (KV freed) or a stop string (KV kept,
        # unused until the engine's abort timeout); the answer does not say which, and either
        # way the generation is complete
        return prefill_answer.get("status") == "completed"
    if kind == "message":  # "stop_sequence": a string, matched after the token (KV kept)
        return prefill_answer.get("stop_reason") in ("end_turn", "tool_use")
    choices = prefill_answer.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    return all(
        isinstance(choice, dict)
        and choice.get("finish_reason") == "stop"
        and not isinstance(choice.get("stop_reason"), str)
        for choice in choices
    )


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
