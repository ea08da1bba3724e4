"""Pausing Python's cyclic garbage collector around work that makes many objects.

A catalog read or written in bulk makes tens of thousands of small objects
(decoded events and definitions, answer dicts), none in a cycle, while the
process already holds a large heap that lives as long as it does: the code
imported and the catalog in force. Each full collection rescans all of it,
about 20 ms for 10,000 models here, and one runs whenever the objects that
outlived young collections reach a quarter of that heap: bulk work got there
every few reads of the past. Reference counting frees everything these
sections make; a cycle made inside one is collected after.

A section whose objects are kept (an answer of 10,000 audit rows, a page of
model views, a past catalog) would still have them scanned as the collector
comes back on: all of them are young, so the next young collection walks
them, then the middle generation walks them again (30 ms and 47 ms for those
audit rows here). Such a section is ``lasting``: it hands what it made
straight to the oldest generation, where only a full collection looks.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused(*, lasting: bool = False, cycles: bool = True) -> Iterator[None]:
    """No cyclic collection for the span of the ``with``, in the main thread;
    ``lasting``: what it made is moved to the oldest generation after;
    ``cycles=False``: what it makes can hold no reference cycle (a decoded
    JSON document, structs converted to builtins), so aging it brings no full
    collection nearer.

    The collector is the whole process's. Threads pausing it in turn could
    leave it off for good (one finds it off because another paused it, and
    so never turns it back on), or keep it off while a server's requests
    overlap; so a pause in any other thread (an HTTP server's workers) does
    nothing, and a server freezes what it loaded at start instead (see
    ``catalog-es serve``). Nested pauses leave it as the outermost found it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    enabled = gc.isenabled()
    # Aging moves whatever is young, so what was young before the section is
    # collected first: a cycle of the caller's must not wait for a full
    # collection (a test run kept 180 MB more when it did). That costs about
    # 0.1 ms, next to the milliseconds saved; worth it for bulk answers only,
    # not for each command. A process that froze part of its heap (a server
    # after start-up) is left as it is: thawing would hand that back.
    aging = lasting and enabled and gc.get_freeze_count() == 0
    if aging:
        _collect_before_aging()
    try:
        # Inside the try: a KeyboardInterrupt raised as disable() returns
        # must still turn it back on.
        gc.disable()
        yield
    finally:
        if enabled:
            gc.enable()
            if aging:
                _age_everything(counted=cycles)


# Objects aged since the last full collection. CPython runs a full one once
# the objects its middle generation promoted reach a quarter of the old ones;
# aged objects skip that count, so without this a cycle made in a lasting
# section could wait for good. Only sections that may make cycles count (a
# past catalog); answers, which are trees, do not. The full collection runs
# as the next lasting section starts, when the caller has usually let the
# last answer go (20 ms or so for a catalog of 10,000 models).
FULL_COLLECTION_AFTER = 1_000_000
_aged = 0


def _collect_before_aging() -> None:
    global _aged
    if _aged >= FULL_COLLECTION_AFTER:
        gc.collect()
        _aged = 0
    else:
        gc.collect(1)


def _age_everything(*, counted: bool) -> None:
    global _aged
    if counted:
        # What the young generation counts now is, near enough, what the
        # section made and kept: it was empty as the section started.
        _aged += gc.get_count()[0]
    # Freezing and thawing splice lists: nothing is scanned. Thawing in a
    # finally: an interrupt in between must not leave the heap frozen.
    try:
        gc.freeze()
    finally:
        gc.unfreeze()
