"""Pausing Python's cyclic garbage collector around work that makes many objects.

A catalog read or written in bulk makes tens of thousands of small objects
(decoded events and definitions, answer dicts), none in a cycle, while the
process already holds a large heap that lives as long as it does: the code
imported and the catalog in force. Each full collection rescans all of it,
about 20 ms for 10,000 models here, and one runs whenever the objects that
outlived young collections reach a quarter of that heap: bulk work got there
every few reads of the past. Reference counting frees everything these
sections make; a cycle made inside one is collected after.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection for the span of the ``with``, in the main thread.

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
    try:
        # Inside the try: a KeyboardInterrupt raised as disable() returns
        # must still turn it back on.
        gc.disable()
        yield
    finally:
        if enabled:
            gc.enable()
