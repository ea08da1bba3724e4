"""The catalog's lock: re-entrant, and taken in turn, a waiting write before
the reads. What a node's writes gain by it is tested in test_concurrency
(`test_a_write_holding_the_log_waits_for_one_read_at_most_…`).

Threads here are daemons and every wait is bounded: a broken lock fails
these tests, never hangs them."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from catalog_es import catalog_lock
from catalog_es.catalog_lock import CatalogLock


def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def started(target: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def queued(lock: CatalogLock) -> int:
    return len(lock._writes) + len(lock._reads)


def test_the_waiting_get_it_in_turn_a_write_before_the_reads() -> None:
    lock, order = CatalogLock(), []

    def take(what: str) -> None:
        lock.acquire(write=what == "write")
        order.append(what)
        lock.release()

    lock.acquire()  # a read under way
    for n, what in enumerate(["read 1", "read 2", "write", "read 3"], 1):
        started(lambda what=what: take(what))  # type: ignore[misc]
        until(lambda n=n: queued(lock) == n)  # type: ignore[misc]
    lock.release()
    until(lambda: len(order) == 4)
    assert order == ["write", "read 1", "read 2", "read 3"]


def _nonstop(lock: CatalogLock, writes: list[bool], seconds: float = 1.0) -> list[int]:
    """Threads taking the lock nonstop (a write where ``writes`` says so), each
    holding it through a little I/O, as a read catching up does: how many
    times each took it."""
    stop, counts = threading.Event(), [0] * len(writes)

    def take(i: int, write: bool) -> None:
        while not stop.is_set():
            lock.acquire(write=write)
            try:
                time.sleep(0.0002)
            finally:
                lock.release()
            counts[i] += 1

    threads = [started(partial(take, i, w)) for i, w in enumerate(writes)]
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(5)
    return counts


def test_threads_reading_nonstop_each_get_their_turns() -> None:
    """A thread letting go and asking again at once queues behind those
    waiting: with the lock taken by whoever asked when it was let go, one
    reader had it thousands of times and the others once."""
    counts = _nonstop(CatalogLock(), [False] * 6)
    assert min(counts) >= max(counts) / 4, counts


def test_a_nonstop_write_leaves_the_reads_their_turns() -> None:
    counts = _nonstop(CatalogLock(), [True] + [False] * 4)
    assert min(counts[1:]) >= counts[0] / 8, counts


def test_its_holder_takes_it_again_while_a_write_waits_for_it() -> None:
    """A read catching up takes the lock again: held back behind the write
    that waits for it, neither would ever go on."""
    lock, holding, again = CatalogLock(), threading.Event(), threading.Event()

    def read_catching_up() -> None:
        with lock:
            holding.set()
            until(lambda: len(lock._writes) == 1)
            with lock:
                again.set()

    reader = started(read_catching_up)
    assert holding.wait(10)

    def write_once() -> None:
        lock.acquire(write=True)
        lock.release()

    writer = started(write_once)
    reader.join(10)
    writer.join(10)
    assert again.is_set()
    assert not reader.is_alive() and not writer.is_alive()


def test_a_write_interrupted_while_it_waits_leaves_its_turn_to_the_next() -> None:
    """Ctrl-C in a write waiting for the lock: the read queued behind it gets
    the lock once its holder lets go, rather than waiting for a write that
    is gone."""
    lock, holder_may_go, read = CatalogLock(), threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            holder_may_go.wait(10)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    started(hold)
    until(lambda: lock._owner is not None)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)

        def read_behind_the_writer() -> None:
            until(lambda: len(lock._writes) == 1)
            lock.acquire()
            read.set()

        started(read_behind_the_writer)
        with pytest.raises(KeyboardInterrupt):
            lock.acquire(write=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert queued(lock) == 1  # the read, and no longer the write
    holder_may_go.set()
    assert read.wait(10), "the read waits for a write that is gone"


def test_a_hand_on_cut_off_half_way_leaves_the_lock_to_be_let_go() -> None:
    """Ctrl-C in the thread letting go, once it made the waiter the holder
    and before it took it off the queue: the waiter, looking again, holds
    the lock, and must leave the queue too, or its own release would hand
    the lock to itself and no other thread would ever get it (review)."""
    lock, released, done = CatalogLock(), threading.Event(), threading.Event()
    source = Path(catalog_lock.__file__).read_text().splitlines()

    def read() -> None:
        with lock:
            pass
        released.set()
        done.wait(10)  # a server's worker lives on (a new thread may reuse its id)

    def interrupt_before_it_leaves_the_queue(frame: FrameType, *_: object) -> Any:
        if frame.f_code is not CatalogLock.release.__code__:
            return None

        def line(frame: FrameType, event: str, _: object) -> Any:
            if event == "line" and "queue.popleft()" in source[frame.f_lineno - 1]:
                sys.settrace(None)
                raise KeyboardInterrupt
            return line

        return line

    lock.acquire()
    started(read)
    until(lambda: len(lock._reads) == 1)
    sys.settrace(interrupt_before_it_leaves_the_queue)
    try:
        with pytest.raises(KeyboardInterrupt):
            lock.release()
    finally:
        sys.settrace(None)
    assert released.wait(10)
    taken = threading.Event()

    def take_once() -> None:
        lock.acquire()
        taken.set()
        lock.release()

    started(take_once)
    assert taken.wait(10), "the lock stayed with the thread that had let it go"
    done.set()


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
