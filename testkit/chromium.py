"""A small headless-Chromium driver over the DevTools protocol, for tests of the status page.

    async with Chromium(tmp_path) as browser:         # starts /usr/bin/chromium, opens a page
        await browser.navigate("http://127.0.0.1:8000/status")
        await browser.wait_for("document.body.dataset.updated", 20, "first render")
        png = await browser.screenshot()

Chromium runs with a fresh profile directory under ``workdir``, ``--remote-debugging-port=0``
(the port it picks is read from ``<profile>/DevToolsActivePort``) and its stderr in
``workdir/chromium.log``; it is its own process group, killed on exit. The protocol goes over
aiohttp's websocket client to the page target (``/json/list``). Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

__all__ = ["CHROMIUM_BINARY", "Chromium", "ChromiumError", "chromium_available"]

CHROMIUM_BINARY = Path(os.environ.get("PDR_CHROMIUM_BINARY", "/usr/bin/chromium"))
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
START_TIMEOUT_S = 30.0  # a cold start on two busy cores is slow
CALL_TIMEOUT_S = 15.0  # one DevTools command
STOP_TIMEOUT_S = 5.0
_POLL_S = 0.05
_MAX_MESSAGE = 64 * 1024 * 1024  # screenshots arrive base64 in one message


class ChromiumError(RuntimeError):
    """Chromium did not start, a DevTools command failed, or a page expression threw."""


def chromium_available() -> bool:
    """Whether the Chromium binary is installed (the tests skip otherwise)."""
    return CHROMIUM_BINARY.is_file() and os.access(CHROMIUM_BINARY, os.X_OK)


class Chromium:
    """One headless Chromium with one page, driven over the DevTools protocol."""

    def __init__(
        self, workdir: Path, *, width: int = 1400, height: int = 1000, binary: Path | None = None
    ) -> None:
        self.workdir = workdir
        self.width, self.height = width, height
        self.binary = binary or CHROMIUM_BINARY
        self.log_path = workdir / "chromium.log"
        self._proc: asyncio.subprocess.Process | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)

    async def __aenter__(self) -> Chromium:
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _start(self) -> None:
        profile = Path(tempfile.mkdtemp(prefix="chromium-profile-", dir=self.workdir))
        argv = [
            str(self.binary),
            *FLAGS,
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            f"--window-size={self.width},{self.height}",
            "about:blank",
        ]
        with self.log_path.open("wb") as log:
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        port = await self._devtools_port(profile / "DevToolsActivePort")
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))
        target = await self._page_target(port)
        self._ws = await self._http.ws_connect(target, max_msg_size=_MAX_MESSAGE)
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False},
        )

    async def _devtools_port(self, path: Path) -> int:
        """The port Chromium wrote to ``DevToolsActivePort`` (first line) once it listens."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            self._check_alive()
            port = _read_port(path)
            if port is not None:
                return port
            if time.monotonic() > deadline:
                raise ChromiumError(f"no DevTools port after {START_TIMEOUT_S}s{self._log_tail()}")
            await asyncio.sleep(_POLL_S)

    async def _page_target(self, port: int) -> str:
        """The websocket URL of the browser's page (its first tab)."""
        assert self._http is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            self._check_alive()
            with contextlib.suppress(aiohttp.ClientError):
                async with self._http.get(f"http://127.0.0.1:{port}/json/list") as response:
                    targets = await response.json(content_type=None)
                for target in targets:
                    if target.get("type") == "page" and "webSocketDebuggerUrl" in target:
                        return str(target["webSocketDebuggerUrl"])
            if time.monotonic() > deadline:
                raise ChromiumError(f"no page target after {START_TIMEOUT_S}s{self._log_tail()}")
            await asyncio.sleep(_POLL_S)

    async def call(
        self, method: str, params: dict[str, Any] | None = None, timeout: float = CALL_TIMEOUT_S
    ) -> dict[str, Any]:
        """Send one DevTools command and return its ``result`` (events in between are dropped)."""
        if self._ws is None:
            raise ChromiumError("the browser is not running")
        ident = next(self._ids)
        await self._ws.send_json({"id": ident, "method": method, "params": params or {}})
        async with asyncio.timeout(timeout):
            while True:
                message = await self._ws.receive()
                if message.type is not aiohttp.WSMsgType.TEXT:
                    raise ChromiumError(f"DevTools connection ended during {method}: {message}")
                reply = message.json()
                if reply.get("id") != ident:
                    continue
                if "error" in reply:
                    raise ChromiumError(f"{method} failed: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result

    async def navigate(self, url: str, timeout: float = CALL_TIMEOUT_S) -> None:
        """Load ``url`` in the page and wait until its new document has loaded (the old one's
        window carried a marker the new one lacks). While the documents switch, an evaluation
        can fail (its execution context went away): that is retried until the deadline."""
        await self.evaluate("window.__pdrOldDocument = true")
        result = await self.call("Page.navigate", {"url": url}, timeout)
        if result.get("errorText"):
            raise ChromiumError(f"navigating to {url} failed: {result['errorText']}")
        loaded = (
            f"!window.__pdrOldDocument && location.href === {json.dumps(url)}"
            " && document.readyState === 'complete'"
        )
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(ChromiumError):
                if await self.evaluate(loaded):
                    return
            if time.monotonic() > deadline:
                state = await self.evaluate("[location.href, document.readyState]")
                raise AssertionError(f"timed out after {timeout}s loading {url}: {state}")
            await asyncio.sleep(_POLL_S)

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page; raises if it throws."""
        result = await self.call(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True}
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise ChromiumError(f"{expression!r} threw: {text}")
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout: float, what: str) -> Any:
        """Poll ``expression`` every 50 ms until it is truthy and return its value; fail naming
        ``what`` (with the last value seen) after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what} ({value!r})")
            await asyncio.sleep(_POLL_S)

    async def screenshot(self) -> bytes:
        """The page's viewport as PNG bytes."""
        result = await self.call("Page.captureScreenshot", {"format": "png"})
        return base64.b64decode(result["data"])

    async def close(self) -> None:
        """Close the DevTools connection and kill the browser's process group."""
        if self._ws is not None:
            await self._ws.close()
            self._ws = None
        if self._http is not None:
            await self._http.close()
            self._http = None
        proc, self._proc = self._proc, None
        if proc is not None:
            await _kill_group(proc)

    def _check_alive(self) -> None:
        if self._proc is not None and self._proc.returncode is not None:
            code = self._proc.returncode
            raise ChromiumError(f"chromium exited with status {code}{self._log_tail()}")

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return "; its log ends:\n" + self.log_path.read_text(errors="replace")[-2000:]
        return ""


def _read_port(path: Path) -> int | None:
    """The port on the first line of ``DevToolsActivePort``, None until Chromium wrote it."""
    with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
        return int(path.read_text().splitlines()[0])
    return None


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the browser's process group, then SIGKILL what is left of it (its helpers:
    renderer, zygote) once the browser exited or did not within ``STOP_TIMEOUT_S``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
