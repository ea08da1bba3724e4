"""``watch`` as server-sent events, stopped when the client goes away.

A :class:`~catalog_es.application.Watch` blocks its thread while it waits for
the next change, so it is iterated on a thread of its own, one ``next`` at a
time (which is also the backpressure: the next change is read only once the
last one is sent). When the client disconnects, the server cancels the
stream; ``finally`` then stops the watch, which ends the blocked ``next``,
and closes the generator on that same thread, so the subscription's
``with`` block (a PostgreSQL LISTEN connection) is left where it was entered.
A server shutting down sets ``closing``: the streams end within a wake-up,
rather than holding the shutdown until they are cancelled; so does a stream
whose token was revoked.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast
from weakref import WeakSet

from fastapi.responses import Response, StreamingResponse

from catalog_es.application import Watch

# A comment line this often keeps proxies from closing a quiet stream, and
# finds a client that left without a word.
KEEP_ALIVE_SECONDS = 15.0
# How often a waiting stream looks whether the server is closing.
WAKE_UP_SECONDS = 0.5


def sse_message(event: dict[str, Any]) -> str:
    """One event: ``id`` the revision (what a reconnecting EventSource sends
    back as Last-Event-ID), ``data`` the event as ``watch --json`` prints it."""
    return f"id: {event['revision']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def _messages(
    watch: Watch, closing: threading.Event, allowed: Callable[[], bool]
) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="catalog-es-watch")
    # ``Watch.__iter__`` is a generator function: it can be closed.
    events = cast(Generator[dict[str, Any], None, None], iter(watch))
    pending: asyncio.Future[dict[str, Any] | None] | None = None
    asked = time.monotonic()

    def still_allowed() -> bool:
        # At most once a wake-up: a catch-up from revision 0 sends many
        # changes a second, each check a stat of the tokens file and a hash.
        nonlocal asked
        if time.monotonic() - asked < WAKE_UP_SECONDS:
            return True
        asked = time.monotonic()
        return allowed()

    try:
        # Sent at once, so a client knows the stream is open before any change.
        yield ": watching\n\n"
        quiet_since = time.monotonic()
        # The token is asked again every wake-up: one revoked while its stream
        # is open stops getting changes within one, as its requests do.
        while not closing.is_set() and still_allowed():
            if pending is None:
                pending = loop.run_in_executor(worker, next, events, None)
            done, _ = await asyncio.wait({pending}, timeout=WAKE_UP_SECONDS)
            if not done:
                if time.monotonic() - quiet_since >= KEEP_ALIVE_SECONDS:
                    quiet_since = time.monotonic()
                    yield ": keep-alive\n\n"
                continue
            quiet_since = time.monotonic()
            event = pending.result()
            pending = None
            if event is None or not still_allowed():
                return
            yield sse_message(event)
    finally:
        watch.stop()
        # Queued behind a pending ``next``, which the stop ends promptly.
        worker.submit(events.close)
        worker.shutdown(wait=False)


_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event_stream(
    watch: Watch,
    closing: threading.Event,
    allowed: Callable[[], bool],
    *,
    head: bool = False,
    open_streams: WeakSet[object],
) -> Response:
    """``watch`` as a stream, for as long as ``allowed`` (the caller's token),
    counted in ``open_streams`` for as long as it lives (a stream a client
    left before it started is gone from there too, though it never ran);
    ``head``: the stream's headers alone, the watch never started (it
    subscribes only once iterated)."""
    if head:
        headers_only = Response(media_type="text/event-stream", headers=_HEADERS)
        del headers_only.headers["content-length"]  # as the stream's, which has none
        return headers_only
    messages = _messages(watch, closing, allowed)
    open_streams.add(messages)
    return StreamingResponse(messages, media_type="text/event-stream", headers=_HEADERS)
