"""The prefill-leg rewrite shared by both vLLM protocols (docs/concepts/protocols.md section 2)."""

from __future__ import annotations

from typing import Any

from router.errors import InvalidRequest
from router.schemas import ParsedRequest

__all__ = ["check_single_sequence", "finished_without_kv", "vllm_prefill_body"]


def vllm_prefill_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The client's body as a one-token, non-streaming prefill request.

    ``min_tokens`` is always 1: vLLM refuses ``min_tokens`` above ``max_tokens=1`` (400), and a
    minimum of one token masks the stop tokens (EOS, ``stop_token_ids``) for the prefill's one
    token. vLLM keeps the KV for the decode only when that token ends the request by length: a
    stop token would end it, free the KV and leave the decode waiting for it (480 s). The decode
    samples the real first token with the client's own settings, so the output is unchanged.
    """
    prefill = dict(body)
    prefill["stream"] = False
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill.pop("stream_options", None)
    prefill.pop("min_completion_tokens", None)
    prefill["min_tokens"] = 1
    prefill["kv_transfer_params"] = kv_transfer_params
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
