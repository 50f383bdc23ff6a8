"""vLLM NixlConnector: prefill first, then decode with the prefill's kv_transfer_params verbatim.

docs/concepts/protocols.md section 4. The prefill copy gets ``min_tokens=1`` (see
``vllm_prefill_body``); the
decode receives the client's original body, ``min_tokens`` included. A DP prefill gets the chosen
rank in ``X-data-parallel-rank`` (section 2), as with Mooncake.
"""

from __future__ import annotations

from typing import Any

from router.adapters.base import LegPlan, says_any
from router.adapters.vllm_common import (
    check_single_sequence,
    finished_without_kv,
    vllm_prefill_body,
)
from router.errors import InvalidRequest
from router.schemas import ParsedRequest
from router.workers import Worker

__all__ = ["KV_FAILURES", "VllmNixlAdapter"]

# A decode's error texts when the KV did not come from its prefill (lower case): the simulated
# engine's (pd-worker) "KV transfer failed: ..." and the fake engine's "NIXL read of <id>
# failed". vLLM itself answers a failed KV load with a bare 500 (protocols.md section 2).
KV_FAILURES = (b"kv transfer failed", b"nixl read of")

_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class VllmNixlAdapter:
    name = "vllm-nixl"
    sequential = True
    needs_engine_ids = False
    splits_samples = False
    # remote_prefill_cached_tokens (copied from the prefill's answer) overrides it
    decode_reports_own_cache = False
    decode_can_prefill = True  # a body without kv_transfer_params is a plain vLLM request

    def check(self, request: ParsedRequest) -> None:
        check_single_sequence(request, self.name)

    def plan(self, request: ParsedRequest, prefill: Worker, rank: int, decode: Worker) -> LegPlan:
        body = vllm_prefill_body(request, dict(_PREFILL_PARAMS))
        # a DP prefill computes on the rank the router chose (cache_aware: where its prefix is)
        headers = {"x-data-parallel-rank": str(rank)} if prefill.dp_size > 1 else {}
        return LegPlan(prefill_body=body, decode_body=None, prefill_headers=headers)

    def decode_after_prefill(self, request: ParsedRequest, prefill_answer: Any) -> dict[str, Any]:
        params = (
            prefill_answer.get("kv_transfer_params") if isinstance(prefill_answer, dict) else None
        )
        if not isinstance(params, dict):
            raise InvalidRequest(
                "the prefill answer carries no kv_transfer_params: is the prefill engine "
                "running with a NixlConnector kv_producer config?"
            )
        decode_body = dict(request.body)
        decode_body["kv_transfer_params"] = params
        return decode_body

    def completed_by_prefill(self, prefill_answer: Any) -> bool:
        return finished_without_kv(prefill_answer)

    def is_stale_layout(self, decode_error_body: bytes) -> bool:
        return False

    def is_kv_failure(self, decode_error_body: bytes) -> bool:
        return says_any(decode_error_body, KV_FAILURES)
