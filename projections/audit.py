"""The audit trail read model: every stored event as who changed what, field by field.

Built by replaying the log over the declared config with a :class:`Catalog`, so
``before`` and ``after`` are the definitions in force around each event, and an
event that load skips is there with the reason rather than missing. The tables
are disposable: :meth:`AuditProjection.rebuild` drops them and replays the log,
with the same answers. The rows depend on the declared config (what a replay
skips depends on what it declares), so each config's are in a table of their
own: nodes declaring different configs on one database, as in a rolling
deploy, each keep theirs, and the oldest configs' tables go.

In the style of eventsourcing's projections (a ``name``, ``topics``, a
singledispatch ``process_event``, rows and tracking position written in one
transaction), but driven by :meth:`AuditProjection.catch_up` rather than the
library's runner: that stops at the first record it cannot decode, where the
audit must show it and go on, and it commits once per event, where replaying a
million events wants one transaction per batch.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from datetime import MAXYEAR, UTC, datetime, timedelta
from typing import Any, TypedDict, TypeVar

import msgspec
import sqlalchemy as sa
from eventsourcing.dispatch import singledispatchmethod
from eventsourcing.persistence import Tracking, TrackingRecorder
from eventsourcing.projection import Projection
from sqlalchemy.engine import Connection, Engine

from catalog_es.catalog import Catalog, Skipped
from catalog_es.collector import collector_paused
from catalog_es.configuration import CONFIGS_KEPT, Configuration, DeclaredConfig
from catalog_es.errors import StorageBusy, first_line, lost_events
from catalog_es.mapper import (
    UndecodableEvent,
    decode_event,
    model_of_state,
    topic_name,
)
from catalog_es.model import DomainEvent, Model, utc_text
from catalog_es.names import CONFIG_DECLARED, DECLARED, REDECLARED, UNDECLARED
from catalog_es.persistence import Kept, SQLRecorder, within_bytes
from catalog_es.spec import ModelSpec
from catalog_es.storage.schema import create, tables_found
from catalog_es.storage.waits import acquire_within, holds, milliseconds, release_to
from catalog_es.views import definition_view, event_fields, event_name
from projections import pointintime, snapshots

log = logging.getLogger("catalog_es.audit")

# Rows per transaction while catching up, and the size their views may reach
# before they are written with fewer: each holds the model before and after,
# and 5,000 rows of a model of 800 KB took a catch-up to 3.3 GB (hostile test).
BATCH_SIZE = 5_000
BATCH_BYTES = 32 << 20
# A catch-up that writes this many rows refreshes the planner's statistics
# (SQLite keeps none unless asked), so a query on a model and an actor uses
# the more selective of the two indexes.
ANALYZE_AFTER = 10_000
# A catalog this far behind the view's position starts again from the newest
# snapshot at or before it, rather than replay every event in between: a new
# process (each CLI query) replayed the whole log after any write, 200,000
# events in 1.4 s, to write one row.
SNAPSHOT_AFTER = 2_000
# Catch-ups that lost a race with another process (it reset the tables, or
# wrote the first rows), tried again before giving up.
RETRIES = 3


# The tables' layout, in their names: bumped with any change to their columns
# or to what a row's view holds (its keys, ``field_changes``, how times are
# written), so that each version of this code keeps tables of its own, and
# nodes of two versions sharing a database during an upgrade each read tables
# they understand. Tables of an earlier layout are left to the nodes that use
# them. 4: a table of rows per declared config; 5: a record that cannot say
# its model is its stream's (it was no model's, so no model's history); 6: a
# config record's changes, to the declared layer (it had none); 7: a row of
# its own for each model a removal takes out of force (a revision had one row);
# 8: the log's hash at the position, to tell a log restored under the rows;
# 9: a row of its own for each model whose declared definition a config
# record changed (a model's history showed none of its config changes);
# 10: an origin's field left out is null in ``before``, ``after``,
# ``changes`` and ``fields``, as in every model view (it was "", which
# `model add` refuses), and a config record's rows say where its write ends.
LAYOUT = 10
# Events to replay from which a catch-up says what it is doing.
TOLD_FROM = 100_000
CHANGES_PREFIX = f"audit_changes_v{LAYOUT}_"
# What this code names a table of rows: another of the prefix (an operator's
# copy, say) is not this code's to drop.
ANY_CHANGES_TABLE = re.compile(f"{CHANGES_PREFIX}[0-9a-f]{{16}}")
# A table per declared config: one set of tables had nodes of two configs (a
# rolling deploy) take turns rebuilding it over their own, and most of their
# queries failed. Those of the CONFIGS_KEPT configs used last are kept, and
# any used within IN_USE: a table in use is never dropped for another's.
IN_USE = timedelta(hours=1)
# A process that only reads says it still uses its table this often at most.
USED_EVERY = 60.0
# How long dropping another config's table waits for the reads that hold it.
DROP_WAIT = 0.1

# The tracking positions, one row per declared config, shared by every config's table.
metadata = sa.MetaData()

tracking_table = sa.Table(
    f"audit_tracking_v{LAYOUT}",
    metadata,
    sa.Column("application_name", sa.String(64), primary_key=True),
    # Fingerprint of the declared config the rows were computed over.
    sa.Column("config", sa.String(64), primary_key=True),
    # Written with the table, at 0: a config without a row has no table.
    sa.Column("notification_id", sa.BigInteger(), nullable=False),
    # The log's hash at that revision as the rows were built (NULL at 0): a
    # log restored from a backup, or rewritten, holds another there, or none.
    sa.Column("log_hash", sa.String(64)),
    # Whether the rows' times never go back as the revisions go up (rows
    # without a time aside), and the latest so far. While they do not, a time
    # bound is a revision bound, which every index can seek.
    sa.Column("times_in_order", sa.Boolean(), nullable=False),
    sa.Column("latest_time", sa.DateTime()),
    # Drawn when the table is made: a position read before a rebuild, and
    # met again as the same number after it, is not the same.
    sa.Column("generation", sa.String(32), nullable=False),
    # When a process last wrote or read the rows (UTC, the database's clock;
    # reads every USED_EVERY at most): which tables are kept.
    sa.Column("used_at", sa.DateTime(), nullable=False),
)


def changes_table_for(application_name: str, config: str) -> sa.Table:
    """The table of the rows computed over one declared config (for one
    application, whose position in it the tracking row keeps): named after
    16 hex digits of a hash of the two."""
    key = hashlib.sha256(f"{application_name}\0{config}".encode()).hexdigest()[:16]
    name = CHANGES_PREFIX + key
    return sa.Table(
        name,
        sa.MetaData(),
        # A rowid table on SQLite all the same: clustered by this key instead
        # (WITHOUT ROWID), each row an index finds is a seek down the key's
        # tree, and one actor's 10,000 rows took 84 ms rather than 65.
        sa.Column("revision", sa.BigInteger(), primary_key=True, autoincrement=False),
        # 0: the event's own row; 1 on: each model it took out of force, in
        # the order load did (a removal takes those naming the model removed
        # as a fallback, and those naming them in turn), or, of a config
        # record, each model whose declared definition it changed.
        sa.Column("place", sa.Integer(), primary_key=True, autoincrement=False),
        # What the queries filter on. UTC; NULL, like actor, for a record that
        # could not be decoded.
        sa.Column("time", sa.DateTime()),
        sa.Column("actor", sa.Text()),
        sa.Column("model", sa.Text(), nullable=False),
        # Text, not a bounded string: an unreadable record's topic can be any length.
        sa.Column("event", sa.Text(), nullable=False),
        # The bytes of ``view``, so that what an answer would hold is known
        # before any view is read (before it, so that a read of it alone
        # reads none of the view's overflow pages on SQLite).
        sa.Column("size", sa.BigInteger(), nullable=False),
        # The row as the queries return it, as JSON: an answer of ten thousand
        # rows is then one decode, not four columns and a dict a row, which was
        # most of its time.
        sa.Column("view", sa.Text(), nullable=False),
        # With the row's key in each index, a filtered query reads its rows
        # in order, newest first for a limit, without sorting; with its size,
        # what an answer would hold is read from the index alone (from the
        # table, 10,000 rows of one actor took 23 ms more).
        sa.Index(f"{name}_model", "model", "revision", "place", "size"),
        sa.Index(f"{name}_actor", "actor", "revision", "place", "size"),
        sa.Index(f"{name}_event", "event", "revision", "place", "size"),
        sa.Index(f"{name}_time", "time", "revision", "place", "size"),
    )


# -- times -------------------------------------------------------------------------


def stored_time(moment: datetime) -> datetime:
    """A timestamp as the audit tables keep it: naive UTC, the same on every database."""
    try:
        return moment.astimezone(UTC).replace(tzinfo=None)
    except OverflowError:
        # Past an end of what UTC can hold, in an offset of its own (only a
        # record written by hand gets there): that end, rather than a
        # catch-up that fails on it every time.
        return datetime.max if moment.year == MAXYEAR else datetime.min


def filter_text(text: str | None) -> str | None:
    """Text as a column queries filter on keeps it: PostgreSQL's text cannot
    hold NUL, which only a record written by hand can carry (the row's
    ``view`` keeps the text as it was); nor can either database a lone
    surrogate (an argument's bytes that are not UTF-8), written out as
    Python writes it, ``\\udcff``, as the refusals keep a name given so. A
    filter is made the same: it finds what was kept of that name."""
    if text is None:
        return None
    text = text.replace("\0", "\ufffd")
    # Each staged audit row passes three texts here: ASCII (most) needs no
    # encoding (76 ns a text: some 0.2 s of a rebuild of a million events).
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


# -- queries -----------------------------------------------------------------------


class ChangeFilters(TypedDict, total=False):
    """What a query of one model's changes asks for (``history``). Every
    filter given must match."""

    by: str | None
    event_type: str | None
    since: datetime | None  # inclusive
    until: datetime | None  # exclusive
    limit: int | None  # the most recent ones


class Filters(ChangeFilters, total=False):
    """What an audit query asks for: a query of changes, of any model or one."""

    model: str | None


def select_rows(
    conn: Connection,
    table: sa.Table,
    order: Sequence[sa.Column[Any]],
    filters: Filters,
    columns: Sequence[sa.ColumnElement[Any]] = (),
    within: tuple[int | None, int | None] = (None, None),
) -> list[sa.Row[Any]]:
    """The rows of ``table`` (one with ``time``, ``actor``, ``model`` and
    ``event`` columns: the audit, the refusals) that match, oldest first by
    ``order``; with a limit, the last ``limit`` of them. ``columns``: what to
    read of each, by default every column; ``within``: the first and last
    value of ``order``'s first column the matches can have, when known."""
    query, newest_first = _matching(table, order, filters, columns, within)
    rows = list(conn.execute(query).all())
    if newest_first:
        rows.reverse()
    return rows


Answer = TypeVar("Answer")
# What reads the values of the matching rows' one column into an answer, in
# the read's transaction: given the store, the connection, the query and
# whether it reads them newest first (a limit's: its last N, without a sort)
# rather than oldest first, as the answer has them.
ValuesReader = Callable[[SQLRecorder, Connection, sa.Select[Any], bool], Answer]


def listed(
    store: SQLRecorder, conn: Connection, query: sa.Select[Any], newest_first: bool
) -> list[Any]:
    """A :data:`ValuesReader`: the values in one list, oldest first, as the
    driver gives them (:meth:`SQLRecorder.column_values`), read at once: the
    driver's fastest read, for an answer held whole anyway (the library's
    lists) or bounded before it is read (the HTTP API's)."""
    values = store.column_values(conn, query)
    if newest_first:
        values.reverse()
    return values


def select_values(
    store: SQLRecorder,
    conn: Connection,
    table: sa.Table,
    order: Sequence[sa.Column[Any]],
    filters: Filters,
    column: sa.Column[Any],
    into: ValuesReader[Answer],
    within: tuple[int | None, int | None] = (None, None),
) -> Answer:
    """:func:`select_rows` of one ``column`` the dialect does not convert, its
    values read by ``into``."""
    query, newest_first = _matching(table, order, filters, [column], within)
    return into(store, conn, query, newest_first)


def _matching(
    table: sa.Table,
    order: Sequence[sa.Column[Any]],
    filters: Filters,
    columns: Sequence[sa.ColumnElement[Any]],
    within: tuple[int | None, int | None],
) -> tuple[sa.Select[Any], bool]:
    """The query of :func:`select_rows`, and whether it reads newest first
    (with a limit, so that the last ``limit`` are read without sorting)."""
    c = table.c
    query = sa.select(*columns) if columns else sa.select(table)
    first, last = within
    if first is not None:
        query = query.where(order[0] >= first)
    if last is not None:
        query = query.where(order[0] <= last)
    for column, value in (
        (c.model, filters.get("model")),
        (c.actor, filters.get("by")),
        (c.event, filters.get("event_type")),
    ):
        if value is not None:
            query = query.where(column == filter_text(value))
    since, until, limit = filters.get("since"), filters.get("until"), filters.get("limit")
    if since is not None:
        query = query.where(c.time >= stored_time(since))
    if until is not None:
        query = query.where(c.time < stored_time(until))
    if limit is None:
        return query.order_by(*order), False
    return query.order_by(*(column.desc() for column in order)).limit(limit), True


# -- what changed ------------------------------------------------------------------


def field_changes(before: Any, after: Any) -> list[dict[str, Any]]:
    """``{field, before, after}`` for each field that differs, as dotted paths
    (``scaling.min``). Lists of named items are matched by name
    (``profiles[cpu].min_memory_gb``); other values are compared whole."""
    changes: list[dict[str, Any]] = []
    if before != after:
        _diff(before, after, "", changes)
    return changes


def _diff(before: Any, after: Any, path: str, changes: list[dict[str, Any]]) -> None:
    """Append the changes from ``before`` to ``after``, which differ."""
    if isinstance(before, dict) and isinstance(after, dict):
        old, new, label = before, after, f"{path}.{{}}" if path else "{}"
    elif _is_named_list(before) and _is_named_list(after):
        old = {item["name"]: item for item in before}
        new = {item["name"]: item for item in after}
        label = f"{path}[{{}}]"
    else:
        changes.append({"field": path, "before": before, "after": after})
        return
    for key in {**old, **new}:
        old_value, new_value = old.get(key), new.get(key)
        if old_value != new_value:  # compared first: most fields do not change
            _diff(old_value, new_value, label.format(key), changes)


def _is_named_list(value: Any) -> bool:
    if not isinstance(value, list | tuple):
        return False
    names = [item.get("name") if isinstance(item, dict) else None for item in value]
    return all(isinstance(n, str) for n in names) and len(set(names)) == len(names)


def _definition(spec: ModelSpec | None) -> dict[str, Any] | None:
    return definition_view(spec) if spec is not None else None


def _declared_models(record: Configuration.Declared | None) -> dict[str, ModelSpec]:
    """A config record's declared definitions by name; none before the first."""
    return {} if record is None else {spec.name: spec for spec in record.models}


def _declared_layer(record: Configuration.Declared | None) -> dict[str, Any]:
    """A config record's engines and models, as its row's changes compare them
    (``models[chat].scaling.max``, ``engines``); none before the first."""
    if record is None:
        return {"engines": [], "models": []}
    # Engines are a set (the fingerprint sorts them): a new order is no change.
    return {
        "engines": sorted(record.engines),
        "models": [definition_view(m) for m in record.models],
    }


# -- the view ----------------------------------------------------------------------


class ViewMoved(StorageBusy):
    """Another process reset the view since this one read its position: what
    this one staged is not written."""


class TimeOrder(msgspec.Struct):
    """Whether the rows' times have only gone up with their revisions, and the
    latest of them. Clocks disagree (each node stamps its own events), so it
    is watched rather than assumed."""

    in_order: bool = True
    latest: datetime | None = None

    def see(self, time: datetime | None) -> None:
        """The time of the next row; rows without one have no place in the order."""
        if time is None:
            return
        if self.latest is not None and time < self.latest:
            self.in_order = False
        else:
            self.latest = time


class Tracked(msgspec.Struct, frozen=True):
    """A config's position, the order of its rows' times, and its table's generation."""

    position: int
    times: TimeOrder
    # Drawn when the table is made: a position read before a rebuild, and met
    # again as the same number after it, is not the same.
    generation: str
    # The log's hash at the position when the rows were built.
    log_hash: str | None = None


def stored_hash(value: object) -> str | None:
    """A hash of the log as the tracking row keeps it: text, whatever type a
    hand edit left in the log (SQLite would store a number it was given as
    text, and it would never compare equal again)."""
    return None if value is None else str(value)


def unvouched(tracked: Tracked, kept: Kept) -> str | None:
    """Why the log, as ``kept`` tells it at ``tracked``'s position, no longer
    holds the events the rows were built from; ``None`` while it does."""
    if kept.last < tracked.position:
        why = (
            f"the log ends at revision {kept.last}, before their position "
            f"({tracked.position}): it lost events"
        )
    elif stored_hash(kept.hash) != tracked.log_hash:
        why = f"the log holds other events at revision {tracked.position} than they were built from"
    else:
        return None
    return lost_events(why)


def _as_tracked(row: sa.Row[Any]) -> Tracked:
    """A :class:`Tracked` of a row selected by :meth:`AuditView._tracking_select`."""
    return Tracked(row[0], TimeOrder(row[1], row[2]), row[3], row[4])


class AuditView(TrackingRecorder):
    """The audit rows of one declared config, in a table of their own, and
    their tracking position."""

    def __init__(self, store: SQLRecorder, config: str) -> None:
        self.store = store
        self.engine: Engine = store.engine
        self.config = config
        self._tables: dict[str, sa.Table] = {}
        # The applications whose table a read of this process last found
        # missing: the next catch-up takes the lock to make it without
        # reading it first (on PostgreSQL, a failed lock of four round trips).
        self._missing: set[str] = set()
        # When this process last said it uses its table (monotonic), by application.
        self._used: dict[str, float] = {}
        store.create_tables(metadata)

    def table(self, application_name: str) -> sa.Table:
        """This config's table of rows, for one application."""
        table = self._tables.get(application_name)
        if table is None:
            table = self._tables[application_name] = changes_table_for(
                application_name, self.config
            )
        return table

    def reset(self, application_name: str) -> Tracked:
        """Make this config's table anew, empty, at position 0."""
        with self.store.locked("catalog_es.audit") as conn:
            return self._make(conn, application_name)

    def remake(self, application_name: str, stale: Tracked, why: str) -> Tracked:
        """:meth:`reset`, with a warning saying ``why``, for rows the log no
        longer vouches for at ``stale``, their position as read before the
        lock. Unless another process has moved them since (made them again,
        caught up) to where the log vouches for them: that work is kept, and
        its position returned."""
        with self.store.locked("catalog_es.audit") as conn:
            now = self._tracked(conn, application_name)
            if now is not None and (now.generation, now.position) != (
                stale.generation,
                stale.position,
            ):
                again = unvouched(now, self.store.kept(conn, now.position))
                if again is None:
                    return now
                why = again
            return self._made_again(conn, application_name, why)

    def resume_from(self, application_name: str) -> Tracked:
        """Where the rows are up to, and the order of their times. A config
        without its table (new here, dropped for others, or by hand) has it
        made, empty: the catch-up starts from 0. So does one whose position is
        behind its rows (set back by hand, the usual way to have a read model
        made again), from which a catch-up would write rows twice."""
        if application_name not in self._missing:
            try:
                with self._reading(application_name) as conn:
                    found = self._tracked_to(conn, application_name)
                    if found is not None and found[1] <= found[0].position:
                        return found[0]
            except ViewMoved:  # the table is missing
                pass
        with self.store.locked("catalog_es.audit") as conn:
            self._missing.discard(application_name)
            # Another process may have made it since the read.
            tables = self._found(conn, application_name)
            if self.table(application_name).name in tables:
                found = self._tracked_to(conn, application_name)
                if found is not None:
                    tracked, end = found
                    if end <= tracked.position:
                        return tracked
                    behind = f"their position (revision {tracked.position}) is behind them"
                    why = f"{behind} (up to {end})"
                    return self._made_again(conn, application_name, why, tables)
            return self._make(conn, application_name, tables)

    def _made_again(
        self,
        conn: Connection,
        application_name: str,
        why: str,
        tables: Collection[str] | None = None,
    ) -> Tracked:
        """:meth:`_make`, for rows that were there, told ``why`` they went."""
        log.warning("audit rows made again from the log: %s", why)
        return self._make(conn, application_name, tables)

    def _found(self, conn: Connection, application_name: str) -> Collection[str]:
        """Which of the tracking table and this config's table are there, in
        one statement: SQLAlchemy's inspector asked it table by table, three
        times in a row, a round trip each on PostgreSQL."""
        return tables_found(conn, [tracking_table.name, self.table(application_name).name]).tables

    def _make(
        self, conn: Connection, application_name: str, tables: Collection[str] | None = None
    ) -> Tracked:
        """This config's table, made anew with its position at 0; those of
        configs no longer in use go (:meth:`_drop_unused`). ``tables``: what
        :meth:`_found` said under this lock, when the caller asked it."""
        if tables is None:
            tables = self._found(conn, application_name)
        if tracking_table.name not in tables:  # dropped by hand since the start
            create(conn, metadata, [tracking_table])
        table = self.table(application_name)
        if table.name in tables:
            table.drop(conn)
        create(conn, table.metadata, [table])  # with its indexes, in one round trip
        t = tracking_table.c
        conn.execute(
            sa.delete(tracking_table).where(
                t.application_name == application_name, t.config == self.config
            )
        )
        tracked = Tracked(0, TimeOrder(), uuid.uuid4().hex)
        conn.execute(
            sa.insert(tracking_table).values(
                application_name=application_name,
                config=self.config,
                notification_id=0,
                times_in_order=True,
                latest_time=None,
                generation=tracked.generation,
                used_at=self._now(),
            )
        )
        self._used[application_name] = time.monotonic()
        self._drop_unused(conn, application_name)
        return tracked

    def _drop_unused(self, conn: Connection, application_name: str) -> None:
        """Drop the tables, and positions, of the configs neither among the
        :data:`CONFIGS_KEPT` used last (this one among them) nor used within
        :data:`IN_USE`. Housekeeping: a table this role may not drop (another
        role's), or that a read holds, is left, with a warning, and tried again
        when the next config comes."""
        t = tracking_table.c
        own = (application_name, self.config)
        rows = conn.execute(
            sa.select(t.application_name, t.config, t.used_at >= self._now(IN_USE)).order_by(
                t.used_at.desc()
            )
        ).all()
        tables = {changes_table_for(name, config).name: (name, config) for name, config, _ in rows}
        # The others, the most recently used first, and whether within IN_USE.
        others = [
            ((name, config), in_use) for name, config, in_use in rows if (name, config) != own
        ]
        kept = {own, *(key for key, _ in others[: CONFIGS_KEPT - 1])}
        kept.update(key for key, in_use in others if in_use)
        if self.store.dialect == "postgresql":
            # A drop waits for the reads of that table: not for long, while
            # holding the audit's lock every other process's rows wait for.
            conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{milliseconds(DROP_WAIT)}ms'")
        for name in sa.inspect(conn).get_table_names():
            if not ANY_CHANGES_TABLE.fullmatch(name) or tables.get(name) in kept:
                continue
            try:
                with conn.begin_nested():
                    sa.Table(name, sa.MetaData()).drop(conn)
            except sa.exc.DBAPIError as error:
                message = first_line(str(error.orig))
                log.warning("audit table %s of a config no longer in use left: %s", name, message)
                if name in tables:
                    kept.add(tables[name])
        for key in set(tables.values()) - kept:
            conn.execute(
                sa.delete(tracking_table).where(t.application_name == key[0], t.config == key[1])
            )

    def _now(self, ago: timedelta = timedelta(0)) -> sa.ColumnElement[Any]:
        """Now, less ``ago``, as ``used_at`` keeps it: naive UTC, on the
        database's clock, one for every node (on their own, a node an hour
        behind would see its own table as unused)."""
        seconds = int(ago.total_seconds())
        if self.store.dialect == "sqlite":
            return sa.func.strftime("%Y-%m-%d %H:%M:%f", "now", f"-{seconds} seconds")
        return sa.func.timezone("UTC", sa.func.now()) - sa.literal_column(
            f"interval '{seconds} seconds'"
        )

    def _still_used(self, application_name: str) -> None:
        """Say that this process still uses its table, every :data:`USED_EVERY`
        at most: a process that only reads writes nothing else. Skipped when
        it cannot be written (the next read tries again)."""
        if time.monotonic() - self._used.get(application_name, 0.0) < USED_EVERY:
            return
        t = tracking_table.c
        try:
            with self.store.locked("catalog_es.audit", wait=0.1) as conn:
                conn.execute(
                    sa.update(tracking_table)
                    .where(t.application_name == application_name, t.config == self.config)
                    .values(used_at=self._now())
                )
        except (StorageBusy, sa.exc.DBAPIError) as error:
            # The read was answered: what it could not write is said by the next write.
            log.debug("audit table's use not recorded: %s", error)
            return
        self._used[application_name] = time.monotonic()

    def analyze(self, application_name: str) -> None:
        """Refresh the planner's statistics; skipped when they cannot be (the
        database busy, the table made anew or dropped since the catch-up), as
        they only make queries faster (the next large catch-up tries again)."""
        try:
            with self.store.locked("catalog_es.audit") as conn:
                conn.execute(sa.text(f"ANALYZE {self.table(application_name).name}"))
        except (StorageBusy, sa.exc.DBAPIError) as error:
            log.debug("audit table not analyzed: %s", error)

    def record(
        self,
        rows: Sequence[dict[str, Any]],
        tracking: Tracking,
        times: TimeOrder,
        generation: str,
        log_hash: str | None,
        wait: float | None = None,
    ) -> None:
        """Rows and the position they bring the view up to, with the log's
        hash there as they were built (``log_hash``), in the table of
        ``generation``, in one transaction, one process at a time. Another
        process may have written some of them since: the same rows, as the
        replay is the same, so only those past its position are written. If it
        made the table anew, or dropped it as no longer in use, the view is no
        longer the one these rows follow (:class:`ViewMoved`). ``wait``: for
        the lock, as ``SQLRecorder.write``'s."""
        application_name = tracking.application_name
        with self.store.locked("catalog_es.audit", wait) as conn:
            tracked = self._tracked(conn, application_name)
            if tracked is None:
                raise ViewMoved(
                    "the audit rows of this declared config were dropped meanwhile, "
                    "as no longer in use"
                )
            if tracked.generation != generation:
                raise ViewMoved("the audit tables were rebuilt by another process meanwhile")
            if tracked.position >= tracking.notification_id:
                return
            conn.execute(
                sa.insert(self.table(application_name)),
                [row for row in rows if row["revision"] > tracked.position],
            )
            self._track(conn, tracking, times, log_hash)

    def insert_tracking(self, tracking: Tracking) -> None:
        """The position alone, which vouches for no log: the next catch-up
        makes the rows again. One at or past it already is refused (IntegrityError)."""
        with self.store.locked("catalog_es.audit") as conn:
            tracked = self._tracked(conn, tracking.application_name)
            if tracked is None:
                tracked = self._make(conn, tracking.application_name)
            if tracked.position >= tracking.notification_id:
                raise sa.exc.IntegrityError(
                    "INSERT INTO audit tracking",
                    (tracking.application_name, tracking.notification_id),
                    ValueError(f"position {tracked.position} is recorded already"),
                )
            self._track(conn, tracking, None, None)

    def max_tracking_id(self, application_name: str) -> int | None:
        with self.engine.connect() as conn:
            tracked = self._tracked(conn, application_name)
        return (tracked.position or None) if tracked is not None else None

    def changes(
        self,
        filters: Filters,
        application_name: str,
        position: int,
        generation: str,
        into: ValuesReader[Answer],
        max_bytes: int | None = None,
    ) -> Answer:
        """The stored views of the matching rows, each a row as JSON, read by
        ``into``, from the table at ``position`` or past it in ``generation``:
        not from one another process is making anew (:class:`ViewMoved`).
        ``max_bytes``: what the views may hold in all (:func:`within_bytes`)."""
        # Paused, and the rows made and freed inside: otherwise the young
        # collections walk them, as they are fetched and as the pause ends,
        # and promote them to the oldest generation, which brings on a full
        # collection every few answers (about 20 ms here, on reads of 25-30 ms).
        with self._reading(application_name) as conn, collector_paused():
            tracked = self._tracked(conn, application_name)
            if tracked is None or tracked.generation != generation or tracked.position < position:
                raise ViewMoved("the audit tables are being rebuilt by another process")
            views = self._matching(conn, filters, application_name, tracked, into, max_bytes)
        self._still_used(application_name)
        return views

    def current_changes(
        self,
        filters: Filters,
        application_name: str,
        into: ValuesReader[Answer],
        max_bytes: int | None = None,
    ) -> Answer | None:
        """:meth:`changes`, when the table is at the head of the log in the
        read, and the log still holds there what the rows were built from;
        ``None`` otherwise: a catch-up is due (it tells which)."""
        try:
            with self._reading(application_name) as conn, collector_paused():  # as in changes()
                tracked = self._tracked(conn, application_name)
                if tracked is None:
                    return None
                kept = self.store.kept(conn, tracked.position)
                if kept.last != tracked.position or stored_hash(kept.hash) != tracked.log_hash:
                    return None
                views = self._matching(conn, filters, application_name, tracked, into, max_bytes)
        except ViewMoved:
            return None
        self._still_used(application_name)
        return views

    @contextmanager
    def _reading(self, application_name: str) -> Iterator[Connection]:
        """A read of this config's table; :class:`ViewMoved` when it is missing.
        On PostgreSQL the table is locked first, before the read's snapshot is
        taken: a table dropped and made again after the snapshot, under the
        same name, would show the read none of its rows, and its tracking row
        the old position. Locked, it is not dropped until the read ends. A
        SQLite read is one snapshot, tables and all. The lock is waited for as
        long as a write's (a drop stalled midway holds it until the server ends
        its session), and then the read is refused as busy."""
        name = self.table(application_name).name
        with self.store.read() as conn:
            if self.store.dialect == "postgresql":
                try:
                    conn.exec_driver_sql(
                        f"SET LOCAL lock_timeout = '{milliseconds(self.store.lock_wait)}ms';"
                        f' LOCK TABLE "{name}" IN ACCESS SHARE MODE'
                    )
                    there = True
                except sa.exc.DBAPIError as error:
                    state = getattr(error.orig, "sqlstate", None)
                    if state == "55P03":
                        raise StorageBusy(
                            f"the audit table stayed locked by another process for "
                            f"{self.store.lock_wait:g} s; nothing was read, try again"
                        ) from None
                    if state != "42P01":
                        raise
                    there = False
            else:
                there = sa.inspect(conn).has_table(name)
            if not there:
                self._missing.add(application_name)
                raise ViewMoved("the audit table of this config is missing: it will be made again")
            yield conn

    def _matching(
        self,
        conn: Connection,
        filters: Filters,
        application_name: str,
        tracked: Tracked,
        into: ValuesReader[Answer],
        max_bytes: int | None,
    ) -> Answer:
        table = self.table(application_name)
        within = self._revisions(conn, filters, table, tracked)
        order = (table.c.revision, table.c.place)
        if max_bytes is not None:
            sizes = select_values(
                self.store, conn, table, order, filters, table.c.size, listed, within
            )
            within_bytes(sizes, max_bytes)
        return select_values(self.store, conn, table, order, filters, table.c.view, into, within)

    def _revisions(
        self, conn: Connection, filters: Filters, table: sa.Table, tracked: Tracked
    ) -> tuple[int | None, int | None]:
        """The time bounds as revision bounds, while times are in order: the
        first revision at or after ``since`` and the last before ``until``.
        Otherwise an upper bound far back with a limit walks back from the
        end of the table through every row after it."""
        since, until = filters.get("since"), filters.get("until")
        if since is None and until is None:
            return None, None
        if not tracked.times.in_order:
            return None, None
        c = table.c
        nothing = (1, 0)
        first = last = None
        if since is not None:
            first = conn.execute(
                sa.select(c.revision)
                .where(c.time >= stored_time(since))
                .order_by(c.time, c.revision)
                .limit(1)
            ).scalar()
            if first is None:
                return nothing
        if until is not None:
            last = conn.execute(
                sa.select(c.revision)
                .where(c.time < stored_time(until))
                .order_by(c.time.desc(), c.revision.desc())
                .limit(1)
            ).scalar()
            if last is None:
                return nothing
        return first, last

    def mentions(self, application_name: str, model: str) -> bool:
        """Whether any stored event is about ``model``."""
        c = self.table(application_name).c
        query = sa.select(c.revision).where(c.model == filter_text(model)).limit(1)
        with self._reading(application_name) as conn:
            return conn.execute(query).first() is not None

    def _tracked(self, conn: Connection, application_name: str) -> Tracked | None:
        row = conn.execute(self._tracking_select(application_name)).first()
        return None if row is None else _as_tracked(row)

    def _tracked_to(self, conn: Connection, application_name: str) -> tuple[Tracked, int] | None:
        """:meth:`_tracked`, and the revision of the last row (0 for none), in
        the same statement: one seek of the key more. The table must be there."""
        revision = self.table(application_name).c.revision
        end = sa.select(sa.func.max(revision)).scalar_subquery()
        row = conn.execute(self._tracking_select(application_name).add_columns(end)).first()
        return None if row is None else (_as_tracked(row), int(row[5] or 0))

    def _tracking_select(self, application_name: str) -> sa.Select[Any]:
        t = tracking_table.c
        return sa.select(
            t.notification_id, t.times_in_order, t.latest_time, t.generation, t.log_hash
        ).where(t.application_name == application_name, t.config == self.config)

    def _track(
        self,
        conn: Connection,
        tracking: Tracking,
        times: TimeOrder | None,
        log_hash: str | None,
    ) -> None:
        """Write the position and the log's hash there, and the time order
        with them when known (a position written without it claims no order)."""
        t = tracking_table.c
        conn.execute(
            sa.update(tracking_table)
            .where(t.application_name == tracking.application_name, t.config == self.config)
            .values(
                notification_id=tracking.notification_id,
                log_hash=log_hash,
                times_in_order=times is not None and times.in_order,
                latest_time=times.latest if times is not None else None,
                used_at=self._now(),
            )
        )
        self._used[tracking.application_name] = time.monotonic()


# -- the projection ----------------------------------------------------------------


def _declaration_at(conn: Connection, revision: int) -> Configuration.Declared | None:
    """The last config record at or before ``revision`` that can be read, as
    a replay up to it leaves :attr:`AuditProjection.declared_then`: one that
    cannot be read is passed over (a replay skips it), for the one before."""
    return next(snapshots.readable_configs(conn, revision), None)


class Unreadable(msgspec.Struct, frozen=True):
    """A stored record that could not be decoded: the audit shows it, with why."""

    model: str
    event: str
    error: str


def read_record(topic: str, state: bytes) -> DomainEvent | Unreadable:
    try:
        return decode_event(topic, state)
    except UndecodableEvent as error:
        return Unreadable(model=model_of_state(state), event=topic_name(topic), error=str(error))


def _own_row(event: DomainEvent) -> dict[str, Any]:
    """The row of a stored event that reads, as :meth:`AuditProjection._stage`
    takes it: its model and type as ``log --json`` has them (a config
    record's model null; the filter column's is "")."""
    return {
        "time": stored_time(event.timestamp),
        "actor": event.by,
        "model": event.model if isinstance(event, Model.Event) else None,
        "event": event_name(event),
        "class_version": event.class_version,
        "reason": event.reason,
        "rollback_to": event.rollback_to,
        "fields": event_fields(event),
    }


class AuditProjection(Projection[AuditView]):
    """Turns each stored event into an audit row. Rows are staged by
    :meth:`process_event` and written, with the position they cover, by
    :meth:`flush`; events the view holds already are replayed into the
    catalog only (it is what ``before`` is read from), never written again."""

    name = "audit"
    # Every stored event: the audit shows even those this code cannot read.
    topics: tuple[str, ...] = ()

    def __init__(self, view: AuditView, declared: DeclaredConfig) -> None:
        super().__init__(view)
        self.declared = declared
        self.lock = threading.RLock()
        # While catching up: what is left of the bounded wait for the write lock.
        self._wait: float | None = None
        self._restart()

    def _restart(self) -> None:
        self.catalog = self._new_catalog()
        self._taken_out: list[tuple[Skipped, ModelSpec]] = []  # by the event replayed
        self.recorded = 0  # the position of the view: rows up to here are written
        self._staged: list[dict[str, Any]] = []
        self._staged_bytes = 0  # the size of their views
        self._tracking: Tracking | None = None
        # The log's hash at the staged position, read in the transaction the
        # rows were replayed in: set as they are written, kept with them if not.
        self._log_hash: str | None = None
        self.times = TimeOrder()  # of the rows written and staged
        self.generation = ""  # of the tables the rows follow
        # The last config record: what the next one changes.
        self.declared_then: Configuration.Declared | None = None
        # Where the write of the config record replayed ends, read ahead in
        # the log: the record is the first event of its write, so a read at
        # its own revision is of the state before it.
        self._record_write_end = 0

    def _new_catalog(self) -> Catalog:
        catalog = self.declared.new_catalog()
        catalog.taken_out = lambda skip, spec: self._taken_out.append((skip, spec))
        return catalog

    def _from_snapshot(self, conn: Connection) -> None:
        """Start the catalog again from the newest snapshot at or before the
        view's position, when that is well past where the catalog is: what
        ``before`` is read from is then the same, for far less replay."""
        if self.recorded - self.catalog.revision < SNAPSHOT_AFTER:
            return
        catalog = self._new_catalog()
        with collector_paused(lasting=True):
            restored = snapshots.restore(
                conn, catalog, self.declared.fingerprint, upto=self.recorded
            )
        if restored and catalog.revision > self.catalog.revision:
            self.catalog = catalog
            self.declared_then = _declaration_at(conn, catalog.revision)

    # -- driving -----------------------------------------------------------------

    def catch_up(self, recorder: SQLRecorder, application_name: str) -> None:
        """Bring the view up to the head of the log. Another process catching
        up at the same time makes one of them go on from the other's rows.
        Catching up writes under a lock another process may hold: queries
        queued behind one waiting for it are each refused within the one
        bounded wait of their own start, not one wait after another."""
        held = holds(self.lock)
        try:
            self._wait = acquire_within(
                self.lock,
                recorder.lock_wait,
                f"the audit rows stayed locked for {recorder.lock_wait:g} s, another query "
                "bringing them up to the log; try again",
            )
            self._catch_up_racing(recorder, application_name)
        finally:
            # Let go down to what this thread held, and again should an
            # interrupt land as it does (see Models._write). The wait is the
            # holder's: one refused the lock leaves it alone (review).
            try:
                if holds(self.lock) > held:
                    self._wait = None
                release_to(self.lock, held)
            except KeyboardInterrupt:
                release_to(self.lock, held)
                raise

    def answer(
        self,
        recorder: SQLRecorder,
        application_name: str,
        filters: Filters,
        into: ValuesReader[Answer],
        max_bytes: int | None = None,
    ) -> Answer:
        """The views of the rows matching ``filters`` once caught up, read by
        ``into``: read again after catching up again if another process
        rebuilt the tables between the catch-up and the read (found before
        any view is read). Tables already at the head are read at once:
        queries at the same moment would otherwise each wait for the lock in
        turn, to find nothing to catch up (four of forty were refused).
        ``max_bytes``: what the views may hold in all (:func:`within_bytes`)."""
        views = self.view.current_changes(filters, application_name, into, max_bytes)
        if views is not None:
            return views
        for _ in range(RETRIES - 1):
            self.catch_up(recorder, application_name)
            try:
                return self._changes(application_name, filters, into, max_bytes)
            except ViewMoved:
                continue
        self.catch_up(recorder, application_name)
        return self._changes(application_name, filters, into, max_bytes)

    def _changes(
        self,
        application_name: str,
        filters: Filters,
        into: ValuesReader[Answer],
        max_bytes: int | None,
    ) -> Answer:
        """The matching rows of the table this process caught up."""
        return self.view.changes(
            filters, application_name, self.recorded, self.generation, into, max_bytes
        )

    def rebuild(self, recorder: SQLRecorder, application_name: str) -> None:
        """Drop the tables and replay the whole log into them again."""
        with self.lock:
            self.view.reset(application_name)
            self._restart()
            self._catch_up_racing(recorder, application_name)

    def _catch_up_racing(self, recorder: SQLRecorder, application_name: str) -> None:
        for attempt in range(RETRIES):
            try:
                self._catch_up(recorder, application_name)
                return
            except (sa.exc.IntegrityError, ViewMoved):
                # Another process wrote first: :meth:`_catch_up` goes on from
                # what it wrote, or from the start if it rebuilt the tables.
                if attempt == RETRIES - 1:
                    raise
            except StorageBusy:
                raise  # nothing written, nothing lost: the staged rows wait for the next try
            except BaseException:
                self._restart()  # the catalog may have moved past what was staged
                raise

    def _catch_up(self, recorder: SQLRecorder, application_name: str) -> None:
        tracked = self.view.resume_from(application_name)
        with collector_paused(), recorder.read() as conn:
            # Checked in the transaction the rows are replayed in, so that
            # what they follow on from is what they were built from.
            kept = recorder.kept(conn, tracked.position)
            stale = unvouched(tracked, kept)
            if stale is not None:
                tracked = self.view.remake(application_name, tracked, stale)
            if tracked.position < self.recorded or (
                self.generation and tracked.generation != self.generation
            ):
                self._restart()  # the table was made anew behind this process's back
            elif self._tracking is not None and self._log_hash != stored_hash(
                recorder.kept(conn, self._tracking.notification_id).hash
            ):
                self._restart()  # the rows left staged follow events the log no longer holds
            if not self._staged:
                # Nothing of this process's waits to be written: go on from the
                # view's position (the catalog is not past it).
                self.recorded, self.times, self.generation = (
                    tracked.position,
                    tracked.times,
                    tracked.generation,
                )
            # Rows, not revisions: a config record writes one for each model it changed.
            written = 0
            self._from_snapshot(conn)
            if kept.last - self.catalog.revision >= TOLD_FROM:
                # Once after an upgrade (a new layout) or a rebuild: a query
                # that takes a minute should not look hung.
                log.warning(
                    "making the audit's rows from %s events of the log, once (about a minute"
                    " a million)",
                    f"{kept.last - self.catalog.revision:,}",
                )
            # Every event past the position stages a row, so the last one read
            # is the staged position; none read, the staged rows' hash holds.
            log_hash = self._log_hash
            for page in recorder.scan_hashed(conn, after=self.catalog.revision):
                for revision, topic, state, log_hash in page:
                    record = read_record(topic, state)
                    if (
                        type(record) is Unreadable
                        and not record.model
                        and revision > self.recorded  # else its row is written
                    ):
                        record = self._filed_under(record, recorder, conn, revision)
                    elif type(record) is Configuration.Declared and revision > self.recorded:
                        self._record_write_end = pointintime.write_end(conn, revision)
                    self.process_event(record, Tracking(application_name, revision))
                    if len(self._staged) >= BATCH_SIZE or self._staged_bytes >= BATCH_BYTES:
                        written += self.flush(stored_hash(log_hash))
            written += self.flush(stored_hash(log_hash))
        if written >= ANALYZE_AFTER:
            self.view.analyze(application_name)

    def _filed_under(
        self, record: Unreadable, recorder: SQLRecorder, conn: Connection, revision: int
    ) -> Unreadable:
        """``record``, whose bytes do not say its model, as its stream's: the
        model's history shows it, as ``log --model`` does (it was left out)."""
        stream = recorder.originator_of(conn, revision)
        name = self.catalog.name_of(stream) if stream is not None else None
        return record if name is None else msgspec.structs.replace(record, model=name)

    def flush(self, log_hash: str | None) -> int:
        """Write the staged rows and the position they reach, together, with
        ``log_hash``, the log's hash there as the replay read it; the number
        of rows written."""
        if self._tracking is None:
            return 0
        written = len(self._staged)
        self._log_hash = log_hash
        self.view.record(
            self._staged, self._tracking, self.times, self.generation, self._log_hash, self._wait
        )
        self._wait = None  # what is left of the wait was for the first rows, queued
        self.recorded = self._tracking.notification_id
        self._staged = []
        self._staged_bytes = 0
        self._tracking = None
        return written

    # -- processing --------------------------------------------------------------

    @singledispatchmethod
    def process_event(self, domain_event: Any, tracking: Tracking) -> None:
        raise TypeError(f"the audit cannot process a {type(domain_event).__name__}")

    @process_event.register
    def model_event(self, event: Model.Event, tracking: Tracking) -> None:
        revision = tracking.notification_id
        before = self.catalog.get(event.model)
        self._taken_out.clear()
        outcome = self.catalog.apply(event, revision)
        if revision <= self.recorded:
            return
        after = self.catalog.get(event.model)
        row = _own_row(event)
        self._stage(tracking, row, before, after, outcome)
        # The models a removal took out of force with it, each in a row of its
        # own: their history ended here, though no event of theirs says so.
        for place, (skip, spec) in enumerate(self._taken_out, start=1):
            self._stage(tracking, {**row, "model": skip.model}, spec, None, skip, place)

    @process_event.register
    def declaration(self, event: Configuration.Declared, tracking: Tracking) -> None:
        """A record of the declared config: who ran which config, from when,
        and what it changed of the one recorded before it (the first, all it
        declares), in its row and in a row of each model it changed."""
        revision = tracking.notification_id
        self.catalog.apply(event, revision)
        before, self.declared_then = self.declared_then, event
        if revision <= self.recorded:
            return  # its rows are written: the layers are compared for rows alone
        row = _own_row(event)
        changes = field_changes(_declared_layer(before), _declared_layer(event))
        ends = self._record_write_end
        self._stage(tracking, row, None, None, None, changes=changes, write_end=ends)
        # Each model whose declared definition it changed, in a row of its
        # own after the record's: the model's history (an indexed read of its
        # name) shows when the config declared it, changed it and dropped it.
        was, now = _declared_models(before), _declared_models(event)
        changed = (name for name in {**was, **now} if was.get(name) != now.get(name))
        fields = {"fingerprint": event.fingerprint}
        for place, name in enumerate(changed, start=1):
            old, new = was.get(name), now.get(name)
            kind = DECLARED if old is None else UNDECLARED if new is None else REDECLARED
            own = {**row, "model": name, "event": kind, "fields": fields}
            self._stage(tracking, own, old, new, None, place, write_end=ends)

    @process_event.register
    def unreadable(self, record: Unreadable, tracking: Tracking) -> None:
        revision = tracking.notification_id
        if record.event == CONFIG_DECLARED:
            # No model's: ``model`` null, as log --json shows the record.
            skipped = self.catalog.skip_declaration(revision, record.error)
            model = None
        else:
            skipped = self.catalog.skip(revision, record.model, record.event, record.error)
            model = record.model
        if revision <= self.recorded:
            return
        definition = self.catalog.get(record.model)
        self._stage(
            tracking,
            {"model": model, "event": record.event, "fields": {}},
            definition,
            definition,
            skipped,
        )

    def _stage(
        self,
        tracking: Tracking,
        row: dict[str, Any],
        before: ModelSpec | None,
        after: ModelSpec | None,
        skipped: Skipped | None,
        place: int = 0,
        changes: list[dict[str, Any]] | None = None,
        write_end: int | None = None,
    ) -> None:
        """Stage a row of one stored event: the columns queries filter on, and
        its view, the ``log --json`` line of the event plus what it did to the
        definition in force (``changes``: to the declared layer, a config
        record's). ``place``: 0 for the event's own model, 1 on for each model
        it took out of force with it, or whose declared definition it changed.
        ``write_end``: where the event's write ends, for a config record's rows."""
        old, new = _definition(before), _definition(after)
        time, actor = row.get("time"), row.get("actor")
        view = {
            "revision": tracking.notification_id,
            "time": utc_text(time) if time is not None else None,
            "by": actor,
            "reason": row.get("reason"),
            "model": row["model"],
            "event": row["event"],
            "class_version": row.get("class_version"),
            "fields": row["fields"],
            "rollback_to": row.get("rollback_to"),
            **({} if write_end is None else {"write_end": write_end}),
            "skipped": skipped.reason if skipped is not None else None,
            "changes": field_changes(old or {}, new or {}) if changes is None else changes,
            "before": old,
            "after": new,
        }
        self.times.see(time)
        self._staged.append(
            {
                "revision": tracking.notification_id,
                "place": place,
                "time": time,
                "actor": filter_text(actor),
                "model": filter_text(row["model"] or ""),
                "event": filter_text(row["event"]),
                "size": len(encoded := msgspec.json.encode(view)),
                "view": encoded.decode(),
            }
        )
        self._staged_bytes += len(encoded)
        self._tracking = tracking
