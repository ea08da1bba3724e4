"""The log on SQLAlchemy Core: SQLite file by default, PostgreSQL for several nodes.

A recorder of our own rather than eventsourcing-sqlalchemy's ORM one, behind
eventsourcing's recorder interfaces, for two reasons: commands must read the
head, decide and append inside one write transaction (``write()``), and replay
must scan large pages of rows without building an ORM object per event.

Revisions are the ``revision`` column: assigned inside the write lock
(``BEGIN IMMEDIATE`` on SQLite, ``LOCK TABLE`` on PostgreSQL), so they
increase in commit order and a reader can never see a later revision before
an earlier one commits.

Every event also gets its link in the hash chain (:mod:`catalog_es.chain`),
computed in the same transaction from the head kept in ``catalog_head``.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import re
import select
import sqlite3
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, NamedTuple, Protocol
from urllib.parse import quote, unquote, urlsplit
from uuid import UUID

import sqlalchemy as sa
from eventsourcing.persistence import (
    AggregateRecorder,
    ApplicationRecorder,
    InfrastructureFactory,
    Notification,
    ProcessRecorder,
    StoredEvent,
    Subscription,
    Tracking,
    TrackingRecorder,
)
from eventsourcing.utils import Environment
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from catalog_es.chain import (
    GENESIS,
    ChainHead,
    ChainRow,
    DamagedHead,
    UnwritableHead,
    link,
    stored_head,
)
from catalog_es.errors import (
    SHOWN_LENGTH,
    ConfigError,
    DamagedLog,
    LogRewritten,
    NoLogYet,
    StorageBusy,
    UpgradeFailed,
    first_line,
    missing_folder,
    shown,
)
from catalog_es.values import MAX_REVISION

DEFAULT_URL = "sqlite:///catalog.db"
# 0.2.0's NOTIFY channel for new events, one for the whole database. Its
# followers wait for it and nothing else (they never look by themselves), so
# every write notifies it too, until no 0.2.0 node or watch is left: a
# release after 0.3.0 drops it.
CHANNEL_OF_0_2 = "catalog_events"
# How long a writer waits for another to let go of the database before the
# command is refused with a clear error rather than "database is locked".
LOCK_WAIT_SECONDS = 10.0
LOCK_WAIT_ENV = "CATALOG_ES_LOCK_WAIT"
# The longest SQLite's busy handler waits at a time for another process's
# lock (the write lock, a file not yet WAL): it sleeps in C, where no signal
# handler runs, so a Ctrl-C or SIGTERM acts only as a wait returns. The lock
# wait is waited out in slices this long.
LOCK_SLICE_SECONDS = 0.1
# How long a PostgreSQL write may sit idle in its transaction, the log's lock
# held, before the server ends its session: a node stopped mid-write (a paused
# VM, SIGSTOP, a stuck process) held it for as long as it stayed stopped, and
# every other node's writes were refused. Deciding 100,000 changes takes 2 s.
WRITE_IDLE_SECONDS = 60.0
WRITE_IDLE_ENV = "CATALOG_ES_WRITE_IDLE"
# Rows per round trip when scanning the log.
PAGE_SIZE = 10_000

log = logging.getLogger("catalog_es")

# What an older release's insert into a log brought over is refused by.
WRITERS_UPGRADED = "catalog_events_written_by_catalog_es_0_2_or_later"

metadata = sa.MetaData()
BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

events_table = sa.Table(
    "catalog_events",
    metadata,
    # The appender numbers the revisions itself, after both the head and the
    # last stored row, so none is reused even after the last row is deleted
    # (which verify must be able to notice). On SQLite AUTOINCREMENT promised
    # the same at the cost of a sqlite_sequence page in every command; logs
    # made with it keep it, and its sequence is read too (_last_taken); on
    # PostgreSQL the column's sequence, which older releases numbered from, is
    # read and moved on with every write.
    sa.Column("revision", BIGINT, primary_key=True, autoincrement=True),
    sa.Column("originator_id", sa.Uuid(), nullable=False),
    sa.Column("originator_version", BIGINT, nullable=False),
    sa.Column("topic", sa.Text(), nullable=False),
    sa.Column("state", sa.LargeBinary(), nullable=False),
    # sha256 hex of the previous event's hash and this event (catalog_es.chain).
    sa.Column("hash", sa.String(64), nullable=False),
    # The revision of the stream's event before this one, 0 for its first: a
    # stream is read back along these (stream_walk). An index on the
    # stream instead took an entry per event at a random place in it, so a
    # batch of a thousand changes dirtied a page per change, more as the log
    # grew (31 ms of SQLite's time per batch at a million events, 7 without).
    # Required, so that a release from before it cannot append unseen by
    # catalog_streams: its insert is refused, by a name that says why.
    sa.Column("stream_previous", BIGINT),
    sa.CheckConstraint("stream_previous IS NOT NULL", name=WRITERS_UPGRADED),
)

# Each stream's last version and the revision of its event, written with the
# events: what the next version follows (a write checks the one it followed
# is still there), and where reading the stream back starts.
streams_table = sa.Table(
    "catalog_streams",
    metadata,
    sa.Column("originator_id", sa.Uuid(), primary_key=True),
    sa.Column("version", BIGINT, nullable=False),
    sa.Column("revision", BIGINT, nullable=False),
)

# The last revision and its hash, kept apart from the events so that deleting
# the last events is noticed too. One row, written with the events it covers.
head_table = sa.Table(
    "catalog_head",
    metadata,
    sa.Column("id", sa.Integer(), sa.CheckConstraint("id = 1"), primary_key=True),
    sa.Column("revision", BIGINT, nullable=False),
    sa.Column("hash", sa.String(64), nullable=False),
)

# Commands that were refused: who tried what, and why. Not events: they have
# no revision and never change the catalog.
refusals_table = sa.Table(
    "catalog_refusals",
    metadata,
    sa.Column("id", BIGINT, primary_key=True, autoincrement=True),
    sa.Column("time", sa.DateTime(), nullable=False),  # UTC
    sa.Column("actor", sa.Text(), nullable=False),
    sa.Column("model", sa.Text(), nullable=False),
    sa.Column("event", sa.String(64), nullable=False),
    sa.Column("refusal", sa.Text(), nullable=False),
    sa.Column("reason", sa.Text(), nullable=False),
    sa.Column("fields", sa.JSON(), nullable=False),
    sa.Index("catalog_refusals_time", "time"),
    sqlite_autoincrement=True,
)

tracking_table = sa.Table(
    "catalog_tracking",
    metadata,
    sa.Column("application_name", sa.String(64), primary_key=True),
    sa.Column("notification_id", BIGINT, nullable=False),
)


# The columns of the log's table before its events named their stream's last.
_UNLINKED_COLUMNS = {"revision", "originator_id", "originator_version", "topic", "state", "hash"}
# The log's columns that eventsourcing's own stored events have none of:
# another application of the library named Catalog keeps its events in a
# table named as the log's, with each of the others.
_LOG_OWN_COLUMNS = {"revision", "hash", "stream_previous"}


def _unlinked(columns: Sequence[str]) -> bool:
    """Whether the log's table, of these ``columns``, is 0.1.0's, unlinked
    (no ``stream_previous``), though every table of today's is there: one
    made beside it by a release that did not bring it over (an operator's
    column on it stopped that)."""
    return set(columns) >= _UNLINKED_COLUMNS and "stream_previous" not in columns


# What the objects that could stand where a table of the catalog is made
# are, by the kind each database gives them (SQLite keeps a view's and an
# index's names with the tables'; PostgreSQL every relation's).
_NOT_TABLES = {
    "view": "a view",
    "index": "an index",
    "v": "a view",
    "m": "a materialized view",
    "i": "an index",
    "I": "an index",
    "S": "a sequence",
    "c": "a composite type",
    "t": "a TOAST table",
}

# On PostgreSQL a table's name is its row type's too: the types of no
# relation (an enum, a domain) named ``names`` in the schema a table is made in
# (quoted: to_regnamespace reads an identifier, and 'Team-B' is none unquoted).
_TYPES_IN_THE_WAY = (
    "SELECT typname, ' in schema ' || typnamespace::regnamespace FROM pg_type"
    " WHERE typname = ANY(%(names)s) AND typrelid = 0"
    " AND typnamespace = to_regnamespace(quote_ident(current_schema()))"
)


class TablesFound(NamedTuple):
    """What :func:`tables_found` found."""

    # Each table found, by its name in lower case, and its schema on
    # PostgreSQL (empty on SQLite).
    tables: dict[str, str]
    # The columns of the log's table, in their order, when it is among them
    # (on SQLite in lower case: its column names are the same in any case,
    # so a log's REVISION is its revision, one was refused as no log).
    log_columns: list[str] | None


def tables_found(conn: Connection, names: Sequence[str]) -> TablesFound:
    """Which of the tables ``names`` this connection's queries find, with the
    log's columns, in one statement on PostgreSQL: a start there asked table
    by table, a round trip each, then the columns, one more. Refused when
    another kind of object takes one's name (a view): a read then made the
    other tables and failed on it, in a line that named neither it nor what
    to do (last session's notes). The columns are read from the database's
    own catalog: SQLAlchemy's reflection of the table on PostgreSQL cost
    every start 13 ms (it reads types, defaults, comments...)."""
    if conn.dialect.name == "sqlite":
        found = conn.exec_driver_sql(
            # SQLite's names are the same in any case: CATALOG_EVENTS is the table.
            "SELECT name, type, '', '', NULL FROM sqlite_master"
            " WHERE type IN ('table', 'view', 'index')"
            f" AND name COLLATE NOCASE IN ({', '.join('?' * len(names))})",
            tuple(names),
        )
    else:
        found = conn.exec_driver_sql(
            "SELECT c.relname, c.relkind::text, ' in schema ' || c.relnamespace::regnamespace,"
            " n.nspname, CASE WHEN c.relname = 'catalog_events' THEN ARRAY(SELECT attname::text"
            " FROM pg_attribute WHERE attrelid = c.oid AND attnum > 0 AND NOT attisdropped"
            " ORDER BY attnum) END FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.relname = ANY(%(names)s) AND pg_table_is_visible(c.oid)",
            {"names": list(names)},
        )
    tables: dict[str, str] = {}
    log_columns = None
    for name, kind, where, schema, columns in found:
        if kind in _NOT_TABLES:
            raise _in_the_way(conn, _NOT_TABLES[kind], name, where)
        # A table (on PostgreSQL, partitioned or foreign too).
        tables[name.lower()] = schema
        log_columns = columns if columns is not None else log_columns
    if conn.dialect.name == "sqlite" and events_table.name in tables:
        # Asked apart: SQLite's statements cost no round trip.
        found = conn.exec_driver_sql("SELECT lower(name) FROM pragma_table_info('catalog_events')")
        log_columns = list(found.scalars())
    return TablesFound(tables, log_columns)


def create(conn: Connection, tables: sa.MetaData, missing: Sequence[sa.Table]) -> None:
    """``tables.create_all(conn, tables=missing, checkfirst=False)``: on
    PostgreSQL the same statements, compiled as it compiles them and in its
    order, sent in one round trip (psycopg runs several at once) rather
    than one each (a new log's tables and index took seven)."""
    if conn.dialect.name != "postgresql":
        tables.create_all(conn, tables=missing, checkfirst=False)
        return
    statements: list[str] = []

    def keep(ddl: sa.schema.ExecutableDDLElement, *_: Any, **__: Any) -> None:
        statements.append(str(ddl.compile(dialect=conn.dialect)))

    compiling = sa.create_mock_engine(conn.engine.url, keep)
    tables.create_all(compiling, tables=missing, checkfirst=False)
    if statements:  # none when every table is there (a log only to bring over)
        conn.exec_driver_sql(";\n".join(statements))


def _another_store(conn: Connection) -> str:
    """What else ``--db`` can point at, said for an operator."""
    return "database or schema" if conn.dialect.name == "postgresql" else "file"


def _in_the_way(conn: Connection, what: str, name: str, where: str) -> DamagedLog:
    """The refusal of ``what`` (an object that is no table) named ``name``,
    ``where`` it is, taking the place of the catalog's table of that name."""
    return DamagedLog(
        f"{what} named {name}{where} stands where the catalog keeps its table"
        f" of that name: nothing was read or made; point --db at another"
        f" {_another_store(conn)}, or rename it (it may hold another application's data)"
    )


def _check_log_columns(conn: Connection, columns: Sequence[str]) -> None:
    """Refused when the table named as the log's, of these ``columns``, lacks
    one every layout of the log has had (an operator's own table, a SQLite
    virtual table, a PostgreSQL foreign table): the other tables were made,
    then a read failed on `no such column: catalog_events.revision`, naming
    neither the table nor what to do. Asked only when the table is there.
    One with a column only the log has, and as many of the log's columns as
    it lacks, is taken for a log damaged by hand: the advice to drop it
    would destroy its history. Without one, it is no log, though it has
    every other (another eventsourcing application's events)."""
    missing = [c.name for c in events_table.columns if c.name in _UNLINKED_COLUMNS - set(columns)]
    if not missing:
        return
    where = ""
    if conn.dialect.name == "postgresql":
        where = conn.exec_driver_sql(
            "SELECT ' in schema ' || relnamespace::regnamespace FROM pg_class"
            " WHERE oid = to_regclass('catalog_events')"
        ).scalar_one()
    kept = [c.name for c in events_table.columns if c.name in columns]
    if _LOG_OWN_COLUMNS.intersection(kept) and len(kept) >= len(missing):
        raise DamagedLog(
            f"the log's table {events_table.name}{where} lacks columns every release has made"
            f" it with ({', '.join(missing)}): it was altered by hand; nothing was read or made;"
            " do not drop it, it may hold the catalog's history: restore the log from a"
            f" backup, or point --db at another {_another_store(conn)}"
        )
    lacking = f"{where}, without the log's columns ({', '.join(missing)}),"
    raise _in_the_way(conn, "a table", events_table.name, lacking)


def _check_split(conn: Connection, found: Mapping[str, str]) -> None:
    """Where the log's tables ``found`` are in more than one schema of the
    PostgreSQL search path (each is read and written where it is found
    first, a table earlier on the path shadowing the log's own), refused
    when one of them lacks the columns of the log's table of its name
    (another application's: every command then failed on a missing
    column), else warned of. Not refused then: 0.2.0 made a table missing
    beside a log (catalog_streams, as it brought 0.1.0's over) first on the
    path, and a log so split is read and written whole by every node on it."""
    by_schema: dict[str, list[str]] = {}  # in the order of their tables' names
    for name, schema in sorted(found.items()):
        by_schema.setdefault(schema, []).append(name)
    if len(by_schema) < 2:
        return
    where = "; ".join(
        f"{', '.join(names)} in schema {schema}" for schema, names in by_schema.items()
    )
    split = f"the log's tables are found in more than one schema of the search path ({where})"
    advice = "or fix the search path (the URL's options, or the role's)"
    columns = conn.exec_driver_sql(
        "SELECT relname, ARRAY(SELECT attname::text FROM pg_attribute WHERE attrelid = c.oid"
        " AND attnum > 0 AND NOT attisdropped) FROM pg_class c"
        " WHERE relname = ANY(%(names)s) AND pg_table_is_visible(c.oid)",
        {"names": list(found)},
    )
    for name, has in columns:
        # The log's table may be 0.1.0's, brought over at this start.
        needs = _UNLINKED_COLUMNS if name == events_table.name else metadata.tables[name].c.keys()
        lacking = [column for column in needs if column not in has]
        if lacking:
            raise DamagedLog(
                f"{split}, and {name} in schema {found[name]} is not the log's (it lacks"
                f" {', '.join(sorted(lacking))}): nothing was read or made; move or drop that"
                f" table (it may hold another application's data), {advice}"
            )
    log.warning(
        "%s: each is read and written where it is found first, which may be a stray table"
        " an older release made first on the path; move the log's into one schema (ALTER"
        " TABLE ... SET SCHEMA) and drop the stray one, %s",
        split,
        advice,
    )


def _log_tables_found(conn: Connection, names: Sequence[str]) -> TablesFound:
    """:func:`tables_found`, refused where the log's table is no log, or a
    damaged one (:func:`_check_log_columns`)."""
    found = tables_found(conn, names)
    if found.log_columns is not None:
        _check_log_columns(conn, found.log_columns)
    return found


# The revision column's sequence on PostgreSQL (NULL if it has none, and the
# functions given it answer NULL): older releases numbered from it, and it is
# kept past every revision written, so none is handed out twice.
_REVISION_SEQUENCE = "pg_get_serial_sequence('catalog_events', 'revision')::regclass"


def channel_of(schema: str) -> str:
    """The NOTIFY channel of the log in ``schema``: a catalog kept in another
    schema of the database wakes none of its followers. A channel is an
    identifier of at most 63 bytes, a schema's name any of them: a digest."""
    return f"catalog_events_{hashlib.sha256(schema.encode()).hexdigest()[:32]}"


# The schema the log's table is found in along the search path, or else the
# one tables are made in (empty when the path names no schema there is), and
# whether the table was found.
_LOG_SCHEMA = (
    "SELECT coalesce(n.nspname, current_schema(), ''), n.nspname IS NOT NULL"
    " FROM (SELECT 1) AS one LEFT JOIN pg_class c ON c.oid = to_regclass('catalog_events')"
    " LEFT JOIN pg_namespace n ON n.oid = c.relnamespace"
)

# The schemas PostgreSQL makes for each session's temporary tables, and drops
# them from as it ends (a name no schema made by hand may have: pg_ is reserved).
_TEMPORARY_SCHEMA = "pg_temp_"

# The events' columns on PostgreSQL, as append lays each row out.
_EVENT_TYPES = ("bigint", "uuid", "bigint", "text", "bytea", "text", "bigint")


def _postgresql_rows(
    types: Sequence[str], rows: Sequence[Sequence[Any]], named: str
) -> tuple[str, list[Any]]:
    """``rows`` as a FROM item called ``named``, and its parameters, in
    binary: a few as VALUES of plain values (an array a column cost a
    command 0.1 ms, in the driver and the server), many as one array a
    column through unnest (VALUES of a thousand rows took longer to plan
    than to run, and as text a thousand states were escaped into a literal)."""
    if len(rows) <= 8:
        row = "(" + ", ".join(f"%b::{t}" for t in types) + ")"
        return f"(VALUES {', '.join([row] * len(rows))}) AS {named}", [v for r in rows for v in r]
    arrays = ", ".join(f"%b::{t}[]" for t in types)
    return f"unnest({arrays}) AS {named}", [list(c) for c in zip(*rows, strict=True)]


def stream_walk(originator_id: UUID, after: int = 0) -> sa.CTE:
    """A stream's events after revision ``after``, newest first, as a CTE of
    ``revision``, ``topic``, ``originator_version`` and ``stream_previous``:
    from its last (catalog_streams), along each event's ``stream_previous``.
    Each step goes back, to the event of the same stream a version before: a
    link edited by hand ends the walk rather than loop, skip or stray into
    another model's events, and a read that needs the whole walk tells so
    (:func:`check_walk_end`). Both databases walk it a row a step, so a
    query that stops at its first match (``LIMIT 1``) reads no further back
    than that."""
    e, s = events_table.c, streams_table.c
    walk = (
        sa.select(e.revision, e.topic, e.originator_version, e.stream_previous)
        .join_from(events_table, streams_table, e.revision == s.revision)
        .where(s.originator_id == originator_id, e.originator_id == originator_id)
        .where(e.revision > after)
        .cte("stream", recursive=True)
    )
    step = events_table.alias("step").c
    return walk.union_all(
        sa.select(step.revision, step.topic, step.originator_version, step.stream_previous).where(
            step.revision == walk.c.stream_previous,
            walk.c.stream_previous > after,
            walk.c.stream_previous < walk.c.revision,
            step.originator_id == originator_id,
            step.originator_version == walk.c.originator_version - 1,
        )
    )


class _Position(FunctionElement[int]):
    """Where bytes (a bound value) first are in a column of bytes, from 1; 0
    where they are not. Each database spells it its own way."""

    type = sa.Integer()
    inherit_cache = True


@compiles(_Position)
def _instr(element: _Position, compiler: SQLCompiler, **kw: Any) -> str:
    column, needle = element.clauses
    return f"instr({compiler.process(column, **kw)}, {compiler.process(needle, **kw)})"


@compiles(_Position, "postgresql")
def _position(element: _Position, compiler: SQLCompiler, **kw: Any) -> str:
    column, needle = element.clauses
    return f"position({compiler.process(needle, **kw)} IN {compiler.process(column, **kw)})"


def holds_bytes(needles: Sequence[bytes]) -> sa.ColumnElement[bool]:
    """Events whose stored form holds one of ``needles`` as bytes: tried by
    the database, so that the rows that do not are never sent (a query on
    what only the encoded state has, the actor, reads no column of its own)."""
    state = events_table.c.state
    return sa.or_(*(_Position(state, sa.literal(n, sa.LargeBinary())) > 0 for n in needles))


def check_walk(conn: Connection, originator_id: UUID, whose: str, after: int = 0) -> None:
    """:func:`check_walk_end` of the walk of ``originator_id``'s stream after
    ``after``: for a read that found nothing along it (a walk cut short
    finds nothing too), at the cost of walking it once more."""
    stream = stream_walk(originator_id, after)
    oldest = conn.execute(
        sa.select(stream.c.revision, stream.c.originator_version, stream.c.stream_previous)
        .order_by(stream.c.revision)
        .limit(1)
    ).first()
    check_walk_end(conn, originator_id, oldest, whose, after)


def check_walk_end(
    conn: Connection,
    originator_id: UUID,
    oldest: Sequence[Any] | None,
    whose: str,
    after: int = 0,
) -> None:
    """Refuse a read of a stream whose walk (:func:`stream_walk`) after
    ``after`` ended short: its ``oldest`` row (revision, version, link) is
    not the stream's first event, nor linked to its event before at or
    before ``after``. A link edited by hand would otherwise answer part of
    the history as all of it; ``verify`` names the edit."""
    if oldest is None:
        return
    revision, version, previous = oldest
    if previous == 0 and version == 1:
        return
    if 0 < previous <= after and version > 1:
        e = events_table.c
        before = conn.execute(
            sa.select(e.originator_id, e.originator_version).where(e.revision == previous)
        ).first()
        if before is not None and tuple(before) == (originator_id, version - 1):
            return
    raise DamagedLog(
        f"{whose}: its event at revision {revision} links to revision {previous} as the one"
        " before it (stream_previous): edited by hand, so its history would be read cut"
        " short (catalog-es verify tells what else was edited)"
    )


SYNC_ENV = "CATALOG_ES_SQLITE_SYNC"
WAL_CHECKPOINT_PAGES = 4000
# What the -wal file is cut back to once a checkpoint has emptied it: a
# reader holding a transaction open keeps every write since in it (18 MB for
# 26,000 commands, a hostile test), and SQLite otherwise keeps the file at
# its largest until the last connection closes. Twice what a checkpoint
# leaves, so that the usual run never pays for cutting and growing it.
WAL_SIZE_LIMIT_BYTES = 2 * WAL_CHECKPOINT_PAGES * 4096
WRITER_CACHE_KIB = 16 * 1024


class Standing(NamedTuple):
    """Where the log stands: the head of the hash chain (``None`` before the
    first event); the last revision taken, the head's or a later one the rows
    took (a row put past the head by hand), after which SQLite numbers the
    next, so a deleted last revision is not handed out again, nor a row past
    the head collided with; and the last version of each stream asked about,
    by its id's ``int``."""

    head: ChainHead | None
    last: int
    versions: dict[int, int]
    # The revision of the log's last event (0 when it has none): below the
    # head's, the events after it were deleted.
    ends: int


class Appendable(Protocol):
    """What :meth:`SQLRecorder.append` reads of an event: eventsourcing's
    ``StoredEvent``, or the mapper's lighter ``StoredRecord``."""

    @property
    def originator_id(self) -> UUID | str: ...

    @property
    def originator_version(self) -> int: ...

    @property
    def topic(self) -> str: ...

    @property
    def state(self) -> bytes: ...


class Appended(NamedTuple):
    """What a write appended: its revisions, the chain's head after them, and
    the revision of each stream's last event, by its id's ``int``."""

    revisions: list[int]
    head: ChainHead
    last_revisions: dict[int, int]


class Kept(NamedTuple):
    """What the log holds of a revision, read in one statement: its last
    revision (0 when empty) and that event's hash, and the hash of the event
    at the revision asked about (``None`` when the log has none there). The
    hashes as stored, which a hand edit may have left of any type."""

    last: int
    last_hash: Any
    hash: Any

    @classmethod
    def of(cls, rows: Iterable[Sequence[Any]], revision: int) -> Kept:
        """From the rows (revision, hash, ...) of :data:`_KEPT` for ``revision``."""
        hashes = {row[0]: row[1] for row in rows}
        last = max(hashes, default=0)
        return cls(last=int(last), last_hash=hashes.get(last), hash=hashes.get(revision))


# What follows the SELECT of the columns of the event at the revision asked
# about and of the log's last (SQLRecorder.kept).
_KEPT = "FROM catalog_events WHERE revision IN (?, (SELECT max(revision) FROM catalog_events))"


class AnswerTooLarge(Exception):
    """The rows that match hold more than an answer may: none was read."""


def fitting(sizes: Iterable[int], max_bytes: int) -> int:
    """How many of the first of ``sizes`` come to no more than ``max_bytes``:
    one at least, whatever its size, so that a page of one reads anything the
    log holds."""
    count, total = 0, 0
    for size in sizes:
        total += size
        if count and total > max_bytes:
            break
        count += 1
    return count


def within_bytes(sizes: Sequence[int], max_bytes: int) -> None:
    """Refuse (:class:`AnswerTooLarge`) rows of these sizes, read before the
    rows themselves, that do not all fit ``max_bytes`` (:func:`fitting`):
    forty rows of large definitions made an answer of 183 MB, and ten
    thousand would take the server's memory."""
    if fitting(sizes, max_bytes) < len(sizes):
        raise AnswerTooLarge


def lock_wait_seconds() -> float:
    """The bounded wait for the write lock: ``CATALOG_ES_LOCK_WAIT`` seconds,
    else ``LOCK_WAIT_SECONDS``."""
    return _seconds(LOCK_WAIT_ENV, LOCK_WAIT_SECONDS)


def milliseconds(seconds: float) -> int:
    """A wait in whole milliseconds, as SQLite's busy timeout and PostgreSQL's
    settings take it: at least 1, as 0 means no bound to either."""
    return max(1, int(seconds * 1000))


def _seconds(variable: str, default: float) -> float:
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


def _into_wal(cursor: sqlite3.Cursor, wait: float) -> None:
    """WAL mode, which the file keeps once set. Setting it on a new file takes
    the file for itself, and SQLite answers "database is locked" at once,
    busy timeout or not, while other processes are opening it too (nodes
    starting together): so that is waited for here, as the write lock is. An
    attempt waits in SQLite's busy handler for a slice at most (the
    connection's busy timeout, ``LOCK_SLICE_SECONDS``): another program's
    writer holds off even a read of its file (not yet WAL), and one wait of
    ``wait`` there took a stop all of it to act. Then the connection's reads
    wait ``wait`` in one, as before."""
    deadline = time.monotonic() + wait
    delay = 0.001
    timeout = LOCK_SLICE_SECONDS
    while True:
        left = deadline - time.monotonic()
        if left < timeout:
            # An attempt waits in the busy handler only for what is left.
            timeout = left
            cursor.execute(f"PRAGMA busy_timeout = {milliseconds(left)}")
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError as error:
            left = deadline - time.monotonic()
            if "locked" not in str(error):
                raise
            if left <= 0:
                # A file another program made (not yet WAL): its writer holds
                # off readers too, until it is done.
                raise StorageBusy(
                    f"the database stayed locked by another process for {wait:g} s, "
                    "before it could be put in WAL mode; nothing was read or written, try again"
                ) from None
        time.sleep(min(delay, left))
        delay = min(2 * delay, 0.05)
    cursor.execute(f"PRAGMA busy_timeout = {milliseconds(wait)}")


# A stream's row in catalog_streams names its last event: the write it
# guards checks so, one seek each (the row edited by hand names another).
_STREAM_ENDS_THERE = (
    "EXISTS (SELECT 1 FROM catalog_events e WHERE e.revision = catalog_streams.revision"
    " AND e.originator_id = catalog_streams.originator_id"
    " AND e.originator_version = catalog_streams.version)"
)

# The log's columns, in the order append's rows and ChainRow's fields have them.
_EVENT_COLUMNS = "revision, originator_id, originator_version, topic, state, hash, stream_previous"

_ODD_DIGITS = "('1', '3', '5', '7', '9', 'b', 'd', 'f', 'B', 'D', 'F')"


def stream_parity(originator_id: UUID) -> int:
    """Whether a stream's id is odd: a split of the streams into two halves
    that SQL can make on the stored id and Python on the id itself."""
    return originator_id.int & 1


def sqlite_synchronous() -> str:
    """SQLite's ``synchronous`` setting for the log, from ``CATALOG_ES_SQLITE_SYNC``.
    FULL (the default): a command reported as written survives a power cut.
    NORMAL: it survives the process being killed, not the machine losing power.
    Set empty, it is unset, as the snapshot interval is: a setting of speed
    falls back to its default, where one saying which log, config or actor
    is refused (``bootstrap.from_env``)."""
    given = os.environ.get(SYNC_ENV, "")
    synchronous = given.strip().upper() or "FULL"
    if synchronous not in ("FULL", "NORMAL"):
        raise ConfigError(f"{SYNC_ENV} must be FULL or NORMAL, not {shown(given)}")
    return synchronous


def create_engine(url: str) -> Engine:
    """An engine with the settings the log relies on."""
    parsed = log_url(url)
    try:
        engine = _settled_engine(parsed)
    except (ValueError, TypeError) as error:
        # A setting in the URL's query the driver cannot read (?timeout=abc).
        told = shown_url(parsed)
        raise ConfigError(f"the database URL {told}: {first_line(str(error))}") from None
    _forgotten_by_children(engine)
    return engine


# The drivers the log is written through: the standard library's sqlite3, and
# psycopg 3 (which a bare postgresql:// means here; SQLAlchemy's default for
# it, psycopg2, is not installed).
_DRIVERS = {
    "sqlite": "sqlite",
    "sqlite+pysqlite": "sqlite",
    "postgresql": "postgresql+psycopg",
    "postgresql+psycopg": "postgresql+psycopg",
}


def shown_url(url: sa.URL, limit: int = SHOWN_LENGTH) -> str:
    """``url`` as a line quotes it, its password hidden."""
    return shown(url.render_as_string(hide_password=True), limit)


def url_where(url: sa.URL) -> str:
    """Where the database at ``url`` is, said for an operator: "at URL",
    whole as a deploy writes one (a schema's search_path and an application
    name made one 160 characters), where a refusal of a URL quotes less."""
    return f"at {shown_url(url, 512)}"


def log_url(url: str) -> sa.URL:
    """``url`` as a URL the log can be kept at, or one line saying why not."""
    usage = "give sqlite:///FILE or postgresql+psycopg://USER@HOST/DATABASE"
    try:
        parsed = sa.make_url(url)
        parsed.port  # noqa: B018  (parsed on first use: a port that is not a number)
    except (sa.exc.ArgumentError, ValueError):
        told = shown(re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url))  # no password
        raise ConfigError(f"the database URL {told} is not a URL: {usage}") from None
    told = shown_url(parsed)
    driver = _DRIVERS.get(parsed.drivername)
    if driver is None:
        raise ConfigError(
            f"the database URL {told}: the log is kept in SQLite, or in PostgreSQL "
            f"through psycopg; {usage}"
        )
    if driver == "sqlite" and in_memory(parsed):
        # Each connection would get a database of its own, gone when it closes:
        # a command would answer a revision that no later read can find.
        raise ConfigError(
            f"the database URL {told} names no file, and a database in memory "
            f"keeps nothing: {usage}"
        )
    if driver == "sqlite":
        # SQLite says "unable to open database file", naming neither.
        path = Path(_sqlite_file(parsed))
        missing = missing_folder(path.parent)
        if missing is not None:
            raise ConfigError(f"the database {path}: {path.parent}: {missing}")
    return parsed.set(drivername=driver)


def _sqlite_file(url: sa.URL) -> str:
    """The file a SQLite URL names."""
    path = url.database or ""
    if url.query.get("uri"):  # file:PATH, %-escaped, a host or not
        path = unquote(urlsplit(path).path)
    return path


def _forgotten_by_children(engine: Engine) -> None:
    """A forked child must not use its parent's connections: a PostgreSQL
    session's socket, a SQLite file's locks (which the child does not hold,
    though its copy of the connection thinks it does). Its copy of the pool
    lets them go, unclosed, as it starts, and it connects afresh."""
    reference = weakref.ref(engine)

    def forget() -> None:
        inherited = reference()
        if inherited is not None:
            inherited.dispose(close=False)

    os.register_at_fork(after_in_child=forget)


def in_memory(url: sa.URL) -> bool:
    """Whether a SQLite URL names a database in memory, in any of its forms."""
    database = url.database or ""
    return (
        database in ("", ":memory:")
        or database.startswith("file::memory:")
        or "memory" in str(url.query.get("mode", ""))
    )


class FileNotTheLog(sqlite3.OperationalError):
    """The SQLite file at the log's path is not the one this process opened:
    gone, emptied, or replaced during a write. Raised as the driver's error,
    so every caller tells it as a database that cannot be used (one line);
    ``lasting`` while an operator must put the file back."""

    def __init__(self, message: str, *, lasting: bool, replaced: bool = False) -> None:
        super().__init__(message)
        self.lasting = lasting
        # Another file at the path than the one opened: a follower ends.
        self.replaced = replaced


# The attribute SQLiteFile.name_in gives a driver's error: where its file is.
_FILE_OF_ERROR = "catalog_es_where"


# A SQLite file's header, and its bytes 18-19 (the file format's write and
# read versions) in WAL mode.
_SQLITE_HEADER_BYTES = 100
_WAL_VERSIONS = b"\x02\x02"


class SQLiteFile:
    """The file a SQLite log is kept in. A connection keeps the file it
    opened whatever then happens at the path: renamed over or removed, its
    writes went on being acknowledged into a file no one reads again, and
    truncated, into a file SQLite no longer makes sense of (hostile test).
    So this process uses the first file it opened there alone, and each
    read and each write checks that the path still names it: one stat,
    1-2 µs. Once the file is made, connections open it only if it is there
    (``mode=rw``): a new empty log at the path would be served as the log."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # The file (device, inode) this process first opened at the path.
        self.opened: tuple[int, int] | None = None

    @property
    def where(self) -> str:
        """Where the file is, said for an operator: "at PATH", in full."""
        return f"at {self.path}"

    def name_in(self, error: BaseException) -> None:
        """Have ``error``, the driver's, name this file when it is told
        (:func:`database_unusable`): SQLite's "unable to open database file"
        or "file is not a database" named none."""
        setattr(error, _FILE_OF_ERROR, self.where)

    def now(self) -> tuple[int, int]:
        """The file at the path (device, inode); refused in one line when it
        is gone, or when it is empty after this process made it: no database
        in WAL mode, which the log is, is ever 0 bytes."""
        try:
            found = self.path.stat()
        except FileNotFoundError:
            raise FileNotTheLog(
                f"the database file {self.path} is gone (removed, or renamed away, while this "
                "process ran): nothing was read or written; put it back",
                lasting=True,
            ) from None
        except OSError as error:
            raise FileNotTheLog(
                f"the database file {self.path}: {error.strerror}",
                lasting=isinstance(error, PermissionError),
            ) from None
        if found.st_size == 0 and self.opened is not None:
            raise FileNotTheLog(
                f"the database file {self.path} is empty (truncated while this process ran?): "
                "it holds no log, nothing was read or written; restore it",
                lasting=True,
            )
        return found.st_dev, found.st_ino

    def looked_at(self, names: Sequence[str]) -> TablesFound | None:
        """Which of the tables ``names`` the path holds (:func:`_log_tables_found`,
        refused as it refuses), told without a connection of the log's where
        one would change the file: no file, an empty one (``touch typo.db``),
        which it would make a database in, or another app's database, which
        it would turn to WAL mode (a setting kept in the file), looked at
        read-only: even one it refuses (a table of its own in the log's
        place). None for one in WAL mode already (every log is), which a
        connection leaves as it was, and one that cannot be looked at: left
        for the connection."""
        try:
            with self.path.open("rb") as file:
                header = file.read(_SQLITE_HEADER_BYTES)
        except FileNotFoundError:
            return TablesFound({}, None)
        except OSError:
            return None
        if not header:
            return TablesFound({}, None)
        if header[18:20] == _WAL_VERSIONS:
            return None
        uri = f"{self.path.as_uri()}?mode=ro"
        engine = sa.create_engine(
            "sqlite://",
            # Not waited on: a file another writer holds is the connection's
            # to wait for, and to say so.
            creator=lambda: sqlite3.connect(uri, uri=True, timeout=0),
            poolclass=sa.pool.NullPool,
        )
        try:
            with engine.connect() as conn:
                return _log_tables_found(conn, names)
        except sa.exc.DBAPIError:
            return None
        finally:
            engine.dispose()

    def check(self) -> None:
        """Refused in one line unless the path still names the file this
        process opened, as :meth:`now` refuses. A file renamed over is not
        read, nor opened: the -wal and -shm files beside it, named by the
        path, are the old file's, and a connection opened on the new one read
        and wrote the two as one, corrupting it (review)."""
        if self.now() != self.opened:
            raise FileNotTheLog(
                f"the database file {self.path} was replaced while this process ran (renamed"
                " over): the -wal and -shm files beside it are the old file's, and reading on"
                " would mix the two; stop every process using it, and remove those two before"
                " starting them again",
                lasting=True,
                replaced=True,
            )

    def existing_only(self, cargs: list[Any], cparams: dict[str, Any]) -> None:
        """The driver's arguments to connect, made to open the file only if it
        is there (SQLite's ``mode=rw``), unless the URL names a mode itself."""
        target = str(cargs[0])
        if not cparams.get("uri"):
            cargs[0] = f"file:{quote(target)}?mode=rw"
            cparams["uri"] = True
        elif target.startswith("file:") and "mode=" not in urlsplit(target).query:
            # A URI names its options; a plain name given as one (``?uri=true``
            # on a path) would take them as part of the file's name.
            cargs[0] = f"{target}{'&' if '?' in target else '?'}mode=rw"


# Each SQLite engine's file, for its recorder's held writer to check.
_SQLITE_FILES: weakref.WeakKeyDictionary[Engine, SQLiteFile] = weakref.WeakKeyDictionary()


def sqlite_file_of(engine: Engine) -> SQLiteFile | None:
    """The file a SQLite engine made here keeps its log in; ``None`` otherwise."""
    return _SQLITE_FILES.get(engine)


def empty_log_engine() -> Engine:
    """An engine on a SQLite database in memory: for an empty log that this
    process alone reads and nothing outlives, a SIGKILL included (the command
    line's answer on a path with no log; a file for it, in a temporary
    folder, stayed behind a process killed). One connection, shared by the
    writer the log's tables are made with and every read, on any thread:
    each connection would open a database of its own. So no write can begin
    inside a read, as a replay's snapshot of a revision past 0 does: an
    empty log, only read, has none to make."""
    engine = sa.create_engine(
        "sqlite://", poolclass=sa.pool.StaticPool, connect_args={"check_same_thread": False}
    )
    _settle_sqlite(engine, None, lock_wait_seconds())
    return engine


def _settled_engine(url: sa.URL) -> Engine:
    if url.drivername == "sqlite":
        wait = lock_wait_seconds()
        # Each connection's first wait, for WAL mode, goes in slices (_into_wal).
        engine = sa.create_engine(url, connect_args={"timeout": LOCK_SLICE_SECONDS})
        file = _SQLITE_FILES[engine] = SQLiteFile(Path(_sqlite_file(url)).absolute())

        @sa.event.listens_for(engine, "do_connect")
        def _opening(
            _dialect: Any, _record: Any, cargs: list[Any], cparams: dict[str, Any]
        ) -> None:
            if file.opened is not None:
                file.check()  # gone, emptied or replaced: said as such, and not opened
                file.existing_only(cargs, cparams)

        @sa.event.listens_for(engine, "handle_error")
        def _failed(context: sa.engine.ExceptionContext) -> None:
            # Its opening's too (a folder, a file not SQLite's).
            file.name_in(context.original_exception)

        _settle_sqlite(engine, file, wait)
        return engine
    engine = postgresql_engine(url)
    _asked_when_idle(engine)
    _check_connection_settings(engine, url)
    _unprepared_behind_a_pooler(engine)
    return engine


def _settle_sqlite(engine: Engine, file: SQLiteFile | None, wait: float) -> None:
    """The settings and transactions the log relies on, on a SQLite engine:
    ``file``, the one it keeps the log in (none in memory); ``wait``, its
    lock wait."""
    synchronous = sqlite_synchronous()

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        # Let us issue BEGIN ourselves (pysqlite's own is deferred and late).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        _into_wal(cursor, wait)
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        # A batch of a thousand changes rewrites most pages of catalog_streams
        # (and, before it, of an index with an entry per event): at SQLite's
        # default (a checkpoint once the WAL holds 1,000 pages) a run of
        # batches paid a checkpoint every few, copying and syncing the same
        # pages into the file each time. At 4,000 pages (16 MB) they are
        # copied fewer times a run.
        cursor.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
        cursor.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")
        cursor.close()
        if file is not None and file.opened is None:
            # Stat after the open: a rename between the two has the new
            # file taken for this process's (a window of microseconds).
            file.opened = file.now()

    @sa.event.listens_for(engine, "begin")
    def _begin(connection: Connection) -> None:
        driver = connection.connection.driver_connection
        if connection.info.get(_OPEN_WRITE):
            if _in_transaction(driver):
                # A statement made through SQLAlchemy inside a write begun on
                # the driver (:func:`_on_the_driver`) joins that transaction.
                return
            # A second transaction, which the block's end would commit.
            raise sa.exc.InvalidRequestError(
                "this write was rolled back inside its block: end the block"
            )
        options = connection.get_execution_options()
        # On the driver: through exec_driver_sql this statement cost a
        # command more than its insert did.
        if options.get("catalog_write", False):
            _begin_write(driver, options.get(_LOCK_WAIT_OPTION, wait))
        else:
            _driver(driver, "BEGIN")

    @sa.event.listens_for(engine, "commit")
    def _commit(connection: Connection) -> None:
        if connection.info.get(_OPEN_WRITE):
            # Committing part of a write would let go of the lock inside it.
            raise sa.exc.InvalidRequestError(
                "a write is committed when its block ends, not inside it"
            )


def postgresql_engine(url: sa.URL, **options: Any) -> Engine:
    """An engine on the PostgreSQL database at ``url``, with ``options``. No
    column is an hstore: SQLAlchemy looking the type up cost each engine's
    first connection three round trips more."""
    return sa.create_engine(url, use_native_hstore=False, **options)


# SQLSTATEs of a prepared statement that is another session's, or that this
# one's was dropped from: a pooler in transaction mode (PgBouncer before
# 1.21, or with max_prepared_statements = 0) hands each transaction whichever
# server session is free, while psycopg prepares a statement run five times
# on a connection, by a name of its own on the session it ran on then. This
# code prepares nothing by name itself, so either means such a pooler.
_PREPARED_ELSEWHERE = ("26000", "42P05")
# The engines (processes) that met one: their connections prepare nothing.
_UNPREPARED: weakref.WeakKeyDictionary[Engine, bool] = weakref.WeakKeyDictionary()
# Each engine's driver connections, open or in the pool, for when it does.
_CONNECTIONS: weakref.WeakKeyDictionary[Engine, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()
# Held to add a connection and to turn preparing off: a WeakSet added to by
# another thread's new connection while it is gone through raised "Set
# changed size during iteration" (review), and that connection's statement
# failed as an internal error.
_PREPARING = threading.Lock()


# In a pooled connection's record: when it was last handed back (time.monotonic()).
_RETURNED_AT = "catalog_es.returned_at"


def _asked_when_idle(engine: Engine) -> None:
    """A connection ``engine``'s pool hands out is asked first whether it is
    still connected, as the held writer is, only when it sat idle in the pool
    more than :data:`IDLE_ASKED_SECONDS` or the server sent it something
    meanwhile (:func:`_may_be_gone`); a connection made for this checkout is
    not. SQLAlchemy's ``pool_pre_ping`` asked every time: a round trip more
    each read, two each command-line write. One found gone has the pool's
    other connections, older than it, made again (a restart or a failover
    ended them all), and is replaced at once, the caller told nothing."""

    @sa.event.listens_for(engine, "checkin")
    def _returned(_dbapi_connection: Any, record: Any) -> None:
        record.info[_RETURNED_AT] = time.monotonic()

    @sa.event.listens_for(engine, "checkout")
    def _lent(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        returned = record.info.get(_RETURNED_AT)
        if returned is None or not _may_be_gone(dbapi_connection, returned):
            return  # made for this checkout (its record's info starts empty), or in use just now
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as error:
            # Gone, or behind a pooler in transaction mode: made again (unprepared), unseen.
            gone = engine.dialect.is_disconnect(error, dbapi_connection, None)
            if gone or prepared_elsewhere(engine, error):
                raise sa.exc.InvalidatePoolError(first_line(str(error))) from error
            raise


def _unprepared_behind_a_pooler(engine: Engine) -> None:
    """Once a statement of this engine meets a prepared statement of another
    session (:func:`prepared_elsewhere`), its connections, those in use, in
    the pool and made later, prepare none and use none they prepared.
    Noticed on a connection's check before use (:func:`_asked_when_idle`),
    that connection is made again and no one is told; otherwise the
    statement's error is an outage, retried."""
    connections: weakref.WeakSet[Any] = weakref.WeakSet()
    _CONNECTIONS[engine] = connections

    @sa.event.listens_for(engine, "connect")
    def _made(dbapi_connection: Any, _record: Any) -> None:
        with _PREPARING:
            connections.add(dbapi_connection)
            if engine in _UNPREPARED:
                dbapi_connection.prepare_threshold = None

    @sa.event.listens_for(engine, "handle_error")
    def _met(context: sa.engine.ExceptionContext) -> None:
        prepared_elsewhere(engine, context.original_exception)


def prepared_elsewhere(engine: Engine, error: BaseException) -> bool:
    """Whether ``error`` (the driver's) is a statement psycopg prepared meeting
    another session's, behind a pooler in transaction mode. The first one
    turns preparing off for ``engine``'s connections (said once)."""
    state: str | None = getattr(error, "sqlstate", None)
    if state not in _PREPARED_ELSEWHERE:
        return False
    with _PREPARING:
        first = engine not in _UNPREPARED
        _UNPREPARED[engine] = True
        # Those in use too: a statement they prepared is not used again (a
        # plain attribute, which psycopg reads as it runs each statement).
        for connection in _CONNECTIONS.get(engine, ()) if first else ():
            connection.prepare_threshold = None
    if first:
        log.warning(
            "the database's sessions are shared through a pooler in transaction mode"
            " (%s): statements are no longer prepared",
            first_line(str(error)),
        )
    return True


def _check_connection_settings(engine: Engine, url: sa.URL) -> None:
    """The settings a PostgreSQL URL gives, read as psycopg reads them to
    connect: it tells a setting libpq does not know (``?foo=``), or a
    ``connect_timeout`` that is not a number, as a programming error on each
    connect. Read here, either is the URL's mistake, told once; and so is one
    of psycopg's own options (``?autocommit=false`` turned autocommit on, and
    a write was no longer one transaction)."""
    # Here, not at the top: a process on SQLite does not load libpq.
    import psycopg
    from psycopg import conninfo

    own = inspect.signature(psycopg.Connection.connect).parameters
    for key in url.query:
        if key in own:
            raise ValueError(f"{key} is psycopg's own option, not a connection setting")
    args, kwargs = engine.dialect.create_connect_args(url)
    try:
        # What connect() takes for itself (the dialect's adapters) is no setting.
        settings = conninfo.conninfo_to_dict(
            conninfo.make_conninfo(*args, **{k: v for k, v in kwargs.items() if k not in own})
        )
    except psycopg.ProgrammingError as error:
        raise ValueError(str(error)) from None
    try:
        conninfo.timeout_from_conninfo(settings)
    except psycopg.ProgrammingError as error:
        if "connect_timeout" in settings:
            raise ValueError(str(error)) from None
        # Not the URL's: libpq's variable, read when the URL gives none.
        raise ConfigError(f"PGCONNECT_TIMEOUT: {error}") from None
    given = "the database URL" if settings.get("options") else "$PGOPTIONS"
    path = _options_search_path(str(settings.get("options") or os.environ.get("PGOPTIONS") or ""))
    if path is not None:
        _search_path_kept(engine, given, path)


def _options_search_path(options: str) -> str | None:
    """The search path libpq's ``options`` set, the last one given, read as
    the server reads them: words split at white space a backslash does not
    escape, a setting as ``-c name=value``, ``-cname=value`` or
    ``--name=value``, its name in any case and with ``-`` for ``_``."""
    words = [re.sub(r"\\(.)", r"\1", word) for word in re.findall(r"(?:\\.|\S)+", options)]
    path = None
    for word, following in pairwise([*words, ""]):
        if word == "-c":
            setting = following
        elif word.startswith(("-c", "--")):
            setting = word[2:]
        else:
            continue
        name, _, value = setting.partition("=")
        if name.replace("-", "_").lower() == "search_path":
            path = value
    return path


# The schemas a search path finds tables in, in its order: the ones that
# exist, past pg_catalog, which holds none of the log's, wherever it is named.
_SCHEMAS_FOUND = "array_remove(current_schemas(false), 'pg_catalog')"


def _search_path_kept(engine: Engine, given: str, path: str) -> None:
    """Each new connection of ``engine``, whose URL (or ``$PGOPTIONS``) sets
    the search path ``path`` that finds the log's schema, refused when its
    session's was not set so and finds other schemas: a connection pooler
    (PgBouncer) passes no ``options`` on, and told to ignore them
    (``ignore_startup_parameters = options``, as is done to get past its
    refusal of them) it drops them without a word. The node then used the
    log of another schema, the public one, as its own: it answered that
    catalog's revision and wrote into it (hostile test). A role whose own
    search path finds the same schemas is what the refusal asks for, and
    was refused too when the URL also gave it."""
    import psycopg

    @sa.event.listens_for(engine, "connect")
    def _kept(dbapi_connection: Any, _record: Any) -> None:
        # Asked in no transaction: one round trip, where psycopg's BEGIN and
        # the ROLLBACK after took two more, each new connection's. (A
        # connection this fails on is not used.)
        dbapi_connection.autocommit = True
        setting, source, found = dbapi_connection.execute(
            f"SELECT setting, source, {_SCHEMAS_FOUND} FROM pg_settings WHERE name = 'search_path'"
        ).fetchone()
        dbapi_connection.autocommit = False
        if source == "client":
            return
        # Rolled back: the path is set only for the time it takes to ask
        # which schemas it finds, and no transaction is left open.
        with (
            dbapi_connection.transaction(force_rollback=True),
            dbapi_connection.cursor() as cursor,
        ):
            cursor.execute("SELECT set_config('search_path', %s, true)", (path,))
            cursor.execute(f"SELECT {_SCHEMAS_FOUND}")
            (asked,) = cursor.fetchone()
        if asked != found:
            raise psycopg.errors.InvalidSchemaName(
                f"{given} sets the search path (options), but this session's is"
                f" {setting!r}, from its {source or 'default'}: a connection pooler dropped"
                " them; give each catalog's role its own (ALTER ROLE … SET"
                " search_path) or connect without the pooler"
            )


# Seconds a PostgreSQL connection (the held writer, or one in the pool) may
# sit idle before it is asked whether it is still connected (one round trip):
# a restart or a failover ends sessions at any moment, and the first write
# after it failed with a 503. Sooner, it is asked when the server sent it
# something while it was idle (:func:`_heard_from`).
IDLE_ASKED_SECONDS = 1.0


def _may_be_gone(driver: Any, used: float) -> bool:
    """Whether the PostgreSQL connection ``driver``, last used at ``used``
    (``time.monotonic()``), must be asked whether it is still connected
    before it is relied on (:data:`IDLE_ASKED_SECONDS`)."""
    return time.monotonic() - used > IDLE_ASKED_SECONDS or _heard_from(driver)


def _heard_from(driver: Any) -> bool:
    """Whether the server sent the PostgreSQL connection ``driver``, idle in
    no transaction, anything since its last statement: a server ending the
    session (a restart, a failover, ``pg_terminate_backend``) says so and
    closes it, which leaves its socket readable (one poll, no round trip). A
    node writing more often than once a second was not asked, and its next
    write failed with a 503 where the others' went through (hostile test)."""
    try:
        poll = select.poll()  # not select(): a server's sockets pass 1,024
        poll.register(driver.fileno(), select.POLLIN)
        return bool(poll.poll(0))
    except Exception:
        return True  # closed, or no socket to poll: asked, and let go if broken


def _begin_write(driver: Any, wait: float) -> None:
    """``BEGIN IMMEDIATE`` on the sqlite3 connection ``driver``, whose busy
    timeout is ``LOCK_SLICE_SECONDS``, waiting at most ``wait`` seconds for
    another process's write lock: a slice at a time, tried again from here, so
    that a stop is acted on between two (within 0.1 s, where one wait of
    ``wait`` took all of it). The last slice is cut to what is left of
    ``wait``, by the clock: SQLite counts the sleeps it asked for, which a
    signal cuts short. The refusal is the last attempt's "database is locked"."""
    deadline = time.monotonic() + wait
    timeout = LOCK_SLICE_SECONDS
    try:
        while True:
            left = deadline - time.monotonic()
            if left < timeout:
                timeout = left
                _driver(driver, f"PRAGMA busy_timeout = {milliseconds(left)}")
            try:
                _driver(driver, "BEGIN IMMEDIATE")
                return
            except sa.exc.OperationalError as error:
                if not _is_busy(error) or time.monotonic() >= deadline:
                    raise
    finally:
        if timeout < LOCK_SLICE_SECONDS:
            with suppress(sa.exc.SQLAlchemyError):  # the first error is the one to tell
                _driver(driver, f"PRAGMA busy_timeout = {milliseconds(LOCK_SLICE_SECONDS)}")


def _driver(driver: Any, statement: str) -> None:
    """``statement`` (BEGIN, COMMIT, ROLLBACK or a PRAGMA) on the sqlite3 connection
    itself. Its errors are wrapped as SQLAlchemy wraps them, with their own
    class: a busy database is waited for, then told; a broken connection is
    dropped by the writer."""
    try:
        driver.execute(statement)
    except sqlite3.Error as error:
        raise sa.exc.DBAPIError.instance(statement, None, error, sqlite3.Error) from None


# In a held writer's ``info`` while a write begun on its driver is open.
_OPEN_WRITE = "catalog_es.open_write"
# A SQLite connection's execution option: the seconds its write transactions
# wait for the lock (a command queued behind another in this process has
# less than the lock wait left).
_LOCK_WAIT_OPTION = "catalog_lock_wait"


def _in_transaction(driver: Any) -> bool:
    """Whether the sqlite3 connection is in a transaction; the error of a closed
    one wrapped as :func:`_driver` wraps them, so the writer lets it go."""
    try:
        return bool(driver.in_transaction)
    except sqlite3.Error as error:
        raise sa.exc.DBAPIError.instance("in_transaction", None, error, sqlite3.Error) from None


@contextmanager
def _on_the_driver(conn: Connection, wait: float) -> Iterator[None]:
    """A write transaction begun and ended on the driver of SQLite connection
    ``conn``, waiting ``wait`` seconds for the lock: SQLAlchemy's own, around
    the same two statements, cost a command 10 µs more (about 8% of one with
    the sync left to checkpoints). A statement made through SQLAlchemy inside
    joins it; ending it then is SQLAlchemy's. Whatever interrupts it, BEGIN
    and COMMIT included (a signal's exception lands just after a statement),
    rolls it back."""
    driver = conn.connection.driver_connection
    try:
        _begin_write(driver, wait)
        conn.info[_OPEN_WRITE] = True
        yield
        conn.info[_OPEN_WRITE] = False
        _end(conn, driver, commit=True)
    except BaseException:
        # Invalidated (an interrupt in a driver call), its transaction went
        # with its connection; touched, it would connect afresh, and the held
        # writer be kept without a writer's settings.
        if not conn.invalidated:
            with suppress(sa.exc.SQLAlchemyError):  # the first error is the one to tell
                conn.info[_OPEN_WRITE] = False
                _end(conn, driver, commit=False)
        raise


def _end(conn: Connection, driver: Any, *, commit: bool) -> None:
    if conn.in_transaction():
        if commit:
            conn.commit()
        else:
            conn.rollback()
    elif _in_transaction(driver):
        _driver(driver, "COMMIT" if commit else "ROLLBACK")


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


def _busy_timeout(conn: Connection, seconds: float) -> None:
    """How long SQLite's busy handler waits on ``conn`` for another writer."""
    _driver(conn.connection.driver_connection, f"PRAGMA busy_timeout = {milliseconds(seconds)}")


# SQLite's errors that mean the database itself cannot be used: not there,
# not SQLite's, or tables of the log's names that are not the log's. Of its
# result codes, these pass (a disk full or failing, memory, a file that
# could not be opened, which is also what running out of descriptors says);
# the others (not a database, corrupt, read-only, no such table) wait on an
# operator.
_SQLITE_UNUSABLE = {"OperationalError", "DatabaseError"}
_SQLITE_OUTAGES = {"BUSY", "LOCKED", "FULL", "IOERR", "NOMEM", "CANTOPEN"}
# What SQLite's words leave out. A database read while it could not be
# written leaves its -shm file so for every later writer (a hostile test:
# chmod 444, a read, chmod 644, and every write refused); a disk with no
# room for the -shm file says "disk I/O error" to reads and writes alike.
_SQLITE_HINTS = {
    "READONLY": " (the file, its folder, and its -wal and -shm files beside it must all be"
    " writable)",
    "IOERR": " (a full disk, or a failing one?)",
}
# PostgreSQL's, by SQLSTATE. Outages, which pass: no connection (class 08),
# out of resources (53), shut down, shutting down or not yet up
# (57P01-57P03: a restart or a failover ends sessions with these), a server
# that takes no writes (25006: a primary demoted in a failover), a session
# the server ended for sitting idle (25P03 in a transaction, as a write
# stopped midway is: CATALOG_ES_WRITE_IDLE; 57P05 outside one). Setup to
# mend, which does not: refused (28: who; 3D: no such database; 3F: no such
# schema, a search_path naming none; 42501: a role without the privileges
# the log needs) and tables of the log's names that are not the log's
# (42P01, 42703). A query cancelled or a lock not had (57014, 55P03) is
# busy, not unusable. An error with no state failed in the client: no
# server reached, or the connection lost.
_POSTGRESQL_OUTAGES = ("08", "53", "57P01", "57P02", "57P03", "57P05", "25006", "25P03")
# A statement psycopg prepared meeting another session's behind a pooler in
# transaction mode passes too: the process prepares none from then on
# (:func:`prepared_elsewhere`), and the statement, run again, is not refused.
# A commit's failures that leave its outcome unknown. SQLite: the sync of
# the -wal file, whose frames, the commit's included, are written by then (a
# recovery puts them back); a write of them that failed (a full disk) left no
# commit frame. PostgreSQL: the session lost (no SQLSTATE, or class 08), or
# ended by a shutdown or an administrator (57P01-57P03), while the server may
# have committed; any other SQLSTATE is the server's refusal, rolled back
# (25P03, the session ended idle in its transaction: no COMMIT reached it).
_SQLITE_SYNCS = {"SQLITE_IOERR_FSYNC", "SQLITE_IOERR_DIR_FSYNC"}
_POSTGRESQL_SESSION_LOST = ("08", "57P01", "57P02", "57P03")


def commit_may_have_stood(error: BaseException) -> bool:
    """Whether ``error``, raised by a write's commit once begun, leaves it
    unknown whether the write stands (rather than known rolled back)."""
    driver = error.orig if isinstance(error, sa.exc.DBAPIError) else error
    if isinstance(driver, sqlite3.Error):
        return getattr(driver, "sqlite_errorname", None) in _SQLITE_SYNCS
    if type(driver).__module__.split(".")[0] != "psycopg":
        return False
    state: str | None = getattr(driver, "sqlstate", None)
    return state is None or state.startswith(_POSTGRESQL_SESSION_LOST)


_POSTGRESQL_SETUP = ("28", "3D", "3F", "42501", "42P01", "42703")
_CLIENT_FAILURES = {"OperationalError", "InterfaceError", "DatabaseError"}
# A server that refuses a connection as it is made says why with FATAL and,
# through libpq, no SQLSTATE: setup (no such role or database, a password),
# unless it says it is starting, stopping, recovering or full. Its words are
# English unless the server is set otherwise: then taken for setup, as the
# CLI always told them.
_CONNECT_OUTAGES = (
    "starting up",
    "shutting down",
    "in recovery",
    "not yet accepting",
    "not accepting connections",
    "too many clients",
    "too many connections",
    "remaining connection slots",
    "administrator command",
)


class Unusable(NamedTuple):
    """Why the database cannot be used at all."""

    said: str  # what the driver said, its first line
    lasting: bool  # setup to mend, not an outage to wait out
    # "at FILE" on SQLite, whose words name no file (an operator with several
    # cannot tell which); PostgreSQL's name the server and database already.
    where: str = ""

    @property
    def told(self) -> str:
        """The line an operator is told (the CLI's error, the server's log)."""
        where = f" {self.where}" if self.where else ""
        return f"the database{where} could not be used: {self.said}"


def database_unusable(error: BaseException) -> Unusable | None:
    """Why, when ``error`` means the database cannot be used at all (rather
    than a statement went wrong): the CLI's one line, the HTTP API's 503 (or
    500, when it lasts) and a watch's waiting for the database all decide by
    this."""
    driver = error.orig if isinstance(error, sa.exc.DBAPIError) else error
    if isinstance(driver, FileNotTheLog):
        return Unusable(first_line(str(driver)), lasting=driver.lasting)
    kind = type(driver)
    package = kind.__module__.split(".")[0]
    said = first_line(str(driver))
    if package == "sqlite3":
        if kind.__name__ not in _SQLITE_UNUSABLE:
            return None
        code = (getattr(driver, "sqlite_errorname", None) or "").removeprefix("SQLITE_")
        hint = _SQLITE_HINTS.get(code.split("_")[0], "")
        lasting = code.split("_")[0] not in _SQLITE_OUTAGES
        return Unusable(said + hint, lasting, str(getattr(driver, _FILE_OF_ERROR, "")))
    if package != "psycopg":
        return None
    state: str | None = getattr(driver, "sqlstate", None)
    if state is None:
        if kind.__name__ not in _CLIENT_FAILURES:
            return None
        refused = "FATAL:" in said and not any(words in said for words in _CONNECT_OUTAGES)
        return Unusable(said, lasting=refused)
    if state.startswith(_POSTGRESQL_OUTAGES) or state in _PREPARED_ELSEWHERE:
        return Unusable(said, lasting=False)
    if state.startswith(_POSTGRESQL_SETUP):
        return Unusable(said, lasting=True)
    return None


def _is_busy(error: sa.exc.OperationalError) -> bool:
    text = str(error.orig).lower()
    return "database is locked" in text or "database is busy" in text or "lock timeout" in text


class SQLRecorder(ProcessRecorder):
    """Events, notifications and tracking positions in one database."""

    def __init__(
        self, engine: Engine, *, create_tables: bool = True, make_log: bool = True
    ) -> None:
        self.engine = engine
        # Whether the log's tables are made where there is no log; if not,
        # :class:`NoLogYet` is raised there, and nothing is made.
        self._make_log = make_log
        # Whether a read (``make_log`` false) found the log without its head
        # record's table: see :meth:`_to_make`.
        self._head_table_missing = False
        self.dialect = engine.dialect.name
        # The driver's errors, which statements made straight on it raise.
        self._dbapi_error: type[Exception] = engine.dialect.loaded_dbapi.Error
        self.lock_wait = lock_wait_seconds()
        self.write_idle = _seconds(WRITE_IDLE_ENV, WRITE_IDLE_SECONDS)
        # The connection writes go through, held between them (see _writer_connection).
        self._writer: Connection | None = None
        self._writer_pid = 0
        self._writer_used = 0.0
        self._writer_lock = threading.Lock()
        # The SQLite file, which the held writer must still have open (see SQLiteFile).
        self._file = sqlite_file_of(engine)
        # Whether SQLite keeps a sequence the log's revisions must stay past.
        self._sequence_kept: bool | None = None
        # The schema of the log's tables on PostgreSQL, once found (log_schema).
        self._log_schema: str | None = None
        # Where this recorder made the log's table, there being none ("at
        # FILE" on SQLite, a file new or empty; "in schema s of database d at
        # host" on PostgreSQL, none along the search path): a path, schema or
        # database mistaken starts a second, empty log, so a command says so.
        self.log_made: str | None = None
        # PostgreSQL's LISTEN connection, shared by this process's followers.
        self._listener: Listener | None = None
        self._listener_pid = 0
        self._listener_lock = threading.Lock()
        if create_tables:
            self.create_tables()

    @contextmanager
    def _writer_connection(self) -> Iterator[Connection]:
        """The connection for write transactions, held open between them:
        checking one out of the pool, with its events, cost a command more than
        its SQL did. One writer at a time in this process; a forked child opens
        its own (the parent's is not its to use); a database error other than
        a busy database drops it, in case it is broken, and the next write
        connects afresh."""
        with self._writer_lock:
            if self._writer_pid != os.getpid():
                self._writer = None  # inherited through a fork: not ours to touch
            if self._writer is not None and self._writer.invalidated:
                # SQLAlchemy invalidates it when an interrupt lands in a driver
                # call; its next use would connect afresh without a writer's
                # settings (below): autocommit on PostgreSQL, the cache on SQLite.
                self._discard_writer()
            if self._writer is not None:
                # Kept if refused, idle: let go of, it could be the file's last
                # connection, whose close copies the WAL into the file it
                # opened, and an emptied one grew again, unreadable (retest).
                self._on_the_file()
            if (
                self._writer is not None
                and self.dialect != "sqlite"
                and _may_be_gone(self._writer.connection.driver_connection, self._writer_used)
            ):
                # Idle, or told something: the server may have closed it. Ask
                # before relying on it.
                try:
                    self._writer.exec_driver_sql("SELECT 1")
                    self._writer.rollback()
                except sa.exc.SQLAlchemyError:
                    self._discard_writer()
            if self._writer is None:
                self._writer = self.engine.connect()
                self._writer.execution_options(catalog_write=True)
                if self.dialect == "postgresql":
                    # Its transactions are begun by hand (:meth:`_locked`).
                    self._writer.execution_options(isolation_level="AUTOCOMMIT")
                if self.dialect == "sqlite":
                    # A batch reads and rewrites catalog_streams at one random
                    # place per model it changes: a large catalog's (4 MB at
                    # 100,000 models) passes SQLite's 2 MB cache, and its pages
                    # were read from the file again by the next batch. Only
                    # this connection: readers pass over pages once.
                    cursor = self._writer.connection.cursor()
                    cursor.execute(f"PRAGMA cache_size = -{WRITER_CACHE_KIB}")
                    # Its writes wait for the lock a slice at a time (_begin_write).
                    cursor.execute(f"PRAGMA busy_timeout = {milliseconds(LOCK_SLICE_SECONDS)}")
                    cursor.close()
                self._writer_pid = os.getpid()
            self._writer_used = time.monotonic()
            try:
                yield self._writer
            except sa.exc.SQLAlchemyError as error:
                # Waiting out another writer broke nothing: the connection, and
                # its cache, stay for the next write.
                busy = isinstance(error, sa.exc.OperationalError) and _is_busy(error)
                if not (busy and self._writer_is_idle()):
                    self._discard_writer()
                raise
            except self._dbapi_error as error:
                # From a statement made straight on the driver (the hot reads):
                # told as SQLAlchemy tells the others.
                self._discard_writer()
                raise self._as_sqlalchemys(error) from None
            except BaseException:
                # Interrupted where nothing could end its transaction (a signal
                # between two statements): a writer left in one would hold the
                # write lock, against every process, until its next write.
                if not self._writer_is_idle():
                    self._discard_writer()
                raise
            if self._file is not None and self._writer is not None:
                try:
                    self._file.check()
                except FileNotTheLog:
                    # Between the check above and the commit: the write went
                    # into the file that was there, not the log at the path.
                    self._discard_writer()
                    raise self._as_sqlalchemys(
                        FileNotTheLog(
                            f"the database file {self._file.path} was replaced, removed or"
                            " emptied during this write, which went into the file that was"
                            " there: the log at the path does not hold it; stop every process"
                            " using it, then start them again",
                            lasting=True,
                            replaced=True,
                        )
                    ) from None

    def _on_the_file(self) -> None:
        """On SQLite, refused when the path no longer names the file this
        process opened (:class:`SQLiteFile`). Asked once a connection is in
        hand, inside the block that gives it back: asked as the pool hands
        it out, an interrupt there stranded connections until the pool ran
        dry (the interrupt test, once in a clean-clone CI run). A connection
        opened afresh is checked as it opens."""
        if self._file is None:
            return
        try:
            self._file.check()
        except FileNotTheLog as error:
            raise self._as_sqlalchemys(error) from None

    def _as_sqlalchemys(self, error: Exception) -> sa.exc.StatementError:
        """A driver error from a statement made straight on the driver, wrapped
        as SQLAlchemy wraps its own: callers handle one kind, and the held
        writer lets go of a connection the error may have broken."""
        prepared_elsewhere(self.engine, error)
        if self._file is not None:
            self._file.name_in(error)
        return sa.exc.DBAPIError.instance(None, None, error, self._dbapi_error)

    def _writer_is_idle(self) -> bool:
        """Whether the held writer is in no transaction, its driver's included."""
        writer = self._writer
        if writer is None:
            return True
        if writer.invalidated:
            # Asked for its driver connection, it would connect afresh (and
            # look idle) without a writer's settings: let go of it instead.
            return False
        try:
            if writer.in_transaction():
                return False
            return self.dialect != "sqlite" or not _in_transaction(
                writer.connection.driver_connection
            )
        except sa.exc.SQLAlchemyError:
            return False

    def _discard_writer(self) -> None:
        """Close the held writer for good, rather than hand it back to the pool
        that readers take connections from: it may be broken, and it keeps the
        writer's page cache."""
        writer, self._writer = self._writer, None
        if writer is not None:
            with suppress(sa.exc.SQLAlchemyError):
                writer.invalidate()
                writer.close()

    def close(self) -> None:
        """Let go of the held write connection."""
        with self._writer_lock:
            if self._writer_pid == os.getpid():
                self._discard_writer()
            self._writer = None

    def create_tables(self, tables: sa.MetaData = metadata) -> None:
        """Create those of ``tables`` that are missing (the log's by default; a
        read model passes its own). Several nodes may start at once on a new
        database. Unlocked, they race (SQLite: "database is locked" from the
        deferred transaction DDL upgrades; PostgreSQL: duplicate catalog
        types), so the tables are created under a lock, and the lock is taken
        only when a table is missing: a start must not wait for a writer when
        there is nothing to create."""
        names = [table.name for table in tables.sorted_tables]
        log = tables is metadata
        if log and self._file is not None:
            # Before a connection makes or changes the file.
            looked = self._file.looked_at(names)
            if looked is not None and not looked.tables and not self._make_log:
                raise NoLogYet(self._file.where)
        with self.engine.connect() as conn:
            if self.dialect == "postgresql":
                # Reads of the server's catalog, which a transaction at its
                # default isolation gives no one view of either: psycopg's
                # BEGIN and the ROLLBACK cost each start two round trips.
                conn.execution_options(isolation_level="AUTOCOMMIT")
            found, columns = _log_tables_found(conn, names)
            if log:
                _check_split(conn, found)
            if columns is not None and self.dialect == "postgresql":
                # Where the log is, which :meth:`log_schema` asked next:
                # four round trips more a process that writes (the pool's
                # check, BEGIN, the query, ROLLBACK).
                self._log_schema = found[events_table.name]
            if not self._to_make(tables, found) and not (
                columns is not None and _unlinked(columns)
            ):
                return
        # Asked here, the schema the log's table is made in when it is missing.
        schema = self.log_schema() if self.dialect == "postgresql" else None
        if schema == "":
            raise self._no_schema()
        if schema is not None and schema.startswith(_TEMPORARY_SCHEMA):
            raise self._temporary_schema(schema)
        # The events table may not exist yet to LOCK: an advisory lock instead.
        with self.locked("catalog_es.tables", schema=schema) as conn:
            # Again under the lock: another node may have made it meanwhile.
            found, columns = _log_tables_found(conn, names)
            missing = self._to_make(tables, found)
            if missing and self.dialect == "postgresql":
                # Made beside the log's table, or a new log's where its lock
                # is: made unqualified, they went to the first schema of the
                # search path, wherever the log was, and a new log to the
                # session's temporary schema when the path named pg_temp
                # first, one not there yet (current_schema() passes it over).
                conn.exec_driver_sql(
                    "SELECT set_config('search_path', quote_ident(%(schema)s), true)",
                    {"schema": found.get(events_table.name, schema)},
                )
                # Only a table to be made has a type in its way; asked with
                # the lookup every start makes, it cost each start time.
                in_the_way = conn.exec_driver_sql(
                    _TYPES_IN_THE_WAY, {"names": [table.name for table in missing]}
                ).first()
                if in_the_way is not None:
                    raise _in_the_way(conn, "a type", *in_the_way)
            # Where the log would be made, once nothing stands in its way.
            if log and not self._make_log and events_table.name not in found:
                raise NoLogYet(self._made_where(schema))  # rolled back: nothing made
            create(conn, tables, missing)
            if not log:
                return
            if columns is not None:
                self._link_streams(conn, columns, streams_table.name in found)
            else:
                # A log's table made just now is today's: nothing to bring
                # over, nor to read back (which cost every new database 20 ms).
                self.log_made = self._made_where(schema)

    def _to_make(self, tables: sa.MetaData, found: Mapping[str, str]) -> list[sa.Table]:
        """Those of ``tables`` not ``found`` that are to be made. A read leaves
        a log found without its head record's table (dropped by hand: every
        release has made it with the log) as it is, and reads it as a log
        whose head row was deleted (it made the table: a command that writes
        nothing wrote). A write makes it, and is then refused as on a deleted
        head row."""
        if tables is metadata and not self._make_log and events_table.name in found:
            self._head_table_missing = head_table.name not in found
        return [
            table
            for table in tables.sorted_tables
            if table.name not in found and not (table is head_table and self._head_table_missing)
        ]

    @property
    def where(self) -> str:
        """Where the log's database is, said for an operator: "at FILE" on
        SQLite, "at URL" (its password hidden) on PostgreSQL."""
        if self._file is not None:
            return self._file.where
        return url_where(self.engine.url)

    def _made_where(self, schema: str | None) -> str:
        """Where the log's table made in ``schema`` is, said for an operator:
        its file on SQLite; on PostgreSQL its schema, database and server as
        the URL names them (read back, the database would cost every new log
        a round trip)."""
        if self._file is not None:
            return self._file.where
        url = self.engine.url
        database = f" of database {url.database}" if url.database else ""
        return f"in schema {schema}{database}{self._server}"

    @property
    def _server(self) -> str:
        """The PostgreSQL server as the URL names it, if it does: " at HOST:PORT"."""
        url = self.engine.url
        port = f":{url.port}" if url.port else ""
        return f" at {url.host}{port}" if url.host else ""

    def _no_schema(self) -> ConfigError:
        """The refusal of a PostgreSQL search path that names no schema this
        role can use (none there is, or none it has USAGE on), where the log's
        tables are missing: none can be found or made. PostgreSQL's words (no
        schema has been selected to create in) named neither the database nor
        the path, and a read did not say it found no log."""
        return self._search_path_refused(
            "names no schema there is (or none this role may use), so none can be found or"
            " made there",
            "create the schema, or name one there is in the search path",
        )

    def _temporary_schema(self, schema: str) -> ConfigError:
        """The refusal of a PostgreSQL search path that names the session's
        temporary schema first (pg_temp), where the log's tables are missing:
        made there, the server dropped them as the session ended, and a write
        told as done was lost as the command exited."""
        return self._search_path_refused(
            f"names first the session's temporary schema ({schema}), which the server drops"
            " as the session ends, and a log made there with it",
            "name the log's schema first in the search path",
        )

    def _search_path_refused(self, problem: str, advice: str) -> ConfigError:
        """No log where the search path leads: the database and the path, the
        ``problem`` with the path, and the ``advice``."""
        with self.engine.connect() as conn:
            database, path = conn.exec_driver_sql(
                "SELECT current_database(), current_setting('search_path')"
            ).one()
        return ConfigError(
            f"no log in database {database}{self._server}: its search path {shown(path)}"
            f" {problem}; nothing was made: {advice} (the URL's options, or the role's)"
        )

    def _link_streams(self, conn: Connection, columns: list[str], streams_kept: bool) -> None:
        """Bring a log written before ``catalog_streams`` to today's layout, in
        the transaction that made that table: each event names its stream's
        event before it, each stream's last version and revision are
        recorded, and the index on (stream, version) goes (SQLite cannot drop
        a table's constraint: the table is made anew, AUTOINCREMENT kept).
        A ``catalog_streams`` dropped from today's layout is made again from
        the rows: left empty, every model's next version would be 1 again."""
        if "stream_previous" in columns:
            if not streams_kept:
                self._fill_streams(conn)
            return
        # Columns an operator added to 0.1.0's table. PostgreSQL adds today's
        # to the table as it is, and they stay; SQLite makes the table anew,
        # and from what it keeps of a column (its type, NOT NULL, default)
        # could not make it again with its constraints (CHECK, COLLATE,
        # REFERENCES): refused before anything is made, the log left as it
        # was (a catalog_streams made empty beside it was never filled).
        added = [c for c in columns if c not in _UNLINKED_COLUMNS]
        if added and self.dialect == "sqlite":
            named = ", ".join(added)
            raise UpgradeFailed(
                f"the log's table catalog_events has columns 0.1.0 did not make ({named}):"
                " this version cannot bring a SQLite log with them to its layout, nothing"
                " was changed; copy what they hold elsewhere if it is needed, drop them"
                f" (ALTER TABLE catalog_events DROP COLUMN {added[0]}), and run again"
            )
        log.warning(
            "bringing the log's tables to this version's layout, once (one transaction over"
            " every event: about 20 s a million); 0.1.0 nodes can no longer write to it"
        )
        try:
            self._bring_over(conn, columns)
        except sa.exc.DBAPIError as error:
            reason = str(error.orig).strip().splitlines()[0] if error.orig else str(error)
            raise UpgradeFailed(
                "the log's tables could not be brought to this version's layout, nothing was"
                f" changed: {reason}"
            ) from None

    def _bring_over(self, conn: Connection, columns: list[str]) -> None:
        previous = "coalesce(lag(revision) OVER (PARTITION BY originator_id ORDER BY revision), 0)"
        if self.dialect == "sqlite":
            made = conn.exec_driver_sql(
                "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'catalog_events'"
            ).scalar()
            # An operator's own indexes and triggers on the table go with it,
            # and a view reading it would stop the rename: all are made again
            # after, as SQLite's own recipe for remaking a table does.
            kept_sql = conn.exec_driver_sql(
                "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL AND"
                " ((type IN ('index', 'trigger') AND tbl_name = 'catalog_events')"
                " OR type = 'view') ORDER BY type = 'view'"
            ).all()
            for kind, name, _ in kept_sql:
                if kind == "view":
                    conn.exec_driver_sql(f'DROP VIEW "{name}"')
            relinked = events_table.to_metadata(sa.MetaData(), name="catalog_events_relinked")
            relinked.dialect_options["sqlite"]["autoincrement"] = (
                "AUTOINCREMENT" in str(made).upper()
            )
            relinked.create(conn)
            kept = ", ".join(columns)
            conn.exec_driver_sql(
                f"INSERT INTO catalog_events_relinked ({kept}, stream_previous)"
                f" SELECT {kept}, {previous} FROM catalog_events"
            )
            # A sequence past the last row (its row deleted) stays past it.
            conn.exec_driver_sql(
                "UPDATE sqlite_sequence SET seq = max(seq, (SELECT seq FROM sqlite_sequence"
                " WHERE name = 'catalog_events')) WHERE name = 'catalog_events_relinked'"
            )
            conn.exec_driver_sql("DROP TABLE catalog_events")
            conn.exec_driver_sql("ALTER TABLE catalog_events_relinked RENAME TO catalog_events")
            for _, _, sql in kept_sql:
                conn.exec_driver_sql(sql)
        else:
            # An operator's append-only trigger would refuse the one update
            # the layout needs: off for it, in this transaction only.
            conn.exec_driver_sql(
                "ALTER TABLE catalog_events ADD COLUMN stream_previous BIGINT, DISABLE TRIGGER USER"
            )
            conn.exec_driver_sql(
                "UPDATE catalog_events e SET stream_previous = linked.previous FROM"
                f" (SELECT revision, {previous} AS previous FROM catalog_events) AS linked"
                " WHERE e.revision = linked.revision"
            )
            conn.exec_driver_sql(
                "ALTER TABLE catalog_events ENABLE TRIGGER USER,"
                f" ADD CONSTRAINT {WRITERS_UPGRADED} CHECK (stream_previous IS NOT NULL),"
                " DROP CONSTRAINT IF EXISTS catalog_events_stream"
            )
        self._fill_streams(conn)

    def _fill_streams(self, conn: Connection) -> None:
        # Each stream's last event, worked out from the events alone: what a
        # catalog_streams made beside a 0.1.0 table holds (by a release that
        # then left it unfilled) is not trusted.
        conn.exec_driver_sql("DELETE FROM catalog_streams")
        conn.exec_driver_sql(
            "INSERT INTO catalog_streams (originator_id, version, revision)"
            " SELECT originator_id, max(originator_version), max(revision)"
            " FROM catalog_events GROUP BY originator_id"
        )

    @contextmanager
    def locked(
        self, name: str, wait: float | None = None, *, schema: str | None = None
    ) -> Iterator[Connection]:
        """A write transaction holding the lock called ``name`` (a constant of
        ours), one process at a time across nodes: SQLite's one write lock, or
        on PostgreSQL an advisory lock of the log's schema (:meth:`log_schema`:
        a catalog kept in another schema of the database has its own), which
        leaves the log's writers alone. On a connection of its own: never the
        one this process's commands write through, which would wait behind
        it. ``wait`` as :meth:`write`'s; ``schema``, the log's, when the
        caller has just asked :meth:`log_schema`."""
        if schema is None and self.dialect == "postgresql":
            schema = self.log_schema()
        # 0.2.0's nodes take the lock by name alone, the database over: taken
        # shared by name too, it still keeps them out during a rolling upgrade
        # while this release's nodes of other schemas share it. Taken first,
        # so that a node waiting for it holds nothing another node waits for.
        with self._locked(
            "SELECT pg_advisory_xact_lock_shared(hashtext(%(name)s))",
            "SELECT pg_advisory_xact_lock(hashtext(%(schema)s), hashtext(%(name)s))",
            params={"name": name, "schema": schema},
            shared=False,
            wait=wait,
        ) as conn:
            yield conn

    def log_schema(self) -> str:
        """The PostgreSQL schema of the log's tables as this node's queries
        find them along its search path (past schemas named before it that
        are missing, ``$user`` among them, or hold no log), or, before they
        are made, the schema they will be made in: the same for every node of
        one catalog, however its search path reads. Empty when the path names
        no schema there is (then the tables can be neither made nor used,
        which says so). Kept once the tables are found: until then, another
        node may make them in another schema of the path."""
        if self._log_schema is None:
            with self.engine.connect() as conn:
                schema, found = conn.exec_driver_sql(_LOG_SCHEMA).one()
            if not found:
                return str(schema)
            self._log_schema = str(schema)
        return self._log_schema

    # -- transactions ------------------------------------------------------------

    @contextmanager
    def write(self, wait: float | None = None) -> Iterator[Connection]:
        """A write transaction holding the log's write lock: one writer at a time,
        across processes and nodes. Committed at the end of the block, rolled
        back if it raises; :meth:`abandon` rolls it back early. ``wait``: the
        seconds left to wait for the lock, when less than ``lock_wait`` is
        (a command that queued behind another in this process)."""
        if self.dialect == "postgresql":
            # Found once, and not with the lock held: appends notify its channel.
            self.log_schema()
        with self._locked("LOCK TABLE catalog_events IN EXCLUSIVE MODE", wait=wait) as conn:
            yield conn

    def abandon(self, conn: Connection) -> None:
        """Roll back the transaction of ``conn`` (from :meth:`write`), which on
        SQLite may be the driver's alone, where ``conn.rollback()`` would not
        reach it."""
        if self.dialect == "sqlite":
            _end(conn, conn.connection.driver_connection, commit=False)
        else:
            conn.rollback()

    def end_unwritten(self, conn: Connection) -> None:
        """End the transaction of ``conn`` (from :meth:`write`), in which the
        caller wrote nothing: :meth:`abandon` it on SQLite; on PostgreSQL
        commit it, as a rollback makes psycopg forget every statement it
        prepared (a ``DEALLOCATE ALL`` after it), and the next writes' are
        planned afresh until prepared again. (One a failed statement aborted
        is rolled back by the server all the same.)"""
        if self.dialect == "sqlite":
            self.abandon(conn)
        else:
            conn.commit()

    @contextmanager
    def _locked(
        self,
        *postgresql_locks: str,
        params: dict[str, Any] | None = None,
        shared: bool = True,
        wait: float | None = None,
    ) -> Iterator[Connection]:
        """A transaction that first waits, at most ``lock_wait`` seconds (or
        ``wait``), for a lock: the SQLite database's (``BEGIN IMMEDIATE``) or,
        on PostgreSQL, those ``postgresql_locks`` take, in turn. ``shared``: on
        the held connection commands write through, else on one from the pool."""
        try:
            if shared and self.dialect == "sqlite":
                # Every command's transaction.
                with (
                    self._writer_connection() as conn,
                    _on_the_driver(conn, self.lock_wait if wait is None else wait),
                ):
                    yield conn
                return
            connection = self._writer_connection() if shared else self._own_connection(wait)
            with connection as conn, conn.begin():
                if self.dialect == "postgresql":
                    waiting = self.lock_wait if wait is None else wait
                    # Stopped mid-write, a node is idle in its transaction, or,
                    # stopped while the server still sends it a read, leaves
                    # what is sent unacknowledged: either ends its session.
                    idle = f"'{milliseconds(self.write_idle)}ms'"
                    timeout = (
                        f"SET LOCAL lock_timeout = '{milliseconds(waiting)}ms';"
                        f" SET LOCAL idle_in_transaction_session_timeout = {idle};"
                        f" SET LOCAL tcp_user_timeout = {idle}"
                    )
                    # Either connection is in autocommit mode: its transaction
                    # begins in the round trip that takes the lock, where
                    # psycopg would send a BEGIN of its own before it (one
                    # round trip of the five a command took); its commit()
                    # and rollback() end the transaction begun here.
                    if params is None:
                        # One round trip for all six, on every command's path.
                        # The write's statements are the same each time, and
                        # psycopg prepares them: planned once, not per command
                        # (planning the append took 0.3 ms of a command's 1.1).
                        conn.exec_driver_sql(
                            f"BEGIN; {timeout}; SET LOCAL plan_cache_mode = force_generic_plan;"
                            f" {'; '.join(postgresql_locks)}"
                        )
                    else:
                        from psycopg import sql

                        # The values written into the statements, as a statement
                        # with parameters goes alone: each lock goes with its SET,
                        # in one round trip (three a lock, where they took five).
                        raw = conn.connection.driver_connection
                        values = {k: sql.Literal(v).as_string(raw) for k, v in params.items()}
                        deadline = time.monotonic() + waiting
                        setting = f"BEGIN; {timeout}"
                        for postgresql_lock in postgresql_locks:
                            conn.exec_driver_sql(f"{setting}; {postgresql_lock % values}")
                            # lock_timeout bounds each wait, not all of them: the
                            # next lock gets what is left of the one wait.
                            left = milliseconds(deadline - time.monotonic())
                            setting = f"SET LOCAL lock_timeout = '{left}ms'"
                yield conn
        except sa.exc.OperationalError as error:
            if _is_busy(error):
                raise StorageBusy(
                    f"the database stayed locked by another writer for {self.lock_wait:g} s; "
                    "nothing was written, try again"
                ) from None
            raise

    @contextmanager
    def _own_connection(self, wait: float | None = None) -> Iterator[Connection]:
        """A pooled connection whose transactions take the write lock as the
        held one's do, waiting for it ``wait`` seconds, or ``lock_wait``."""
        with self.engine.connect() as conn, self._sliced(conn):
            self._on_the_file()
            waiting = self.lock_wait if wait is None else wait
            conn.execution_options(catalog_write=True, **{_LOCK_WAIT_OPTION: waiting})
            if self.dialect == "postgresql":
                # Its transaction is begun by hand, as the held writer's
                # (:meth:`_locked`); the pool puts the mode back as it is returned.
                conn.execution_options(isolation_level="AUTOCOMMIT")
            yield conn

    @contextmanager
    def _sliced(self, conn: Connection) -> Iterator[None]:
        """On SQLite, the pooled ``conn`` waits for the write lock a slice at a
        time (:func:`_begin_write`) until the block ends; then, back in the
        pool, its reads wait in one ``lock_wait`` again, as every one's do."""
        if self.dialect != "sqlite":
            yield
            return
        _busy_timeout(conn, LOCK_SLICE_SECONDS)
        try:
            yield
        finally:
            with suppress(self._dbapi_error, sa.exc.SQLAlchemyError):
                _busy_timeout(conn, self.lock_wait)

    @contextmanager
    def write_beside(self) -> Iterator[Connection]:
        """A transaction that writes beside the log (a refused command's
        record), taking none of the log's locks: on PostgreSQL a plain one;
        on SQLite, where any write takes the database's one lock, on a pooled
        connection that waits for it as a write does (:func:`_begin_write`),
        a slice at a time, so that a stop acts between two, where an INSERT
        in a deferred transaction waited ``lock_wait`` in one."""
        if self.dialect != "sqlite":
            with self.engine.begin() as conn:
                yield conn
            return
        with self.engine.connect() as conn, self._sliced(conn):
            conn.execution_options(catalog_write=True)
            with conn.begin():
                yield conn

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read transaction: one consistent view of the log. On PostgreSQL that
        takes REPEATABLE READ (its default, READ COMMITTED, lets each statement
        see new commits, so a head read first and events read after would not
        agree); SQLite's deferred BEGIN already reads one snapshot."""
        with self.engine.connect() as conn:
            self._on_the_file()
            if self.dialect == "postgresql":
                conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                yield conn

    # -- events ------------------------------------------------------------------

    def insert_events(
        self,
        stored_events: Sequence[StoredEvent],
        *,
        conn: Connection | None = None,
        tracking: Tracking | None = None,
        standing: Standing | None = None,
        **_: Any,
    ) -> Sequence[int] | None:
        """Append events, chained onto the head; ``conn`` must come from :meth:`write`.
        ``standing``: read in this transaction with nothing appended since, it
        spares the append reading the head again."""
        if conn is None:
            with self.write() as own:
                return self.insert_events(stored_events, conn=own, tracking=tracking)
        revisions: list[int] = []
        if stored_events:
            revisions = self.append(conn, stored_events, standing).revisions
        if tracking is not None:
            self._insert_tracking(conn, tracking)
        return revisions

    def select_events(
        self,
        originator_id: UUID | str,
        *,
        gt: int | None = None,
        lte: int | None = None,
        desc: bool = False,
        limit: int | None = None,
    ) -> Sequence[StoredEvent]:
        t = events_table.c
        stream = stream_walk(_as_uuid(originator_id))
        query = sa.select(t.originator_id, t.originator_version, t.topic, t.state).where(
            t.revision.in_(sa.select(stream.c.revision))
        )
        if gt is not None:
            query = query.where(t.originator_version > gt)
        if lte is not None:
            query = query.where(t.originator_version <= lte)
        query = query.order_by(t.originator_version.desc() if desc else t.originator_version)
        if limit is not None:
            query = query.limit(limit)
        with self.read() as conn:
            return [
                StoredEvent(originator_id=r[0], originator_version=r[1], topic=r[2], state=r[3])
                for r in conn.execute(query)
            ]

    def select_notifications(
        self,
        start: int | None,
        limit: int,
        stop: int | None = None,
        topics: Sequence[str] = (),
        *,
        inclusive_of_start: bool = True,
    ) -> Sequence[Notification]:
        t = events_table.c
        query = sa.select(t.revision, t.originator_id, t.originator_version, t.topic, t.state)
        if start is not None:
            query = query.where(t.revision >= start if inclusive_of_start else t.revision > start)
        if stop is not None:
            query = query.where(t.revision <= stop)
        if topics:
            query = query.where(t.topic.in_(topics))
        query = query.order_by(t.revision).limit(limit)
        with self.read() as conn:
            return [
                Notification(
                    id=r[0], originator_id=r[1], originator_version=r[2], topic=r[3], state=r[4]
                )
                for r in conn.execute(query)
            ]

    def page_end(
        self,
        after: int,
        limit: int,
        max_bytes: int,
        topics: Sequence[str] = (),
        *,
        upto: int | None = None,
        among: Sequence[int] | None = None,
        containing: Sequence[bytes] = (),
    ) -> int | None:
        """The last revision of a page of at most ``limit`` events after
        ``after`` whose stored forms come to no more than ``max_bytes`` (one
        event at least, however large); ``None`` when there is none. Told by
        the sizes alone, which neither database reads the bytes for. Only
        events up to ``upto``, only those of the revisions ``among``, and
        only those holding one of ``containing`` (:func:`holds_bytes`)."""
        with self.read() as conn:
            return self._page_end(
                conn, after, limit, max_bytes, topics, upto=upto, among=among, containing=containing
            )

    def _page_end(
        self,
        conn: Connection,
        after: int,
        limit: int,
        max_bytes: int,
        topics: Sequence[str] = (),
        *,
        upto: int | None = None,
        among: Sequence[int] | None = None,
        containing: Sequence[bytes] = (),
    ) -> int | None:
        t = events_table.c
        query = sa.select(t.revision, sa.func.length(t.state)).where(t.revision > after)
        if topics:
            query = query.where(t.topic.in_(topics))
        if upto is not None:
            query = query.where(t.revision <= upto)
        if among is not None:
            query = query.where(t.revision.in_(among))
        if containing:
            query = query.where(holds_bytes(containing))
        rows = conn.execute(query.order_by(t.revision).limit(limit)).all()
        count = fitting((size for _, size in rows), max_bytes)
        return rows[count - 1][0] if count else None

    def pull_page(
        self,
        after: int,
        after_hash: str | None,
        limit: int,
        max_bytes: int,
        topics: Sequence[str],
        containing: Sequence[bytes] = (),
    ) -> PulledPage:
        """A follower's next page: the events after ``after`` of
        :meth:`page_end`'s page, with their hashes, in one read; only those
        holding one of ``containing`` (:func:`holds_bytes`), when given. Given
        ``after_hash``, the hash of the event at ``after`` as the follower
        gave it, the log must still hold that hash there, or it is no longer
        the one the follower gave (:class:`LogRewritten`): the chain vouches
        for every event before, and the page is one snapshot of one log."""
        t = events_table.c
        query = sa.select(
            t.revision, t.originator_id, t.originator_version, t.topic, t.state, t.hash
        ).where(t.revision > after)
        if topics:
            query = query.where(t.topic.in_(topics))
        if containing:
            query = query.where(holds_bytes(containing))
        with self.read() as conn:
            # The hash stored at the follower's last event, not that recomputed
            # from the next one's content: an event edited by hand (skipped,
            # reported) there ended a watch as if the log had been replaced.
            # Asked of an empty page too: a log put back to before that event
            # went on being followed, and the events written at its revisions
            # since were given to none (retest).
            if after_hash is not None and self.hash_at(conn, after) != after_hash:
                raise LogRewritten.at(after)
            end = self._page_end(conn, after, limit, max_bytes, topics, containing=containing)
            if end is None:
                # None up to the head holds them: the next read starts past
                # them, rather than reading them all again (every look, for
                # an actor who writes nothing).
                head = self.head(conn) if containing else after
                head_hash = self.hash_at(conn, head) if head > after else after_hash
                return PulledPage([], head, head_hash)
            page = conn.execute(query.where(t.revision <= end).order_by(t.revision))
            notifications = [
                ChainedNotification(
                    id=r[0],
                    originator_id=r[1],
                    originator_version=r[2],
                    topic=r[3],
                    state=r[4],
                    hash=r[5],
                )
                for r in page
            ]
            return PulledPage(notifications, end, notifications[-1].hash)

    def max_notification_id(self) -> int | None:
        with self.read() as conn:
            return self.head(conn) or None

    def head(self, conn: Connection) -> int:
        """The last revision in the log, 0 when it is empty."""
        value = conn.execute(sa.select(sa.func.max(events_table.c.revision))).scalar()
        return int(value or 0)

    def hash_at(self, conn: Connection, revision: int) -> Any:
        """The hash stored at ``revision``: that of the log up to it (``None``
        past the head, GENESIS at 0)."""
        if revision == 0:
            return GENESIS
        rows = self._fetch(conn, "SELECT hash FROM catalog_events WHERE revision = ?", revision)
        return rows[0][0] if rows else None

    def event_at(self, conn: Connection, revision: int) -> tuple[Any, Any] | None:
        """The ``(topic, state)`` stored at ``revision``, as a follower was given them."""
        rows = self._fetch(
            conn, "SELECT topic, state FROM catalog_events WHERE revision = ?", revision
        )
        return (rows[0][0], rows[0][1]) if rows else None

    def kept(self, conn: Connection, revision: int) -> Kept:
        """The log's last revision and its hash, and the hash at ``revision``:
        whether the log still holds the events a catalog at ``revision`` was
        built from. Through the driver, as every read asks it (and a write
        that catches up, inside its own transaction)."""
        return Kept.of(self._fetch(conn, f"SELECT revision, hash {_KEPT}", revision), revision)

    def kept_with_head(
        self, conn: Connection, revision: int
    ) -> tuple[Kept, ChainHead | DamagedHead | None]:
        """:meth:`kept`, and the head of the hash chain as :meth:`chain_head`
        reads it, in one statement: a load asked them one after the other, a
        round trip each on PostgreSQL."""
        # The last column tells the head's row from the log's.
        head_row = " UNION ALL SELECT revision, hash, 1 FROM catalog_head WHERE id = 1"
        head_row = "" if self._head_table_missing else head_row
        rows = self._fetch(conn, f"SELECT revision, hash, 0 {_KEPT}{head_row}", revision)
        head = next((stored_head(row[0], row[1]) for row in rows if row[2]), None)
        return Kept.of((row for row in rows if not row[2]), revision), head

    def kept_alone(self, revision: int) -> Kept | None:
        """:meth:`kept`, one statement consistent by itself, in no transaction
        where one costs round trips: on PostgreSQL, to begin it and to end it
        (a read of an idle log took four, now two). ``None`` on SQLite, where
        a transaction costs none: the read that follows asks in its own (a
        connection more to check out is one more for an interrupt to strand)."""
        if self.dialect != "postgresql":
            return None
        with self._in_no_transaction() as conn:
            return self.kept(conn, revision)

    def end_alone(self) -> tuple[Kept, ChainHead | DamagedHead | None]:
        """:meth:`kept_with_head` of where the log ends, one statement
        consistent by itself: on PostgreSQL in no transaction (a read
        transaction's BEGIN and end cost two round trips more)."""
        if self.dialect != "postgresql":
            with self.read() as conn:
                return self.kept_with_head(conn, 0)
        with self._in_no_transaction() as conn:
            return self.kept_with_head(conn, 0)

    @contextmanager
    def _in_no_transaction(self) -> Iterator[Connection]:
        """A PostgreSQL connection whose statements run each in its own."""
        with self.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            yield conn

    def _fetch(self, conn: Connection, sql: str, *params: Any) -> list[Any]:
        """The rows of one statement written with ``?`` marks, through the
        driver in ``conn``'s transaction; its errors as SQLAlchemy tells them."""
        cursor = conn.connection.cursor()
        try:
            cursor.execute(self._sql(sql), params)
            return list(cursor.fetchall())
        except self._dbapi_error as error:
            raise self._as_sqlalchemys(error) from None
        finally:
            cursor.close()

    def stream_version(self, conn: Connection, originator_id: UUID) -> int:
        """The last version in an aggregate's stream, 0 for a new one. Read from
        the log, not the catalog: a record replay skipped still holds its place."""
        cursor = conn.connection.cursor()
        try:
            cursor.execute(
                self._sql("SELECT version FROM catalog_streams WHERE originator_id = ?"),
                (self._uuid(originator_id),),
            )
            (value,) = cursor.fetchone() or (None,)
        except self._dbapi_error as error:
            raise self._as_sqlalchemys(error) from None
        finally:
            cursor.close()
        _check_whole([value])
        return value or 0

    def originator_of(self, conn: Connection, revision: int) -> UUID | None:
        """The stream the event at ``revision`` was filed in; ``None`` for no such
        row, or an id edited by hand into no UUID."""
        rows = self._fetch(
            conn, "SELECT originator_id FROM catalog_events WHERE revision = ?", revision
        )
        try:
            return _as_uuid(rows[0][0]) if rows else None
        except (ValueError, TypeError, AttributeError):
            return None

    def stream_versions(self, conn: Connection, originator_ids: Sequence[UUID]) -> list[int]:
        """``stream_version`` of many streams, in the order given, in a few round trips."""
        # Keyed by the stored form, so no UUID is parsed or hashed per row.
        stored = [self._uuid(u) for u in originator_ids]
        found: dict[Any, Any] = {}
        cursor = conn.connection.cursor()
        try:
            for start in range(0, len(stored), 500):
                wanted = list(dict.fromkeys(stored[start : start + 500]))
                marks = ", ".join(["?"] * len(wanted))
                cursor.execute(
                    self._sql(
                        "SELECT originator_id, version FROM catalog_streams"
                        f" WHERE originator_id IN ({marks})"
                    ),
                    wanted,
                )
                found.update(cursor.fetchall())
        except self._dbapi_error as error:
            raise self._as_sqlalchemys(error) from None
        finally:
            cursor.close()
        _check_whole(found.values())
        return [found.get(s) or 0 for s in stored]

    def _sql(self, text: str) -> str:
        """Driver SQL written with ``?`` marks, in this driver's paramstyle."""
        return text if self.dialect == "sqlite" else text.replace("?", "%s")

    def _uuid(self, value: UUID | str) -> UUID | str:
        """A UUID as the ``Uuid`` column stores it: 32 hex digits on SQLite."""
        if isinstance(value, str):
            value = UUID(value)
        return value.hex if self.dialect == "sqlite" else value

    def scan(
        self,
        conn: Connection,
        after: int = 0,
        upto: int | None = None,
        *,
        stream_parity: int | None = None,
    ) -> Iterator[list[tuple[int, str, bytes]]]:
        """Pages of ``(revision, topic, state)`` after a revision, in order;
        ``stream_parity`` (SQLite only): only the rows of streams whose id is
        odd (1) or even (0), as :func:`stream_parity` tells them apart for an
        id stored as hex (an id stored otherwise by hand counts as even; a
        split replay then finds its events in the wrong half and gives up)."""
        where = ""
        if stream_parity is not None:
            # The id's last hex digit, as stored: 32 digits, or by hand with dashes.
            where = f" AND (substr(originator_id, -1) IN {_ODD_DIGITS}) = {int(stream_parity)}"
        return self._pages(conn, "revision, topic, state", after, upto, where)

    def scan_hashed(
        self, conn: Connection, after: int = 0
    ) -> Iterator[list[tuple[int, str, bytes, Any]]]:
        """:meth:`scan`'s pages with each event's hash as stored, for a read
        model that keeps the log's hash at its position: taken from its
        replay, not read again."""
        return self._pages(conn, "revision, topic, state, hash", after, None)

    def _pages(
        self, conn: Connection, columns: str, after: int, upto: int | None, where: str = ""
    ) -> Iterator[list[Any]]:
        """Pages of rows after a revision, in order; ``columns`` starts with the
        revision. The hot path of every replay, so it reads through the driver's
        own cursor (in the caller's transaction) rather than building a
        SQLAlchemy row per event. Keyset paging on the primary key: each page is
        an index range scan."""
        sql = f"SELECT {columns} FROM catalog_events WHERE revision > ?{where}"
        if upto is not None:
            sql += f" AND revision <= {int(upto)}"
        sql = self._sql(sql + f" ORDER BY revision LIMIT {PAGE_SIZE}")
        cursor = conn.connection.cursor()
        try:
            while True:
                try:
                    cursor.execute(sql, (after,))
                    rows = list(cursor.fetchall())
                except self._dbapi_error as error:
                    # A damaged file (verify's walk reads every page): told
                    # as SQLAlchemy's errors are, in one line, not as a bug.
                    raise self._as_sqlalchemys(error) from None
                if rows:
                    yield rows
                if len(rows) < PAGE_SIZE:
                    return
                after = rows[-1][0]
        finally:
            # An interrupt (Ctrl-C) may close the connection before this
            # generator is collected: its cursor went with it, and the
            # driver's complaint would be printed past the one line told.
            with suppress(self._dbapi_error):
                cursor.close()

    def column_values(self, conn: Connection, query: sa.Select[Any]) -> list[Any]:
        """The value of each row of ``query``, which selects one column the
        dialect does not convert (text, an integer), as the driver gives it.
        SQLAlchemy builds, binds and runs the statement; the rows are read off
        the driver's cursor, as :meth:`_pages` reads them, not made into a
        SQLAlchemy row each: for 10,000 audit rows that was a fifth of the
        fetch (89.7 → 70.6 million instructions)."""
        result = conn.execute(query)
        try:
            return [value for (value,) in result.cursor.fetchall()]
        except self._dbapi_error as error:
            raise self._as_sqlalchemys(error) from None
        finally:
            result.close()

    def chain_head(self, conn: Connection) -> ChainHead | DamagedHead | None:
        """The head of the hash chain as stored, ``None`` before the first
        event. The head record alone: a node that only reads may lack the
        privileges a write's read of where the log stands needs (on
        PostgreSQL, the revisions' sequence)."""
        if self._head_table_missing:
            return None
        row = conn.execute(
            sa.select(head_table.c.revision, head_table.c.hash).where(head_table.c.id == 1)
        ).first()
        return None if row is None else stored_head(row.revision, row.hash)

    def standing(self, conn: Connection, streams: Sequence[UUID] = ()) -> Standing:
        """Where the log stands, in one read: for a write, at its start, to
        know whether to catch up, what to chain onto, and the versions of the
        streams it names (a command's is on the way anyway)."""
        revision, hash_, (taken, ends, *found) = self._read_standing(conn, streams)
        head = stored_head(revision, hash_)
        if isinstance(head, DamagedHead):
            raise DamagedLog(UnwritableHead.damaged(head).refusal())
        _check_whole((taken, ends, *found))
        if head is None and ends:
            raise DamagedLog(UnwritableHead.missing(ends).refusal())
        return Standing(
            head=head,
            last=max(head.revision if head is not None else 0, taken or 0),
            versions={s.int: v or 0 for s, v in zip(streams, found, strict=True)},
            ends=ends or 0,
        )

    def _read_standing(
        self, conn: Connection, streams: Sequence[UUID]
    ) -> tuple[Any, Any, list[Any]]:
        """The head's columns as stored, then the last revision taken, the
        last event's and the last version of each of ``streams``, in one
        statement."""
        versions = ", (SELECT version FROM catalog_streams WHERE originator_id = ?)"
        head = (
            "NULL, NULL"
            if self._head_table_missing
            else "(SELECT revision FROM catalog_head WHERE id = 1),"
            " (SELECT hash FROM catalog_head WHERE id = 1)"
        )
        cursor = conn.connection.cursor()
        try:
            cursor.execute(
                self._sql(
                    f"SELECT {head}, "
                    + self._last_taken(cursor)
                    + ", (SELECT max(revision) FROM catalog_events)"
                    + versions * len(streams)
                ),
                [self._uuid(s) for s in streams],
            )
            row = cursor.fetchone()
        except self._dbapi_error as error:
            raise self._as_sqlalchemys(error) from None
        finally:
            cursor.close()
        assert row is not None, "a SELECT of scalars answers one row"
        revision, hash_, *rest = row
        return revision, hash_, rest

    def _last_taken(self, cursor: Any) -> str:
        """SQL for the last revision the rows have taken: the last row's, and
        the one a sequence kept, so a log never hands out a deleted revision
        again, even once its head is gone too: on PostgreSQL the column's
        (each write moves it on: ``_append_postgresql``), on a SQLite log whose
        table was made with AUTOINCREMENT its ``sqlite_sequence``. Looked up
        once the table is there: how it was made does not change under a
        running log."""
        if self.dialect == "postgresql":
            return (
                "greatest((SELECT max(revision) FROM catalog_events),"
                f" pg_sequence_last_value({_REVISION_SEQUENCE}))"
            )
        if self._sequence_kept is None:
            cursor.execute(
                "SELECT sql LIKE '%AUTOINCREMENT%' FROM sqlite_master"
                " WHERE type = 'table' AND name = 'catalog_events'"
            )
            made = cursor.fetchone()
            if made is not None:
                self._sequence_kept = bool(made[0])
        if self._sequence_kept:
            return (
                "max(coalesce((SELECT max(revision) FROM catalog_events), 0),"
                " coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'catalog_events'), 0))"
            )
        return "(SELECT max(revision) FROM catalog_events)"

    def append(
        self,
        conn: Connection,
        stored_events: Sequence[Appendable],
        standing: Standing | None,
        last_revisions: Mapping[int, int] | None = None,
    ) -> Appended:
        """Insert events, each chained onto the one before and onto its
        stream's last, move each stream's last version and the head: one read
        and one write of the head per transaction, not per event. Straight
        through the driver: this is every command's write. ``conn`` must come
        from :meth:`write`, and ``standing`` be read in it (or ``None``).
        ``last_revisions``: the revision of streams' last events, by their
        ids' ``int``, where known (written by this service since the log
        last moved); each is checked against the stream's row as it moves."""
        standing = standing or self.standing(conn)
        head, last = standing.head, standing.last
        if (
            any(e.originator_version > MAX_REVISION for e in stored_events)
            or last + len(stored_events) > MAX_REVISION
        ):
            # Only a head or a version raised by hand brings the limit within reach.
            raise DamagedLog(
                f"the log's next revision or a model's next version would pass {MAX_REVISION:,},"
                " the largest the database stores; nothing was written (catalog-es verify)"
            )
        # The driver's errors, wrapped as SQLAlchemy wraps them (as BEGIN's are):
        # the held writer then lets go of a connection the error may have broken.
        cursor = conn.connection.cursor()
        try:
            # Numbered here, after the last taken, on either database: under the
            # write lock nothing else appends; an event must know the revision of
            # the one before it in its stream, which may be in the same write;
            # SQLite writes no sqlite_sequence page for them; and PostgreSQL's
            # column sequence would cost a round trip more a write.
            revisions = list(range(last + 1, last + 1 + len(stored_events)))
            chained = head.hash if head is not None else GENESIS
            rows = []
            # Each stream this write appends to, by its stored id: the version
            # it followed, its last version and revision after the write, and
            # the revision of its last event before it, where given.
            streams: dict[Any, list[Any]] = {}
            written: dict[int, int] = {}
            known = last_revisions or {}
            for revision, e in zip(revisions, stored_events, strict=True):
                originator_id = _as_uuid(e.originator_id)
                chained = link(chained, originator_id, e.originator_version, e.topic, e.state)
                stored_id = self._uuid(originator_id)
                written[originator_id.int] = revision
                stream = streams.get(stored_id)
                if stream is None:
                    # The stream's last revision before this write: as given,
                    # else the database's.
                    previous = known.get(originator_id.int)
                    stream = streams[stored_id] = [e.originator_version - 1, 0, 0, previous]
                elif e.originator_version == stream[1] + 1:
                    previous = stream[2]
                else:
                    # What the index on (stream, version) refused in one write too.
                    raise sa.exc.IntegrityError(
                        "a model's versions in one write do not follow on from each other",
                        None,
                        ValueError(e.originator_version),
                    )
                stream[1:3] = e.originator_version, revision
                rows.append(
                    (
                        revision,
                        stored_id,
                        e.originator_version,
                        e.topic,
                        e.state,
                        chained,
                        previous,
                    )
                )
            if self.dialect == "sqlite":
                # The stream's event before, when not this write's, is the
                # stream's last: one seek each, in the statement prepared once.
                insert = (
                    f"INSERT INTO catalog_events ({_EVENT_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5,"
                    " ?6, coalesce(?7, (SELECT revision FROM catalog_streams"
                    " WHERE originator_id = ?2), 0))"
                )
                if len(rows) == 1:
                    cursor.execute(insert, rows[0])
                else:
                    cursor.executemany(insert, rows)
                # Each stream moves only where it is still at the version (and
                # the revision, where given) the write followed; a new one
                # only where it is still missing.
                moved = 0
                followed = [(v, r, key, f, p) for key, (f, v, r, p) in streams.items() if f > 0]
                if followed:
                    cursor.executemany(
                        "UPDATE catalog_streams SET version = ?1, revision = ?2"
                        " WHERE originator_id = ?3 AND version = ?4"
                        f" AND revision = coalesce(?5, revision) AND {_STREAM_ENDS_THERE}",
                        followed,
                    )
                    moved += cursor.rowcount
                new = [(key, v, r) for key, (f, v, r, _) in streams.items() if f == 0]
                if new:
                    cursor.executemany(
                        "INSERT INTO catalog_streams (originator_id, version, revision)"
                        " VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                        new,
                    )
                    moved += cursor.rowcount
                if head is None:
                    move = "INSERT INTO catalog_head (id, revision, hash) VALUES (1, ?, ?)"
                else:
                    move = "UPDATE catalog_head SET revision = ?, hash = ? WHERE id = 1"
                cursor.execute(move, (revisions[-1], chained))
            else:
                moved = self._append_postgresql(cursor, rows, streams, chained)
            if moved != len(streams):
                raise DamagedLog(
                    "a model's last version in catalog_streams is not its last event's, or"
                    " not the one this node read: edited by hand; nothing was written"
                    " (catalog-es verify)"
                )
        except self._dbapi_error as error:
            raise self._as_sqlalchemys(error) from None
        finally:
            cursor.close()
        return Appended(revisions, ChainHead(revision=revisions[-1], hash=chained), written)

    def _append_postgresql(
        self, cursor: Any, rows: list[tuple[Any, ...]], streams: dict[Any, list[Any]], chained: str
    ) -> int:
        """The events in chunks of a thousand (``_postgresql_rows``): one
        round trip each, and never one statement so large it stalls the
        driver. The last moves the streams and the head in the same round
        trip, and tells followers: delivered at commit, so a follower never
        wakes before it can read. Answers how many streams moved."""
        # The stream's event before, when not this write's, is the stream's last.
        insert = (
            f"INSERT INTO catalog_events ({_EVENT_COLUMNS}) SELECT e.revision,"
            " e.originator_id, e.originator_version, e.topic, e.state, e.hash,"
            " coalesce(e.previous, (SELECT s.revision FROM catalog_streams s"
            " WHERE s.originator_id = e.originator_id), 0) FROM {events}"
        )
        if len(rows) > 1:
            # Planned for the rows it has: the plan a command's write keeps
            # (one row) was a tenth slower for a thousand.
            cursor.execute("SET LOCAL plan_cache_mode = auto")
        for start in range(0, len(rows), 1000):
            events, params = _postgresql_rows(
                _EVENT_TYPES,
                rows[start : start + 1000],
                "e (revision, originator_id, originator_version, topic, state, hash, previous)",
            )
            if start + 1000 < len(rows):
                cursor.execute(insert.format(events=events), params)
                continue
            # Each stream moves only where it is still at the version (and the
            # revision, where given) the write followed; a new one only where
            # it is still missing.
            wanted, more = _postgresql_rows(
                ("uuid", "bigint", "bigint", "bigint", "bigint"),
                [(stored_id, *stream) for stored_id, stream in streams.items()],
                "w (originator_id, followed, version, revision, previous)",
            )
            # An upsert: the lock is the events table's, and a head deleted
            # meanwhile by hand is put back rather than left missing. Never
            # backwards: a head raised by hand since this write read it would
            # be moved back, and the edit hidden.
            params += [*more, rows[-1][0], chained, rows[-1][0]]
            cursor.execute(
                f"WITH added AS ({insert.format(events=events)}),"
                f" wanted AS (SELECT * FROM {wanted}),"
                " updated AS (UPDATE catalog_streams SET version = w.version,"
                " revision = w.revision FROM wanted w"
                " WHERE catalog_streams.originator_id = w.originator_id"
                " AND catalog_streams.version = w.followed AND w.followed > 0"
                " AND catalog_streams.revision = coalesce(w.previous, catalog_streams.revision)"
                f" AND {_STREAM_ENDS_THERE} RETURNING 1),"
                " created AS (INSERT INTO catalog_streams (originator_id, version, revision)"
                " SELECT originator_id, version, revision FROM wanted WHERE followed = 0"
                " ON CONFLICT DO NOTHING RETURNING 1)"
                " INSERT INTO catalog_head (id, revision, hash) VALUES (1, %s, %s)"
                " ON CONFLICT (id) DO UPDATE SET revision = excluded.revision,"
                " hash = excluded.hash WHERE catalog_head.revision < excluded.revision"
                " RETURNING (SELECT count(*) FROM updated) + (SELECT count(*) FROM created),"
                f" pg_notify('{channel_of(self.log_schema())}', ''),"
                f" pg_notify('{CHANNEL_OF_0_2}', ''), setval({_REVISION_SEQUENCE}, %s)",
                params,
            )
            row = cursor.fetchone()
            if row is None:  # the head did not move
                raise DamagedLog(
                    "the log's head record (catalog_head) was raised by hand past this"
                    " write's revisions while it ran; nothing was written"
                    " (catalog-es verify)"
                )
            return int(row[0])
        raise AssertionError("a write appends at least one event")

    def scan_chain(self, conn: Connection) -> Iterator[ChainRow]:
        """Every stored event with its hash, in revision order, from the
        first: a row put before revision 1 by hand too, which nothing else
        reads."""
        # The id as stored, not parsed: a hand-edited one is a broken link, not a crash.
        for page in self._pages(conn, _EVENT_COLUMNS, -MAX_REVISION - 1, None):
            for row in page:
                yield ChainRow(*row)

    def scan_streams(self, conn: Connection) -> list[tuple[Any, Any, Any]]:
        """Each stream's ``(id, last version, its revision)`` as stored."""
        rows = conn.exec_driver_sql("SELECT originator_id, version, revision FROM catalog_streams")
        return [tuple(row) for row in rows]

    def listener(self) -> Listener:
        """This process's one LISTEN connection to the log's database."""
        # Not the writer's lock, which a write holds while it waits for another
        # node's: a new follower would wait with it.
        with self._listener_lock:
            if self._listener is None or self._listener_pid != os.getpid():
                url = self.engine.url.set(drivername="postgresql")
                # The channel as the writers name it, from the log's schema as
                # this node's engine finds it: the LISTEN connection's settings
                # of its own have no say.
                self._listener = Listener(
                    url.render_as_string(hide_password=False), channel_of(self.log_schema())
                )
                self._listener_pid = os.getpid()
            return self._listener

    def subscribe(
        self,
        gt: int | None = None,
        topics: Sequence[str] = (),
        *,
        gt_hash: str | None = None,
        containing: Sequence[bytes] = (),
    ) -> PullingSubscription:
        """``gt_hash``: the hash of the event at ``gt`` as the follower knows
        it; given, each page read must follow on from the last event given.
        ``containing``: only the events holding one of those bytes."""
        kind = ListenSubscription if self.dialect == "postgresql" else PollingSubscription
        return kind(self, gt=gt, topics=topics, gt_hash=gt_hash, containing=containing)

    # -- tracking ----------------------------------------------------------------

    def insert_tracking(self, tracking: Tracking) -> None:
        with self.write() as conn:
            self._insert_tracking(conn, tracking)

    def _insert_tracking(self, conn: Connection, tracking: Tracking) -> None:
        t = tracking_table.c
        updated = conn.execute(
            sa.update(tracking_table)
            .where(t.application_name == tracking.application_name)
            .where(t.notification_id < tracking.notification_id)
            .values(notification_id=tracking.notification_id)
        )
        if updated.rowcount == 0:
            known = conn.execute(
                sa.select(t.notification_id).where(t.application_name == tracking.application_name)
            ).scalar()
            if known is not None:
                # Applying a position twice would apply its events twice.
                raise sa.exc.IntegrityError(
                    "tracking position already recorded", None, ValueError(tracking)
                )
            conn.execute(
                sa.insert(tracking_table).values(
                    application_name=tracking.application_name,
                    notification_id=tracking.notification_id,
                )
            )

    def max_tracking_id(self, application_name: str) -> int | None:
        with self.read() as conn:
            value = conn.execute(
                sa.select(tracking_table.c.notification_id).where(
                    tracking_table.c.application_name == application_name
                )
            ).scalar()
            return int(value) if value is not None else None


def _check_whole(numbers: Iterable[object]) -> None:
    """Refuse to write after revisions or versions read back as something
    other than whole numbers (SQLite keeps what a hand edit gives it)."""
    if any(n is not None and type(n) is not int for n in numbers):
        raise DamagedLog(
            "the log holds a revision or a model's version that is not a whole number; "
            "nothing was written (catalog-es verify tells which event was edited)"
        )


def _as_uuid(value: UUID | str) -> UUID:
    return UUID(value) if isinstance(value, str) else value


_PULLING = threading.Lock()


@dataclass(frozen=True)
class ChainedNotification(Notification):
    """A notification with its event's hash as stored (:mod:`catalog_es.chain`)."""

    hash: Any


class PulledPage(NamedTuple):
    """A follower's page (:meth:`SQLRecorder.pull_page`), and the revision
    its next read starts after, with the hash stored there."""

    notifications: list[ChainedNotification]
    read_to: int
    read_to_hash: Any


class PullingSubscription(Subscription[SQLRecorder]):
    """New notifications as they commit, pulled a page at a time on the thread
    that iterates, once it has used up the last page: an unread follower holds
    one page, however far behind the head it started. (eventsourcing's LISTEN
    subscription pulls ahead in a thread of its own into a queue of ten pages:
    two hundred unread watches from an early revision held 900 MB.) A page is
    ``page`` events or ``page_bytes`` of them, whichever comes first: of
    events of a definition with thousands of profiles, 32 unread streams held
    5 GB (hostile test). With nothing new it waits to be woken (:meth:`wake`),
    or ``interval`` seconds if that is set. Stops promptly when ``stop()`` is
    called from any thread.

    Given ``gt_hash``, the hash of the event at ``gt``, it checks each page
    follows on from the last event it gave (:meth:`SQLRecorder.pull_page`):
    a log replaced under it (a restored backup) ends it, rather than its
    events after the last given being given as if they followed it.

    Given ``containing``, only the events holding one of those bytes
    (:func:`holds_bytes`) are read: the database passes the others over."""

    page = 500
    page_bytes = 1 << 20
    interval: float | None = None

    def __init__(
        self,
        recorder: SQLRecorder,
        gt: int | None = None,
        topics: Sequence[str] = (),
        *,
        gt_hash: str | None = None,
        containing: Sequence[bytes] = (),
    ) -> None:
        super().__init__(recorder=recorder, gt=gt, topics=topics)
        self._buffer: deque[ChainedNotification] = deque()
        self._last_hash = gt_hash
        self._containing = containing
        self._woken = threading.Event()
        self._error: BaseException | None = None

    def wake(self) -> None:
        """A commit may have landed: pull before waiting again."""
        self._woken.set()

    def pulled(self) -> Sequence[ChainedNotification]:
        """The notifications pulled already, the next first: taking them waits
        for nothing (an event stream sends such ones together)."""
        return () if self._has_been_stopped else self._buffer

    def fail(self, error: BaseException) -> None:
        """End, raising ``error`` to the iterating thread (a watch subscribes again)."""
        if self._error is None:
            self._error = error
        self.stop()

    def stop(self) -> None:
        super().stop()
        self._woken.set()

    def __next__(self) -> ChainedNotification:
        while True:
            # Cleared before the stop is looked at and before the read: a stop
            # or a wake-up after this sets it again, and the wait ends at once.
            self._woken.clear()
            if self._has_been_stopped:
                if self._error is not None:
                    raise self._error
                raise StopIteration
            if self._buffer:
                break
            after = self._last_notification_id or 0
            # One follower of the process pulls a page at a time: fifty
            # catching up at once kept a server's other requests waiting
            # seconds, each of their threads wanting the interpreter's lock.
            with _PULLING:
                pulled = self._recorder.pull_page(
                    after,
                    self._last_hash,
                    self.page,
                    self.page_bytes,
                    self._topics,
                    self._containing,
                )
            self._buffer.extend(pulled.notifications)
            if not self._buffer:
                self._last_notification_id = pulled.read_to
                if self._last_hash is not None:
                    self._last_hash = pulled.read_to_hash
                self._woken.wait(self.interval)
        notification = self._buffer.popleft()
        self._last_notification_id = notification.id
        if self._last_hash is not None:
            self._last_hash = notification.hash
        return notification


class PollingSubscription(PullingSubscription):
    """The SQLite way: it has no LISTEN/NOTIFY, so it looks every ``interval``."""

    interval: float | None = 0.2


class ListenSubscription(PullingSubscription):
    """Woken by PostgreSQL's LISTEN/NOTIFY rather than by polling. Every
    wake-up reads what is after the last revision delivered, so a lost
    notification delays nothing past the next one, and a slow wake-up misses
    nothing. The LISTEN connection is the process's, shared (:class:`Listener`).
    With nothing heard it looks anyway every ``interval`` seconds: behind a
    connection pooler in transaction mode notifications are lost, and a
    watch waited for good."""

    interval: float | None = 10.0

    def __init__(
        self,
        recorder: SQLRecorder,
        gt: int | None = None,
        topics: Sequence[str] = (),
        *,
        gt_hash: str | None = None,
        containing: Sequence[bytes] = (),
    ) -> None:
        super().__init__(
            recorder=recorder, gt=gt, topics=topics, gt_hash=gt_hash, containing=containing
        )
        self._listener = recorder.listener()
        self._listener.add(self)

    def __exit__(self, *args: object, **kwargs: Any) -> None:
        self._listener.discard(self)
        super().__exit__(*args, **kwargs)


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


class Factory(InfrastructureFactory[TrackingRecorder]):
    """eventsourcing's way in: ``PERSISTENCE_MODULE=catalog_es.persistence``.
    The URL is the service's setting ``CATALOG_ES_DB`` (:meth:`Models.construct_env`)."""

    URL = "CATALOG_ES_DB"
    # Set to "no": where there is no log, raise NoLogYet rather than make it.
    MAKE_LOG = "CATALOG_ES_MAKE_LOG"
    # Set to "yes": a new, empty log in memory (empty_log_engine), not the URL's.
    IN_MEMORY = "CATALOG_ES_IN_MEMORY"

    def __init__(self, env: Environment) -> None:
        super().__init__(env)
        if self.env.get(self.IN_MEMORY) == "yes":
            self.engine = empty_log_engine()
        else:
            self.engine = create_engine(self.env.get(self.URL) or DEFAULT_URL)
        self._make_log = self.env.get(self.MAKE_LOG) != "no"
        self._recorder: SQLRecorder | None = None

    def recorder(self) -> SQLRecorder:
        if self._recorder is None:
            try:
                self._recorder = SQLRecorder(self.engine, make_log=self._make_log)
            except NoLogYet:
                self.engine.dispose()  # no service is made to close it
                raise
        return self._recorder

    def aggregate_recorder(self, purpose: str = "events") -> AggregateRecorder:
        return self.recorder()

    def application_recorder(self) -> ApplicationRecorder:
        return self.recorder()

    def tracking_recorder(
        self, tracking_recorder_class: type[TrackingRecorder] | None = None
    ) -> TrackingRecorder:
        return self.recorder()

    def process_recorder(self) -> ProcessRecorder:
        return self.recorder()

    def close(self) -> None:
        if self._recorder is not None:
            self._recorder.close()
        self.engine.dispose()
