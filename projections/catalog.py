"""The catalog projection: the log replayed, in revision order, over the declared config.

One bad record cannot take the cluster down: an event that cannot be decoded,
or whose effect would make the catalog invalid, is skipped and recorded with
its revision and the reason (``Catalog.skipped``), and the replay carries on.
Declared models are in force before the first event is read, so they always
load.

A long replay from a SQLite file is split between two processes, one for the
streams of each parity (see :func:`_split_replay`) when a second core is
there to take it: deciding each event in Python costs twice what reading and
decoding it does.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from io import BufferedReader
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import ClassVar

import msgspec
from sqlalchemy.engine import Connection

from catalog_es import cpu
from catalog_es.catalog import Catalog, Skipped
from catalog_es.collector import collector_paused
from catalog_es.mapper import (
    DECLARED_TOPIC,
    UndecodableEvent,
    decode_event,
    is_about_another,
    model_of_state,
    topic_name,
)
from catalog_es.model import DomainEvent, Model, model_id
from catalog_es.persistence import SQLRecorder, stream_parity
from catalog_es.spec import EVERY_FIELD, ModelSpec
from catalog_es.storage.engines import create_engine, in_memory

Progress = Callable[[int], None]
Page = list[tuple[int, str, bytes]]

# Events left to replay from which a replay is split in two: below this, the
# second process costs more than it saves (forking and merging take a few
# milliseconds, a thousand events about three).
SPLIT_AFTER = 100_000
# Cores' worth of CPU time from which it is split: under a container's quota
# of 1.5 cores a million events replayed in 2.9 s split, 3.3-3.5 s whole; of
# 1.2 cores, 3.7-3.9 s split, 3.3-3.4 s whole.
SPLIT_CORES = 1.5


def catch_up(
    catalog: Catalog,
    recorder: SQLRecorder,
    conn: Connection,
    *,
    upto: int | None = None,
    model: str | None = None,
    progress: Progress | None = None,
    split: bool = False,
) -> list[Skipped]:
    """Apply every event after ``catalog.revision`` (up to ``upto``), in order,
    and return the ones skipped. Each event is applied once: the catalog's
    revision is its tracking position. ``model``: only the events that can
    change that model are decoded and applied, for a read of it alone; the
    catalog's revision, skips and time then say nothing of the others.
    ``split``: a replay that may be long (a load, a past catalog) is split
    between two processes where it can be (:func:`_split_replay`); not asked
    by commands, whose few events would pay for finding out."""
    with collector_paused():
        if split and model is None and progress is None:
            halves = _split_replay(catalog, recorder, conn, upto)
            if halves is not None:
                return halves
        pages = recorder.scan(conn, after=catalog.revision, upto=upto)
        if model is not None:
            pages = (_about(page, model) for page in pages)
        skipped, last = _replay(catalog, pages, progress)
    if last is not None:
        catalog.saw(last[1])
    return skipped


def _replay(
    catalog: Catalog, pages: Iterable[Page], progress: Progress | None = None
) -> tuple[list[Skipped], tuple[int, datetime] | None]:
    """Apply each row of ``pages``: the skips, and the revision and time of the
    last event decoded."""
    # Read from the catalog after: a removal's replay can skip other models too.
    base = len(catalog.skipped)
    apply = catalog.apply
    last: DomainEvent | None = None
    last_revision = 0
    for page in pages:
        for revision, topic, state in page:
            try:
                event = decode_event(topic, state)
            except UndecodableEvent as error:
                if topic == DECLARED_TOPIC:
                    catalog.skip_declaration(revision, str(error))
                else:
                    catalog.skip(revision, model_of_state(state), topic_name(topic), str(error))
            else:
                last, last_revision = event, revision
                apply(event, revision)
            if progress is not None:
                if last is not None:
                    # What the caller keeps at this revision (the snapshots a
                    # rebuild writes) has the time a command must follow too.
                    catalog.saw(last.timestamp)
                progress(revision)
    skipped = catalog.skipped[base:]
    return skipped, (last_revision, last.timestamp) if last is not None else None


def _about(page: list[tuple[int, str, bytes]], model: str) -> list[tuple[int, str, bytes]]:
    """The rows of ``page`` that may change ``model``, the rest left undecoded."""
    return [row for row in page if not is_about_another(row[1], row[2], model)]


# -- a replay split in two -----------------------------------------------------------


def _parity(name: str) -> int:
    return stream_parity(model_id(name))


class _Crossed(Exception):
    """An event of one half of the streams that reads or changes the other half."""


class _Half(Catalog):
    """The catalog as a replay of the streams of one parity alone makes it.

    Replay applies an event to the model it names, and every rule reads that
    model, the declared layer (whose fallbacks name only declared models) and
    the models linked to it by fallbacks. So each half decides exactly as the
    whole replay would, as long as no fallback links two runtime models of
    different halves, and every event, and every skip, is of a model of its
    own half. An event that would break that raises :class:`_Crossed`, and
    the replay is made whole instead."""

    parity: ClassVar[int]

    @classmethod
    def of(cls, catalog: Catalog) -> _Half:
        half = cls.__new__(cls)
        half.__dict__.update(catalog.copy().__dict__)
        return half

    def check(
        self, name: str, new: ModelSpec | None, touches: tuple[str, ...] = EVERY_FIELD
    ) -> None:
        if new is not None and any(
            target not in self.declared and _parity(target) != self.parity
            for target in new.fallbacks
        ):
            raise _Crossed(name)
        super().check(name, new, touches)

    def changed_the_other_half(self, start: Catalog) -> bool:
        before = start.aggregates
        return any(
            aggregate is not before.get(name) and self.parity_of(name) != self.parity
            for name, aggregate in self.aggregates.items()
        )

    def own_aggregates(self) -> list[Model]:
        return [a for a in self.aggregates.values() if self.parity_of(a.name) == self.parity]

    def own_unhealed(self) -> list[str]:
        return [name for name in self._unhealed if self.parity_of(name) == self.parity]

    def parity_of(self, name: str) -> int:
        # The id replay worked out, where there is one, rather than hashing the name.
        known = self._ids.get(name)
        return known & 1 if known is not None else _parity(name)


class _Even(_Half):
    parity = 0


class _Odd(_Half):
    parity = 1


class _HalfReplayed(msgspec.Struct, frozen=True):
    """What the replay of the odd streams sends back."""

    revision: int
    last: tuple[int, datetime] | None
    recorded_declaration: tuple[str, int] | None
    aggregates: list[Model]
    skipped: list[Skipped]
    unhealed: list[str]


def _replay_half(
    start: Catalog, half: _Half, pages: Iterable[Page]
) -> tuple[list[Skipped], tuple[int, datetime] | None]:
    skipped, last = _replay(half, pages)
    if half.changed_the_other_half(start) or any(
        half.parity_of(skip.model) != half.parity
        for skip in skipped
        if not skip.config_record  # no model's: the merge takes the later record
    ):
        # A record filed by hand in a stream of this half but about a model of
        # the other: the check is made once, after, not on every event.
        raise _Crossed()
    return skipped, last


def _split_replay(
    catalog: Catalog, recorder: SQLRecorder, conn: Connection, upto: int | None
) -> list[Skipped] | None:
    """:func:`catch_up` in two processes, when it is worth it and safe: this one
    replays the streams with an even id, a forked child those with an odd id,
    each on its own connection, and this one then takes over the child's
    models. The outcome is the one replay's, skips listed in revision order;
    ``None`` (the catalog as it was) where the replay must be made whole: an
    event crossed the halves, or the child could not be started or failed."""
    if not _can_split(catalog, recorder):
        return None
    # Read on this connection first, so that its transaction's view of the log
    # is fixed before the child starts reading its own.
    head = recorder.head(conn)
    if upto is not None:
        head = min(head, upto)
    # The CPU time for two processes last: finding it out reads a few files.
    if head - catalog.revision < SPLIT_AFTER or cpu.allowance() < SPLIT_CORES:
        return None
    after = catalog.revision
    # No descriptor or process to spare: one process is enough.
    try:
        reader, writer = os.pipe()
    except OSError:
        return None
    try:
        child = os.fork()
    except OSError:
        os.close(reader)
        os.close(writer)
        return None
    if child == 0:
        # Whatever happens here ends here: the parent replays whole without an answer.
        code = 1
        try:
            os.close(reader)
            with os.fdopen(writer, "wb") as out:
                out.write(_replay_odd(catalog, recorder, after, head))
            code = 0
        finally:
            os._exit(code)
    handle = _pidfd(child)
    answered = False
    status = 1
    try:
        os.close(writer)
        with os.fdopen(reader, "rb") as answer:
            even = _Even.of(catalog)
            try:
                pages = recorder.scan(conn, after=after, upto=head, stream_parity=0)
                skipped, last = _replay_half(catalog, even, _while_answering(pages, answer))
            except _Crossed:
                return None
            data = answer.read()
            answered = True
    finally:
        if not answered:
            _kill(child, handle)
        if handle is not None and handle != _GONE:
            os.close(handle)
        try:
            status = os.waitpid(child, 0)[1]
        except ChildProcessError:  # reaped already (SIGCHLD ignored): judge by the answer
            status = 0
    if status != 0:
        return None
    try:
        odd = msgspec.msgpack.decode(data, type=_HalfReplayed)
    except msgspec.DecodeError:  # cut short: the child did not finish
        return None
    base = len(catalog.skipped)
    catalog.__dict__.update(even.__dict__)
    catalog.adopt(odd.aggregates, odd.unhealed, lambda name: _parity(name) == 1)
    catalog.revision = max(catalog.revision, odd.revision)
    skipped = sorted([*skipped, *odd.skipped], key=attrgetter("revision"))
    catalog.skipped[base:] = skipped
    # Both halves started from the same one; the later is the last recorded.
    declarations = [d for d in (catalog.recorded_declaration, odd.recorded_declaration) if d]
    if declarations:
        catalog.recorded_declaration = max(declarations, key=itemgetter(1))
    lasts = [x for x in (last, odd.last) if x is not None]
    if lasts:
        catalog.saw(max(lasts)[1])
    return skipped


# What _pidfd answers for a child that has ended, and been reaped, already.
_GONE = -1


def _pidfd(pid: int) -> int | None:
    """A handle on the child just forked, where the system gives one (Linux);
    ``None`` where it does not."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return _GONE
    except (AttributeError, OSError):
        return None


def _kill(pid: int, handle: int | None) -> None:
    """Stop the child, which may have ended already and been reaped: where
    SIGCHLD is ignored, or a handler reaps every child, that is at once. Its
    handle, unlike its pid, cannot have been given to another process since;
    without one, the pid is all there is."""
    if handle == _GONE:
        return
    try:
        if handle is not None:
            signal.pidfd_send_signal(handle, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # ended


def _while_answering(pages: Iterable[Page], answer: BufferedReader) -> Iterator[Page]:
    """The parent's pages, given up as soon as the child's half has failed
    (its pipe closed with no answer): the child stops at its first crossing
    event, and the rest of the parent's half would be time lost."""
    for page in pages:
        yield page
        if select.select([answer], [], [], 0)[0] and not answer.peek(1):
            raise _Crossed()


def _replay_odd(catalog: Catalog, recorder: SQLRecorder, after: int, head: int) -> bytes:
    """The forked child's half, on a connection of its own: the parent's is not
    safe to use across a fork. Up to ``head``, read in the parent's transaction
    before the fork, it reads the rows that transaction sees: the log only
    grows, and SQLite commits one writer at a time."""
    own = SQLRecorder(
        create_engine(recorder.engine.url.render_as_string(False)), create_tables=False
    )
    odd = _Odd.of(catalog)
    with own.read() as conn:
        skipped, last = _replay_half(
            catalog, odd, own.scan(conn, after=after, upto=head, stream_parity=1)
        )
    return msgspec.msgpack.encode(
        _HalfReplayed(
            revision=odd.revision,
            last=last,
            recorded_declaration=odd.recorded_declaration,
            aggregates=odd.own_aggregates(),
            skipped=skipped,
            unhealed=odd.own_unhealed(),
        )
    )


def _can_split(catalog: Catalog, recorder: SQLRecorder) -> bool:
    """A SQLite file (each process opens its own connection), no other thread,
    and no fallback linking runtime models of two halves."""
    url = recorder.engine.url
    return (
        recorder.dialect == "sqlite"
        and not in_memory(url)
        and hasattr(os, "fork")
        and _alone()
        and all(_parity(name) == _parity(target) for name, target in catalog.runtime_fallbacks())
    )


def _alone() -> bool:
    """No other thread in this process: forking copies one thread, and a lock
    another held stays held in the child. Counted by the system where it
    lists them, which also sees threads the threading module did not start
    (``_thread``'s, a C library's)."""
    if threading.active_count() != 1:
        return False
    try:
        return sum(1 for _ in Path("/proc/self/task").iterdir()) == 1
    except OSError:
        return True
