"""Per-protocol PD checks and KV rendezvous for the fake engine (`testkit/fake_engine.py`).

One class per (protocol, role) checks the fields a router must send, exactly as the real engines
need them (docs/concepts/protocols.md sections 2-5), and raises `EngineError` (answered as an OpenAI
error JSON) when one is missing or wrong. With `FakeConfig.check_kv` the classes also play the KV
hand-over between a prefill (P) and a decode (D), so a router that pairs the wrong engines, ranks or
ids makes the decode fail instead of silently "working":

* vllm-mooncake: D GETs `{remote_bootstrap_addr}/query` and looks up `remote_engine_id`, then
  POSTs `{remote_bootstrap_addr}/fake/pull`; P's bootstrap port answers once P has served the
  request with that `transfer_id` on the DP rank owning that engine id.
* vllm-nixl: D POSTs `http://{remote_host}:{remote_port}/fake/nixl/pull` on P's HTTP port with
  the `remote_request_id` P returned.
* sglang: D POSTs `/fake/sglang/kv` on P's bootstrap port once per room; P answers only after
  D arrived (SGLang's `KVPoll.Bootstrapping`), and D only after P served the room.

What real engines do when the KV does not come (docs/real-engines.md section 5, "Observed
router-relevant behaviour"), each reproduced here: a vLLM prefill whose one token is a stop
token keeps no KV (its connectors hold KV only for a request that ended by length); a prefill
that died after answering (`FakeConfig.die_after_answer`) or withholds the KV (`withhold_kv`)
never serves it; a decode whose KV read hits a transport error retries until `kv_timeout` (vLLM
waits its full abort timeout for a dead prefill); SGLang's decode waits forever for an n > 1
request (`sglang_n_hang`: its prefix warm-up reuses the room).

The HTTP app and the bootstrap app of one engine may run on different threads (tests start one
uvicorn per app), so the rendezvous primitives (`testkit/fake_base.py`) are thread-safe.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

import httpx

from testkit.fake_base import (
    Admission,
    Call,
    EngineContext,
    EngineError,
    FakeConfig,
    Reply,
    RoleHandler,
    RouteRequest,
    Routes,
    Shape,
    SlotTable,
    bad_request,
    generate,
    is_int,
    run_all,
    wait_ready,
)
from testkit.fake_formats import FORMAT_PATHS, RESPONSES_PATH
from testkit.fake_wire import COMPLETIONS_PATH

__all__ = ["HANDLERS", "build_handler"]

MAX_ROOM: Final = 2**63 - 1
FAKE_WORKER_PORT: Final = 41000  # advertised ZMQ ports: nothing listens there
BOOTSTRAP_KEYS: Final = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
ROUTE_KEYS_OLD: Final = ("engine_rank", "target_dp_group")
ROUTE_KEYS_NEW: Final = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
QUERY_TIMEOUT_S: Final = 10.0
RETRY_S: Final = 0.05  # a decode's pause between two KV reads that hit a transport error


async def health_ok(_: RouteRequest) -> Reply:
    return Reply(200, b"OK")


def _error_detail(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:200]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "detail" in data:
            return str(data["detail"])
    return str(data)[:200]


def http_url(host: str, port: int, path: str) -> str:
    """An http URL; IPv6 hosts may come with or without brackets."""
    return str(httpx.URL(scheme="http", host=host.strip("[]"), port=port, path=path))


def hands_over_kv(config: FakeConfig) -> bool:
    """Whether a prefill will ever serve the KV of what it answers (not dying, not withholding)."""
    return not (config.withhold_kv or config.die_after_answer)


def vllm_keeps_kv(call: Call, config: FakeConfig) -> bool:
    """Whether a vLLM prefill keeps the request's KV for the decode: only when its one token
    ended the request by length. A stop token (EOS, `stop_token_ids`) frees it at once; a stop
    string does not (vLLM matches it in the front end after the engine finished by length)."""
    return hands_over_kv(config) and not generate(call.sampling_body(), 1, True, config).token_stop


async def post_retrying(ctx: EngineContext, url: str, body: dict[str, Any]) -> httpx.Response:
    """POST `body`, retrying transport errors (refused, reset) until `kv_timeout`; TimeoutError
    then. A real vLLM decode does not fail a KV read when the prefill is gone: it waits its full
    abort timeout (480-540 s) for the KV."""
    async with asyncio.timeout(ctx.config.kv_timeout):
        while True:
            try:
                return await ctx.http_client().post(url, json=body)
            except httpx.TransportError:
                await asyncio.sleep(RETRY_S)


# --------------------------------------------------------------------------- vLLM common


def _require_str(params: Mapping[str, Any], key: str, where: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}.{key} must be a non-empty string, got {value!r}")
    return value


def _require_flag(params: Mapping[str, Any], key: str, expected: bool) -> None:
    value = params.get(key)
    if value is not expected:
        want = "true" if expected else "false"
        raise bad_request(f"kv_transfer_params.{key} must be {want}, got {value!r}")


def _require_one(body: Mapping[str, Any], key: str) -> None:
    value = body.get(key)
    if not (is_int(value) and value == 1):
        raise bad_request(f"prefill request must set {key}=1, got {value!r}")


def check_vllm_prefill(body: Mapping[str, Any], path: str = COMPLETIONS_PATH) -> dict[str, Any]:
    """The prefill rewrite of the reference proxies (docs/concepts/protocols.md 2) for the
    endpoint `path`; returns the KV params. Responses: `max_output_tokens` 1, `ignore_eos`
    (it has no `min_tokens`) and `store` false; Messages: `max_tokens` 1 (no `min_tokens` nor
    `ignore_eos` in vLLM's Anthropic request)."""
    if body.get("stream") is not False:
        raise bad_request(f"prefill request must set stream=false, got {body.get('stream')!r}")
    if path == RESPONSES_PATH:
        _require_one(body, "max_output_tokens")
        for key, expected in (("ignore_eos", True), ("store", False)):
            if body.get(key) is not expected:
                raise bad_request(
                    f"prefill request must set {key}={str(expected).lower()}, got {body.get(key)!r}"
                )
    else:
        _require_one(body, "max_tokens")
    if "max_completion_tokens" in body and path not in FORMAT_PATHS:
        _require_one(body, "max_completion_tokens")
    if "stream_options" in body:
        raise bad_request("prefill request must not carry stream_options")
    if path not in FORMAT_PATHS:
        _check_min_tokens(body)
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise bad_request(f"prefill request needs a kv_transfer_params object, got {params!r}")
    _require_flag(params, "do_remote_decode", True)
    return params


def _check_min_tokens(body: Mapping[str, Any]) -> None:
    """vLLM's ``SamplingParams`` check: ``min_tokens`` above ``max_tokens`` is a 400 (vLLM
    0.32 answers the one-token prefill leg of a ``min_tokens: 4`` request this way)."""
    min_tokens = body.get("min_tokens", 0)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(min_tokens, int) and isinstance(max_tokens, int) and min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )


def decode_params(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """D's `kv_transfer_params`; None for a plain (non-PD) request."""
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise bad_request(f"kv_transfer_params must be an object, got {params!r}")
    return params


def parse_dp_rank(headers: Mapping[str, str], dp_size: int) -> int:
    """The `X-data-parallel-rank` pin; required when dp_size > 1."""
    raw = headers.get("x-data-parallel-rank")
    if raw is None:
        if dp_size > 1:
            raise bad_request(f"x-data-parallel-rank header is required (dp_size={dp_size})")
        return 0
    try:
        rank = int(raw)
    except ValueError:
        raise bad_request(f"x-data-parallel-rank must be an integer, got {raw!r}") from None
    if not 0 <= rank < dp_size:
        raise bad_request(f"x-data-parallel-rank {rank} is out of range for dp_size={dp_size}")
    return rank


# --------------------------------------------------------------------------- vLLM Mooncake


class MooncakePrefill(RoleHandler):
    """vLLM >= 0.16 MooncakeConnector producer (docs/concepts/protocols.md 3.2, 3.3)."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self._served: SlotTable[str] = SlotTable()  # transfer_id -> engine id that computed it

    async def admit(self, call: Call) -> Admission:
        params = check_vllm_prefill(call.body, call.record.path)
        _require_flag(params, "do_remote_prefill", False)
        transfer_id = _require_str(params, "transfer_id", "kv_transfer_params")
        rank = parse_dp_rank(call.headers, self.ctx.dp_size)
        call.record.dp_ranks.append(rank)
        if self.ctx.config.check_kv and vllm_keeps_kv(call, self.ctx.config):
            self._served.fulfil(transfer_id, self.ctx.engine_ids[rank])
        return Admission(echo_kv=True, max_tokens=1)

    def bootstrap_routes(self) -> Routes:
        return {
            "/health": {"GET": health_ok},
            "/query": {"GET": self._query},
            "/fake/pull": {"POST": self._pull},
        }

    def reset(self) -> None:
        self._served.clear()

    async def _query(self, _: RouteRequest) -> Reply:
        table = {
            str(rank): {
                "engine_id": engine_id,
                "worker_addr": {"0": {"0": f"tcp://127.0.0.1:{FAKE_WORKER_PORT + rank}"}},
            }
            for rank, engine_id in enumerate(self.ctx.engine_ids)
        }
        return Reply(200, table)

    async def _pull(self, request: RouteRequest) -> Reply:
        data = request.json()
        transfer_id = _require_str(data, "transfer_id", "body")
        engine_id = _require_str(data, "engine_id", "body")
        if engine_id not in self.ctx.engine_ids:
            return Reply(404, {"detail": f"engine_id {engine_id} not found here (restarted?)"})
        slot = self._served.get(transfer_id)
        timeout = self.ctx.config.kv_timeout
        if not await wait_ready(slot, timeout):
            self._served.pop(transfer_id)
            msg = f"Timeout waiting for P side ready: transfer_id {transfer_id} ({timeout}s)"
            return Reply(504, {"detail": msg})
        if slot.value != engine_id:
            msg = (
                f"transfer_id {transfer_id} was prefilled by engine {slot.value}, "
                f"not by {engine_id} (wrong DP rank?)"
            )
            return Reply(409, {"detail": msg})
        self._served.pop(transfer_id)
        return Reply(200, {"status": "ok"})


class MooncakeDecode(RoleHandler):
    """vLLM >= 0.16 MooncakeConnector consumer: pulls KV named by the router's params."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self._known: dict[str, frozenset[str]] = {}  # bootstrap addr -> engine ids

    async def admit(self, call: Call) -> Admission:
        params = decode_params(call.body)
        if params is None:
            return Admission(echo_kv=True)
        _require_flag(params, "do_remote_prefill", True)
        _require_flag(params, "do_remote_decode", False)
        engine_id = _require_str(params, "remote_engine_id", "kv_transfer_params")
        addr = _require_str(params, "remote_bootstrap_addr", "kv_transfer_params")
        if not addr.startswith("http://"):
            raise bad_request(f"kv_transfer_params.remote_bootstrap_addr needs http://: {addr!r}")
        transfer_id = _require_str(params, "transfer_id", "kv_transfer_params")
        if self.ctx.config.check_kv:
            await self._resolve(addr, engine_id)
            await self._pull(addr, engine_id, transfer_id)
        return Admission(echo_kv=True)

    def reset(self) -> None:
        self._known.clear()

    async def _resolve(self, addr: str, engine_id: str) -> None:
        if engine_id in self._known.get(addr, frozenset()):
            return
        self._known[addr] = await self._query(addr)
        if engine_id not in self._known[addr]:
            raise EngineError(500, f"remote engine_id {engine_id} not found from bootstrap server")

    async def _query(self, addr: str) -> frozenset[str]:
        try:
            response = await self.ctx.http_client().get(f"{addr}/query", timeout=QUERY_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise EngineError(500, f"bootstrap query {addr}/query failed: {exc!r}") from None
        try:
            table = response.json() if response.status_code == 200 else None
        except ValueError:
            table = None
        if not isinstance(table, dict):
            raise EngineError(500, f"bad bootstrap answer from {addr}/query: {response.text!r}")
        return frozenset(
            str(entry.get("engine_id")) for entry in table.values() if isinstance(entry, dict)
        )

    async def _pull(self, addr: str, engine_id: str, transfer_id: str) -> None:
        timeout = self.ctx.config.kv_timeout
        body = {"transfer_id": transfer_id, "engine_id": engine_id}
        try:
            response = await post_retrying(self.ctx, f"{addr}/fake/pull", body)
        except TimeoutError:
            raise EngineError(500, f"KV pull of {transfer_id} timed out after {timeout}s") from None
        except httpx.HTTPError as exc:
            msg = f"KV pull of {transfer_id} from {addr} failed: {exc!r}"
            raise EngineError(500, msg) from None
        if response.status_code != 200:
            detail = _error_detail(response)
            raise EngineError(
                500, f"KV pull of {transfer_id} failed ({response.status_code}): {detail}"
            )


# --------------------------------------------------------------------------- vLLM NIXL


class NixlPrefill(RoleHandler):
    """vLLM NixlConnector producer: returns the params D must receive verbatim
    (docs/concepts/protocols.md 4)."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self._lock = threading.Lock()
        self._ready: set[str] = set()  # remote_request_id of KV waiting to be pulled
        self._withheld: set[str] = set()  # remote_request_id of KV that never comes

    async def admit(self, call: Call) -> Admission:
        check_vllm_prefill(
            call.body, call.record.path
        )  # min_tokens above max_tokens=1 is a 400, as on vLLM
        config = self.ctx.config
        if generate(
            call.sampling_body(), 1, True, config
        ).token_stop:  # the KV is freed: nothing to read
            return Admission(echo_kv=True, kv_transfer_params=None, max_tokens=1)
        request_id = f"{call.headers.get('x-request-id', 'cmpl')}-{uuid.uuid4().hex[:8]}"
        if config.check_kv:
            with self._lock:
                (self._ready if hands_over_kv(config) else self._withheld).add(request_id)
        params = self._params(call, request_id)
        return Admission(echo_kv=True, kv_transfer_params=params, max_tokens=1)

    def routes(self) -> Routes:
        return {"/fake/nixl/pull": {"POST": self._pull}}

    def reset(self) -> None:
        with self._lock:
            self._ready.clear()
            self._withheld.clear()

    def _params(self, call: Call, request_id: str) -> dict[str, Any]:
        host, port = call.server
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[1, 2, 3]],
            "remote_engine_id": self.ctx.engine_id,
            "remote_request_id": request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": 1,
            "remote_num_tokens": call.shape.prompt_tokens,
            "transfer_mode": "pull",
            "some_future_field": "x",
        }

    async def _pull(self, request: RouteRequest) -> Reply:
        request_id = _require_str(request.json(), "remote_request_id", "body")
        with self._lock:
            known = request_id in self._ready
            self._ready.discard(request_id)
            withheld = request_id in self._withheld
        if withheld:  # the read never completes
            await asyncio.sleep(self.ctx.config.kv_timeout)
            return Reply(504, {"detail": f"KV of {request_id} never became readable"})
        if not known:
            return Reply(404, {"detail": f"unknown remote_request_id {request_id}"})
        return Reply(200, {"status": "ok"})


NIXL_DECODE_KEYS: Final = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)


class NixlDecode(RoleHandler):
    """vLLM NixlConnector consumer: needs P's params, reads KV from P."""

    async def admit(self, call: Call) -> Admission:
        params = decode_params(call.body)
        if params is None:
            return Admission(echo_kv=True)
        _require_flag(params, "do_remote_prefill", True)
        missing = [key for key in NIXL_DECODE_KEYS if params.get(key) is None]
        if missing:
            raise bad_request(f"kv_transfer_params is missing {', '.join(missing)}")
        host, port = params["remote_host"], params["remote_port"]
        if not isinstance(host, str) or not is_int(port):
            raise bad_request(f"bad remote_host/remote_port: {host!r}, {port!r}")
        if self.ctx.config.check_kv:
            await self._pull(host, port, str(params["remote_request_id"]))
        return Admission(echo_kv=True)

    async def _pull(self, host: str, port: int, request_id: str) -> None:
        url = http_url(host, port, "/fake/nixl/pull")
        try:
            response = await post_retrying(self.ctx, url, {"remote_request_id": request_id})
        except (TimeoutError, httpx.HTTPError) as exc:
            msg = f"NIXL read of {request_id} from {url} failed: {exc!r}"
            raise EngineError(500, msg) from None
        if response.status_code != 200:
            detail = _error_detail(response)
            raise EngineError(
                500, f"NIXL read of {request_id} failed ({response.status_code}): {detail}"
            )


# --------------------------------------------------------------------------- SGLang


def _valid_host(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def _valid_port(value: object) -> bool:
    return value is None or (is_int(value) and 0 < value < 65536)


def _valid_room(value: object) -> TypeGuard[int]:
    return is_int(value) and 0 <= value <= MAX_ROOM


BOOTSTRAP_CHECKS: Final[dict[str, Callable[[object], bool]]] = {
    "bootstrap_host": _valid_host,
    "bootstrap_port": _valid_port,
    "bootstrap_room": _valid_room,
}


@dataclass(frozen=True)
class Bootstrap:
    """The validated bootstrap fields, one entry per sequence (prompt x sample)."""

    hosts: list[str]
    ports: list[int | None]
    rooms: list[int]
    listed: bool  # the router sent lists (else scalars the engine expands)


def _scalar_form(body: Mapping[str, Any], shape: Shape) -> Bootstrap:
    """Scalars: SGLang expands the room to `room + i` for each of n samples (io_struct)."""
    if shape.batch is not None:
        raise bad_request(
            f"bootstrap_host/port/room must be lists of {shape.choices} values for a batch "
            f"of {shape.batch} prompts"
        )
    room = body["bootstrap_room"]
    if _valid_room(room) and room + shape.choices - 1 > MAX_ROOM:
        raise bad_request(f"bootstrap_room {room} + n - 1 is out of range")
    count = shape.choices
    rooms = [room + i for i in range(count)] if _valid_room(room) else [room]
    hosts, ports = [body["bootstrap_host"]] * count, [body["bootstrap_port"]] * count
    return Bootstrap(hosts, ports, rooms, listed=False)


def _list_form(body: Mapping[str, Any], shape: Shape) -> Bootstrap:
    """Lists: one entry per sequence, so only for a batch or n > 1."""
    count = shape.choices
    for key in BOOTSTRAP_KEYS:
        value = body[key]
        if count == 1:
            raise bad_request(f"{key} must be a single value for a single request, got a list")
        if not isinstance(value, list) or len(value) != count:
            raise bad_request(f"{key} must be a list of {count} values, got {value!r}")
    hosts, ports, rooms = (body[key] for key in BOOTSTRAP_KEYS)
    return Bootstrap(hosts, ports, rooms, listed=True)


def parse_bootstrap(body: Mapping[str, Any], shape: Shape) -> Bootstrap:
    """Check `bootstrap_host/port/room` (docs/concepts/protocols.md 5.1).

    All three are scalars (a single prompt; with n > 1 the engine uses rooms `room + i`) or
    all three are lists with one entry per sequence: batch size x n.
    """
    missing = [key for key in BOOTSTRAP_KEYS if key not in body]
    if missing:
        raise bad_request(f"SGLang PD request is missing {', '.join(missing)}")
    listed = isinstance(body["bootstrap_room"], list)
    boot = _list_form(body, shape) if listed else _scalar_form(body, shape)
    columns: tuple[list[Any], ...] = (boot.hosts, boot.ports, boot.rooms)
    for key, values in zip(BOOTSTRAP_KEYS, columns, strict=True):
        bad = [value for value in values if not BOOTSTRAP_CHECKS[key](value)]
        if bad:
            raise bad_request(f"invalid {key} value {bad[0]!r}")
    if len(set(boot.rooms)) != len(boot.rooms):
        raise bad_request(f"bootstrap_room values must be distinct, got {boot.rooms!r}")
    return boot


def _optional_ranks(body: Mapping[str, Any], key: str, boot: Bootstrap) -> list[int] | None:
    """An optional DP-rank field: an int, or (for a batch) a list with one int per room."""
    value = body.get(key)
    if value is None:
        return None
    ranks = value if isinstance(value, list) and boot.listed else [value]
    if not all(is_int(rank) and rank >= 0 for rank in ranks):
        raise bad_request(f"{key} must be a non-negative integer, got {value!r}")
    if len(ranks) == 1:
        return ranks * len(boot.rooms)
    if len(ranks) != len(boot.rooms):
        raise bad_request(f"{key} must have {len(boot.rooms)} entries, got {value!r}")
    return ranks


class SglangPrefill(RoleHandler):
    """SGLang prefill: same body as D, DP rank follows the room (docs/concepts/protocols.md 5.1,
    5.5, 5.6)."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self._arrived: SlotTable[int] = SlotTable()  # D sent its metadata for the room
        self._served: SlotTable[int] = SlotTable()  # P finished the room (KV "sent")

    async def admit(self, call: Call) -> Admission:
        boot = parse_bootstrap(call.body, call.shape)
        call.record.dp_ranks.extend(self._dp_ranks(call.body, boot))
        if self.ctx.config.check_kv:
            await run_all(self._serve_room(room) for room in boot.rooms)
        return Admission(max_tokens=1)

    def bootstrap_routes(self) -> Routes:
        return {
            "/health": {"GET": health_ok},
            "/route": {"GET": self._route},
            "/fake/sglang/kv": {"POST": self._decode_arrives},
        }

    def reset(self) -> None:
        self._arrived.clear()
        self._served.clear()

    def _dp_ranks(self, body: Mapping[str, Any], boot: Bootstrap) -> list[int]:
        dp_size = self.ctx.dp_size
        ranks = [room % dp_size for room in boot.rooms]
        routed = _optional_ranks(body, "routed_dp_rank", boot)
        for room, rank, wanted in zip(boot.rooms, ranks, routed or ranks, strict=True):
            if wanted != rank:
                raise EngineError(
                    500,
                    f"follow_bootstrap_room conflict: bootstrap_room {room} % {dp_size} = {rank}"
                    f" but routed_dp_rank = {wanted}",
                )
        return ranks

    async def _serve_room(self, room: int) -> None:
        timeout = self.ctx.config.kv_timeout
        try:
            arrived = await wait_ready(self._arrived.get(room), timeout)
        finally:
            self._arrived.pop(room)
        if not arrived:
            raise EngineError(
                500,
                f"Request {room} timed out after {timeout} seconds in KVPoll.Bootstrapping "
                "(the decode never arrived)",
            )
        if hands_over_kv(self.ctx.config):
            self._served.fulfil(room)

    async def _decode_arrives(self, request: RouteRequest) -> Reply:
        room = request.json().get("room")
        if not _valid_room(room):
            raise bad_request(f"'room' must be a bootstrap room integer, got {room!r}")
        self._arrived.fulfil(room)
        timeout = self.ctx.config.kv_timeout
        try:
            served = await wait_ready(self._served.get(room), timeout)
        finally:
            self._served.pop(room)
            self._arrived.pop(room)
        if not served:
            return Reply(504, {"detail": f"room {room} was not prefilled within {timeout}s"})
        return Reply(200, {"status": "ok"})

    async def _route(self, request: RouteRequest) -> Reply:
        query = request.query
        if all(query.get(key) == "-1" for key in ROUTE_KEYS_NEW):
            return Reply(200, self._server_info())
        if all(query.get(key) == "-1" for key in ROUTE_KEYS_OLD):
            return Reply(200, {"prefill_tp_size": 1, "prefill_dp_size": self.ctx.dp_size})
        if all(key in query for key in ROUTE_KEYS_NEW) or all(k in query for k in ROUTE_KEYS_OLD):
            return Reply(200, {"rank_ip": "127.0.0.1", "rank_port": FAKE_WORKER_PORT})
        return Reply(400, b"Missing inputs for bootstrap server.")

    def _server_info(self) -> dict[str, Any]:
        return {
            "attn_tp_size": 1,
            "attn_cp_size": 1,
            "dp_size": self.ctx.dp_size,
            "pp_size": 1,
            "page_size": 16,
            "kv_cache_dtype": "auto",
            "follow_bootstrap_room": True,
        }


class SglangDecode(RoleHandler):
    """SGLang decode: fetches each room's KV from the prefill's bootstrap port.

    A body with none of the bootstrap fields is a plain request (the benchmark's
    direct-to-decode baseline); the prefill always requires them. An unreachable prefill is
    retried until `kv_timeout` (real SGLang gives up after two failed heartbeats, ~10 s).
    """

    async def admit(self, call: Call) -> Admission:
        if not any(key in call.body for key in BOOTSTRAP_KEYS):
            return Admission()
        boot = parse_bootstrap(call.body, call.shape)
        _optional_ranks(call.body, "disagg_prefill_dp_rank", boot)
        if self.ctx.config.sglang_n_hang and call.shape.n > 1:
            await self._never_arrives(boot.rooms)
        if self.ctx.config.check_kv:
            default_port = self.ctx.config.default_bootstrap_port
            await run_all(
                self._fetch(host, default_port if port is None else port, room)
                for host, port, room in zip(boot.hosts, boot.ports, boot.rooms, strict=True)
            )
        return Admission()

    async def _never_arrives(self, rooms: list[int]) -> None:
        """SGLang 0.5.23 with n > 1: its prefix warm-up request reuses the room(s), and the decode
        waits for a transfer that never comes (until SGLang's waiting timeout, 300 s)."""
        timeout = self.ctx.config.kv_timeout
        await asyncio.sleep(timeout)
        raise EngineError(
            500, f"bootstrap_room {rooms}: KV not received within {timeout}s (n > 1 request)"
        )

    async def _fetch(self, host: str, port: int, room: int) -> None:
        url = http_url(host, port, "/fake/sglang/kv")
        timeout = self.ctx.config.kv_timeout
        try:
            response = await post_retrying(self.ctx, url, {"room": room})
        except TimeoutError:
            raise EngineError(
                500, f"bootstrap_room {room}: KV not received within {timeout}s from {url}"
            ) from None
        except httpx.HTTPError as exc:
            raise EngineError(
                500, f"bootstrap_room {room}: lost connection with prefill {url}: {exc!r}"
            ) from None
        if response.status_code != 200:
            detail = _error_detail(response)
            raise EngineError(
                500, f"bootstrap_room {room}: KV transfer failed ({response.status_code}): {detail}"
            )


HANDLERS: Final[dict[tuple[str, str], type[RoleHandler]]] = {
    ("vllm-mooncake", "prefill"): MooncakePrefill,
    ("vllm-mooncake", "decode"): MooncakeDecode,
    ("vllm-nixl", "prefill"): NixlPrefill,
    ("vllm-nixl", "decode"): NixlDecode,
    ("sglang", "prefill"): SglangPrefill,
    ("sglang", "decode"): SglangDecode,
}


def build_handler(protocol: str, role: str, ctx: EngineContext) -> RoleHandler:
    """The handler class for (protocol, role); ValueError for an unknown pair."""
    try:
        handler_cls = HANDLERS[(protocol, role)]
    except KeyError:
        raise ValueError(f"unknown protocol/role: {protocol!r}/{role!r}") from None
    return handler_cls(ctx)
