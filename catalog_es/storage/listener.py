"""The process's PostgreSQL LISTEN connection, which its subscriptions
(:class:`~catalog_es.persistence.ListenSubscription`) share."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from catalog_es.persistence import ListenSubscription


# The LISTEN connection's own, where the database URL does not say. Its
# connect is bounded: the last follower out waits for its thread to end. It is
# idle for as long as nothing is written: a NAT or firewall that drops idle
# flows (minutes, in most clouds) would cut it without a word, and every
# watch would wait for good. Probes every 30 s keep the flow, and a peer that
# stops answering ends it within a minute (the watches subscribe again); the
# system's default is two hours.
LISTEN_SETTINGS = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}


class Listener:
    """One LISTEN connection a process shares among its subscriptions, in a
    thread that runs while any is open. A connection each, a few dozen
    watchers (the console's tabs, gateway replicas over HTTP) took every
    connection the server allows, from every node."""

    def __init__(self, conninfo: str, channel: str) -> None:
        self._conninfo = conninfo
        self._channel = channel
        self._lock = threading.Lock()
        self._subscriptions: set[ListenSubscription] = set()
        self._listening = False
        self._thread: threading.Thread | None = None

    def add(self, subscription: ListenSubscription) -> None:
        with self._lock:
            self._subscriptions.add(subscription)
            if self._listening:
                # Commits from now on are heard; one pull covers those before.
                subscription.wake()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._listen, name="catalog-es-listen", daemon=True
                )
                self._thread.start()

    def discard(self, subscription: ListenSubscription) -> None:
        """Let go of ``subscription``; the last one out waits for the thread
        to end (within one of its short waits): a process about to fork (a
        split replay) must have no other thread."""
        with self._lock:
            self._subscriptions.discard(subscription)
            thread = self._thread
        while thread is not None and thread.is_alive():
            with self._lock:
                if self._subscriptions:
                    return  # another has joined: the thread goes on for it
            thread.join(0.05)

    def _listen(self) -> None:
        try:
            # Imported here, where PostgreSQL is listened to: importing it
            # costs each CLI run on SQLite 60 ms.
            import psycopg
            from psycopg.conninfo import conninfo_to_dict, make_conninfo

            given = conninfo_to_dict(self._conninfo)
            settings = {k: v for k, v in LISTEN_SETTINGS.items() if k not in given}
            conninfo = make_conninfo(self._conninfo, **settings)
            with psycopg.connect(conninfo, autocommit=True) as conn:
                conn.execute(f"LISTEN {self._channel}")
                with self._lock:
                    # Commits between a subscription's first pull and LISTEN
                    # would go unheard: each pulls again now.
                    self._listening = True
                    waiting = list(self._subscriptions)
                for subscription in waiting:
                    subscription.wake()
                while True:
                    # Short waits, so the last subscription's end is noticed promptly.
                    notified = any(True for _ in conn.notifies(timeout=0.2, stop_after=1))
                    with self._lock:
                        # Those there now: one added meanwhile pulled once it was.
                        waiting = list(self._subscriptions)
                        if not waiting:
                            self._listening = False
                            self._thread = None
                            return
                    if notified:
                        for subscription in waiting:
                            subscription.wake()
        except BaseException as error:  # told to each subscription, which ends
            with self._lock:
                if self._thread is not threading.current_thread():
                    return  # ended on its way out (closing): a newer thread serves them
                self._listening = False
                self._thread = None
                failed = list(self._subscriptions)
                self._subscriptions.clear()
            for subscription in failed:
                subscription.fail(error)
