"""A test that leaves one of logging's locks held fails, and the lock is let go.

An interrupt (Ctrl-C, a test's SIGALRM) that lands just as logging has
taken its module's lock, or a handler's, before the ``try`` that lets it go,
leaves it held for good by the thread it landed in. That thread takes it
again freely (the lock is re-entrant); any other waits for it forever the
first time it logs. A test server's thread does at once (its event loop's
first debug line), so every server test after it in the process failed with
"the test server did not start", and nothing named the test that did it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from catalog_es.storage.waits import holds


@pytest.fixture(autouse=True)
def _no_logging_lock_left_held() -> Iterator[None]:
    yield
    held = _logging_locks_held()
    for _, lock in held:
        while holds(lock):
            lock.release()
    if held:
        names = ", ".join(name for name, _ in held)
        pytest.fail(
            f"the test left {names} held by its thread (an interrupt as it was "
            "taken?): no other thread could log; let go now",
            pytrace=False,
        )


def _logging_locks_held() -> list[tuple[str, threading.RLock]]:
    """logging's locks this thread holds: its module's, its handlers'."""
    # Neither is in logging's public interface, nor in its stubs.
    locks: list[tuple[str, threading.RLock | None]] = [
        ("logging's module lock", logging._lock)  # type: ignore[attr-defined]
    ]
    for ref in list(logging._handlerList):  # type: ignore[attr-defined]
        handler = ref()
        if handler is not None:
            locks.append((f"the lock of {handler!r}", handler.lock))
    return [(name, lock) for name, lock in locks if lock is not None and holds(lock)]
