"""A real server for the HTTP and console tests: uvicorn on 127.0.0.1 and a
free port, in a thread of the test process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from catalog_es.web.app import end_streams
from catalog_es.web.tokens import TokenStore

ROLES = ("read", "write", "admin")


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """The app served until the ``with`` ends; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        end_streams(app)
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a server process to take."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def tokens_for_roles(path: Path) -> tuple[TokenStore, dict[str, str]]:
    """A tokens file with one token per role, the actor named after it."""
    store = TokenStore(path)
    return store, {role: store.add(f"{role}-user", role)[1] for role in ROLES}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
