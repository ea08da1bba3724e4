"""The catalog's lock: re-entrant, and a waiting write goes before the reads
that come after it. What a node's writes gain by it is tested in
test_concurrency (`test_a_write_holding_the_log_waits_for_one_read_at_most_…`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from catalog_es.catalog_lock import CatalogLock


def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def started(target: Callable[[], object], name: str | None = None) -> threading.Thread:
    # Daemons: a thread a broken lock leaves waiting must not keep pytest running.
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def test_a_waiting_write_takes_the_lock_before_reads_that_come_after_it() -> None:
    lock, order = CatalogLock(), []

    def take(write: bool) -> None:
        lock.acquire(write=write)
        order.append("write" if write else "read")
        lock.release()

    lock.acquire()  # a read under way
    writer = started(lambda: take(True))
    until(lambda: lock._writes_waiting == 1)
    readers = [started(lambda: take(False)) for _ in range(3)]
    until(lambda: lock._waiting == 4)
    lock.release()
    for thread in (writer, *readers):
        thread.join(10)
    assert order == ["write", "read", "read", "read"]


def test_its_holder_takes_it_again_while_a_write_waits_for_it() -> None:
    """A read catching up takes the lock again: held back behind the write
    that waits for it, neither would ever go on."""
    lock, holding, again = CatalogLock(), threading.Event(), threading.Event()

    def read_catching_up() -> None:
        with lock:
            holding.set()
            until(lambda: lock._writes_waiting == 1)
            with lock:
                again.set()

    reader = started(read_catching_up)
    assert holding.wait(10)
    writer = started(lambda: (lock.acquire(write=True), lock.release()))
    reader.join(10)
    writer.join(10)
    assert again.is_set()
    assert not reader.is_alive() and not writer.is_alive()


def test_a_write_interrupted_while_it_waits_lets_the_reads_it_held_back_go_on() -> None:
    """Ctrl-C lands in a write waiting for the lock just as its holder lets go:
    a read that saw the write waiting and went back to wait is woken."""
    lock = CatalogLock()
    wait, writer_woken = lock._turn.wait, threading.Event()

    def interrupted_after_waking(timeout: float | None = None) -> bool:
        if threading.current_thread().name != "writer":
            return wait(timeout)
        wait()
        writer_woken.set()
        wait(0.5)  # the read wakes meanwhile, finds the write waiting and waits again
        raise KeyboardInterrupt

    lock._turn.wait = interrupted_after_waking  # type: ignore[method-assign]
    interrupts: list[BaseException] = []

    def write() -> None:
        try:
            lock.acquire(write=True)
        except KeyboardInterrupt as error:
            interrupts.append(error)

    read = threading.Event()
    lock.acquire()
    writer = started(write, "writer")
    until(lambda: lock._writes_waiting == 1)
    reader = started(lambda: (lock.acquire(), read.set(), lock.release()))
    until(lambda: lock._waiting == 2)
    lock.release()
    assert writer_woken.wait(10)
    assert read.wait(10), "the read waits for a write that is gone"
    writer.join(10)
    reader.join(10)
    assert len(interrupts) == 1
    with lock:  # and the lock is free
        pass


def test_a_thread_that_does_not_hold_the_lock_cannot_let_it_go() -> None:
    lock, refused = CatalogLock(), []

    def let_go() -> None:
        try:
            lock.release()
        except RuntimeError as error:
            refused.append(str(error))

    let_go()
    lock.acquire()
    started(let_go).join(10)
    lock.release()
    assert refused == ["the catalog's lock let go by a thread that does not hold it"] * 2
