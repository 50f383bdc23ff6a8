"""Read a completion request's prompts and PD fields, as SGLang and vLLM engines receive them.

* SGLang (docs/concepts/protocols.md 5.1, 5.5): ``bootstrap_host`` / ``bootstrap_port`` /
``bootstrap_room``,
  scalars or one list entry per sequence (batches, ``n`` > 1); ``routed_dp_rank`` names the
  prefill DP rank, ``disagg_prefill_dp_rank`` the one a decode pulls from.
* vLLM MooncakeConnector >= 0.16 (3.3): ``kv_transfer_params`` with the router's ``transfer_id``,
  and ``X-data-parallel-rank`` choosing the prefill's DP engine. A decode needs
  ``do_remote_prefill`` and all of ``remote_engine_id``, ``remote_bootstrap_addr``,
  ``transfer_id``; like vLLM it prefills locally (with a warning) when any is missing. A prefill
  needs ``do_remote_decode`` and a ``transfer_id``. ``transfer_id`` maps to a room by a hash,
  the same on both sides.

Prompts become tokens with the worker's ``worker.tokenizer`` (bytes by default).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from worker.tokenizer import ByteTokenizer, PromptTokenizer, TokenizerError

__all__ = ["PDProtocol", "Seq", "WorkerError", "max_tokens", "room_of", "sequences"]

logger = logging.getLogger(__name__)

PDProtocol = Literal["sglang", "vllm-mooncake"]
_ROOM_MASK = (1 << 63) - 1
_BYTES = ByteTokenizer()


class WorkerError(Exception):
    """A request the worker refuses or cannot finish: ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class Seq:
    """One sequence of a request: its prompt tokens and its PD fields (room None: local)."""

    index: int
    tokens: list[int]
    room: int | None = None
    bootstrap: str | None = None  # the prefill's bootstrap API, for a decode
    dp_rank: int | None = None  # a prefill's DP rank (routed_dp_rank / X-data-parallel-rank)
    source_dp_rank: int | None = None  # the prefill DP rank a decode pulls from
    engine_id: str | None = None  # vLLM: the prefill DP engine a decode pulls from
    local: bool = False  # vLLM params too incomplete to disaggregate: prefill locally


def room_of(transfer_id: str) -> int:
    """The room a vLLM ``transfer_id`` maps to, on prefill and decode alike."""
    digest = hashlib.blake2b(transfer_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _ROOM_MASK


def max_tokens(body: Mapping[str, Any]) -> int:
    value = body.get("max_tokens") or body.get("max_completion_tokens") or 16
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise WorkerError(400, f"max_tokens must be a positive integer, got {value!r}")
    return value


def sequences(
    body: Mapping[str, Any],
    chat: bool,
    headers: Mapping[str, str],
    tokenizer: PromptTokenizer = _BYTES,
) -> list[Seq]:
    """The request's sequences with their PD fields, for whichever protocol it speaks."""
    n = body.get("n") or 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise WorkerError(400, f"n must be a positive integer, got {n!r}")
    try:
        prompts = [t for t in _prompts(body, chat, tokenizer) for _ in range(n)]
    except TokenizerError as exc:
        raise WorkerError(400, str(exc)) from exc
    params = body.get("kv_transfer_params")
    if params is not None:
        return _vllm(prompts, params, headers)
    return _sglang(prompts, body)


def _sglang(prompts: list[list[int]], body: Mapping[str, Any]) -> list[Seq]:
    rooms = _as_list(body.get("bootstrap_room"), len(prompts))
    hosts = _as_list(body.get("bootstrap_host"), len(prompts))
    ports = _as_list(body.get("bootstrap_port"), len(prompts))
    routed = _optional_int(body.get("routed_dp_rank"), "routed_dp_rank")
    pulled = _optional_int(body.get("disagg_prefill_dp_rank"), "disagg_prefill_dp_rank")
    seqs = []
    for i, (tokens, room, host, port) in enumerate(zip(prompts, rooms, hosts, ports, strict=True)):
        bootstrap = None if host is None or port is None else f"{host}:{port}"
        room_id = _optional_int(room, "bootstrap_room")
        if room_id is not None and not 0 <= room_id < 1 << 64:
            raise WorkerError(400, f"bootstrap_room {room_id} is outside [0, 2^64)")
        seqs.append(Seq(i, list(tokens), room_id, bootstrap, routed, pulled))
    return seqs


def _vllm(prompts: list[list[int]], params: Any, headers: Mapping[str, str]) -> list[Seq]:
    if not isinstance(params, dict):
        raise WorkerError(400, "kv_transfer_params must be an object")
    if len(prompts) != 1:
        raise WorkerError(400, "kv_transfer_params takes exactly one sequence (no batch, n=1)")
    tokens = prompts[0]
    transfer_id = params.get("transfer_id")
    if params.get("do_remote_decode"):
        if not isinstance(transfer_id, str) or not transfer_id:
            raise WorkerError(400, "Missing transfer_id in kv_transfer_params from router!")
        rank = headers.get("x-data-parallel-rank")
        dp_rank = _optional_int(rank, "X-data-parallel-rank")
        return [Seq(0, tokens, room_of(transfer_id), dp_rank=dp_rank)]
    if params.get("do_remote_prefill"):
        engine_id, addr = params.get("remote_engine_id"), params.get("remote_bootstrap_addr")
        fields = (engine_id, addr, transfer_id)
        if all(isinstance(f, str) and f for f in fields):
            assert isinstance(engine_id, str) and isinstance(addr, str)
            assert isinstance(transfer_id, str)
            return [Seq(0, tokens, room_of(transfer_id), addr, engine_id=engine_id)]
        logger.warning(
            "Got invalid KVTransferParams: %s. This request will not utilize KVTransfer", params
        )
    return [Seq(0, tokens, local=True)]


def _prompts(body: Mapping[str, Any], chat: bool, tokenizer: PromptTokenizer) -> list[list[int]]:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise WorkerError(400, "messages must be a non-empty list")
        return [tokenizer.chat(messages)]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [tokenizer.prompt(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [tokenizer.prompt(p) for p in prompt]
    raise WorkerError(400, "prompt must be a string or a list of strings")


def _as_list(value: Any, count: int) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise WorkerError(400, f"{len(value)} bootstrap values for {count} sequences")
        return value
    if count != 1 and value is not None:
        raise WorkerError(400, "batched requests need list bootstrap fields")
    return [value] * count


def _optional_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise WorkerError(400, f"{name} must be an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise WorkerError(400, f"{name} must be an integer, got {value!r}") from None
