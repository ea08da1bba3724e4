"""A real server for the HTTP and console tests: uvicorn on 127.0.0.1 and a
free port, in a thread of the test process."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from catalog_es.web.app import end_streams
from catalog_es.web.tokens import TokenStore

ROLES = ("read", "write", "admin")

log = logging.getLogger("uvicorn.error")

# How long a test server may take to start, at most: it takes milliseconds.
START_SECONDS = 10

# httpx reads certifi's bundle into a TLS context of its own for each client
# it makes (15-40 ms, more than most tests' requests), though the test
# servers speak plain HTTP: one context, read once, serves every client.
_TLS = ssl.create_default_context()


def http_client(**options: Any) -> httpx.Client:
    """An httpx client for the test servers."""
    return httpx.Client(verify=_TLS, **options)


class _Server(uvicorn.Server):
    """uvicorn's server, looking for ``should_exit`` every 10 ms, not every
    100 ms: a test waited half that on average for each server it ended."""

    loop: asyncio.AbstractEventLoop

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def main_loop(self) -> None:
        ticks = 0
        while not await self.on_tick(ticks):
            ticks += 1
            await asyncio.sleep(0.01)

    async def idle(self) -> None:
        """Every connection closed and every request done, as uvicorn's
        shutdown leaves them (within its grace period, then cut), the socket
        still listening: nothing one test opened is there for the next."""
        state = self.server_state
        for connection in list(state.connections):
            connection.shutdown()
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                while state.connections or state.tasks:
                    await asyncio.sleep(0.005)
        except TimeoutError:
            log.error("cancelling %s request(s) a test left running", len(state.tasks))
            for task in state.tasks:
                task.cancel()
            for connection in list(state.connections):
                connection.transport.abort()
            while state.connections or state.tasks:
                await asyncio.sleep(0.005)


@contextmanager
def _running(app: ASGIApp, **options: Any) -> Iterator[tuple[str, _Server]]:
    """``app`` served by a server of its own until the ``with`` ends; yields
    its base URL and the server."""
    # The protocol named, as serve's getaddrinfo names it: asyncio turns Nagle
    # off only on a socket whose proto is TCP, and with it on, each answer on
    # a kept-alive connection waited 40 ms for the client's delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # uvicorn's own logging left alone: its lines then reach the test's
    # captured log, where they were written to whatever stream the first
    # server of the process found (a startup failure said nothing).
    config = uvicorn.Config(
        app, log_level="warning", log_config=None, timeout_graceful_shutdown=1, **options
    )
    server = _Server(config)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as error:
            failed.append(error)
            raise

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_SECONDS
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True  # started after all, it ends at once
            raise RuntimeError(f"the test server did not start{_why_not(thread, failed)}")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """The app served by a server of its own until the ``with`` ends; yields
    its base URL. For a test that needs a server of its own (one whose
    connections it cuts, say); others take :class:`SharedServer`'s."""
    with _running(app) as (url, _):
        try:
            yield url
        finally:
            end_streams(app)


class SharedServer:
    """One server for many tests, each serving its own app on it in turn:
    starting and ending a server of its own took a test 0.1 s."""

    def __init__(self, url: str, server: _Server, swapped: _Swapped) -> None:
        self.url = url
        self._server = server
        self._swapped = swapped

    @contextmanager
    def serving(self, app: FastAPI) -> Iterator[str]:
        """``app`` served until the ``with`` ends; yields the base URL. Then
        its streams are ended and every connection closed, as a server's
        shutdown would: the next test's app is served on none of them."""
        self._swapped.app = app
        try:
            yield self.url
        finally:
            end_streams(app)
            idle = asyncio.run_coroutine_threadsafe(self._server.idle(), self._server.loop)
            idle.result(timeout=START_SECONDS)
            self._swapped.app = None


class _Swapped:
    """The app a shared server serves: the one swapped in for the test."""

    def __init__(self) -> None:
        self.app: FastAPI | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.app is None:
            raise RuntimeError("a request came to the shared test server between tests")
        await self.app(scope, receive, send)


@contextmanager
def shared_server() -> Iterator[SharedServer]:
    """A :class:`SharedServer`, until the ``with`` ends."""
    swapped = _Swapped()
    # No lifespan: it would be the app's at the server's start, when no test's
    # app is there yet (and create_app's has no startup or shutdown to run).
    with _running(swapped, lifespan="off") as (url, server):
        yield SharedServer(url, server, swapped)


def _why_not(thread: threading.Thread, failed: list[BaseException]) -> str:
    """The error the server's thread ended with, or where it still waits:
    one that waited for a lock held for good said only that it did not
    start, in every server test after (a CI run)."""
    if failed:
        return f": {failed[0]!r}"
    waiting = sys._current_frames().get(thread.ident or 0)
    if waiting is None:
        return ""
    where = "".join(traceback.format_stack(waiting)[-3:])
    return f" in {START_SECONDS} s; its thread waits at:\n{where}"


class Proxy:
    """A TCP proxy in threads, on 127.0.0.1 and a free port: a way to a
    database that can be cut, as a restart or a failover cuts it."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._open: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.port = 0
        self.resume()

    def resume(self) -> None:
        """Take connections (again, on the same port, after :meth:`cut`)."""
        self._listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self._start(self._accept, self._listener)

    def _start(self, target: Callable[..., None], *args: socket.socket) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            upstream = socket.create_connection(self._target)
            with self._lock:
                if listener is not self._listener or self._listener.fileno() < 0:
                    # Accepted as it was cut: dropped, as the others were.
                    client.close()
                    upstream.close()
                    return
                self._open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                self._start(_pipe, source, sink)

    def cut(self) -> None:
        """Refuse new connections and drop the open ones; its threads end."""
        with suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._listener.close()
        with self._lock:
            for sock in self._open:
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._open.clear()
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join(timeout=10)


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
    except OSError:
        pass
    with suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def started(server: subprocess.Popen[str]) -> tuple[str, str]:
    """The base URL a ``catalog-es serve --port 0`` process says it serves at
    (the port the system gave it: one picked free beforehand could be taken
    by another test before the server bound it), and what it said on stderr
    up to then, that line included."""
    assert server.stderr is not None
    said = ""
    # One that hangs before it says so is stopped, rather than hang the test.
    deadline = threading.Timer(30, server.kill)
    deadline.start()
    try:
        while line := server.stderr.readline():
            said += line
            if serving := re.search(r"serving the catalog at revision \d+ on (http://\S+?)/", line):
                return serving[1], said
    finally:
        deadline.cancel()
    raise AssertionError(f"the server stopped before it served: {said!r}")


def tokens_for_roles(path: Path) -> tuple[TokenStore, dict[str, str]]:
    """A tokens file with one token per role, the actor named after it."""
    store = TokenStore(path)
    return store, {role: store.add(f"{role}-user", role)[1] for role in ROLES}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
