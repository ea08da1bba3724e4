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

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, cast
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
    ConfigError,
    DamagedLog,
    LogRewritten,
    NoLogYet,
    StorageBusy,
    UpgradeFailed,
    shown,
)
from catalog_es.storage.engines import (
    LOCK_WAIT_OPTION,
    WRITE_OPTION,
    busy_timeout,
    create_engine,
    driver_in_transaction,
    empty_log_engine,
    end_transaction,
    is_busy,
    may_be_gone,
    on_the_driver,
    prepared_elsewhere,
    url_where,
)
from catalog_es.storage.listener import Listener
from catalog_es.storage.schema import (
    EVENT_TYPES,
    LOG_SCHEMA,
    REVISION_SEQUENCE,
    TEMPORARY_SCHEMA,
    TYPES_IN_THE_WAY,
    UNLINKED_COLUMNS,
    WRITERS_UPGRADED,
    channel_of,
    check_split,
    create,
    events_table,
    head_table,
    holds_bytes,
    log_tables_found,
    metadata,
    postgresql_rows,
    refusal_in_the_way,
    stream_walk,
    streams_table,
    tracking_table,
    unlinked,
)
from catalog_es.storage.sqlite_file import WRITER_CACHE_KIB, FileNotTheLog, sqlite_file_of
from catalog_es.storage.waits import (
    LOCK_SLICE_SECONDS,
    lock_wait_seconds,
    milliseconds,
    seconds_from_env,
)
from catalog_es.values import MAX_REVISION

DEFAULT_URL = "sqlite:///catalog.db"
# 0.2.0's NOTIFY channel for new events, one for the whole database. Its
# followers wait for it and nothing else (they never look by themselves), so
# every write notifies it too, until no 0.2.0 node or watch is left: a
# release after 0.3.0 drops it.
CHANNEL_OF_0_2 = "catalog_events"
# How long a PostgreSQL write may sit idle in its transaction, the log's lock
# held, before the server ends its session: a node stopped mid-write (a paused
# VM, SIGSTOP, a stuck process) held it for as long as it stayed stopped, and
# every other node's writes were refused. Deciding 100,000 changes takes 2 s.
WRITE_IDLE_SECONDS = 60.0
WRITE_IDLE_ENV = "CATALOG_ES_WRITE_IDLE"
# Rows per round trip when scanning the log.
PAGE_SIZE = 10_000

log = logging.getLogger("catalog_es")


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
        self.write_idle = seconds_from_env(WRITE_IDLE_ENV, WRITE_IDLE_SECONDS)
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
                and may_be_gone(self._writer.connection.driver_connection, self._writer_used)
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
                self._writer.execution_options(**{WRITE_OPTION: True})
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
                    # Its writes wait for the lock a slice at a time: the engine
                    # tries each one's BEGIN IMMEDIATE again, a slice each, until
                    # its wait is spent.
                    cursor.execute(f"PRAGMA busy_timeout = {milliseconds(LOCK_SLICE_SECONDS)}")
                    cursor.close()
                self._writer_pid = os.getpid()
            self._writer_used = time.monotonic()
            try:
                yield self._writer
            except sa.exc.SQLAlchemyError as error:
                # Waiting out another writer broke nothing: the connection, and
                # its cache, stay for the next write.
                busy = isinstance(error, sa.exc.OperationalError) and is_busy(error)
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
        process opened (:class:`~catalog_es.storage.sqlite_file.SQLiteFile`).
        Asked once a connection is in hand, inside the block that gives it
        back: asked as the pool hands it out, an interrupt there stranded
        connections until the pool ran dry (the interrupt test, once in a
        clean-clone CI run). A connection opened afresh is checked as it
        opens."""
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
            return self.dialect != "sqlite" or not driver_in_transaction(
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
            found, columns = log_tables_found(conn, names)
            if log:
                check_split(conn, found)
            if columns is not None and self.dialect == "postgresql":
                # Where the log is, which :meth:`log_schema` asked next:
                # four round trips more a process that writes (the pool's
                # check, BEGIN, the query, ROLLBACK).
                self._log_schema = found[events_table.name]
            if not self._to_make(tables, found) and not (columns is not None and unlinked(columns)):
                return
        # Asked here, the schema the log's table is made in when it is missing.
        schema = self.log_schema() if self.dialect == "postgresql" else None
        if schema == "":
            raise self._no_schema()
        if schema is not None and schema.startswith(TEMPORARY_SCHEMA):
            raise self._temporary_schema(schema)
        # The events table may not exist yet to LOCK: an advisory lock instead.
        with self.locked("catalog_es.tables", schema=schema) as conn:
            # Again under the lock: another node may have made it meanwhile.
            found, columns = log_tables_found(conn, names)
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
                    TYPES_IN_THE_WAY, {"names": [table.name for table in missing]}
                ).first()
                if in_the_way is not None:
                    raise refusal_in_the_way(conn, "a type", *in_the_way)
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
        added = [c for c in columns if c not in UNLINKED_COLUMNS]
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
                schema, found = conn.exec_driver_sql(LOG_SCHEMA).one()
            if not found:
                return str(schema)
            self._log_schema = str(schema)
        return self._log_schema

    # -- transactions ------------------------------------------------------------

    @contextmanager
    def write(
        self, wait: float | None = None, *, beside_commands: bool = False
    ) -> Iterator[Connection]:
        """A write transaction holding the log's write lock: one writer at a time,
        across processes and nodes. Committed at the end of the block, rolled
        back if it raises; :meth:`abandon` rolls it back early. ``wait``: the
        seconds left to wait for the lock, when less than ``lock_wait`` is
        (a command that queued behind another in this process).
        ``beside_commands``: on a connection of its own, not the one this
        process's commands write through, for a write made with none of the
        process's locks held (a snapshot's): on that one, a command of
        another thread waited for it to get the lock, then its own wait."""
        if self.dialect == "postgresql":
            # Found once, and not with the lock held: appends notify its channel.
            self.log_schema()
        with self._locked(
            "LOCK TABLE catalog_events IN EXCLUSIVE MODE", wait=wait, shared=not beside_commands
        ) as conn:
            yield conn

    def abandon(self, conn: Connection) -> None:
        """Roll back the transaction of ``conn`` (from :meth:`write`), which on
        SQLite may be the driver's alone, where ``conn.rollback()`` would not
        reach it."""
        if self.dialect == "sqlite":
            end_transaction(conn, conn.connection.driver_connection, commit=False)
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
                    on_the_driver(conn, self.lock_wait if wait is None else wait),
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
            if is_busy(error):
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
            conn.execution_options(**{WRITE_OPTION: True, LOCK_WAIT_OPTION: waiting})
            if self.dialect == "postgresql":
                # Its transaction is begun by hand, as the held writer's
                # (:meth:`_locked`); the pool puts the mode back as it is returned.
                conn.execution_options(isolation_level="AUTOCOMMIT")
            yield conn

    @contextmanager
    def _sliced(self, conn: Connection) -> Iterator[None]:
        """On SQLite, the pooled ``conn`` waits for the write lock a slice at a
        time until the block ends (the engine tries a write's BEGIN IMMEDIATE
        again after each slice, until its wait is spent); then, back in the
        pool, its reads wait in one ``lock_wait`` again, as every one's do."""
        if self.dialect != "sqlite":
            yield
            return
        busy_timeout(conn, LOCK_SLICE_SECONDS)
        try:
            yield
        finally:
            with suppress(self._dbapi_error, sa.exc.SQLAlchemyError):
                busy_timeout(conn, self.lock_wait)

    @contextmanager
    def write_beside(self) -> Iterator[Connection]:
        """A transaction that writes beside the log (a refused command's
        record), taking none of the log's locks: on PostgreSQL a plain one;
        on SQLite, where any write takes the database's one lock, on a pooled
        connection that waits for it as a write does (its BEGIN IMMEDIATE
        tried again a slice at a time), so that a stop acts between two, where
        an INSERT in a deferred transaction waited ``lock_wait`` in one."""
        if self.dialect != "sqlite":
            with self.engine.begin() as conn:
                yield conn
            return
        with self.engine.connect() as conn, self._sliced(conn):
            conn.execution_options(**{WRITE_OPTION: True})
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

    def column_pages(
        self, conn: Connection, query: sa.Select[Any], page_bytes: int
    ) -> Generator[Sequence[Any]]:
        """:meth:`column_values` of a text column, a page at a time: each of
        as many values as reach ``page_bytes`` characters of text (at least
        one), no more held at once (pages sized from the rows before them
        held thousands of large rows after a first of small ones; review).
        On PostgreSQL off a server-side cursor (psycopg's own holds every row
        before the first is given), planned as a read of all of them (a
        cursor's plan is otherwise made for its first tenth), which SQLAlchemy
        reads ahead of what it gives, up to 1,000 rows a round trip;
        SQLite's steps through them as they are read off it, as
        :meth:`column_values` reads them (as SQLAlchemy's rows, 200,000 views
        took 0.70 s, not 0.23)."""
        values: Iterable[Any]
        if self.dialect == "postgresql":
            conn.exec_driver_sql("SET LOCAL cursor_tuple_fraction = 1")
            result = conn.execute(query.execution_options(stream_results=True))
            values = result.scalars()
        else:
            result = conn.execute(query)
            # The sqlite3 cursor, iterated a row at a time (typed as a DBAPI one).
            values = (value for (value,) in cast("Iterable[tuple[Any]]", result.cursor))
        try:
            page: list[Any] = []
            held = 0
            for value in values:
                page.append(value)
                held += len(value) if isinstance(value, str | bytes) else 0
                if held >= page_bytes:
                    yield page
                    page, held = [], 0
            if page:
                yield page
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
                f" pg_sequence_last_value({REVISION_SEQUENCE}))"
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
        """The events in chunks of a thousand (``postgresql_rows``): one
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
            events, params = postgresql_rows(
                EVENT_TYPES,
                rows[start : start + 1000],
                "e (revision, originator_id, originator_version, topic, state, hash, previous)",
            )
            if start + 1000 < len(rows):
                cursor.execute(insert.format(events=events), params)
                continue
            # Each stream moves only where it is still at the version (and the
            # revision, where given) the write followed; a new one only where
            # it is still missing.
            wanted, more = postgresql_rows(
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
                f" pg_notify('{CHANNEL_OF_0_2}', ''), setval({REVISION_SEQUENCE}, %s)",
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


class Factory(InfrastructureFactory[TrackingRecorder]):
    """eventsourcing's way in: ``PERSISTENCE_MODULE=catalog_es.persistence``.
    The URL is the service's setting ``CATALOG_ES_DB``
    (:meth:`~catalog_es.application.Models.construct_env`)."""

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
