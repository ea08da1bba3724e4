"""A SQLite log's file: its WAL mode and synchronous setting, and the
read-only look (:class:`SQLiteFile`) that leaves another program's file as
it was."""

from __future__ import annotations

import os
import sqlite3
import time
import weakref
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from catalog_es.errors import (
    ConfigError,
    StorageBusy,
    shown,
)
from catalog_es.storage.schema import TablesFound, log_tables_found
from catalog_es.storage.waits import LOCK_SLICE_SECONDS, milliseconds

SYNC_ENV = "CATALOG_ES_SQLITE_SYNC"
WAL_CHECKPOINT_PAGES = 4000
# What the -wal file is cut back to once a checkpoint has emptied it: a
# reader holding a transaction open keeps every write since in it (18 MB for
# 26,000 commands, a hostile test), and SQLite otherwise keeps the file at
# its largest until the last connection closes. Twice what a checkpoint
# leaves, so that the usual run never pays for cutting and growing it.
WAL_SIZE_LIMIT_BYTES = 2 * WAL_CHECKPOINT_PAGES * 4096
WRITER_CACHE_KIB = 16 * 1024


def into_wal(cursor: sqlite3.Cursor, wait: float) -> str:
    """WAL mode, which the file keeps once set; the journal mode SQLite
    answers, which is another where the URL opens the file so that WAL
    cannot be used (``nolock``, ``immutable``, a VFS without shared memory),
    and for a database in memory. Setting it on a new file takes
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
            (mode,) = cursor.execute("PRAGMA journal_mode=WAL").fetchone()
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
    return str(mode)


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
FILE_OF_ERROR = "catalog_es_where"


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
        # Those of the file and its -wal and -shm files that were not there
        # as this process first opened the path (see :meth:`unmade`).
        self._absent: list[Path] = []

    @property
    def where(self) -> str:
        """Where the file is, said for an operator: "at PATH", in full."""
        return f"at {self.path}"

    def name_in(self, error: BaseException) -> None:
        """Have ``error``, the driver's, name this file when it is told
        (:func:`~catalog_es.storage.engines.database_unusable`): SQLite's
        "unable to open database file" or "file is not a database" named
        none."""
        setattr(error, FILE_OF_ERROR, self.where)

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
        """Which of the tables ``names`` the path holds (:func:`log_tables_found`,
        refused as it refuses), told without a connection of the log's where
        one would change the file: no file, an empty one (``touch typo.db``),
        which it would make a database in, or another app's database, which
        it would turn to WAL mode (a setting kept in the file), looked at
        read-only: even one it refuses (a table of its own in the log's
        place). None for one in WAL mode already (every log is), which a
        connection leaves as it was, and one that cannot be looked at: left
        for the connection."""
        try:
            header = self._header()
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
                return log_tables_found(conn, names)
        except sa.exc.DBAPIError:
            return None
        finally:
            engine.dispose()

    def _header(self) -> bytes:
        """The file's SQLite header: fewer bytes, or none, in a file too short."""
        with self.path.open("rb") as file:
            return file.read(_SQLITE_HEADER_BYTES)

    def in_wal_mode(self) -> bool:
        """Whether the file's header says it is in WAL mode (no, if it cannot be read)."""
        try:
            return self._header()[18:20] == _WAL_VERSIONS
        except OSError:
            return False

    def opening(self) -> None:
        """Noted before a first open of the path (SQLite makes the file if
        it is not there): which of the file and the -wal and -shm files
        beside it are not there yet."""
        beside = [self.path.with_name(f"{self.path.name}{end}") for end in ("-wal", "-shm")]
        self._absent = [path for path in (self.path, *beside) if not path.exists()]

    def unmade(self) -> None:
        """After a refused first open (:meth:`opening`): the file removed,
        with the -wal and -shm files beside it, if that open made it and it
        is still empty; a refusal had left a new empty file behind. A file
        that was there before, or that another process has written into
        since, is left as it is."""
        if self.opened is not None or self.path not in self._absent:
            return
        with suppress(OSError):  # the refusal is the error to tell
            if self.path.stat().st_size == 0:
                for path in self._absent:
                    path.unlink(missing_ok=True)

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
SQLITE_FILES: weakref.WeakKeyDictionary[Engine, SQLiteFile] = weakref.WeakKeyDictionary()


def sqlite_file_of(engine: Engine) -> SQLiteFile | None:
    """The file a SQLite engine made here keeps its log in; ``None`` otherwise."""
    return SQLITE_FILES.get(engine)
