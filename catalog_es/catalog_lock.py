"""The lock on a process's catalog in force, which reads and writes take in turn."""

from __future__ import annotations

import threading
from collections import deque

# How often a waiter looks whether the lock came to it all the same: a hand-off
# whose wake-up an interrupt (Ctrl-C) cut off then costs this long, not forever.
RECHECK_SECONDS = 0.05


class _Waiter:
    """A thread waiting for the lock: woken once it has been handed the lock."""

    __slots__ = ("ident", "woken")

    def __init__(self, ident: int) -> None:
        self.ident = ident
        self.woken = threading.Lock()
        self.woken.acquire()


class CatalogLock:
    """Re-entrant, and taken in turn: those waiting get it in the order they
    came, a write before every read. A plain lock is taken by whoever asks
    when it is let go, most often the thread that let it go (it still runs):
    threads reading nonstop (an HTTP server's) took it back read after read,
    holding a write off (87 ms at the 90th percentile behind 16 of them) while
    that write held the log's lock, which every node's writes queue behind.
    So the lock is handed on: the one letting go makes the next waiter its
    holder, then wakes it, and coming straight back queues behind it.

    Reads still take the lock one at a time: a read may catch the catalog up
    with the log, which changes it."""

    def __init__(self) -> None:
        # Guards what follows; held for a few statements at a time.
        self._mutex = threading.Lock()
        # Only the holder ever finds its own ident here, so reading it
        # unlocked tells a thread whether it holds the lock.
        self._owner: int | None = None
        self._depth = 0
        self._writes: deque[_Waiter] = deque()
        self._reads: deque[_Waiter] = deque()

    def acquire(self, *, write: bool = False) -> None:
        me = threading.get_ident()
        if self._owner == me:
            # Taken again by its holder (a read catching up): never queued
            # behind a write, which would be waiting for this very holder.
            self._depth += 1
            return
        queue = self._writes if write else self._reads
        waiter: _Waiter | None = None
        # An interrupt anywhere in here leaves neither the lock nor a place
        # in the queue to a thread that no longer waits.
        try:
            with self._mutex:
                if self._owner is None and not self._writes and (write or not self._reads):
                    self._owner, self._depth = me, 1
                    return
                waiter = _Waiter(me)
                queue.append(waiter)
            while not waiter.woken.acquire(timeout=RECHECK_SECONDS):
                with self._mutex:
                    if self._owner == me:
                        # Handed over, the one handing it cut off before it
                        # woke this waiter, or took it off the queue: left
                        # there, its own release would hand it to itself.
                        if waiter in queue:
                            queue.remove(waiter)
                        return
                    first = queue[0] if queue else None
                    if self._owner is None and first is waiter and (write or not self._writes):
                        # Let go with no one handed it (its holder interrupted).
                        queue.popleft()
                        self._owner, self._depth = me, 1
                        return
        except BaseException:
            with self._mutex:
                if waiter is not None and waiter in queue:
                    queue.remove(waiter)
            # Out of the queue, it is handed nothing more: what it holds, it
            # holds, and hands on.
            if self._owner == me:
                self._depth = 1
                self.release()
            raise

    def release(self) -> None:
        if self._owner != threading.get_ident():
            raise RuntimeError("the catalog's lock let go by a thread that does not hold it")
        if self._depth > 1:
            self._depth -= 1
            return
        # Handed on inline, with no call before the holder is set: an
        # interrupt comes between calls, not inside them. The holder is set
        # before the waiter leaves the queue and before it is woken: a waiter
        # whose wake-up is cut off finds itself holding the lock on its next look.
        with self._mutex:
            queue = self._writes or self._reads
            if not queue:
                self._owner, self._depth = None, 0
                return
            waiter = queue[0]
            self._owner, self._depth = waiter.ident, 1
            queue.popleft()
            waiter.woken.release()

    def depth(self) -> int:
        """How many times the calling thread holds the lock: 0 when it does not."""
        return self._depth if self._owner == threading.get_ident() else 0

    def release_to(self, depth: int) -> None:
        """Let go until the calling thread holds the lock ``depth`` times:
        what it took, counted by what it holds rather than by a flag set
        after each take, which an interrupt can come before."""
        while self.depth() > depth:
            self.release()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *_: object) -> None:
        self.release()
