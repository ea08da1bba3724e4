"""``watch`` as server-sent events, stopped when the client goes away.

A :class:`~catalog_es.application.Watch` blocks its thread while it waits for
the next change, so it is iterated on a thread of its own, a batch at a time:
the next change, and those after it the watch has read already, up to
:data:`BATCH_MESSAGES` (which is also the backpressure: the next batch is
made only once the last one is sent). A change at a time, a catch-up went at
2,400 changes a second where the watch reads 40,000 and more; made flat out
by a thread of each stream's own, fifty catch-ups kept the server's other
requests waiting seconds. So the threads make their batches one at a time.
When the client disconnects, the server cancels the stream; ``finally`` then
stops the watch, which ends the blocked ``next``, and closes the generator
on that same thread, so the subscription's ``with`` block (a PostgreSQL
LISTEN connection) is left where it was entered. A server shutting down sets
``closing``: the streams end within a wake-up, rather than holding the
shutdown until they are cancelled (but for one whose client stopped reading,
waiting in its send until the server's grace period ends); so does a stream
whose token was revoked.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi.responses import Response, StreamingResponse

from catalog_es.application import Watch
from catalog_es.errors import LogRewritten, json_line

# A comment line this often keeps proxies from closing a quiet stream, and
# finds a client that left without a word.
KEEP_ALIVE_SECONDS = 15.0
# How often a waiting stream looks whether the server is closing.
WAKE_UP_SECONDS = 0.5
# A batch, at most: as many messages, or as many characters of them.
BATCH_MESSAGES = 64
BATCH_CHARACTERS = 1 << 16
# Held by the thread making a batch from changes read already: one at a
# time in the process, so that catch-ups leave the server's loop its turn.
_making = threading.Lock()


def sse_message(event: dict[str, Any]) -> str:
    """One event: ``id`` the revision (what a reconnecting EventSource sends
    back as Last-Event-ID), ``data`` the event as ``watch --json`` prints it."""
    return f"id: {event['revision']}\ndata: {json_line(event)}\n\n"


def _next_batch(changes: Iterator[dict[str, Any]], watch: Watch) -> str | None:
    """The next change's message (waited for if need be), and those of the
    changes after it the watch has read already, up to a batch; ``None``
    once the watch ended."""
    first = next(changes, None)
    if first is None:
        return None
    messages = [sse_message(first)]
    size = len(messages[0])
    with _making:
        while len(messages) < BATCH_MESSAGES and size < BATCH_CHARACTERS and watch.ready():
            change = next(changes, None)  # read already: no wait
            if change is None:
                break  # ended: the next batch says so
            messages.append(sse_message(change))
            size += len(messages[-1])
    return "".join(messages)


class StreamPlaces:
    """The event streams a server keeps open at once, at most. A place is
    taken before a stream starts and given back as it ends; one a client
    left before it started is given back when it is freed. (Counted by what
    was still alive, a stream a client left stayed counted until the cyclic
    collector ran, which under ``serve`` is seldom: real watches were refused.)"""

    def __init__(self, most: int) -> None:
        self.most = most
        self.open = 0
        self._lock = threading.Lock()

    def take(self) -> Callable[[], None] | None:
        """A place: the function that gives it back (once, however often
        called), or ``None`` when all are taken."""
        with self._lock:
            if self.open >= self.most:
                return None
            self.open += 1
        given = False

        def give_back() -> None:
            nonlocal given
            with self._lock:
                if not given:
                    given = True
                    self.open -= 1

        return give_back


async def _messages(
    watch: Watch,
    closing: threading.Event,
    allowed: Callable[[], bool],
    give_back: Callable[[], None],
) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="catalog-es-watch")
    # A generator (``Watch.__iter__``): it can be closed.
    events = iter(watch)
    pending: asyncio.Future[str | None] | None = None
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
                pending = loop.run_in_executor(worker, _next_batch, events, watch)
            done, _ = await asyncio.wait({pending}, timeout=WAKE_UP_SECONDS)
            if not done:
                if time.monotonic() - quiet_since >= KEEP_ALIVE_SECONDS:
                    quiet_since = time.monotonic()
                    yield ": keep-alive\n\n"
                continue
            quiet_since = time.monotonic()
            try:
                batch = pending.result()
            except LogRewritten as error:
                # Said as a comment, which followers pass over, and the stream
                # ends: one resumed with Last-Event-ID follows the new log on.
                yield f": error: {error}\n\n"
                return
            pending = None
            if batch is None or not still_allowed():
                return
            yield batch
    finally:
        give_back()
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
    give_back: Callable[[], None],
) -> Response:
    """``watch`` as a stream, for as long as ``allowed`` (the caller's token),
    holding a place (:class:`StreamPlaces`) that ``give_back`` gives back;
    ``head``: the stream's headers alone, the watch never started (it
    subscribes only once iterated)."""
    if head:
        headers_only = Response(media_type="text/event-stream", headers=_HEADERS)
        del headers_only.headers["content-length"]  # as the stream's, which has none
        return headers_only
    messages = _messages(watch, closing, allowed, give_back)
    # Never started (the client left first), it runs no ``finally``.
    weakref.finalize(messages, give_back)
    return StreamingResponse(messages, media_type="text/event-stream", headers=_HEADERS)
