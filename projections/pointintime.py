"""Reading the catalog as it was: at a revision, or at a UTC time.

``at`` resolves to a transaction boundary, never between two events that one
transaction wrote (a rollback's compensating events, say): those states were
never in force. Every event of one transaction carries the same timestamp and
the log's timestamps never run backwards (see ``Models._next_timestamp``), so
a boundary is where the timestamp changes, and a time resolves by binary
search to the last event at or before it.
"""

from __future__ import annotations

from datetime import datetime

import msgspec
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from catalog_es.catalog import Catalog
from catalog_es.collector import collector_paused
from catalog_es.configuration import CONFIGURATION_ID, Configuration, DeclaredConfig
from catalog_es.errors import ConfigError, Refused
from catalog_es.mapper import UNREADABLE, UndecodableEvent, decode_event
from catalog_es.model import MAX_CLOCK_SKEW, UtcTime, utc_now, utc_text
from catalog_es.persistence import SQLRecorder
from catalog_es.spec import EVERY_FIELD, ModelSpec
from catalog_es.storage.schema import check_walk, events_table
from projections import snapshots
from projections.catalog import catch_up


class _Stamp(msgspec.Struct):
    timestamp: UtcTime


_stamp_decoder = msgspec.json.Decoder(_Stamp)


def _stamp(state: bytes) -> datetime | None:
    try:
        return _stamp_decoder.decode(state).timestamp
    except UNREADABLE:
        return None


def _row(conn: Connection, query: sa.Select[tuple[int, bytes]]) -> tuple[int, bytes] | None:
    row = conn.execute(query.limit(1)).first()
    return (row[0], row[1]) if row is not None else None


_t = events_table.c
_rows = sa.select(_t.revision, _t.state)
# The most rows read at once along a write (a rollback's, an apply's).
_PAGE_MOST = 1000


def within_head(revision: int, head: int) -> None:
    """Refuse a revision the log does not reach: a reader asking for what
    comes after it is on another log, or on one restored from an older
    backup, and an empty answer would tell it nothing changed."""
    if revision > head:
        raise Refused(f"revision {revision} is beyond the head of the log ({head})")


def resolve_revision(conn: Connection, head: int, revision: int) -> int:
    """The transaction boundary at or before ``revision``."""
    if revision < 0:
        raise Refused(f"revision {revision} is not a revision (they start at 1; 0 is the config)")
    within_head(revision, head)
    at = _row(conn, _rows.where(_t.revision <= revision).order_by(_t.revision.desc()))
    if at is None:
        return 0
    stamp = _stamp(at[1])
    after = _row(conn, _rows.where(_t.revision > at[0]).order_by(_t.revision))
    if stamp is None or after is None or _stamp(after[1]) != stamp:
        return at[0]
    # Inside a transaction: the boundary is just before its first event.
    _, before = _along_the_write(conn, at[0], stamp, forward=False)
    return 0 if before is None else before


def write_end(conn: Connection, revision: int) -> int:
    """The last revision of the write that ``revision`` is in: what a read
    of, or a rollback to, the state it left reads as meant."""
    at = _row(conn, _rows.where(_t.revision == revision))
    stamp = _stamp(at[1]) if at is not None else None
    if stamp is None:
        return revision
    end, _ = _along_the_write(conn, revision, stamp, forward=True)
    return end


def _along_the_write(
    conn: Connection, start: int, stamp: datetime, *, forward: bool
) -> tuple[int, int | None]:
    """From ``start`` on (not included), forward or back: the last revision
    of the run stamped ``stamp`` (the write's, whose events share their
    timestamp; ``start`` if none is), and the first past it (None: the log
    ends first). Read in growing pages, the first of two: a write is mostly
    an event or two, and each row read holds its event's whole state (a
    config record's, every declared definition), where the audit's build
    asks this of every config record it replays."""
    last, page = start, 2
    order = _t.revision if forward else _t.revision.desc()
    while True:
        step = _t.revision > last if forward else _t.revision < last
        rows = conn.execute(_rows.where(step).order_by(order).limit(page)).all()
        for r, state in rows:
            if _stamp(state) != stamp:
                return last, int(r)
            last = int(r)
        if len(rows) < page:
            return last, None
        page = min(page * 8, _PAGE_MOST)


def resolve_time(conn: Connection, head: int, moment: datetime) -> int:
    """The last revision written at or before ``moment`` (0: before the first).

    A binary search, so it relies on the log's time never running backwards.
    A record stamped far ahead of this clock (a bad clock, a hand edit) would
    break that, and commands do not follow such a time, so records beyond the
    horizon, and undecodable ones, are passed over as untimed."""
    if moment.tzinfo is None:
        raise Refused(f"time {moment.isoformat()} has no time zone; give UTC, e.g. ...Z")
    now = utc_now()
    horizon = now + MAX_CLOCK_SKEW
    if moment > now:
        # Ahead of this clock, but not of the log's when a node's clock runs
        # fast (commands follow it): a time `log` shows reads as any other.
        # Past both, a change may yet be written before it.
        newest = _last_timed(conn, head, horizon)
        if newest is None or moment > newest:
            raise Refused(f"time {utc_text(moment)} is in the future")
    low, high = 0, head
    while low < high:
        middle = (low + high + 1) // 2
        timed = _first_timed(conn, middle, high, horizon)
        if timed is None:
            high = middle - 1
        elif timed[1] <= moment:
            low = timed[0]
        else:
            high = middle - 1
    return low


def _last_timed(conn: Connection, head: int, horizon: datetime) -> datetime | None:
    """The time of the last record up to ``head`` with a time to trust."""
    found = _timed(conn, 1, head, horizon, backwards=True)
    return found[1] if found is not None else None


def _first_timed(
    conn: Connection, start: int, stop: int, horizon: datetime
) -> tuple[int, datetime] | None:
    """The first record in ``start..stop`` with a time to trust, and its time."""
    return _timed(conn, start, stop, horizon, backwards=False)


# Records read at a time, looking for one with a time to trust.
_TIMED_PAGE = 64


def _timed(
    conn: Connection, start: int, stop: int, horizon: datetime, *, backwards: bool
) -> tuple[int, datetime] | None:
    """The record nearest ``start`` (or ``stop``, ``backwards``) in
    ``start..stop`` with a time to trust, and its time."""
    order = _t.revision.desc() if backwards else _t.revision
    while start <= stop:
        within = _rows.where(_t.revision >= start, _t.revision <= stop)
        rows = conn.execute(within.order_by(order).limit(_TIMED_PAGE)).all()
        for revision, state in rows:
            stamp = _stamp(state)
            if stamp is not None and stamp <= horizon:
                return int(revision), stamp
        if len(rows) < _TIMED_PAGE:
            return None
        if backwards:
            stop = rows[-1][0] - 1
        else:
            start = rows[-1][0] + 1
    return None


def declared_at(conn: Connection, revision: int) -> DeclaredConfig:
    """The declared layer the log had recorded as in force at ``revision``: its
    last record at or before it, found walking back from the newest (a deploy
    records one, so they are few)."""
    # The walk yields the newest first: LIMIT 1 reads no further back than
    # the record taken, where an ORDER BY would read them all (config_records).
    found = conn.execute(snapshots.config_records(revision).limit(1)).first()
    if found is None:
        check_walk(conn, CONFIGURATION_ID, snapshots.CONFIG_RECORDS)
    if found is None and revision > 0:
        # A write records the layer in force unless it is the one a log that
        # recorded none has: nothing declared, the default engines. So after
        # a write, no record yet means that one (`models: []`, or no config).
        return DeclaredConfig()
    if found is None:
        raise Refused(
            f"no declared config was recorded at or before revision {revision} "
            "(the first write records the one in force)"
        )
    recorded, topic, state = found
    try:
        record = decode_event(topic, state)
    except UndecodableEvent as error:
        raise Refused(
            f"the declared config recorded at revision {recorded} cannot be read: {error}"
        ) from None
    if not isinstance(record, Configuration.Declared):
        raise Refused(f"revision {recorded}, in the declared config's stream, is no record of one")
    declared = DeclaredConfig(models=record.models, engines=record.engines, path=record.path)
    try:
        # The rules of today's code, which a record written under older ones may break.
        declared.check()
    except ConfigError as error:
        raise Refused(
            f"the declared config recorded at revision {recorded} does not load: {error}"
        ) from None
    return declared


def catalog_at(
    recorder: SQLRecorder, conn: Connection, declared: DeclaredConfig, revision: int
) -> Catalog:
    """The catalog in force at ``revision`` over the declared config
    ``declared`` (today's, or :func:`declared_at`): the newest snapshot at or
    before it, and the events after that."""
    catalog = declared.new_catalog()
    if revision > 0:
        with collector_paused(lasting=True):
            snapshots.restore(conn, catalog, declared.fingerprint, upto=revision)
            catch_up(catalog, recorder, conn, upto=revision, split=True)
    return catalog


def model_at(
    recorder: SQLRecorder, conn: Connection, declared: DeclaredConfig, revision: int, name: str
) -> tuple[ModelSpec | None, bool]:
    """The definition of ``name`` in force at ``revision``, as in
    :func:`catalog_at`, and whether it is declared; read from the declared
    layer, the model's entry in the newest snapshot, and the events after
    that which name it. Only an event whose outcome depends on other models
    (see :class:`_OneModel`) costs the whole catalog."""
    catalog: Catalog = _OneModel(declared.models, declared.engines)
    if revision > 0:
        snapshots.restore_model(conn, catalog, declared.fingerprint, revision, name)
        try:
            if _leans_on_others(catalog, catalog.get(name)):
                raise _NeedsTheOthers(name)
            catch_up(catalog, recorder, conn, upto=revision, model=name)
        except _NeedsTheOthers:
            catalog = catalog_at(recorder, conn, declared, revision)
    return catalog.get(name), catalog.is_declared(name)


def _leans_on_others(catalog: Catalog, spec: ModelSpec | None) -> bool:
    return spec is not None and any(target not in catalog.declared for target in spec.fallbacks)


class _NeedsTheOthers(Exception):
    """An event of the one model whose outcome depends on the models around it."""


class _OneModel(Catalog):
    """The declared layer and one runtime model, replayed from the events
    that name it.

    Replay applies an event to the model it names, so only those can change
    it, and each decides the same here as in the whole catalog as long as it
    reads that model and the declared layer alone: every rule does but one.
    A definition naming runtime fallbacks asks whether they exist and close
    a cycle, and falls out of force when one of them is removed (an event
    that does not name it); one restored or replayed sends the read to the
    whole catalog. Declared fallbacks are all here, are never removed at
    runtime, and name only declared models, so no cycle runs through them."""

    def check(
        self, name: str, new: ModelSpec | None, touches: tuple[str, ...] = EVERY_FIELD
    ) -> None:
        if _leans_on_others(self, new):
            raise _NeedsTheOthers(name)
        super().check(name, new, touches)
