"""How long a command waits for a lock (CATALOG_ES_LOCK_WAIT), in what slices, and
the thread-lock helpers that count and give back what a thread holds."""

from __future__ import annotations

import os
import re
import threading
import time

from catalog_es.errors import (
    ConfigError,
    StorageBusy,
    shown,
)

# How long a writer waits for another to let go of the database before the
# command is refused with a clear error rather than "database is locked".
LOCK_WAIT_SECONDS = 10.0
LOCK_WAIT_ENV = "CATALOG_ES_LOCK_WAIT"
# The longest SQLite's busy handler waits at a time for another process's
# lock (the write lock, a file not yet WAL): it sleeps in C, where no signal
# handler runs, so a Ctrl-C or SIGTERM acts only as a wait returns. The lock
# wait is waited out in slices this long.
LOCK_SLICE_SECONDS = 0.1


def lock_wait_seconds() -> float:
    """The bounded wait for the write lock: ``CATALOG_ES_LOCK_WAIT`` seconds,
    else ``LOCK_WAIT_SECONDS``."""
    return seconds_from_env(LOCK_WAIT_ENV, LOCK_WAIT_SECONDS)


def milliseconds(seconds: float) -> int:
    """A wait in whole milliseconds, as SQLite's busy timeout and PostgreSQL's
    settings take it: at least 1, as 0 means no bound to either."""
    return max(1, int(seconds * 1000))


def seconds_from_env(variable: str, default: float) -> float:
    """Seconds from environment ``variable``, else ``default``; empty is unset."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        # As written in ASCII, without underscores: Python's float() also
        # reads "١" as 1 and "1_0" as 10 (hostile test).
        seconds = float(text) if text.isascii() and "_" not in text else float("nan")
    except ValueError:
        seconds = float("nan")
    # Written so that NaN fails too; an hour is already far past any useful wait.
    if not 0 < seconds <= 3600:
        raise ConfigError(
            f"{variable} must be a number of seconds above 0 and at most 3600, not {shown(text)}"
        )
    return seconds


def acquire_within(lock: threading.Lock | threading.RLock, bound: float, busy: str) -> float | None:
    """Take ``lock`` (this process's, in front of a database lock), waiting for
    another thread no longer than ``bound``, the wait for the database, and
    answer what is left of it (``None``: all of it), to wait for the database
    no longer than that: callers queued behind one that waits for another
    process are each refused within the one bound, not one bound after
    another. Refused as ``busy`` (:class:`StorageBusy`) past the bound."""
    started = time.monotonic()
    if not lock.acquire(timeout=bound):
        raise StorageBusy(busy)
    waited = time.monotonic() - started
    return None if waited < 0.001 else max(0.001, bound - waited)


def holds(lock: threading.RLock) -> int:
    """How many times this thread holds ``lock``. Python's RLock keeps the
    count, and has no public way to ask it."""
    recursion_count = getattr(lock, "_recursion_count", None)
    if recursion_count is not None:
        count: int = recursion_count()
        return count
    # Python before 3.11.7 (Debian 12's is 3.11.2) has no _recursion_count:
    # every write failed there with an AttributeError. Its RLock tells its
    # owner and count in its repr alone (`<locked _thread.RLock object
    # owner=140… count=2 at 0x…>`).
    told = _RLOCK_REPR.search(repr(lock))
    if told is None or int(told["owner"]) != threading.get_ident():
        return 0
    return int(told["count"])


_RLOCK_REPR = re.compile(r"owner=(?P<owner>\d+) count=(?P<count>\d+)")


def release_to(lock: threading.RLock, held: int) -> None:
    """Let go of ``lock`` until this thread holds it ``held`` times, as it did
    coming in. An interrupt lands as a call returns, the lock's own wait
    included: whether that wait took it is known only by asking the lock."""
    while holds(lock) > held:
        lock.release()
