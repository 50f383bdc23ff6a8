"""Graceful shutdown: the router's side of SIGTERM.

``begin_shutdown(grace_s)`` (from the signal handler, via ``router.__main__``): ``/ready``
answers 503 at once while uvicorn stops accepting connections; requests in flight get
``grace_s`` to finish; past it every request still running is cancelled with ``STOP_MESSAGE``,
and its handler ends it cleanly: a stream with a final SSE error event, a request whose response
has not started with a 503 error JSON. ``uvicorn``'s own cut-off comes later (``grace_s`` plus a
margin), so it never cuts a stream without that event.
"""

from __future__ import annotations

import asyncio
import logging

__all__ = ["STOP_MESSAGE", "RouterLifecycle"]

logger = logging.getLogger(__name__)

STOP_MESSAGE = "pd-router: shutdown grace period exceeded"


class RouterLifecycle:
    def __init__(self) -> None:
        self.shutting_down = False
        self.stopping = False  # the grace period is over: requests still running are ended
        self._requests: set[asyncio.Task[object]] = set()
        self.served = 0  # requests that ended (for router --workers N's per-process view)
        self.joined = False  # router --workers N: this process listens on the client port
        self._timer: asyncio.TimerHandle | None = None

    @property
    def inflight(self) -> int:
        """Requests being served now."""
        return len(self._requests)

    def track(self) -> asyncio.Task[object] | None:
        """Register the current request's task until ``untrack``."""
        task = asyncio.current_task()
        if task is not None:
            self._requests.add(task)
        return task

    def untrack(self, task: asyncio.Task[object] | None) -> None:
        if task is not None:
            self._requests.discard(task)
            self.served += 1

    def begin_shutdown(self, grace_s: float) -> None:
        """Stop being ready now; end what still runs after ``grace_s``. Idempotent."""
        if self.shutting_down:
            return
        self.shutting_down = True
        logger.info(
            "shutting down: %d request(s) in flight get %gs to finish", len(self._requests), grace_s
        )
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(grace_s, self._stop_requests)

    def _stop_requests(self) -> None:
        self.stopping = True
        if self._requests:
            logger.warning(
                "shutdown grace period over: ending %d request(s) with an error",
                len(self._requests),
            )
        for task in list(self._requests):
            task.cancel(msg=STOP_MESSAGE)
