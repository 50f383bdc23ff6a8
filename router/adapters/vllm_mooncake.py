"""vLLM MooncakeConnector >= 0.16: router-minted transfer_id, P and D sent concurrently.

docs/concepts/protocols.md section 3.3: P gets ``X-data-parallel-rank`` and ``max_tokens=1`` (with
``min_tokens=1``: see ``vllm_prefill_body``); D gets the client's body with the
prefill's bootstrap address, the engine id of the pinned DP rank and the same ``transfer_id``.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from router.adapters.base import LegPlan, says_any
from router.adapters.vllm_common import (
    check_single_sequence,
    finished_without_kv,
    vllm_prefill_body,
)
from router.schemas import ParsedRequest
from router.workers import Worker

__all__ = ["KV_FAILURES", "VllmMooncakeAdapter"]

# A decode's error texts when the KV did not come from its prefill (lower case): the prefill's
# "Timeout waiting for P side ready." (protocols.md 3.4), the simulated engine's (pd-worker) "KV
# transfer failed: ..." and the fake engine's "KV pull of <id> timed out / failed". vLLM itself
# answers a failed KV load (kv_load_failure_policy "fail") with a bare 500: the pipeline then
# goes by whether the prefill had answered (router.pipeline.verdicts).
KV_FAILURES = (b"timeout waiting for p side ready", b"kv transfer failed", b"kv pull of")


def _uuid_transfer_id() -> str:
    return f"xfer-{secrets.token_hex(16)}"


class VllmMooncakeAdapter:
    name = "vllm-mooncake"
    sequential = False
    needs_engine_ids = True
    splits_samples = False
    # the router writes the decode's kv_transfer_params (no remote_prefill_cached_tokens)
    decode_reports_own_cache = True
    decode_can_prefill = True  # a body without kv_transfer_params is a plain vLLM request

    def __init__(self, new_transfer_id: Callable[[], str] = _uuid_transfer_id) -> None:
        self._new_transfer_id = new_transfer_id

    def check(self, request: ParsedRequest) -> None:
        check_single_sequence(request, self.name)

    def plan(self, request: ParsedRequest, prefill: Worker, rank: int, decode: Worker) -> LegPlan:
        transfer_id = self._new_transfer_id()
        prefill_params = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
        }
        decode_body = dict(request.body)
        decode_body["kv_transfer_params"] = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": prefill.bootstrap_addr,
            "remote_engine_id": prefill.engine_ids[rank],
            "transfer_id": transfer_id,
        }
        return LegPlan(
            prefill_body=vllm_prefill_body(request, prefill_params),
            decode_body=decode_body,
            prefill_headers={"x-data-parallel-rank": str(rank)},
            transfer_ref=f"transfer_id={transfer_id}",
        )

    def decode_after_prefill(self, request: ParsedRequest, prefill_answer: Any) -> dict[str, Any]:
        raise NotImplementedError("vllm-mooncake dispatches prefill and decode concurrently")

    def completed_by_prefill(self, prefill_answer: Any) -> bool:
        return finished_without_kv(prefill_answer)

    def is_stale_layout(self, decode_error_body: bytes) -> bool:
        return b"not found from bootstrap server" in decode_error_body

    def is_kv_failure(self, decode_error_body: bytes) -> bool:
        return says_any(decode_error_body, KV_FAILURES)
