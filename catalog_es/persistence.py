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

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
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

from catalog_es.chain import GENESIS, ChainHead, ChainRow, link
from catalog_es.errors import StorageBusy

DEFAULT_URL = "sqlite:///catalog.db"
# How long a writer waits for another to let go of the database before the
# command is refused with a clear error rather than "database is locked".
LOCK_WAIT_SECONDS = 10.0
# Rows per round trip when scanning the log.
PAGE_SIZE = 10_000

metadata = sa.MetaData()
_bigint = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

events_table = sa.Table(
    "catalog_events",
    metadata,
    # AUTOINCREMENT on SQLite: a revision is never reused, even after the last
    # row is deleted (which verify must be able to notice).
    sa.Column("revision", _bigint, primary_key=True, autoincrement=True),
    sa.Column("originator_id", sa.Uuid(), nullable=False),
    sa.Column("originator_version", _bigint, nullable=False),
    sa.Column("topic", sa.Text(), nullable=False),
    sa.Column("state", sa.LargeBinary(), nullable=False),
    # sha256 hex of the previous event's hash and this event (catalog_es.chain).
    sa.Column("hash", sa.String(64), nullable=False),
    sa.UniqueConstraint("originator_id", "originator_version", name="catalog_events_stream"),
    sqlite_autoincrement=True,
)

# The last revision and its hash, kept apart from the events so that deleting
# the last events is noticed too. One row, written with the events it covers.
head_table = sa.Table(
    "catalog_head",
    metadata,
    sa.Column("id", sa.Integer(), sa.CheckConstraint("id = 1"), primary_key=True),
    sa.Column("revision", _bigint, nullable=False),
    sa.Column("hash", sa.String(64), nullable=False),
)

# Commands that were refused: who tried what, and why. Not events: they have
# no revision and never change the catalog.
refusals_table = sa.Table(
    "catalog_refusals",
    metadata,
    sa.Column("id", _bigint, primary_key=True, autoincrement=True),
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
    sa.Column("notification_id", _bigint, nullable=False),
)


def create_engine(url: str) -> Engine:
    """An engine with the settings the log relies on."""
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"timeout": LOCK_WAIT_SECONDS})

        @sa.event.listens_for(engine, "connect")
        def _connect(dbapi_connection: Any, _record: Any) -> None:
            # Let us issue BEGIN ourselves (pysqlite's own is deferred and late).
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            # FULL: a command reported as written survives a power cut too.
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.close()

        @sa.event.listens_for(engine, "begin")
        def _begin(connection: Connection) -> None:
            write = connection.get_execution_options().get("catalog_write", False)
            connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

        return engine
    return sa.create_engine(url, pool_pre_ping=True)


def _is_busy(error: sa.exc.OperationalError) -> bool:
    text = str(error.orig).lower()
    return "database is locked" in text or "database is busy" in text or "lock timeout" in text


class SQLRecorder(ProcessRecorder):
    """Events, notifications and tracking positions in one database."""

    def __init__(self, engine: Engine, *, create_tables: bool = True) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        if create_tables:
            metadata.create_all(engine)

    # -- transactions ------------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A write transaction holding the log's write lock: one writer at a time,
        across processes and nodes."""
        try:
            with self.engine.connect() as conn:
                conn.execution_options(catalog_write=True)
                with conn.begin():
                    if self.dialect == "postgresql":
                        conn.exec_driver_sql(
                            f"SET LOCAL lock_timeout = '{int(LOCK_WAIT_SECONDS * 1000)}ms'"
                        )
                        conn.exec_driver_sql("LOCK TABLE catalog_events IN EXCLUSIVE MODE")
                    yield conn
        except sa.exc.OperationalError as error:
            if _is_busy(error):
                raise StorageBusy(
                    f"the database stayed locked by another writer for {LOCK_WAIT_SECONDS:g} s; "
                    "nothing was written, try again"
                ) from None
            raise

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read transaction: one consistent view of the log."""
        with self.engine.connect() as conn, conn.begin():
            yield conn

    # -- events ------------------------------------------------------------------

    def insert_events(
        self,
        stored_events: Sequence[StoredEvent],
        *,
        conn: Connection | None = None,
        tracking: Tracking | None = None,
        **_: Any,
    ) -> Sequence[int] | None:
        """Append events, chained onto the head; ``conn`` must come from :meth:`write`."""
        if conn is None:
            with self.write() as own:
                return self.insert_events(stored_events, conn=own, tracking=tracking)
        revisions: list[int] = []
        if stored_events:
            head = self.chain_head(conn)
            chained = head.hash if head is not None else GENESIS
            rows = []
            for e in stored_events:
                originator_id = _uuid(e.originator_id)
                chained = link(chained, originator_id, e.originator_version, e.topic, e.state)
                rows.append(
                    {
                        "originator_id": originator_id,
                        "originator_version": e.originator_version,
                        "topic": e.topic,
                        "state": e.state,
                        "hash": chained,
                    }
                )
            statement = sa.insert(events_table).returning(
                events_table.c.revision, sort_by_parameter_order=True
            )
            revisions = list(conn.execute(statement, rows).scalars())
            new_head = {"revision": revisions[-1], "hash": chained}
            if head is None:
                conn.execute(sa.insert(head_table).values(id=1, **new_head))
            else:
                conn.execute(sa.update(head_table).values(**new_head))
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
        query = sa.select(t.originator_id, t.originator_version, t.topic, t.state).where(
            t.originator_id == _uuid(originator_id)
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

    def max_notification_id(self) -> int | None:
        with self.read() as conn:
            return self.head(conn) or None

    def head(self, conn: Connection) -> int:
        """The last revision in the log, 0 when it is empty."""
        value = conn.execute(sa.select(sa.func.max(events_table.c.revision))).scalar()
        return int(value or 0)

    def stream_version(self, conn: Connection, originator_id: UUID) -> int:
        """The last version in an aggregate's stream, 0 for a new one. Read from
        the rows, not the catalog: a record replay skipped still holds its place."""
        t = events_table.c
        value = conn.execute(
            sa.select(sa.func.max(t.originator_version)).where(t.originator_id == originator_id)
        ).scalar()
        return int(value or 0)

    def chain_head(self, conn: Connection) -> ChainHead | None:
        """The head of the hash chain as stored, ``None`` before the first event."""
        row = conn.execute(sa.select(head_table.c.revision, head_table.c.hash)).first()
        return ChainHead(revision=row[0], hash=row[1]) if row is not None else None

    def scan(
        self, conn: Connection, after: int = 0, upto: int | None = None
    ) -> Iterator[tuple[int, str, bytes]]:
        """``(revision, topic, state)`` after a revision, in order, in large pages."""
        t = events_table.c
        for row in self._pages(conn, (t.revision, t.topic, t.state), after, upto):
            yield row[0], row[1], row[2]

    def scan_chain(self, conn: Connection) -> Iterator[ChainRow]:
        """Every stored event with its hash, in revision order."""
        t = events_table.c
        # The id as stored, not parsed: a hand-edited one is a broken link, not a crash.
        stored_id = sa.type_coerce(t.originator_id, sa.String())
        columns = (t.revision, stored_id, t.originator_version, t.topic, t.state, t.hash)
        for row in self._pages(conn, columns, 0, None):
            yield ChainRow(*row)

    def _pages(
        self,
        conn: Connection,
        columns: Sequence[sa.ColumnElement[Any]],
        after: int,
        upto: int | None,
    ) -> Iterator[sa.Row[Any]]:
        """Keyset paging on the primary key: each page is an index range scan.
        The first column must be the revision."""
        t = events_table.c
        while True:
            query = sa.select(*columns).where(t.revision > after)
            if upto is not None:
                query = query.where(t.revision <= upto)
            rows = conn.execute(query.order_by(t.revision).limit(PAGE_SIZE)).all()
            yield from rows
            if len(rows) < PAGE_SIZE:
                return
            after = rows[-1][0]

    def subscribe(
        self, gt: int | None = None, topics: Sequence[str] = ()
    ) -> Subscription[ApplicationRecorder]:
        return PollingSubscription(self, gt=gt, topics=topics)

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


def _uuid(value: UUID | str) -> UUID:
    return UUID(value) if isinstance(value, str) else value


class PollingSubscription(Subscription[ApplicationRecorder]):
    """New notifications as they commit, by polling: the SQLite way (it has no
    LISTEN/NOTIFY). Stops promptly when ``stop()`` is called from any thread."""

    interval = 0.2

    def __init__(
        self, recorder: SQLRecorder, gt: int | None = None, topics: Sequence[str] = ()
    ) -> None:
        super().__init__(recorder=recorder, gt=gt, topics=topics)
        self._buffer: list[Notification] = []
        self._stopped = threading.Event()

    def stop(self) -> None:
        super().stop()
        self._stopped.set()

    def __next__(self) -> Notification:
        while not self._buffer:
            if self._stopped.is_set():
                raise StopIteration
            self._buffer = list(
                self._recorder.select_notifications(
                    start=self._last_notification_id or 0,
                    limit=500,
                    topics=self._topics,
                    inclusive_of_start=False,
                )
            )
            if not self._buffer:
                self._stopped.wait(self.interval)
        notification = self._buffer.pop(0)
        self._last_notification_id = notification.id
        return notification


class Factory(InfrastructureFactory[TrackingRecorder]):
    """eventsourcing's way in: ``PERSISTENCE_MODULE=catalog_es.persistence``.
    The URL comes from ``CATALOG_ES_DB``."""

    URL = "CATALOG_ES_DB"

    def __init__(self, env: Environment) -> None:
        super().__init__(env)
        self.engine = create_engine(self.env.get(self.URL) or DEFAULT_URL)
        self._recorder: SQLRecorder | None = None

    def recorder(self) -> SQLRecorder:
        if self._recorder is None:
            self._recorder = SQLRecorder(self.engine)
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
        self.engine.dispose()
