"""An in-process OpenAI-compatible route served on a loopback TCP port, for agents that build their own client from
a URL (agent=lit: an agent-lightning `LitAgent` reads `main_llm.endpoint`).

A trainer's rollout clients reach the policy server in process (an ASGI app behind httpx, no socket: `OpenAIChat.app`)
on the event loop that also drives generation. `Loopback` is one uvicorn server on 127.0.0.1 (a daemon thread with
its own event loop, started at first use, its start waited for at most `START_WAIT_S`). A request to
`/rollouts/<id>/...` is handed to the app and event loop registered for `<id>` (`Loopback.route`), unchanged: the
same route, so the ledger records the call under that rollout, token in, token out. A route nobody registered is a
404; one whose loop has closed, a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

START_WAIT_S = 30.0  # the longest the first route waits for the server to listen
_ROLLOUT_PATH = re.compile(r"^/rollouts/([^/]+)/")


@dataclass
class Route:
    """One rollout's registration: where its requests go, and what its calls were (request messages, reply)."""

    app: Any
    loop: asyncio.AbstractEventLoop
    strip: bool = False  # the app serves /v1/... (a scripted chat): the /rollouts/<id> prefix is taken off
    calls: list[tuple[list[dict[str, Any]], str]] = field(default_factory=list)


class Loopback:
    def __init__(self) -> None:
        self._routes: dict[str, Route] = {}
        self._lock = threading.Lock()
        self._port: int | None = None

    @property
    def port(self) -> int:
        """The port it listens on (started at the first call)."""
        with self._lock:
            if self._port is None:
                self._port = self._start()
            return self._port

    def _start(self) -> int:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(self, lifespan="off", log_level="warning", access_log=False)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="loopback", daemon=True)
        thread.start()
        waited = 0.0
        while not server.started:
            if not thread.is_alive() or waited >= START_WAIT_S:
                raise RuntimeError(f"the loopback server did not start within {START_WAIT_S} s")
            threading.Event().wait(0.01)
            waited += 0.01
        return int(sock.getsockname()[1])

    @contextlib.contextmanager
    def route(
        self, rollout_id: str, app: Any, loop: asyncio.AbstractEventLoop, *, strip: bool = False
    ) -> Iterator[Route]:
        """Serve `/rollouts/<rollout_id>/...` with `app` on `loop` while the block runs."""
        entry = Route(app, loop, strip)
        with self._lock:
            if rollout_id in self._routes:
                raise RuntimeError(f"rollout {rollout_id} is already served on the loopback port")
            self._routes[rollout_id] = entry
        try:
            yield entry
        finally:
            with self._lock:
                self._routes.pop(rollout_id, None)

    def base_url(self, rollout_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/rollouts/{rollout_id}/v1"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        match = _ROLLOUT_PATH.match(scope.get("path", "")) if scope["type"] == "http" else None
        entry = self._routes.get(match.group(1)) if match else None
        if entry is None:
            await _plain(send, 404, "no rollout is served at this path")
            return
        if entry.strip:
            scope = {k: v for k, v in scope.items() if k != "raw_path"} | {"path": scope["path"][match.end() - 1 :]}
        here = asyncio.get_running_loop()
        body: list[bytes] = []
        reply: list[bytes] = []

        async def receive_there() -> Any:
            message = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(receive(), here))
            body.append(message.get("body", b""))
            return message

        async def send_there(message: Any) -> None:
            if message["type"] == "http.response.body":
                reply.append(message.get("body", b""))
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(send(message), here))

        try:
            future = asyncio.run_coroutine_threadsafe(entry.app(scope, receive_there, send_there), entry.loop)
        except RuntimeError:  # the rollout's event loop has closed
            await _plain(send, 503, "the rollout's event loop has closed")
            return
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # the client went away
            future.cancel()
            raise
        _record(entry, b"".join(body), b"".join(reply))


def _record(entry: Route, request: bytes, response: bytes) -> None:
    """Keep a chat call's messages and reply (what the rollout's record shows); anything else is left out."""
    with contextlib.suppress(ValueError, KeyError, IndexError, TypeError, AttributeError):
        messages = json.loads(request)["messages"]
        content = json.loads(response)["choices"][0]["message"].get("content") or ""
        entry.calls.append((messages, content))


async def _plain(send: Any, status: int, text: str) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": text.encode()})


LOOPBACK = Loopback()  # one per process
