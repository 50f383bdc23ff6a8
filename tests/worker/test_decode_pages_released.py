"""A decode's KV pages come back as soon as its request is given up, not at the transfer deadline.

A decode request holds its pages (and an aux slot) while it waits for the prefill's KV. When its
client goes away (the router cancels the decode leg when the prefill leg fails, or when the
client leaves), the decode fails the room at once: it aborts it at the prefill, which
acknowledges, and the pages are free again within the receiver's drain timeout. Holding them
until the transfer deadline instead let a burst of failed prefills exhaust the decode's pool,
whose 503s orphaned computed prefills, whose full pools failed more prefills: the cluster never
recovered under steady load (``bench.soak.rss_drift`` with ``--pages 256``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from testkit.polling import wait_until
from testkit.worker_cluster import SHAPE, PDCluster, pd_cluster
from worker.rank import AUX_SLOTS

TRANSFER_TIMEOUT_S = 30.0  # far longer than the test waits for the pages
RELEASED_WITHIN_S = 4.0  # the receiver's drain timeout (2 s) plus slack


@pytest.fixture(params=["sglang", "vllm-mooncake"])
def cluster(request: pytest.FixtureRequest) -> Iterator[PDCluster]:
    with pd_cluster(engine=request.param, transfer_timeout_s=TRANSFER_TIMEOUT_S) as c:
        yield c


def _pd_fields(c: PDCluster, room: int) -> dict[str, Any]:
    """A decode request's PD fields for a prefill that never computes the room."""
    if c.engine == "sglang":
        return {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": c.registries[0],
            "bootstrap_room": room,
        }
    return {
        "kv_transfer_params": {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": f"http://127.0.0.1:{c.registries[0]}",
            "remote_engine_id": c.prefills[0].worker.engine_id(0),
            "transfer_id": f"never-prefilled-{room}",
        }
    }


def _decode_holds_pages(c: PDCluster) -> bool:
    return c.decodes[0].worker.pool.free_pages < SHAPE.pages


def _released(c: PDCluster) -> None:
    decode = c.decodes[0].worker
    wait_until(
        lambda: all(side.idle() for side in c.sides) and len(decode.ranks[0].aux_free) == AUX_SLOTS,
        RELEASED_WITHIN_S,
        f"pages back after the client left: {c.describe()}",
    )


def test_a_decode_whose_client_leaves_gives_its_pages_back_at_once(cluster: PDCluster) -> None:
    body = {"prompt": "q" * 500, "max_tokens": 4, **_pd_fields(cluster, 9001)}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up: its connection closes
        httpx.post(f"{cluster.worker_urls[1]}/v1/completions", json=body, timeout=1.0)
    assert cluster.decodes[0].open_rooms() == 1 and _decode_holds_pages(cluster)  # waiting
    left = time.monotonic()
    _released(cluster)
    assert time.monotonic() - left < TRANSFER_TIMEOUT_S / 2
    body = {"model": "sim-model", "prompt": "after the client left"}
    assert (
        httpx.post(f"{cluster.router}/v1/completions", json=body, timeout=10.0).status_code == 200
    )
    cluster.wait_idle()


def test_a_failed_prefill_leg_frees_the_decode_leg_pages() -> None:
    """The prefill refuses the prompt (too long for it): the router cancels the decode leg it
    sent concurrently (vLLM Mooncake), and the decode's pages come back at once."""
    with pd_cluster(
        engine="vllm-mooncake",
        transfer_timeout_s=TRANSFER_TIMEOUT_S,
        prefill_options={"max_prompt_tokens": 100},
    ) as c:
        for _ in range(3):
            body = {"model": "sim-model", "prompt": "r" * 400, "max_tokens": 4}
            answer = httpx.post(f"{c.router}/v1/completions", json=body, timeout=10.0)
            assert answer.status_code == 400, answer.text
        _released(c)
