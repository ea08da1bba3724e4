"""``watch`` as server-sent events, stopped when the client goes away.

A :class:`~catalog_es.application.Watch` blocks its thread while it waits for
the next change, so it is followed on a thread of its own, which makes each
message there and leaves it in a bounded buffer (:class:`Unsent`); the stream
sends what the buffer holds each time it wakes, all at once. That is also
the backpressure: once the buffer is full, the next change is read only once
the client took what is there. Asked of the thread a change at a time, a
catch-up went at 2,400 changes a second where the watch reads 48,000. When
the client disconnects, the server cancels the stream; ``finally`` then stops
the watch, which ends the blocked ``next``, and the thread closes the watch's
generator itself, so the subscription's ``with`` block (a PostgreSQL LISTEN
connection) is left on the thread where it was entered. A server shutting
down sets ``closing``: the streams end within a wake-up, rather than holding
the shutdown until they are cancelled; so does a stream whose token was
revoked.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Generator
from contextlib import suppress
from typing import Any, cast

from fastapi.responses import Response, StreamingResponse

from catalog_es.application import Watch
from catalog_es.errors import LogRewritten, json_line

# A comment line this often keeps proxies from closing a quiet stream, and
# finds a client that left without a word.
KEEP_ALIVE_SECONDS = 15.0
# How often a waiting stream looks whether the server is closing.
WAKE_UP_SECONDS = 0.5
# The messages made and not yet sent, at most (one at least, whatever its size).
UNSENT_BYTES = 1 << 18


def sse_message(event: dict[str, Any]) -> str:
    """One event: ``id`` the revision (what a reconnecting EventSource sends
    back as Last-Event-ID), ``data`` the event as ``watch --json`` prints it."""
    return f"id: {event['revision']}\ndata: {json_line(event)}\n\n"


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


class Unsent:
    """Messages the watch's thread made that the stream has not sent: about
    :data:`UNSENT_BYTES` at most, which the thread waits for room under; then
    how the watch ended (``None`` while it goes on, else the error or
    :data:`ENDED`). ``wake`` is called, on the thread, for each change."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._room = threading.Condition()
        self._messages: list[str] = []
        self._size = 0
        self._end: BaseException | object | None = None
        self._closed = False

    def put(self, message: str) -> bool:
        """Leave ``message`` to be sent; ``False``: the stream is gone."""
        with self._room:
            self._room.wait_for(lambda: self._closed or self._size < UNSENT_BYTES)
            if self._closed:
                return False
            self._messages.append(message)
            self._size += len(message)
        self._wake()
        return True

    def end(self, how: BaseException | object) -> None:
        with self._room:
            self._end = how
        self._wake()

    def take(self) -> tuple[list[str], BaseException | object | None]:
        """Everything made so far, and how the watch ended if it did."""
        with self._room:
            messages, self._messages, self._size = self._messages, [], 0
            self._room.notify_all()
            return messages, self._end

    def close(self) -> None:
        """The stream is gone: the thread's next :meth:`put` says so."""
        with self._room:
            self._closed = True
            self._room.notify_all()


ENDED = object()


def _follow(watch: Watch, unsent: Unsent) -> None:
    """The watch's changes, made into messages on this thread, until it ends
    or the stream does; its generator closed here, where it ran."""
    # ``Watch.__iter__`` is a generator function: it can be closed.
    changes = cast(Generator[dict[str, Any], None, None], iter(watch))
    try:
        for change in changes:
            if not unsent.put(sse_message(change)):
                return
        unsent.end(ENDED)
    except BaseException as error:  # told by the stream, which ends with it
        unsent.end(error)
    finally:
        changes.close()


async def _messages(
    watch: Watch,
    closing: threading.Event,
    allowed: Callable[[], bool],
    give_back: Callable[[], None],
) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    made = asyncio.Event()

    def wake() -> None:
        with suppress(RuntimeError):  # the server's loop closed: nothing to wake
            loop.call_soon_threadsafe(made.set)

    unsent = Unsent(wake)
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
        threading.Thread(target=_follow, args=(watch, unsent), name="catalog-es-watch").start()
        quiet_since = time.monotonic()
        # The token is asked again every wake-up: one revoked while its stream
        # is open stops getting changes within one, as its requests do.
        while not closing.is_set() and still_allowed():
            try:
                await asyncio.wait_for(made.wait(), WAKE_UP_SECONDS)
            except TimeoutError:
                if time.monotonic() - quiet_since >= KEEP_ALIVE_SECONDS:
                    quiet_since = time.monotonic()
                    yield ": keep-alive\n\n"
                continue
            made.clear()
            messages, end = unsent.take()
            quiet_since = time.monotonic()
            if messages:
                if not still_allowed():
                    return
                yield "".join(messages)
            if isinstance(end, LogRewritten):
                # Said as a comment, which followers pass over, and the stream
                # ends: one resumed with Last-Event-ID follows the new log on.
                yield f": error: {end}\n\n"
                return
            if isinstance(end, BaseException):
                raise end
            if end is ENDED:
                return
    finally:
        give_back()
        unsent.close()
        watch.stop()


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
