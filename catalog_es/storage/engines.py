"""Engines on the log's URL: made and settled (SQLite's pragmas, PostgreSQL's
connection checks and prepared statements behind a pooler), the driver's
transactions and lock waits, and which errors mean the database is
unusable rather than the log damaged."""

from __future__ import annotations

import inspect
import logging
import os
import re
import select
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from itertools import pairwise
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit

import sqlalchemy as sa
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
from sqlalchemy.engine import Connection, Engine

from catalog_es.errors import (
    SHOWN_LENGTH,
    ConfigError,
    first_line,
    missing_folder,
    shown,
)
from catalog_es.storage.sqlite_file import (
    FILE_OF_ERROR,
    SQLITE_FILES,
    WAL_CHECKPOINT_PAGES,
    WAL_SIZE_LIMIT_BYTES,
    FileNotTheLog,
    SQLiteFile,
    into_wal,
    sqlite_synchronous,
)
from catalog_es.storage.waits import LOCK_SLICE_SECONDS, lock_wait_seconds, milliseconds

log = logging.getLogger("catalog_es")


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
    if not _uri_true(url):
        return path  # "file:" and all
    if path.startswith("file:"):  # read as a URI (_read_as_uri): %-escaped, a host or not
        return unquote(urlsplit(path).path)
    # A path, "%" and all, which SQLAlchemy gives with the URL's SQLite
    # settings after a "?" ("a.db?nolock=1"): SQLite opens it as named.
    try:
        (name,), _ = SQLiteDialect_pysqlite().create_connect_args(url)
    except ValueError:  # a setting refused as the engine is made (timeout=abc)
        return path
    return str(name)


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
        # Each connection's first wait, for WAL mode, goes in slices (into_wal).
        engine = sa.create_engine(url, connect_args={"timeout": LOCK_SLICE_SECONDS})
        file = SQLITE_FILES[engine] = SQLiteFile(Path(_sqlite_file(url)).absolute())

        @sa.event.listens_for(engine, "do_connect")
        def _opening(
            _dialect: Any, _record: Any, cargs: list[Any], cparams: dict[str, Any]
        ) -> None:
            if file.opened is not None:
                file.check()  # gone, emptied or replaced: said as such, and not opened
                file.existing_only(cargs, cparams)
            else:
                file.opening()  # what it makes is its to remove if it is refused

        @sa.event.listens_for(engine, "handle_error")
        def _failed(context: sa.engine.ExceptionContext) -> None:
            # Its opening's too (a folder, a file not SQLite's).
            file.name_in(context.original_exception)

        _settle_sqlite(engine, file, wait, _without_shared_memory(url))
        return engine
    engine = postgresql_engine(url)
    _asked_when_idle(engine)
    _check_connection_settings(engine, url)
    _unprepared_behind_a_pooler(engine)
    return engine


def _settle_sqlite(
    engine: Engine, file: SQLiteFile | None, wait: float, unshared: Sequence[str] = ()
) -> None:
    """The settings and transactions the log relies on, on a SQLite engine:
    ``file``, the one it keeps the log in (none in memory); ``wait``, its
    lock wait; ``unshared``, its URL's settings that open the file without
    the locks and shared memory of WAL mode (:func:`_without_shared_memory`)."""
    synchronous = sqlite_synchronous()

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        try:
            _settled(dbapi_connection)
        except BaseException:
            dbapi_connection.close()  # refused: no pool takes it to close
            if file is not None:
                file.unmade()
            raise

    def _settled(dbapi_connection: Any) -> None:
        # Let us issue BEGIN ourselves (pysqlite's own is deferred and late).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            mode = into_wal(cursor, wait)
        except sqlite3.OperationalError as error:
            # SQLite's "unable to open database file" named neither the
            # setting nor WAL mode.
            cannot_open = getattr(error, "sqlite_errorname", "") == "SQLITE_CANTOPEN"
            if file is None or not unshared or not cannot_open or not file.in_wal_mode():
                raise
            settings = " and ".join(unshared)
            plural = "s" if len(unshared) > 1 else ""
            raise ConfigError(
                f"the database {file.where}: SQLite cannot open it with the URL's {settings}"
                f" setting{plural}, as it is in {_WAL_NEEDED}: give the URL without "
                f"{'them' if plural else 'it'}"
            ) from None
        if file is not None and mode != "wal":
            # The writer's busy timeout is short (LOCK_SLICE_SECONDS) as, in
            # WAL, no reader holds off its commit; nolock lets two writers in
            # at once; immutable reads skip the commits in the -wal file.
            raise ConfigError(
                f"the database {file.where}: SQLite keeps it in {mode} journal mode as "
                f"the URL opens it, not in {_WAL_NEEDED}: give the URL without its "
                "vfs, nolock or immutable setting"
            )
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
            if driver_in_transaction(driver):
                # A statement made through SQLAlchemy inside a write begun on
                # the driver (:func:`on_the_driver`) joins that transaction.
                return
            # A second transaction, which the block's end would commit.
            raise sa.exc.InvalidRequestError(
                "this write was rolled back inside its block: end the block"
            )
        options = connection.get_execution_options()
        # On the driver: through exec_driver_sql this statement cost a
        # command more than its insert did.
        if options.get(WRITE_OPTION, False):
            _begin_write(driver, options.get(LOCK_WAIT_OPTION, wait))
        else:
            _driver(driver, "BEGIN")

    @sa.event.listens_for(engine, "commit")
    def _commit(connection: Connection) -> None:
        if connection.info.get(_OPEN_WRITE):
            # Committing part of a write would let go of the lock inside it.
            raise sa.exc.InvalidRequestError(
                "a write is committed when its block ends, not inside it"
            )


# Said of a SQLite file the URL keeps out of WAL mode.
_WAL_NEEDED = "WAL mode, which the log needs (readers that neither hold off a write nor miss one)"
# SQLite's VFSs that have no shared memory, which WAL mode needs.
_VFS_UNSHARED = ("unix-none", "unix-dotfile")


def _without_shared_memory(url: sa.URL) -> list[str]:
    """The settings of SQLite URL ``url`` that open its file without the
    locks and shared memory WAL mode needs, as given ("nolock=1"): SQLite
    opens no file in WAL mode so. None unless the URL is read as a URI
    (:func:`_read_as_uri`): SQLite is given no other setting."""
    if not _read_as_uri(url):
        return []
    found = []
    for name, values in url.query.items():
        for value in (values,) if isinstance(values, str) else values:
            if (name == "nolock" and _sqlite_true(value)) or (
                name == "vfs" and value in _VFS_UNSHARED
            ):
                found.append(f"{name}={value}")
    return found


def _read_as_uri(url: sa.URL) -> bool:
    """Whether SQLite reads the database of URL ``url`` as a URI, with the
    URL's settings: its ``uri`` true (:func:`_uri_true`), and the database
    starting "file:", as SQLite reads a URI (in that case: it opens
    "FILE:a.db" or "a%2541.db" as named). Else SQLite is given a path."""
    return (url.database or "").startswith("file:") and _uri_true(url)


def _uri_true(url: sa.URL) -> bool:
    """Whether the ``uri`` of URL ``url`` is true, as SQLAlchemy reads a boolean."""
    value = url.query.get("uri")
    if not isinstance(value, str):
        return value is not None  # given twice: a tuple, which SQLAlchemy takes as true
    try:
        return bool(sa.util.asbool(value))
    except ValueError:  # refused by SQLAlchemy as the engine connects
        return False


def _sqlite_true(value: str) -> bool:
    """A URI's boolean parameter as SQLite reads it: a number not 0, on, yes or true."""
    number = re.match(r"\d+", value)
    if number is not None:
        return int(number.group()) != 0
    return value.lower() in ("on", "yes", "true")


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
    meanwhile (:func:`may_be_gone`); a connection made for this checkout is
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
        if returned is None or not may_be_gone(dbapi_connection, returned):
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


def may_be_gone(driver: Any, used: float) -> bool:
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
                if not is_busy(error) or time.monotonic() >= deadline:
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
# The writer connection's execution option: on SQLite, its transactions begin
# with BEGIN IMMEDIATE (the lock taken at once, not at the first write).
WRITE_OPTION = "catalog_write"
# A SQLite connection's execution option: the seconds its write transactions
# wait for the lock (a command queued behind another in this process has
# less than the lock wait left).
LOCK_WAIT_OPTION = "catalog_lock_wait"


def driver_in_transaction(driver: Any) -> bool:
    """Whether the sqlite3 connection is in a transaction; the error of a closed
    one wrapped as :func:`_driver` wraps them, so the writer lets it go."""
    try:
        return bool(driver.in_transaction)
    except sqlite3.Error as error:
        raise sa.exc.DBAPIError.instance("in_transaction", None, error, sqlite3.Error) from None


@contextmanager
def on_the_driver(conn: Connection, wait: float) -> Iterator[None]:
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
        end_transaction(conn, driver, commit=True)
    except BaseException:
        # Invalidated (an interrupt in a driver call), its transaction went
        # with its connection; touched, it would connect afresh, and the held
        # writer be kept without a writer's settings.
        if not conn.invalidated:
            with suppress(sa.exc.SQLAlchemyError):  # the first error is the one to tell
                conn.info[_OPEN_WRITE] = False
                end_transaction(conn, driver, commit=False)
        raise


def end_transaction(conn: Connection, driver: Any, *, commit: bool) -> None:
    if conn.in_transaction():
        if commit:
            conn.commit()
        else:
            conn.rollback()
    elif driver_in_transaction(driver):
        _driver(driver, "COMMIT" if commit else "ROLLBACK")


def busy_timeout(conn: Connection, seconds: float) -> None:
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
        return Unusable(said + hint, lasting, str(getattr(driver, FILE_OF_ERROR, "")))
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


def is_busy(error: sa.exc.OperationalError) -> bool:
    text = str(error.orig).lower()
    return "database is locked" in text or "database is busy" in text or "lock timeout" in text
