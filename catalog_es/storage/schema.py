"""The log's tables, the lookups that find them (and what stands in their
place) and make the missing ones, and the SQL the recorder builds on them:
a stream's walk, the hash chain's checks."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple
from uuid import UUID

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from catalog_es.errors import (
    DamagedLog,
)

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
    # made with it keep it, and the recorder reads its sequence too; on
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
UNLINKED_COLUMNS = {"revision", "originator_id", "originator_version", "topic", "state", "hash"}
# The log's columns that eventsourcing's own stored events have none of:
# another application of the library named Catalog keeps its events in a
# table named as the log's, with each of the others.
_LOG_OWN_COLUMNS = {"revision", "hash", "stream_previous"}


def unlinked(columns: Sequence[str]) -> bool:
    """Whether the log's table, of these ``columns``, is 0.1.0's, unlinked
    (no ``stream_previous``), though every table of today's is there: one
    made beside it by a release that did not bring it over (an operator's
    column on it stopped that)."""
    return set(columns) >= UNLINKED_COLUMNS and "stream_previous" not in columns


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
TYPES_IN_THE_WAY = (
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
            raise refusal_in_the_way(conn, _NOT_TABLES[kind], name, where)
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


def refusal_in_the_way(conn: Connection, what: str, name: str, where: str) -> DamagedLog:
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
    missing = [c.name for c in events_table.columns if c.name in UNLINKED_COLUMNS - set(columns)]
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
    raise refusal_in_the_way(conn, "a table", events_table.name, lacking)


def check_split(conn: Connection, found: Mapping[str, str]) -> None:
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
        needs = UNLINKED_COLUMNS if name == events_table.name else metadata.tables[name].c.keys()
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


def log_tables_found(conn: Connection, names: Sequence[str]) -> TablesFound:
    """:func:`tables_found`, refused where the log's table is no log, or a
    damaged one (:func:`_check_log_columns`)."""
    found = tables_found(conn, names)
    if found.log_columns is not None:
        _check_log_columns(conn, found.log_columns)
    return found


# The revision column's sequence on PostgreSQL (NULL if it has none, and the
# functions given it answer NULL): older releases numbered from it, and it is
# kept past every revision written, so none is handed out twice.
REVISION_SEQUENCE = "pg_get_serial_sequence('catalog_events', 'revision')::regclass"


def channel_of(schema: str) -> str:
    """The NOTIFY channel of the log in ``schema``: a catalog kept in another
    schema of the database wakes none of its followers. A channel is an
    identifier of at most 63 bytes, a schema's name any of them: a digest."""
    return f"catalog_events_{hashlib.sha256(schema.encode()).hexdigest()[:32]}"


# The schema the log's table is found in along the search path, or else the
# one tables are made in (empty when the path names no schema there is), and
# whether the table was found.
LOG_SCHEMA = (
    "SELECT coalesce(n.nspname, current_schema(), ''), n.nspname IS NOT NULL"
    " FROM (SELECT 1) AS one LEFT JOIN pg_class c ON c.oid = to_regclass('catalog_events')"
    " LEFT JOIN pg_namespace n ON n.oid = c.relnamespace"
)

# The schemas PostgreSQL makes for each session's temporary tables, and drops
# them from as it ends (a name no schema made by hand may have: pg_ is reserved).
TEMPORARY_SCHEMA = "pg_temp_"

# The events' columns on PostgreSQL, as append lays each row out.
EVENT_TYPES = ("bigint", "uuid", "bigint", "text", "bytea", "text", "bigint")


def postgresql_rows(
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
