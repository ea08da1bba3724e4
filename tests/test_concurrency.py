"""Several processes on one database at once (issue 7): no lost update, no
"database is locked" for the operator, and a bounded wait with a clear error.

The writers are separate OS processes, forked from a server that has the
stack imported already (``forkserver``), so a test can start many of them.
"""

from __future__ import annotations

import contextlib
import dis
import json
import logging
import multiprocessing
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.context import ForkServerContext
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from eventsourcing.persistence import Tracking

from catalog_es import application, commands
from catalog_es.application import Models
from catalog_es.bootstrap import SNAPSHOT_ENV
from catalog_es.catalog import Catalog
from catalog_es.catalog_lock import CatalogLock
from catalog_es.cli import cli
from catalog_es.errors import (
    DamagedLog,
    InvalidModel,
    ModelNotFound,
    Refused,
    RevisionConflict,
    StorageBusy,
)
from catalog_es.inputs import DeclaredConfig, load_config
from catalog_es.model import Model, model_id, utc_now
from catalog_es.persistence import WRITE_IDLE_ENV, SQLRecorder
from catalog_es.ports import Applier, NoApplier
from catalog_es.rollback import plan_rollback
from catalog_es.spec import ModelSpec, Scaling
from catalog_es.storage.engines import create_engine, database_unusable
from catalog_es.storage.schema import events_table
from catalog_es.storage.sqlite_file import (
    SYNC_ENV,
    WAL_CHECKPOINT_PAGES,
    WAL_SIZE_LIMIT_BYTES,
    WRITER_CACHE_KIB,
)
from catalog_es.storage.waits import LOCK_WAIT_ENV, LOCK_WAIT_SECONDS, holds
from projections import snapshots
from tests.helpers import (
    PUT_THE_HEAD_BACK,
    config_yaml,
    count_events,
    event,
    model_data,
    model_spec,
    newest_snapshot,
    round_trips,
    schema_of,
)


def forkserver() -> ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["catalog_es.application", "catalog_es.cli"])
    return context


def _start_and_add(url: str, name: str, start: Any, out: Any) -> None:
    start.wait()
    try:
        Models(DeclaredConfig(), env={"CATALOG_ES_DB": url}).add(model_spec(name), by=name)
        out.put((name, "ok"))
    except Exception as error:
        out.put((name, f"{type(error).__name__}: {error}"))


def test_nodes_starting_at_once_on_a_new_database_all_start(db_url: str) -> None:
    """Six nodes started together on a database with no tables yet: one
    creates them, the others wait for it, and all serve."""
    context = forkserver()
    nodes = 6
    start, out = context.Barrier(nodes), context.Queue()
    workers = [
        context.Process(target=_start_and_add, args=(db_url, f"n{i}", start, out))
        for i in range(nodes)
    ]
    for w in workers:
        w.start()
    outcomes = dict(out.get(timeout=60) for _ in workers)
    for w in workers:
        w.join(timeout=30)
    assert outcomes == {f"n{i}": "ok" for i in range(nodes)}
    assert count_events(db_url) == nodes


def _increment(url: str, name: str, increments: int, start: Any, out: Any) -> None:
    """Read the counter, write it plus one on the grounds of what was read
    (``expected_revision``), retry when someone else got there first."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    start.wait()
    conflicts, done = 0, 0
    try:
        while done < increments:
            current = models.get_model(name)["scaling"]["max"]
            try:
                models.scale(
                    name,
                    None,
                    current + 1,
                    by=f"pid{os.getpid()}",
                    expected_revision=models.revision,
                )
                done += 1
            except RevisionConflict:
                conflicts += 1
        out.put((conflicts, ""))
    except Exception as error:
        out.put((conflicts, f"{type(error).__name__}: {error}"))


def test_no_update_is_lost_under_contention(tmp_path: Path) -> None:
    """Six processes each add one to a counter twenty times on one SQLite
    file: every read-modify-write that succeeded is in the total, none
    overwrote another."""
    url = f"sqlite:///{tmp_path}/contended.db"
    Models(DeclaredConfig(), env={"CATALOG_ES_DB": url}).add(model_spec("counter"), by="setup")
    context = forkserver()
    processes, increments = 6, 20
    start, out = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(target=_increment, args=(url, "counter", increments, start, out))
        for _ in range(processes)
    ]
    for w in workers:
        w.start()
    outcomes = [out.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(timeout=30)
    assert [error for _, error in outcomes if error] == []
    conflicts = sum(conflicts for conflicts, _ in outcomes)
    assert conflicts > 0, "the processes never contended"
    print(f"contention: {processes * increments} increments, {conflicts} retried after a conflict")
    reader = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    assert reader.get_model("counter")["scaling"]["max"] == 1 + processes * increments
    assert count_events(url) == 1 + processes * increments
    assert reader.skipped() == []


def _cli_commands(url: str, worker: int, commands: int, start: Any, out: Any) -> None:
    """Commands as an operator types them, through the CLI, each one opening
    the database afresh, racing the other workers on a shared model."""
    runner = CliRunner()
    start.wait()
    outcomes = []
    for i in range(commands):
        if i % 3 == 0:
            args, text = ["model", "add", "-"], json.dumps(model_data(f"w{worker}-{i}"))
        elif i % 3 == 1:
            args, text = ["model", "scale", "shared", "--max", str(100 * worker + i)], None
        else:
            args, text = ["model", "list"], None
        result = runner.invoke(cli, ["--db", url, "--json", *args], input=text)
        outcomes.append((args, result.exit_code, result.stdout, result.stderr))
    out.put(outcomes)


def test_cli_under_contention_never_reports_a_locked_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/contended.db"
    Models(DeclaredConfig(), env={"CATALOG_ES_DB": url}).add(model_spec("shared"), by="setup")
    context = forkserver()
    processes, commands = 4, 24
    start, out = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(target=_cli_commands, args=(url, worker, commands, start, out))
        for worker in range(processes)
    ]
    for w in workers:
        w.start()
    outcomes = [o for _ in workers for o in out.get(timeout=120)]
    for w in workers:
        w.join(timeout=30)
    failures = [(args, code, err) for args, code, _, err in outcomes if code != 0 or err]
    assert failures == []
    writes = [json.loads(stdout) for args, _, stdout, _ in outcomes if args[1] != "list"]
    revisions = sorted(w["revision"] for w in writes)
    assert revisions == list(range(2, 2 + len(writes))), "a write is missing or answered twice"
    assert count_events(url) == 1 + len(writes)
    # Blind writes: what is in force is what the last one in log order wrote.
    last_scale = max(
        (w for w in writes if w["removed"] is None and w["model"]["name"] == "shared"),
        key=lambda w: w["revision"],
    )
    reader = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    assert reader.get_model("shared") == last_scale["model"]
    assert reader.skipped() == []


# -- the bounded wait -----------------------------------------------------------------


@contextmanager
def write_lock_held(url: str) -> Iterator[None]:
    """Another connection holding the log's write lock, as a writer stuck
    mid-transaction would: raw sqlite3 ``BEGIN IMMEDIATE``, or PostgreSQL's
    table lock."""
    if url.startswith("sqlite"):
        raw = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        raw.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            raw.execute("ROLLBACK")
            raw.close()
        return
    engine = sa.create_engine(url)
    with engine.connect() as conn, conn.begin():
        conn.exec_driver_sql("LOCK TABLE catalog_events IN EXCLUSIVE MODE")
        yield
    engine.dispose()


def catalog_es(url: str, *args: str, wait: str = "0.5") -> tuple[int, str, str, float]:
    """The real command line, in a process of its own: exit code, stdout,
    stderr and how long it took."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CATALOG_ES_")}
    env[LOCK_WAIT_ENV] = wait
    started = time.monotonic()
    done = subprocess.run(
        # In the test's own folder (the fixture's): not this repo's catalog.yaml.
        [sys.executable, "-m", "catalog_es", "--db", url, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout, done.stderr, time.monotonic() - started


def refused_as_busy(outcome: tuple[int, str, str, float], message: str) -> None:
    """Exit 1 with ``message`` as the one line, nothing on stdout, and after
    the half second asked for, not the default ten: the whole run took less
    than those ten (its start-up, seconds on a loaded machine, took 7.7 s
    against a bound of 5 once, with four test runs beside it)."""
    code, stdout, stderr, took = outcome
    assert (code, stderr.splitlines(), stdout) == (1, [message], "")
    assert took < LOCK_WAIT_SECONDS


def test_a_held_write_lock_refuses_a_command_after_the_bounded_wait(db_url: str) -> None:
    Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url}).add(model_spec("m"), by="setup")
    rows = count_events(db_url)
    with write_lock_held(db_url):
        # Readers do not wait for writers.
        code, stdout, stderr, _ = catalog_es(db_url, "--json", "model", "list")
        assert (code, stderr) == (0, "")
        assert [m["name"] for m in json.loads(stdout)] == ["m"]
        refused_as_busy(
            catalog_es(db_url, "model", "scale", "m", "--max", "3"),
            "error: the database stayed locked by another writer for 0.5 s; "
            "nothing was written, try again",
        )
    assert count_events(db_url) == rows
    code, _, stderr, _ = catalog_es(db_url, "model", "scale", "m", "--max", "3")
    assert (code, stderr) == (0, "")
    assert count_events(db_url) == rows + 1


# The command line (its arguments after the script's), saying on stderr that
# it is about to wait for another process's lock, and waiting for a line on
# stdin, the test's go, before it does: {waiting} names the call that waits,
# as the module calling it (audit, persistence or engines) has it.
WAITING = """
import sys
from catalog_es import audit, persistence
from catalog_es.storage import engines
from catalog_es.__main__ import main
waiting = {waiting}
def told(*args, **kwargs):
    print("waiting", file=sys.stderr, flush=True)
    sys.stdin.readline()
    return waiting(*args, **kwargs)
{waiting} = told
sys.argv = ["catalog-es", *sys.argv[1:]]
main()
"""
STOPS = pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])


def stopped_while_waiting(
    waiting: str, stop: signal.Signals, *args: str, held: Callable[[], Any] = contextlib.nullcontext
) -> None:
    """The command line ``args``, sent ``stop`` half a second into its wait
    for another process's lock (30 s at most), stops within a second, saying
    `Aborted!`: with 1 of a Ctrl-C; a SIGTERM ends the process by it.
    ``held``: the lock taken as the command is about to wait, not before."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CATALOG_ES_")}
    command = subprocess.Popen(
        [sys.executable, "-c", WAITING.format(waiting=waiting), *args],
        env={**env, LOCK_WAIT_ENV: "30"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert command.stderr is not None
    assert command.stdin is not None
    assert command.stderr.readline() == "waiting\n"
    with held():
        command.stdin.write("\n")
        command.stdin.flush()
        time.sleep(0.5)  # well inside the wait
        stopped = time.monotonic()
        command.send_signal(stop)
        out, err = command.communicate(timeout=60)
    took = time.monotonic() - stopped
    status = 1 if stop == signal.SIGINT else -stop
    assert (command.returncode, out, err) == (status, "", "\nAborted!\n")
    assert took < 1, f"the stop took {took:.1f} s to act"


@STOPS
def test_a_stop_while_a_write_waits_for_the_lock_acts_at_once(
    db_url: str, stop: signal.Signals
) -> None:
    """A Ctrl-C, or a supervisor's SIGTERM, sent to a command waiting for
    another process's write lock on SQLite acted only once the whole wait was
    over (7.7 s of the default 10 measured): SQLite's busy handler sleeps in C,
    where no signal handler runs. The wait goes in slices of 0.1 s, and the
    stop acts between two, as on PostgreSQL; nothing is written."""
    Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url}).add(model_spec("m"), by="setup")
    rows = count_events(db_url)
    with write_lock_held(db_url):
        scale = ["--db", db_url, "model", "scale", "m", "--max", "3"]
        stopped_while_waiting("persistence.SQLRecorder.write", stop, *scale)
    assert count_events(db_url) == rows


@STOPS
def test_a_stop_while_waiting_for_a_locked_file_not_yet_in_wal_mode_acts_at_once(
    tmp_path: Path, stop: signal.Signals
) -> None:
    """Another program's file (not yet WAL), its writer holding it: a command
    on it waits to put it in WAL mode, and a stop acted only once the wait
    was over; the file is left as it was."""
    path = tmp_path / "older.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE theirs (a)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        stopped_while_waiting(
            "engines.into_wal", stop, "--db", f"sqlite:///{path}", "model", "list"
        )
    finally:
        holder.execute("ROLLBACK")
    assert holder.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    holder.close()


@STOPS
def test_a_stop_while_a_refusals_record_waits_for_the_lock_acts_at_once(
    tmp_path: Path, stop: signal.Signals
) -> None:
    """A refused command records its refusal in a transaction of its own,
    after the refused one let go of the lock: another process taking the
    lock between the two held the record's INSERT in SQLite's busy handler,
    where a stop acted only once the whole wait was over. The record waits
    as a write does, in slices, and the stop acts between two; nothing is
    recorded."""
    url = f"sqlite:///{tmp_path}/catalog.db"
    Models(DeclaredConfig(), env={"CATALOG_ES_DB": url}).add(model_spec("m"), by="setup")
    scale = ["--db", url, "model", "scale", "nope", "--max", "3"]
    stopped_while_waiting(
        "audit.AuditTrail.record_refusal", stop, *scale, held=lambda: write_lock_held(url)
    )
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM catalog_refusals").scalar() == 0
    engine.dispose()
    assert count_events(url) == 1


def test_a_write_waits_out_its_whole_bound_in_slices_that_let_signal_handlers_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait for a SQLite write lock ends, refused with the same line,
    once the bound is past by the clock (0.35 s: three slices and a half),
    and signal handlers run meanwhile (a timer's, every 20 ms), where one
    wait in SQLite's busy handler ran none until it was over, and ended
    after 0.18 s: SQLite counts the sleeps it asked for, which the signals
    cut short. The upper bound leaves room for a loaded machine."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "0.35")
    url = f"sqlite:///{tmp_path}/catalog.db"
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    models.add(model_spec("m"), by="setup")
    handled: list[float] = []
    previous = signal.signal(signal.SIGALRM, lambda *_: handled.append(time.monotonic()))
    try:
        with write_lock_held(url):
            started = time.monotonic()
            signal.setitimer(signal.ITIMER_REAL, 0.02, 0.02)
            try:
                with pytest.raises(StorageBusy) as refused:
                    models.scale("m", 0, 3, by="ops")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            took = time.monotonic() - started
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert str(refused.value) == (
        "the database stayed locked by another writer for 0.35 s; nothing was written, try again"
    )
    assert 0.35 <= took < 1, f"refused after {took:.3f} s"
    during = [t - started for t in handled if t - started < 0.3]
    assert len(during) >= 2, f"signal handlers ran at {during} s of the wait alone"
    assert count_events(url) == 1
    models.close()


@pytest.mark.parametrize("stopped_when", ["deciding", "appended"])
def test_a_postgresql_node_stopped_mid_write_lets_go_of_the_lock_within_a_bound(
    pg_url: str, stopped_when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node stopped in the middle of a write (a paused VM, SIGSTOP) held the
    log's lock for as long as it stayed stopped: every other node's writes
    were refused, with no end (hostile test). The server ends a write's
    session once it sits idle in its transaction for ``write_idle`` seconds;
    the stopped node's write, when it goes on, is refused as the database
    gone (not as an unexpected error: review) and writes nothing. The bound
    is ``CATALOG_ES_WRITE_IDLE`` seconds, 60 by default."""
    other = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    monkeypatch.setenv(WRITE_IDLE_ENV, "1")
    stopped = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    stopped.add(model_spec("m"), by="setup")
    holding, go_on = threading.Event(), threading.Event()
    outcome: list[BaseException | int] = []

    def stop() -> None:
        holding.set()
        go_on.wait()

    def plan(batch: Any) -> None:
        if stopped_when == "deciding":
            stop()
        commands.scale("m", 0, 5).decide(batch)

    append = stopped.store.append

    def append_then_stop(*args: Any, **kwargs: Any) -> Any:
        appended = append(*args, **kwargs)
        stop()
        return appended

    if stopped_when == "appended":
        monkeypatch.setattr(stopped.store, "append", append_then_stop)

    def write() -> None:
        try:
            outcome.append(stopped.write_plan(plan, by="stopped")[0])
        except BaseException as error:
            outcome.append(error)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert holding.wait(10)
        started = time.monotonic()
        other.scale("m", 0, 3, by="ops")
        assert time.monotonic() - started < other.store.lock_wait
    finally:
        go_on.set()
    writer.join(10)
    # What the CLI and HTTP tell as "the database could not be used".
    assert len(outcome) == 1 and isinstance(outcome[0], BaseException), outcome
    assert database_unusable(outcome[0]) is not None, outcome
    assert [(e["by"], e["event"]) for e in other.log_events()][-1] == ("ops", "Scaled")
    assert other.get_model("m")["scaling"] == {"min": 0, "max": 3}
    # The stopped node writes again once it goes on.
    stopped.scale("m", 1, 4, by="stopped")
    assert other.get_model("m")["scaling"] == {"min": 1, "max": 4}
    stopped.close()
    other.close()


_READS_INSIDE_A_WRITE = """
import sys
from catalog_es.persistence import SQLRecorder, create_engine

store = SQLRecorder(create_engine(sys.argv[1]))
with store.write() as conn:
    # A read far larger than the sockets hold, as a catch-up page can be.
    conn.exec_driver_sql("SELECT repeat('x', 1000) FROM generate_series(1, 50000)").all()
"""


def test_a_postgresql_node_stopped_while_it_is_sent_a_read_lets_go_of_the_lock(
    pg_url: str, pg_admin: sa.Engine
) -> None:
    """Stopped while the server still sent it a large read inside its write,
    a node's session was not idle but waiting to send, and held the log's
    lock with no end (review). What it leaves unacknowledged ends the
    session after ``CATALOG_ES_WRITE_IDLE`` seconds too."""
    SQLRecorder(create_engine(pg_url)).close()  # the tables
    env = {**os.environ, WRITE_IDLE_ENV: "1"}
    node = subprocess.Popen([sys.executable, "-c", _READS_INSIDE_A_WRITE, pg_url], env=env)

    def sending() -> list[tuple[Any, ...]]:
        with pg_admin.connect() as conn:
            return [
                tuple(row)
                for row in conn.exec_driver_sql(
                    "SELECT a.pid, a.wait_event FROM pg_stat_activity a JOIN pg_locks l"
                    " ON l.pid = a.pid AND l.mode = 'ExclusiveLock' AND l.relation IS NOT NULL"
                    " WHERE a.query LIKE 'SELECT repeat%%' AND a.application_name = %(own)s",
                    {"own": schema_of(pg_url)},
                )
            ]

    try:
        deadline = time.monotonic() + 20
        while not sending():
            assert node.poll() is None and time.monotonic() < deadline
            time.sleep(0.005)
        node.send_signal(signal.SIGSTOP)
        time.sleep(1)
        assert sending(), "the read ended before the node was stopped"
        deadline = time.monotonic() + 6
        while sending():
            assert time.monotonic() < deadline, sending()
            time.sleep(0.1)
    finally:
        node.kill()
        node.wait()


Outcomes = list[tuple[str, float]]


def timed(outcomes: Outcomes, call: Callable[[], object], done: str) -> Callable[[], None]:
    """``call``, as a thread's target that adds to ``outcomes`` how it ended
    (``done``, or the refusal of a busy database) and in how many seconds."""

    def run() -> None:
        start = time.monotonic()
        try:
            call()
            outcomes.append((done, time.monotonic() - start))
        except StorageBusy as busy:
            outcomes.append((str(busy), time.monotonic() - start))

    return run


def test_a_server_waiting_for_another_writer_still_answers_reads_and_refuses_in_time(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one process serving many requests, a command waiting for another
    process's write lock holds up neither the reads of the catalog in force
    nor, past the one bounded wait, the commands queued behind it: each is
    refused within that wait of its own start, not one wait after another."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "1")
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("m"), by="setup")
    rows = count_events(db_url)
    outcomes: Outcomes = []
    scale = timed(outcomes, lambda: models.scale("m", 0, 3, by="ops"), "written")
    with write_lock_held(db_url):
        commands_ = [threading.Thread(target=scale) for _ in range(3)]
        for thread in commands_:
            thread.start()
            time.sleep(0.05)
        start = time.monotonic()
        assert [m["name"] for m in models.list_models()] == ["m"]
        assert models.get_model("m")["scaling"]["max"] == 1
        assert models.skipped() == []
        models.refresh()
        assert time.monotonic() - start < 0.5, "reads waited for the writes"
        assert all(thread.is_alive() for thread in commands_)
        for thread in commands_:
            thread.join()
    assert all("stayed locked" in outcome for outcome, _ in outcomes), outcomes
    assert max(seconds for _, seconds in outcomes) < 1.5, outcomes
    assert count_events(db_url) == rows
    models.scale("m", 0, 3, by="ops")  # the full wait again, and the write goes
    assert count_events(db_url) == rows + 1
    models.close()


def test_a_write_queued_in_the_process_is_refused_naming_the_lock_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command waiting for this process's write lock, which another
    thread's write holds, is refused past the lock wait in words that name
    that wait, as it is set when the command waits (the words are made once
    a wait, not by every write)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{tmp_path / 'c.db'}"})
    models.add(model_spec("m"), by="setup")
    rows = count_events(f"sqlite:///{tmp_path / 'c.db'}")
    planning, planned = threading.Event(), threading.Event()

    def slow_plan(_batch: Any) -> None:
        planning.set()
        planned.wait(10)

    writer = threading.Thread(target=models.write_plan, args=(slow_plan,), kwargs={"by": "slow"})
    writer.start()
    try:
        assert planning.wait(10)
        for lock_wait in (0.1, 0.2):
            monkeypatch.setattr(models.store, "lock_wait", lock_wait)
            with pytest.raises(StorageBusy) as refused:
                models.scale("m", 0, 3, by="ops")
            assert str(refused.value) == (
                f"the log stayed locked by another write for {lock_wait:g} s; "
                "nothing was written, try again"
            )
    finally:
        planned.set()
        writer.join()
    assert count_events(f"sqlite:///{tmp_path / 'c.db'}") == rows
    models.close()


def test_a_dry_run_rollback_neither_waits_for_nor_holds_up_writers(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dry run writes nothing, so it reads one view of the log without the
    write lock: a reader's dry-run rollback of a large catalog held every
    node's writes while it planned, for seconds (hostile test). With another
    writer holding the lock, it answers at once, from the head it read."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "1")
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("m"), by="setup")
    added = models.revision
    models.scale("m", 0, 3, by="ops")
    rows = count_events(db_url)
    with write_lock_held(db_url):
        dry = models.rollback(added, dry_run=True, by="reader")
    assert (dry["revision"], dry["written"]) == (added + 1, False)
    assert dry["events"] == [
        {"model": "m", "event": "Scaled", "fields": {"scaling": {"min": 1, "max": 1}}}
    ]
    assert dry["diff"] == models.diff(added + 1, added)
    assert count_events(db_url) == rows
    models.close()


def test_a_dry_run_rollback_diffs_from_the_head_it_read_while_a_write_lands(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Holding no lock, a dry run may see another write land while it plans:
    its diff is still from the head it read, not from the catalog in force
    once the plan is made."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("m"), by="setup")
    added = models.revision
    models.scale("m", 0, 3, by="ops")
    plan = plan_rollback

    def plan_while_another_writes(*args: Any, **kwargs: Any) -> list[str]:
        meanwhile = threading.Thread(target=models.scale, args=("m", 0, 5), kwargs={"by": "x"})
        meanwhile.start()
        meanwhile.join()
        return plan(*args, **kwargs)

    monkeypatch.setattr(application, "plan_rollback", plan_while_another_writes)
    dry = models.rollback(added, dry_run=True, by="reader")
    assert models.revision == dry["revision"] + 1  # the other write landed meanwhile
    (change,) = dry["diff"]["changed"]
    assert change["fields"]["scaling"]["before"] == {"min": 0, "max": 3}
    assert dry["diff"] == models.diff(dry["revision"], added)
    models.close()


def test_audit_queries_waiting_for_another_writer_are_refused_within_one_wait(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audit query first writes the rows of the events since the last one,
    under the write lock. Queued behind each other while another process
    holds it, each is refused within the one bounded wait of its own start,
    not one wait after another; nothing is written, and the next answers."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "1")
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("m"), by="setup")
    models.audit()
    models.scale("m", 0, 3, by="ops")  # a row for the queries to write first
    outcomes: Outcomes = []
    query = timed(outcomes, lambda: models.history("m"), "answered")
    with write_lock_held(db_url):
        queries = [threading.Thread(target=query) for _ in range(4)]
        for thread in queries:
            thread.start()
            time.sleep(0.05)
        for thread in queries:
            thread.join()
    # PostgreSQL's audit lock is not the log's: it does not wait at all.
    if db_url.startswith("sqlite"):
        assert all("stayed locked" in outcome for outcome, _ in outcomes), outcomes
    else:
        assert [outcome for outcome, _ in outcomes] == ["answered"] * 4
    assert max(seconds for _, seconds in outcomes) < 1.5, outcomes
    assert [row["event"] for row in models.history("m")] == ["Added", "Scaled"]
    models.close()


def test_an_audit_query_behind_a_long_catch_up_in_its_process_is_refused_in_time(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another query of this process bringing the rows up to the log (a long
    one, after a large `apply`) holds them: a query behind it is refused once
    the bounded wait is over, rather than waiting for it however long."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "1")
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("m"), by="setup")
    outcomes: Outcomes = []
    query = timed(outcomes, models.audit, "answered")
    with models._audit.lock:  # as the long catch-up holds it
        waiting = threading.Thread(target=query)
        waiting.start()
        waiting.join(timeout=3)
    assert not waiting.is_alive()
    [(outcome, seconds)] = outcomes
    assert outcome.startswith("the audit rows stayed locked for 1 s") and seconds < 1.5
    assert [row["event"] for row in models.audit()] == ["Added"]
    models.close()


def test_reads_go_on_while_this_process_plans_a_batch(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch is planned on a copy of the catalog while no other writer can
    move the log: reads of the catalog in force (a server's, in other
    threads) go on meanwhile, where they waited for the whole batch (a
    20,000-change apply made them wait 3.3 s), and see it once committed."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("m"), by="setup")
    planning, go_on = threading.Event(), threading.Event()
    decide = commands.Step.decide

    def slowly(step: commands.Step, batch: Any) -> Any:
        planning.set()
        go_on.wait(10)
        return decide(step, batch)

    monkeypatch.setattr(commands.Step, "decide", slowly)
    writer = threading.Thread(
        target=lambda: models.apply_changes([commands.scale("m", 0, 2)], by="ops")
    )
    writer.start()
    try:
        assert planning.wait(10)

        def read() -> None:
            models.refresh()
            models.list_models()

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(timeout=2)
        assert not reader.is_alive(), "reads waited for the batch being planned"
        assert models.get_model("m")["scaling"]["max"] == 1
    finally:
        go_on.set()
        writer.join()
    assert models.get_model("m")["scaling"]["max"] == 2
    models.close()


def test_a_batch_does_not_take_back_what_a_read_caught_up_with_after_its_commit(
    db_url: str,
) -> None:
    """Between a batch's commit and its taking the catalog again, a read may
    catch up with the log: the batch's changes, and another writer's after
    them. The batch then leaves the catalog as that read left it, rather
    than putting its own copy back, which would hide the other writer's; and
    the applier is handed that catalog with the revision it is at."""

    class Recording(NoApplier):
        def __init__(self) -> None:
            self.pushed: list[tuple[int, dict[str, int]]] = []

        def replace_catalog(self, models: Sequence[ModelSpec], revision: int) -> None:
            self.pushed.append((revision, {m.name: m.scaling.max for m in models}))

    applier = Recording()
    models = Models(DeclaredConfig(), applier=applier, env={"CATALOG_ES_DB": db_url})
    other = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("m"), by="setup")
    models.add(model_spec("n"), by="setup")
    committed, go_on = threading.Event(), threading.Event()
    writer_takes = 0

    class Pausing(CatalogLock):
        """The catalog's lock, holding up the writer as it takes it again."""

        def acquire(self, *, write: bool = False) -> None:
            nonlocal writer_takes
            if threading.current_thread() is writer:
                writer_takes += 1
                # Before the write lock, inside it, then committed and coming
                # back for the catalog.
                if writer_takes == 3:
                    committed.set()
                    go_on.wait(10)
            super().acquire(write=write)

    models._state = Pausing()
    writer = threading.Thread(
        target=lambda: models.apply_changes([commands.scale("m", 0, 2)], by="ops")
    )
    writer.start()
    try:
        assert committed.wait(10)
        other.scale("n", 0, 3, by="elsewhere")
        models.refresh()
    finally:
        go_on.set()
        writer.join()
    assert models.revision == other.revision
    assert [models.get_model(name)["scaling"]["max"] for name in ("m", "n")] == [2, 3]
    assert applier.pushed[-1] == (other.revision, {"m": 2, "n": 3})
    models.close()
    other.close()


@pytest.mark.parametrize("several", [False, True])
def test_a_write_interrupted_just_after_it_takes_the_catalog_lets_go_of_it(
    db_url: str, several: bool
) -> None:
    """An interrupt (Ctrl-C) landing after a take of the catalog's lock and
    before the write noted it held it left the lock taken for good: every
    read of the process then waited forever (review: 25 in 460 interrupts).
    Each of the write's takes, interrupted: the next read goes through."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("m"), by="setup")
    state = models._state
    acquire = state.acquire
    takes = 3 if several else 2  # the pass-through, in the transaction, after a batch

    for interrupted in range(1, takes + 1):
        taken = 0

        def acquire_then_interrupted(*, write: bool = False, at: int = interrupted) -> None:
            nonlocal taken
            acquire(write=write)
            taken += 1
            if taken == at:
                raise KeyboardInterrupt

        state.acquire = acquire_then_interrupted  # type: ignore[method-assign]
        try:
            with pytest.raises(KeyboardInterrupt):
                if several:
                    models.apply_changes([commands.scale("m", 0, 2 + interrupted)], by="ops")
                else:
                    models.scale("m", 0, 2 + interrupted, by="ops")
        finally:
            state.acquire = acquire  # type: ignore[method-assign]
        assert state.depth() == 0, interrupted
        read = threading.Thread(target=models.list_models, daemon=True)
        read.start()
        read.join(5)
        assert not read.is_alive(), f"the lock was kept after take {interrupted}"
    models.close()


def test_a_write_holding_the_log_waits_for_one_read_at_most_however_many_threads_read(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write holds the log's lock, which every node's writes queue behind,
    while it waits for its own node's catalog. Threads reading nonstop (an
    HTTP server's) took it back before the write woke, read after read: each
    write then held the log 16-87 ms (90th percentile) behind 4-16 readers.
    The read under way when the write comes is the one it waits for: none
    that begins after it."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.apply_changes([commands.add(model_spec(f"m{i}")) for i in range(300)], by="setup")
    holding_the_log, stop = threading.Event(), threading.Event()
    reads_meanwhile: list[int] = []
    write = models.store.write

    @contextmanager
    def marked(wait: float | None = None) -> Iterator[sa.Connection]:
        with write(wait) as conn:
            if threading.current_thread() is writer:
                reads_meanwhile.append(0)
                holding_the_log.set()
            try:
                yield conn
            finally:
                holding_the_log.clear()

    def read() -> None:
        while not stop.is_set():
            began_meanwhile = holding_the_log.is_set()
            models.list_models()
            if began_meanwhile and holding_the_log.is_set():
                reads_meanwhile[-1] += 1

    monkeypatch.setattr(models.store, "write", marked)
    # Daemons, waited for within bounds: a lock that never comes back fails
    # the test rather than hang the run.
    readers = [threading.Thread(target=read, daemon=True) for _ in range(4)]
    writer = threading.Thread(
        target=lambda: [models.scale("m0", 0, 2 + i % 2, by="ops") for i in range(20)],
        daemon=True,
    )
    for thread in readers:
        thread.start()
    try:
        writer.start()
        writer.join(30)
    finally:
        stop.set()
        for thread in readers:
            thread.join(5)
    assert len(reads_meanwhile) == 20
    # A read (rarely two) may begin between the write taking the log's lock
    # and its asking for the catalog's; none after that (before: up to 23).
    assert max(reads_meanwhile) <= 2, reads_meanwhile
    models.close()


def test_a_server_restarting_on_the_recorded_config_starts_while_another_writes(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve` records its config at start: one the log has recorded already
    needs no write, so another node's long write neither holds it up nor
    refuses it. A config to record still waits for the lock, within the bound."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "0.5")
    recorded, other = tmp_path / "recorded.yaml", tmp_path / "other.yaml"
    recorded.write_text(config_yaml(model_spec("declared")))
    other.write_text(config_yaml(model_spec("declared"), model_spec("more")))
    first = Models(load_config(str(recorded)), env={"CATALOG_ES_DB": db_url})
    first.add(model_spec("m"), by="setup")
    rows = count_events(db_url)
    with write_lock_held(db_url):
        again = Models(load_config(str(recorded)), env={"CATALOG_ES_DB": db_url})
        start = time.monotonic()
        assert again.record_declaration(by="node") == first.revision
        assert time.monotonic() - start < 0.4
        changed = Models(load_config(str(other)), env={"CATALOG_ES_DB": db_url})
        with pytest.raises(StorageBusy):
            changed.record_declaration(by="node")
    assert count_events(db_url) == rows
    assert changed.record_declaration(by="node") == rows + 1
    for models in (first, again, changed):
        models.close()


def test_a_server_starting_on_the_recorded_config_asks_where_the_log_stands_in_one_statement(
    pg_url: str, tmp_path: Path
) -> None:
    """On a log that has its config recorded, ``serve``'s start reads, after
    its load, only whether the log moved since: in a read transaction, its
    BEGIN and COMMIT were two round trips more. Moved by another node
    meanwhile, it starts on what that node wrote."""
    config = tmp_path / "recorded.yaml"
    config.write_text(config_yaml(model_spec("declared")))
    first = Models(load_config(str(config)), env={"CATALOG_ES_DB": pg_url})
    first.add(model_spec("m"), by="setup")
    node = Models(load_config(str(config)), env={"CATALOG_ES_DB": pg_url})
    with round_trips(node.store.engine) as trips:
        assert node.record_declaration(by="node") == first.revision
    assert len(trips) == 1, trips
    written = first.scale("m", 0, 2, by="elsewhere").revision
    assert node.record_declaration(by="node") == written
    assert node.get_model("m")["scaling"] == {"min": 0, "max": 2}
    first.close()
    node.close()


class _AnotherWriterMeanwhile(Applier):
    """Once armed, lets another process's connection take the write lock
    while the catalog is pushed, and hold it for ``seconds``: between a
    command's commit and the snapshot it then writes."""

    def __init__(self, path: Path, seconds: float) -> None:
        self.path, self.seconds = path, seconds
        self.armed = False
        self.locked, self.let_go = threading.Event(), threading.Event()

    def replace_catalog(self, models: Any, revision: int) -> None:
        if self.armed:
            self.armed = False
            threading.Thread(target=self._hold).start()
            self.locked.wait()

    def replace_replicas(self, model: Any, revision: int) -> None:
        raise NotImplementedError

    def _hold(self) -> None:
        raw = sqlite3.connect(self.path, isolation_level=None)
        raw.execute("BEGIN IMMEDIATE")
        self.locked.set()
        time.sleep(self.seconds)
        raw.execute("ROLLBACK")
        raw.close()
        self.let_go.set()


def _snapshotting_beside_another_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lock_wait: str, held: float = 1.0
) -> tuple[Models, _AnotherWriterMeanwhile]:
    """A service snapshotting at every write, model ``m`` added, whose next
    push has another process take the write lock for ``held`` seconds."""
    monkeypatch.setenv(LOCK_WAIT_ENV, lock_wait)
    path = tmp_path / "c.db"
    applier = _AnotherWriterMeanwhile(path, seconds=held)
    models = Models(
        DeclaredConfig(),
        applier=applier,
        snapshot_interval=1,
        env={"CATALOG_ES_DB": f"sqlite:///{path}"},
    )
    models.add(model_spec("m"), by="setup")
    applier.armed = True
    return models, applier


def test_reads_do_not_wait_for_a_snapshot_waiting_for_another_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models, applier = _snapshotting_beside_another_writer(tmp_path, monkeypatch, "3")
    command = threading.Thread(target=lambda: models.scale("m", 0, 3, by="ops"))
    command.start()
    assert applier.locked.wait(5)
    time.sleep(0.1)  # the command is writing its snapshot, and waits
    start = time.monotonic()
    assert models.get_model("m")["scaling"]["max"] == 3
    assert time.monotonic() - start < 0.5, "a read waited for the snapshot"
    assert command.is_alive()
    command.join()
    with models.store.read() as conn:
        assert newest_snapshot(conn, DeclaredConfig().fingerprint) == models.revision
    models.close()


def test_a_snapshot_the_database_stays_locked_for_is_left_and_the_write_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot only saves time: one whose save waits out the lock wait for
    another process is not saved, and the write that made it due answers
    as written, neither of this process's locks left held."""
    models, applier = _snapshotting_beside_another_writer(tmp_path, monkeypatch, "0.3")
    assert models.scale("m", 0, 3, by="ops").revision == 2
    assert (holds(models._lock), models._state.depth()) == (0, 0)
    assert applier.let_go.wait(5)
    with models.store.read() as conn:
        assert newest_snapshot(conn, DeclaredConfig().fingerprint) == 1
    assert models.scale("m", 1, 3, by="ops").revision == 3
    with models.store.read() as conn:
        assert newest_snapshot(conn, DeclaredConfig().fingerprint) == 3
    models.close()


def test_a_writer_waits_no_longer_than_the_lock_wait_beside_a_snapshot_waiting_for_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot saved with the process's write lock let go waited for the
    database's lock on the connection the process's commands write through:
    a command of another thread waited for it to give up, then out its own
    lock wait, refused after twice the wait (1.96 s where it is 1 s; review).
    Saved on a connection of its own, the command waits its own wait alone."""
    models, applier = _snapshotting_beside_another_writer(tmp_path, monkeypatch, "1", held=2.5)
    command = threading.Thread(target=lambda: models.scale("m", 0, 3, by="ops"))
    command.start()
    try:
        assert applier.locked.wait(5)
        time.sleep(0.1)  # the command is saving its snapshot, and waits for the lock
        started = time.monotonic()
        with pytest.raises(StorageBusy):
            models.scale("m", 1, 3, by="another thread")
        assert time.monotonic() - started < 1.5
    finally:
        command.join()
    assert models.get_model("m")["scaling"]["max"] == 3
    models.close()


def test_reads_do_not_wait_for_a_snapshot_being_encoded(
    service: Callable[..., Models], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that takes a snapshot encoded the catalog with it held: every
    read waited about 5 ms for 10,000 models, ten times that for 100,000,
    every snapshot interval. The catalog is let go first now; what the
    snapshot keeps was taken as the write left it, and a read meanwhile
    answers at once."""
    models = service(snapshot_interval=2)
    models.add(model_spec("m"), by="setup")
    encoding, read = threading.Event(), threading.Event()
    encode = snapshots.encode

    def slow_encode(state: snapshots.SnapshotState) -> bytes:
        encoding.set()
        read.wait(10)  # until the read below answers: for good, were it to wait for this
        return encode(state)

    monkeypatch.setattr(snapshots, "encode", slow_encode)
    command = threading.Thread(target=lambda: models.scale("m", 0, 3, by="ops"))
    command.start()
    assert encoding.wait(10)
    service().scale("m", 1, 3, by="another node")
    start = time.monotonic()
    # Caught up with the other node's write, as the snapshot is encoded.
    assert models.get_model("m")["scaling"] == {"min": 1, "max": 3}
    read.set()
    assert time.monotonic() - start < 5, "a read waited for the snapshot"
    command.join()
    # The snapshot holds the catalog as the write left it (one of a later
    # catalog would not serve: its hash is not the log's at revision 2).
    catalog = Catalog()
    with models.store.read() as conn:
        assert snapshots.restore(conn, catalog, DeclaredConfig().fingerprint, upto=None)
    kept = catalog.get("m")
    assert catalog.revision == 2 and kept is not None and kept.scaling == Scaling(min=0, max=3)


def _written_while_held(monkeypatch: pytest.MonkeyPatch, name: str, models: Models) -> int:
    """The revision another thread's write of ``m`` answers while
    ``snapshots.<name>`` is held up in one thread's write of it."""
    held, written = threading.Event(), threading.Event()
    real = getattr(snapshots, name)

    def held_up(*args: Any, **kwargs: Any) -> Any:
        held.set()
        written.wait(10)  # until the other write is done
        return real(*args, **kwargs)

    monkeypatch.setattr(snapshots, name, held_up)
    command = threading.Thread(target=lambda: models.scale("m", 0, 3, by="ops"))
    command.start()
    try:
        assert held.wait(10)
        return models.scale("m", 1, 3, by="another thread").revision
    finally:
        written.set()
        command.join()


def test_writers_do_not_wait_for_a_snapshot_another_write_of_the_process_saves(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that made a snapshot due encoded and saved it holding this
    process's write lock: every other writer of the process (a server's
    handlers) waited for it, 120 ms for 100,000 models where a write alone
    took 4. It is saved once that lock is let go now, as the write left
    the catalog, and the other writer's write goes on meanwhile."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "1")  # refused after that, were it to wait
    models = Models(DeclaredConfig(), snapshot_interval=2, env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("m"), by="setup")
    assert _written_while_held(monkeypatch, "encode", models) == 3
    # The snapshot saved holds the catalog as the first write left it.
    catalog = Catalog()
    with models.store.read() as conn:
        assert snapshots.restore(conn, catalog, DeclaredConfig().fingerprint, upto=None)
    kept = catalog.get("m")
    assert catalog.revision == 2 and kept is not None and kept.scaling == Scaling(min=0, max=3)
    models.close()


def test_a_writer_does_not_wait_for_the_encoding_of_a_large_snapshot(db_url: str) -> None:
    """msgspec holds the GIL through a call: a snapshot of 100,000 models
    encoded in one kept every other thread of the process (a server's
    handlers) from running, and a write of one waited 65-90 ms, where it
    takes 3-7 alone. Its models are encoded a slice at a time now, the GIL
    let go between: a write made meanwhile answers in a small part of the
    encoding's time (it answered at three quarters of it or after, as the
    compression, which lets go of the GIL, began)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("m"), by="setup")
    defined = model_spec("large")
    state = snapshots.SnapshotState(
        revision=1,
        last_timestamp=None,
        recorded_declaration=None,
        aggregates=[Model(f"large-{i}", 1, defined) for i in range(200_000)],
        skipped=[],
    )
    encoding = threading.Event()
    written: list[float] = []

    def write() -> None:
        assert encoding.wait(10)
        models.scale("m", 0, 3, by="another thread")
        written.append(time.perf_counter())

    writer = threading.Thread(target=write)
    writer.start()
    started = time.perf_counter()
    encoding.set()
    snapshots.encode(state)
    encoded = time.perf_counter() - started
    writer.join()
    assert written, "the write failed"
    waited = written[0] - started
    assert waited < encoded / 2, f"the write answered {waited:.3f} s in, of {encoded:.3f} s"
    models.close()


def test_writers_do_not_wait_for_the_lookup_of_a_config_put_back(
    service: Callable[..., Models],
    write_config: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A write recording its config over another's looks up whether the log
    recorded it before (to warn of a config put back): it looked holding
    this process's write lock, every other writer of the process waiting
    for it. It looks once that lock is let go now."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "1")  # refused after that, were it to wait
    service(write_config(config_yaml(model_spec("base")))).add(model_spec("m"), by="a node")
    models = service(write_config(config_yaml(model_spec("base"), model_spec("extra"))))
    # Its config recorded at 3, over the other node's at 1; its change at 4.
    assert _written_while_held(monkeypatch, "last_replaced", models) == 5
    assert models.get_model("m")["scaling"] == {"min": 1, "max": 3}


def test_a_locked_file_not_yet_in_wal_mode_is_reported_busy(tmp_path: Path) -> None:
    # A file made by another program, in SQLite's default journal mode, whose
    # writer holds it: putting it in WAL mode needs the whole file.
    path = tmp_path / "older.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE theirs (a)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        outcome = catalog_es(f"sqlite:///{path}", "model", "list")
    finally:
        holder.execute("ROLLBACK")
    refused_as_busy(
        outcome,
        "error: the database stayed locked by another process for 0.5 s, before it could "
        "be put in WAL mode; nothing was read or written, try again",
    )
    assert holder.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    tables = holder.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    assert tables == [("theirs",)]
    holder.close()


def test_a_read_of_a_locked_file_not_yet_in_wal_mode_waits_the_bounded_wait_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read on such a file looked at it read-only first (to leave another
    app's file as it was), and that look waited out SQLite's own 5 s on the
    lock before the bounded wait began: refused as locked "for 0.5 s" after
    5.5. The look does not wait; in process, with no start-up to count."""
    path = tmp_path / "older.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE theirs (a)")
    holder.execute("BEGIN EXCLUSIVE")
    monkeypatch.setenv(LOCK_WAIT_ENV, "0.5")
    try:
        started = time.monotonic()
        refused = CliRunner().invoke(cli, ["--db", f"sqlite:///{path}", "model", "list"])
        took = time.monotonic() - started
    finally:
        holder.close()
    assert (refused.exit_code, refused.stderr.splitlines()) == (
        1,
        [
            "error: the database stayed locked by another process for 0.5 s, before it could"
            " be put in WAL mode; nothing was read or written, try again"
        ],
    )
    assert took < 3


@pytest.mark.parametrize(("sync", "level"), [(None, 2), ("NORMAL", 1), ("full", 2)])
def test_every_connection_to_a_file_keeps_the_settings_the_log_relies_on(
    sync: str | None, level: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # FULL unless told otherwise (a command reported as written survives a power
    # cut), and checkpoints rare enough that a batch of a thousand changes does
    # not pay for one (it rewrites most pages of catalog_streams);
    # the one connection commands write through caches 16 MB of pages.
    if sync is not None:
        monkeypatch.setenv(SYNC_ENV, sync)
    engine = create_engine(f"sqlite:///{tmp_path}/c.db")
    try:
        for _ in range(2):  # the pool's first connection, then a new one beside it
            with engine.connect() as conn, engine.connect() as other:
                for c in (conn, other):
                    settings = [
                        c.exec_driver_sql(f"PRAGMA {name}").scalar()
                        for name in ("journal_mode", "synchronous", "wal_autocheckpoint")
                    ]
                    assert settings == ["wal", level, WAL_CHECKPOINT_PAGES]
        recorder = SQLRecorder(engine)
        with recorder.write() as writer, recorder.read() as reader:
            assert writer.exec_driver_sql("PRAGMA cache_size").scalar() == -WRITER_CACHE_KIB
            assert reader.exec_driver_sql("PRAGMA cache_size").scalar() != -WRITER_CACHE_KIB
        recorder.close()
    finally:
        engine.dispose()


def test_the_writers_page_cache_never_reaches_a_reader(tmp_path: Path) -> None:
    # The held writer is dropped after a database error, and let go on close:
    # neither may go back to the pool readers take connections from, 16 MB
    # caches filling with the pages of every scan.
    engine = create_engine(f"sqlite:///{tmp_path}/c.db")
    recorder = SQLRecorder(engine)
    try:
        with pytest.raises(sa.exc.OperationalError), recorder.write() as conn:
            conn.exec_driver_sql("SELECT * FROM no_such_table")
        with recorder.write() as conn:
            assert conn.exec_driver_sql("PRAGMA cache_size").scalar() == -WRITER_CACHE_KIB
        recorder.close()
        with recorder.read() as a, recorder.read() as b, recorder.read() as c:
            for reader in (a, b, c):
                assert reader.exec_driver_sql("PRAGMA cache_size").scalar() != -WRITER_CACHE_KIB
    finally:
        engine.dispose()


def test_the_wal_a_long_reader_made_grow_is_cut_back_once_it_lets_go(tmp_path: Path) -> None:
    """A reader holding a transaction open keeps every write since in the
    -wal file, which SQLite then kept at its largest until the last
    connection closed: for as long as a server ran (hostile test)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{tmp_path}/c.db"})
    names = [f"m{i}" for i in range(1000)]
    models.apply_changes([commands.add(model_spec(name)) for name in names], by="ops")
    wal = tmp_path / "c.db-wal"
    reader = sqlite3.connect(tmp_path / "c.db", isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM catalog_events").fetchall()
    round_ = 0
    while wal.stat().st_size <= WAL_SIZE_LIMIT_BYTES * 1.25:
        round_ += 1
        steps = [commands.scale(name, 0, 2 + round_ % 3) for name in names]
        models.apply_changes(steps, by="ops")
    reader.execute("ROLLBACK")
    reader.close()
    for maximum in (7, 8):  # the first commit's checkpoint empties it, the next starts it over
        models.scale("m0", 0, maximum, by="ops")
    assert wal.stat().st_size <= WAL_SIZE_LIMIT_BYTES
    models.close()


def test_a_writer_sqlalchemy_invalidated_is_made_anew_with_its_settings(db_url: str) -> None:
    """An interrupt landing in a driver call has SQLAlchemy invalidate the
    held writer, which its next use connected afresh without the writer's
    settings: on PostgreSQL out of autocommit, so psycopg sent a BEGIN of its
    own before each write's (a round trip more, a server warning each write;
    hostile test); on SQLite without its page cache."""
    engine = create_engine(db_url)
    recorder = SQLRecorder(engine)

    def set_as_a_writer(conn: sa.Connection) -> bool:
        if engine.dialect.name == "postgresql":
            driver = conn.connection.driver_connection
            return driver is not None and bool(driver.autocommit)
        return conn.exec_driver_sql("PRAGMA cache_size").scalar() == -WRITER_CACHE_KIB

    try:
        for _ in range(2):
            with recorder.write() as conn:
                assert set_as_a_writer(conn)
            # As SQLAlchemy does when a KeyboardInterrupt lands in a driver
            # call: inside the write, and so as the write ends (review).
            with pytest.raises(KeyboardInterrupt), recorder.write() as conn:
                conn.invalidate()
                raise KeyboardInterrupt
        with recorder.write() as conn:
            assert set_as_a_writer(conn)
        recorder.close()
    finally:
        engine.dispose()


LOCK_WAIT_REFUSAL = "must be a number of seconds above 0 and at most 3600, not {!r}"


@pytest.mark.parametrize(
    ("variable", "value", "refusal"),
    [
        *(
            (LOCK_WAIT_ENV, v, LOCK_WAIT_REFUSAL)
            for v in ["soon", "0", "-1", "nan", "inf", "1e9", "\u0661", "1_0"]
        ),
        *((WRITE_IDLE_ENV, v, LOCK_WAIT_REFUSAL) for v in ["a minute", "0", "nan", "3601"]),
        (SYNC_ENV, "OFF", "must be FULL or NORMAL, not {!r}"),
        (SYNC_ENV, "garbage", "must be FULL or NORMAL, not {!r}"),  # as given
        # 0 was refused as "not a whole number of revisions", which it is.
        *(
            (SNAPSHOT_ENV, v, "must be a whole number of revisions, at least 1, not {!r}")
            for v in ["0", "often", "-1"]
        ),
    ],
)
def test_a_storage_setting_out_of_range_is_refused_in_one_line(
    variable: str, value: str, refusal: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(variable, value)
    result = CliRunner().invoke(cli, ["--db", f"sqlite:///{tmp_path}/c.db", "model", "list"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [f"error: {variable} {refusal.format(value)}"]


@pytest.mark.parametrize("variable", [LOCK_WAIT_ENV, WRITE_IDLE_ENV, SYNC_ENV, SNAPSHOT_ENV])
def test_a_setting_set_empty_is_unset(
    variable: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As a shell's `VAR= catalog-es …` means; some of them refused it, one
    took it for its default (hostile test)."""
    monkeypatch.setenv(variable, " ")
    result = CliRunner().invoke(cli, ["--db", f"sqlite:///{tmp_path}/c.db", "model", "list"])
    assert result.exit_code == 0, result.stderr


# A trigger that refuses every insert (made, then dropped), by dialect.
_REFUSING_TRIGGER = {
    "sqlite": (
        [
            "CREATE TRIGGER refuse BEFORE INSERT ON catalog_events"
            " BEGIN SELECT RAISE(ABORT, 'refused by a trigger'); END"
        ],
        "DROP TRIGGER refuse",
    ),
    "postgresql": (
        [
            "CREATE FUNCTION refuse() RETURNS trigger AS"
            " $$ BEGIN RAISE EXCEPTION 'refused by a trigger'; END $$ LANGUAGE plpgsql",
            "CREATE TRIGGER refuse BEFORE INSERT ON catalog_events"
            " FOR EACH ROW EXECUTE FUNCTION refuse()",
        ],
        "DROP TRIGGER refuse ON catalog_events",
    ),
}


def test_a_command_on_a_log_nobody_else_moved_reads_it_once(tmp_path: Path) -> None:
    """Whether to catch up, the head to chain onto and the stream's version
    come from one read: a command is six statements, three of them writes
    (the event, its stream's last version, the head)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{tmp_path / 'c.db'}"})
    models.add(model_spec("a"), by="setup")
    statements: list[str] = []
    with models.store._writer_connection() as writer:
        driver = writer.connection.driver_connection
    assert driver is not None
    driver.set_trace_callback(statements.append)
    models.scale("a", 0, 2, by="ops")
    verbs = [statement.split()[0] for statement in statements]
    assert verbs == ["BEGIN", "SELECT", "INSERT", "UPDATE", "UPDATE", "COMMIT"], statements
    models.close()


def _versions(models: Models, name: str) -> list[int]:
    """The stored versions of ``name``'s stream, in revision order."""
    t = events_table.c
    query = (
        sa.select(t.originator_version)
        .where(t.originator_id == model_id(name))
        .order_by(t.revision)
    )
    with models.store.engine.connect() as conn:
        return list(conn.execute(query).scalars())


def _linked_in_order(models: Models, name: str) -> list[tuple[int, int]]:
    """Each stored event of ``name``'s stream, in revision order: its revision
    and its link to the stream's event before it (``stream_previous``),
    asserted to be that event's revision, the first's none."""
    t = events_table.c
    query = (
        sa.select(t.revision, t.stream_previous)
        .where(t.originator_id == model_id(name))
        .order_by(t.revision)
    )
    with models.store.engine.connect() as conn:
        rows = [(revision, previous) for revision, previous in conn.execute(query)]
    # Each links to the one before it, the first to none.
    assert [previous for _, previous in rows] == [0, *(r for r, _ in rows[:-1])], rows
    return rows


def test_a_service_reads_no_version_it_wrote_while_nobody_else_wrote(tmp_path: Path) -> None:
    """The versions a service wrote still hold while the log's last revision
    is its own: its next batch on the same models reads none of them."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{tmp_path / 'c.db'}"})
    models.apply_changes([commands.add(model_spec(n)) for n in "abc"], by="setup")
    statements: list[str] = []
    with models.store._writer_connection() as writer:
        driver = writer.connection.driver_connection
    assert driver is not None
    driver.set_trace_callback(statements.append)
    models.apply_changes([commands.scale(n, 0, 2) for n in "abc"], by="ops")
    models.scale("b", 1, 3, by="ops")
    assert not [s for s in statements if s.startswith("SELECT") and "catalog_streams" in s]
    assert [_versions(models, n) for n in "abc"] == [[1, 2], [1, 2, 3], [1, 2]]
    # Linked from what the service wrote, not read (stream_previous).
    assert len(_linked_in_order(models, "b")) == 3
    models.close()


def test_versions_another_writer_moved_are_read_again(db_url: str) -> None:
    """Once another service has appended, what this one knew may not hold."""
    mine = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    theirs = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    try:
        mine.add(model_spec("a"), by="me")
        theirs.scale("a", 0, 2, by="them")
        theirs.apply_changes([commands.scale("a", 0, 3), commands.owner("a", "team:x")], by="them")
        mine.scale("a", 1, 4, by="me")
        mine.apply_changes([commands.scale("a", 0, 5)], by="me")
        assert _versions(mine, "a") == [1, 2, 3, 4, 5, 6]
        # Each links to the event before it, theirs included, not to the last
        # this service wrote (stream_previous).
        assert len(_linked_in_order(mine, "a")) == 6
        assert mine.get_model("a")["scaling"] == theirs.get_model("a")["scaling"]
    finally:
        mine.close()
        theirs.close()


# Hand edits of a model's row in catalog_streams, which every write follows.
STREAM_EDITS = {
    "version raised": "UPDATE catalog_streams SET version = version + 20",
    "version lowered": "UPDATE catalog_streams SET version = version - 1",
    "version made negative": "UPDATE catalog_streams SET version = -1",
    "revision past the log": "UPDATE catalog_streams SET revision = 999999",
    "revision of another model's event": "UPDATE catalog_streams SET revision = 1",
}


@pytest.mark.parametrize("edit", STREAM_EDITS, ids=list(STREAM_EDITS))
def test_a_stream_row_edited_by_hand_refuses_writes_to_that_model(db_url: str, edit: str) -> None:
    """The service running when the edit was made and a new one alike: every
    write to that model is refused in one line, nothing written, rather than
    repeat, skip or misplace a version (the old index on (stream, version)
    refused a repeat only); other models are written; verify names it."""
    running = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    running.apply_changes([commands.add(model_spec(n)) for n in "ba"], by="setup")
    running.scale("a", 0, 2, by="ops")
    # As stored: 32 hex digits on SQLite, a uuid on PostgreSQL.
    stored = model_id("a").hex if db_url.startswith("sqlite") else str(model_id("a"))
    with running.store.engine.begin() as conn:
        conn.exec_driver_sql(f"{STREAM_EDITS[edit]} WHERE originator_id = '{stored}'")
    fresh = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    before = count_events(db_url)
    for models in (running, running, fresh):
        with pytest.raises(DamagedLog, match="edited by hand; nothing was written"):
            models.scale("a", 1, 3, by="ops")
    assert count_events(db_url) == before
    fresh.scale("b", 0, 4, by="ops")
    assert "catalog_streams records stream" in fresh.verify()["broken"]["problem"]
    running.close()
    fresh.close()


def _deleted_told(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What was logged of events deleted from the log's end."""
    return [r.getMessage() for r in caplog.records if "deleted" in r.getMessage()]


def test_a_running_node_whose_write_goes_on_after_deleted_events_says_so(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A node loaded before the last events were deleted (a server) wrote
    after the head, leaving the gap, and said nothing: only a command
    loading the log told it (review). Said once, by the write."""
    running = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    other = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    try:
        running.apply_changes([commands.add(model_spec(n)) for n in "ab"], by="setup")
        other.scale("b", 0, 2, by="ops")
        with running.store.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM catalog_events WHERE revision = 3")
        with caplog.at_level(logging.WARNING, logger="catalog_es"):
            # Refused, a write goes on after nothing: it neither tells nor
            # uses up the telling (review).
            with pytest.raises(ModelNotFound):
                running.scale("nosuch", 0, 3, by="ops")
            assert not _deleted_told(caplog)
            assert running.scale("a", 0, 3, by="ops").revision == 4
            running.scale("a", 0, 4, by="ops")
        assert _deleted_told(caplog) == [
            "revision 3 is missing: the head is at revision 3 but the log ends at 2, so the"
            " last events were deleted (catalog-es verify); this write is numbered after"
            " revision 3, leaving the gap"
        ]
    finally:
        running.close()
        other.close()


def test_a_running_node_whose_write_goes_on_after_every_event_was_deleted_says_from_where(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A log with no event left but its head ends at 0: every revision up to
    the head is told missing, not all but the first."""
    running = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    other = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    try:
        other.apply_changes([commands.add(model_spec(n)) for n in "ab"], by="setup")
        with running.store.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM catalog_events")
            conn.exec_driver_sql("DELETE FROM catalog_streams")
        with caplog.at_level(logging.WARNING, logger="catalog_es"):
            assert running.add(model_spec("c"), by="ops").revision == 3
        assert _deleted_told(caplog) == [
            "revisions 1..2 are missing: the head is at revision 2 but the log ends at 0, so"
            " the last events were deleted (catalog-es verify); this write is numbered after"
            " revision 2, leaving the gap"
        ]
    finally:
        running.close()
        other.close()


def test_verify_names_the_earliest_of_two_stream_rows_edited_by_hand(db_url: str) -> None:
    """A row for a stream with no events was told first, however late its
    revision, before an earlier break (review)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    for name in "abc":
        models.add(model_spec(name), by="setup")
    sqlite = db_url.startswith("sqlite")
    stored = {n: model_id(n).hex if sqlite else str(model_id(n)) for n in ("a", "ghost")}
    with models.store.engine.begin() as conn:
        conn.exec_driver_sql(
            f"UPDATE catalog_streams SET version = 7 WHERE originator_id = '{stored['a']}'"
        )
        conn.exec_driver_sql(
            "INSERT INTO catalog_streams (originator_id, version, revision)"
            f" VALUES ('{stored['ghost']}', 1, 3)"
        )
    broken = models.verify()["broken"]
    assert broken["revision"] == 1
    assert f"stream {stored['a']} as at version 7" in broken["problem"]
    models.close()


def test_a_stream_row_deleted_by_hand_under_a_running_service_is_damage(db_url: str) -> None:
    """Without its row in catalog_streams a model would start again at
    version 1: the running service's write fails the check of the version
    it followed, and every write after it, reading again, is refused as
    damage, nothing written; verify names the stream."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("a"), by="setup")
    with models.store.engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM catalog_streams")
    before = count_events(db_url)
    with pytest.raises(DamagedLog, match="not the one this node read"):
        models.scale("a", 0, 2, by="ops")
    for _ in range(2):
        with pytest.raises(DamagedLog, match="catalog_streams records it at version 0"):
            models.scale("a", 0, 2, by="ops")
    with pytest.raises(DamagedLog, match="catalog_streams records it at version 0"):
        models.apply_changes([commands.scale("a", 0, 3)], by="ops")
    assert count_events(db_url) == before
    assert "catalog_streams records stream" in models.verify()["broken"]["problem"]
    models.close()


def test_versions_of_one_model_that_do_not_follow_on_in_one_write_are_refused(
    db_url: str,
) -> None:
    """The guard the index on (stream, version) also kept within one write."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("a"), by="setup")
    before = count_events(db_url)
    for versions in ([2, 2], [2, 4]):
        stored = [
            models.mapper.to_stored_event(
                Model.Scaled(
                    originator_id=model_id("a"),
                    originator_version=version,
                    timestamp=utc_now(),
                    by="x",
                    model="a",
                    scaling=Scaling(0, 2),
                )
            )
            for version in versions
        ]
        with pytest.raises(sa.exc.IntegrityError, match="do not follow on"):
            models.store.insert_events(stored)
    assert count_events(db_url) == before
    models.close()


@pytest.mark.parametrize("deleted", ["the head", "the last event and the head"])
def test_a_write_to_a_log_whose_head_is_missing_is_refused_until_it_is_put_back(
    db_url: str, deleted: str
) -> None:
    """Written on, the chain started afresh from no head (verify then named the
    new event altered, not the deletion), and on a SQLite log a deleted last
    revision was handed out again, which a reader that had seen it skipped
    (hostile test). What went with the head cannot be known: writes are
    refused, one line, until an operator puts it back as docs/audit.md says."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    for name in "abc":
        models.add(model_spec(name), by="setup")
    with models.store.engine.begin() as conn:
        if deleted != "the head":
            conn.exec_driver_sql("DELETE FROM catalog_events WHERE revision = 3")
            conn.exec_driver_sql("DELETE FROM catalog_streams WHERE revision = 3")
        conn.exec_driver_sql("DELETE FROM catalog_head")
    models.close()
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    before = count_events(db_url)
    last = 3 if deleted == "the head" else 2
    with pytest.raises(DamagedLog) as refused:
        models.add(model_spec("d"), by="ops")
    assert str(refused.value) == (
        "the log's head record (catalog_head) is missing, but the log holds events up to"
        f" revision {last}, and maybe held more; nothing was written (catalog-es verify;"
        " docs/audit.md says how to put the head back)"
    )
    assert count_events(db_url) == before
    with models.store.engine.begin() as conn:
        conn.exec_driver_sql(PUT_THE_HEAD_BACK)
    written = models.add(model_spec("d"), by="ops").revision
    if deleted == "the head":
        assert (written, models.verify()["ok"]) == (4, True)
    else:  # the operator's to judge: PostgreSQL's sequence still skips what was taken
        assert written == (4 if db_url.startswith("postgresql") else 3)
    models.close()


def test_catalog_streams_dropped_is_made_again_from_the_rows(db_url: str) -> None:
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.apply_changes([commands.add(model_spec(n)) for n in "ab"], by="setup")
    models.scale("a", 0, 2, by="ops")
    models.close()
    with sa.create_engine(db_url).begin() as conn:
        kept = conn.exec_driver_sql("SELECT * FROM catalog_streams ORDER BY revision").all()
        conn.exec_driver_sql("DROP TABLE catalog_streams")
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    with models.store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT * FROM catalog_streams ORDER BY revision").all() == kept
    models.scale("a", 1, 2, by="ops")
    assert _versions(models, "a") == [1, 2, 3]
    assert models.verify()["ok"] is True
    models.close()


def test_a_driver_error_in_the_insert_is_sqlalchemys_and_lets_the_writer_go(
    db_url: str,
) -> None:
    """The append runs on the driver too: whatever it raises reaches the
    caller as SQLAlchemy wraps it, nothing is written, and the writer
    connection is let go, in case the error broke it."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("a"), by="ops")
    before = count_events(db_url)
    engine = sa.create_engine(db_url)
    create, drop = _REFUSING_TRIGGER[engine.dialect.name]
    try:
        with engine.begin() as conn:
            for statement in create:
                conn.exec_driver_sql(statement)
        with pytest.raises(sa.exc.DBAPIError, match="refused by a trigger"):
            models.scale("a", 0, 2, by="ops")
        assert count_events(db_url) == before
        assert models.store._writer is None
        with engine.begin() as conn:
            conn.exec_driver_sql(drop)
    finally:
        engine.dispose()
    models.scale("a", 0, 2, by="ops")
    assert count_events(db_url) == before + 1
    models.close()


def test_a_write_connection_broken_underneath_is_dropped_and_the_next_write_reconnects(
    tmp_path: Path,
) -> None:
    """BEGIN runs on the driver: its error must still reach the writer as
    SQLAlchemy's, so the broken connection is let go rather than reused."""
    url = f"sqlite:///{tmp_path}/catalog.db"
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    models.add(model_spec("a"), by="ops")
    before = count_events(url)
    writer = models.store._writer
    assert writer is not None
    writer.connection.driver_connection.close()  # type: ignore[union-attr]
    with pytest.raises(sa.exc.ProgrammingError, match="closed database"):
        models.scale("a", 0, 2, by="ops")
    assert count_events(url) == before
    assert models.store._writer is None
    models.scale("a", 0, 2, by="ops")
    assert count_events(url) == before + 1
    assert models.get_model("a")["scaling"] == {"min": 0, "max": 2}
    models.close()


class _Stop(Exception):
    pass


@pytest.mark.parametrize("count", [1000, 1001])
def test_a_postgresql_write_of_a_thousand_events_or_more_keeps_every_one(
    pg_url: str, count: int
) -> None:
    """PostgreSQL's append goes in statements of a thousand events, the
    last of which moves the head: a thousand exactly go in one, the
    thousand and first in the next, none left out and none twice."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    names = [f"m{i}" for i in range(count)]
    written = models.apply_changes([commands.add(model_spec(name)) for name in names], by="ops")
    assert written["revision"] == count_events(pg_url) == count
    assert [m["name"] for m in models.list_models()] == sorted(names)
    report = models.verify()
    assert (report["ok"], report["events"]) == (True, count)
    models.close()


@pytest.mark.parametrize("order", ["sqlalchemy-then-driver", "driver-then-sqlalchemy", "driver"])
@pytest.mark.parametrize("end", ["commit", "raise", "abandon"])
def test_a_write_ends_whole_whichever_layer_its_statements_went_through(
    db_url: str, end: str, order: str
) -> None:
    """On SQLite a write transaction is begun and ended on the driver; a
    statement made through SQLAlchemy inside it joins it. So a write that
    raises or is abandoned leaves nothing of either kind, one that ends keeps
    both, and nothing is left open for the next command."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("a"), by="ops")
    before = count_events(db_url)
    added = event(Model.Added, "b", version=1, spec=model_spec("b"))
    with contextlib.suppress(_Stop), models.store.write() as conn:
        steps: dict[str, Callable[[], object]] = {
            "sqlalchemy": lambda: models.store._insert_tracking(conn, Tracking("test-reader", 7)),
            "driver": lambda: models.events.put([added], conn=conn),
        }
        for layer in order.split("-then-"):
            steps[layer]()
        if end == "raise":
            raise _Stop
        if end == "abandon":
            models.store.abandon(conn)
    kept = end == "commit"
    assert count_events(db_url) == before + kept
    tracked = 7 if kept and "sqlalchemy" in order else None
    assert models.store.max_tracking_id("test-reader") == tracked
    models.scale("a", 0, 2, by="ops")
    assert count_events(db_url) == before + kept + 1
    assert models.get_model("a")["scaling"] == {"min": 0, "max": 2}
    models.close()


def test_a_write_is_committed_whole_at_the_end_of_its_block_or_refused(tmp_path: Path) -> None:
    """Committing through SQLAlchemy inside a write, or writing again after
    abandoning it, would let part of the block land on its own: both are
    refused, and nothing of the block is written."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{tmp_path}/c.db"})
    models.add(model_spec("a"), by="ops")
    track = "INSERT INTO catalog_tracking (application_name, notification_id) VALUES ('t', 1)"
    committed = pytest.raises(sa.exc.InvalidRequestError, match="committed when its block ends")
    with committed, models.store.write() as conn, conn.begin():
        conn.exec_driver_sql(track)
    reused = pytest.raises(sa.exc.InvalidRequestError, match="rolled back inside its block")
    with reused, models.store.write() as conn:
        models.store.abandon(conn)
        conn.exec_driver_sql(track)
    assert models.store.max_tracking_id("t") is None
    models.scale("a", 0, 2, by="ops")
    assert models.get_model("a")["scaling"] == {"min": 0, "max": 2}
    models.close()


@pytest.mark.parametrize("then_read", [False, True], ids=["block-ends", "read-on-the-driver"])
def test_a_write_connection_closed_inside_a_write_is_let_go(
    tmp_path: Path, then_read: bool
) -> None:
    """Told as SQLAlchemy tells a driver's error, whichever statement meets it."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{tmp_path}/c.db"})
    models.add(model_spec("a"), by="ops")
    closed = pytest.raises(sa.exc.ProgrammingError, match="closed database")
    with closed, models.store.write() as conn:
        conn.connection.driver_connection.close()  # type: ignore[union-attr]
        if then_read:
            models.store.stream_version(conn, model_id("a"))
    assert models.store._writer is None
    models.scale("a", 0, 2, by="ops")
    assert models.get_model("a")["scaling"] == {"min": 0, "max": 2}
    models.close()


# An interrupt that lands in a garbage collector's callback is reported and
# dropped by Python, as any Ctrl-C there would be.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupt_anywhere_in_a_write_leaves_no_lock_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in a process that goes on (a REPL, a notebook) lands between any
    two statements of a write, BEGIN and COMMIT included: what it interrupts
    is rolled back or let go, so no other process or thread waits on a lock
    that no one will release, and the next command writes."""
    monkeypatch.setenv(SYNC_ENV, "NORMAL")  # many commands in a short time
    path = tmp_path / "c.db"
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{path}"})
    models.add(model_spec("a"), by="ops")
    rng = random.Random(1)

    def interrupt(*_: object) -> None:
        if holds(logging._lock):  # type: ignore[attr-defined]
            # Landed in logging's own gap (Python 3.11's _acquireLock takes
            # its lock before the try that lets it go): raised there, it left
            # the lock held for good, and every test server after this test
            # in the worker waited for it (a CI run). Not this code's to
            # survive: tried again a little later.
            signal.setitimer(signal.ITIMER_REAL, 0.0001)
            return
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    interrupts = 0
    # A write cut off before it put its changes in force has the catalog
    # loaded afresh, with a warning; an interrupt landing in logging's
    # handler would leave its lock held for every test after this one.
    logging.disable(logging.CRITICAL)
    try:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            landed: list[str] = []
            try:
                # One signal, within the first few commands of the run; armed
                # inside the try, as a loaded machine may deliver it at once.
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.00005, 0.0012))
                for i in range(1000):
                    models.scale("a", i % 2, 3, by="ops")
            except KeyboardInterrupt as cut:
                interrupts += 1
                # Where it landed, for the failure below (rare: once in eight
                # full runs, never in storms of 20,000 interrupts alone).
                landed = traceback.format_tb(cut.__traceback__)[-6:]
            # This process's write lock too: the thread that took it re-enters
            # it, and every other thread's write was refused as busy (review).
            if holds(models._lock):
                pytest.fail("the write lock is left held; interrupted at:\n" + "".join(landed))
            other = sqlite3.connect(path, timeout=0, isolation_level=None)
            try:
                other.execute("BEGIN IMMEDIATE")  # "database is locked" if one is held
                other.execute("ROLLBACK")
            except sqlite3.OperationalError as error:
                idle = models.store._writer_is_idle()
                where = "".join(landed)
                pytest.fail(f"{error}; held writer idle: {idle}; interrupted at:\n{where}")
            finally:
                other.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        logging.disable(logging.NOTSET)
    assert interrupts > 100
    models.scale("a", 0, 2, by="ops")
    assert models.get_model("a")["scaling"] == {"min": 0, "max": 2}
    models.close()


def interrupted_at(code: CodeType, line: int, landed: list[int]) -> Any:
    """A tracer that raises KeyboardInterrupt, as SIGINT does between two
    statements, the first time ``code`` reaches ``line`` (noted in ``landed``)."""

    def tracer(frame: FrameType, event: str, _: object) -> Any:
        if frame.f_code is not code:
            return None

        def at_line(frame: FrameType, event: str, _: object) -> Any:
            if event == "line" and frame.f_lineno == line:
                sys.settrace(None)
                landed.append(line)
                raise KeyboardInterrupt
            return at_line

        return at_line

    return tracer


@pytest.mark.parametrize("code", [Models._write.__code__, Models._put_in_force.__code__])
@pytest.mark.parametrize("several", [False, True], ids=["one-event", "a-batch"])
def test_an_interrupt_on_any_line_of_a_write_leaves_the_catalog_a_fresh_node_reads(
    tmp_path: Path, code: CodeType, several: bool
) -> None:
    """Cut off between two lines of putting a write in force, the catalog
    held the changes at the revision before them, and the next read replayed
    them over themselves: a Scaled of the model the batch then removed was
    reported skipped, by every node that loaded a snapshot taken since
    (review). Wherever it lands, the node then reads what a fresh one does.
    (Not on a ``try:``, whose line is a no-op a signal never lands on, and
    from which a tracer's exception escapes every handler.)"""
    lines = sorted(
        {
            i.positions.lineno
            for i in dis.get_instructions(code)
            if i.starts_line and i.opname != "NOP" and i.positions and i.positions.lineno
        }
    )[1:]  # not the def
    landed: list[int] = []
    logging.disable(logging.CRITICAL)  # each cut-off write is loaded again, with a warning
    try:
        for line in lines:
            url = f"sqlite:///{tmp_path}/{line}-{several}.db"
            models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url}, snapshot_interval=3)
            models.add(model_spec("x"), by="ops")
            models.add(model_spec("y"), by="ops")
            sys.settrace(interrupted_at(code, line, landed))
            try:
                if several:
                    changes = [commands.scale("x", 0, 2), commands.remove("x")]
                    models.apply_changes(changes, by="ops")
                else:
                    models.remove("x", by="ops")
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            # No lock left held: this thread would re-enter it, no other could (review).
            assert (holds(models._lock), models._state.depth()) == (0, 0), line
            fresh = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
            read = (models.list_models(), models.skipped())
            # Written or not, as the log has it, and nothing skipped.
            assert read == (fresh.list_models(), fresh.skipped()), line
            assert read[1] == [], line
            models.scale("y", 0, 3, by="ops")
            assert models.verify()["ok"], line
            models.close()
            fresh.close()
    finally:
        logging.disable(logging.NOTSET)
    assert len(landed) > len(lines) // 2  # each path passes some lines by


def test_a_start_on_the_expected_revision_waits_for_no_writer(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve --expected-revision`` on the log it expects, its config
    recorded already, starts without waiting for another node's long write
    (it took the write lock to find there was nothing to record; review);
    on a log moved past it, it is refused without writing; on the revision
    another node moved the log to since this one last looked, it starts."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "5")
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("m"), by="setup")
    head = models.revision
    with write_lock_held(db_url):
        started = time.monotonic()
        assert models.record_declaration(by="ops", expected_revision=head) == head
        assert time.monotonic() - started < 2
    with pytest.raises(RevisionConflict):
        models.record_declaration(by="ops", expected_revision=head - 1)
    assert models.revision == head
    other = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    moved = other.scale("m", 0, 2, by="elsewhere").revision
    assert models.record_declaration(by="ops", expected_revision=moved) == moved
    assert models.revision == moved
    for node in (models, other):
        node.close()


def test_a_start_on_a_revision_the_log_skipped_is_told_so(pg_url: str) -> None:
    """``serve --expected-revision`` of a number PostgreSQL skipped (a write
    that failed took it) was told "someone changed the catalog since you read
    it"; it is now told that the log skipped it, as a command is."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    models.add(model_spec("m"), by="setup")
    with models.store.engine.begin() as conn:
        conn.exec_driver_sql("SELECT nextval(pg_get_serial_sequence('catalog_events', 'revision'))")
    assert models.scale("m", 0, 2, by="setup").revision == 3
    with pytest.raises(RevisionConflict) as skipped:
        models.record_declaration(by="ops", expected_revision=2)
    assert str(skipped.value) == (
        "the log is at revision 3, not 2: revision 2 was never written (the log's"
        " revisions skip it); read it again and retry"
    )
    with pytest.raises(RevisionConflict) as moved:
        models.record_declaration(by="ops", expected_revision=1)
    assert "someone changed the catalog since you read it" in str(moved.value)
    assert models.revision == 3
    models.close()


def test_no_postgresql_session_of_a_node_stays_in_a_transaction_after_a_refusal(
    pg_url: str, pg_admin: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The held writer begins its transactions by hand, in autocommit mode
    (the BEGIN in the lock's round trip): psycopg must still end each one,
    refused or waited out, or the node would hold the log's lock between
    commands (review)."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "0.2")
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    models.add(model_spec("m"), by="setup")

    def in_a_transaction() -> list[str]:
        with pg_admin.connect() as conn:
            return list(
                conn.exec_driver_sql(
                    "SELECT state FROM pg_stat_activity WHERE application_name = %(own)s"
                    " AND state <> 'idle'",
                    {"own": schema_of(pg_url)},
                ).scalars()
            )

    with pytest.raises(RevisionConflict):
        models.scale("m", 0, 2, by="ops", expected_revision=models.revision - 1)
    assert in_a_transaction() == []
    with pytest.raises(InvalidModel):
        models.scale("m", 3, 2, by="ops")
    assert in_a_transaction() == []
    with write_lock_held(pg_url), pytest.raises(StorageBusy):
        models.scale("m", 0, 2, by="ops")
    assert in_a_transaction() == []
    models.scale("m", 0, 2, by="ops")  # the lock is taken again, and let go
    assert in_a_transaction() == []
    models.close()


def test_a_read_of_a_postgresql_log_no_one_moved_opens_no_transaction(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One statement tells whether the log moved: a read transaction cost a
    read of an idle log two round trips more (BEGIN, COMMIT), 1,848 against
    2,928 reads a second. Moved by another node, the read catches up."""
    reader = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    writer = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    writer.add(model_spec("a"), by="ops")
    assert reader.get_model("a")["scaling"] == {"min": 1, "max": 1}
    opened: list[int] = []
    read = reader.store.read

    @contextlib.contextmanager
    def counted() -> Iterator[sa.Connection]:
        opened.append(1)
        with read() as conn:
            yield conn

    monkeypatch.setattr(reader.store, "read", counted)
    for _ in range(10):
        reader.get_model("a")
    assert opened == []
    writer.scale("a", 0, 2, by="ops")
    assert reader.get_model("a")["scaling"] == {"min": 0, "max": 2}
    assert opened == [1]
    reader.close()
    writer.close()


def test_a_refused_or_empty_postgresql_write_keeps_the_statements_the_writer_prepared(
    pg_url: str,
) -> None:
    """psycopg prepares a statement run five times, and forgets them all at
    every rollback (``DEALLOCATE ALL``): with one command in ten refused, the
    writes after each were planned afresh, and the rate fell by nearly a third.
    A write that wrote nothing (refused, or nothing to write) is committed;
    one refused after it wrote is rolled back, as ever (as
    ``test_a_stream_row_edited_by_hand_refuses_writes_to_that_model`` and
    ``test_a_stream_row_deleted_by_hand_under_a_running_service_is_damage``
    check on PostgreSQL)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    models.apply_changes([commands.add(model_spec(n)) for n in "ab"], by="setup")
    for replicas in range(6):
        models.scale("a", 0, replicas + 1, by="ops")

    def prepared() -> list[str]:
        # On the writer's own session, by its driver: SQLAlchemy would leave
        # a transaction begun, as a command's statements do not.
        assert models.store._writer is not None
        driver = models.store._writer.connection.driver_connection
        assert driver is not None
        return sorted(n for (n,) in driver.execute("SELECT name FROM pg_prepared_statements"))

    kept = prepared()
    assert kept  # the standing read and the append, at least
    head, log = models.revision, list(models.log_events())
    with pytest.raises(RevisionConflict):
        models.scale("a", 0, 2, by="ops", expected_revision=head - 1)
    with pytest.raises(InvalidModel):
        models.scale("a", 3, 2, by="ops")
    assert models.rollback(head, by="ops")["revision"] == head  # nothing to write
    assert prepared() == kept
    assert (models.revision, list(models.log_events())) == (head, log)
    models.close()


def test_a_name_no_model_can_have_is_refused_before_the_write(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked before the write, as a command is made: it took the write lock
    (and, behind another writer, was told as busy, and not kept), a model id
    of its text, a query, and in a list its whole text in the refusal
    (review). On SQLite the refusal waits for the lock to be kept."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "5")
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("m"), by="setup")
    before = count_events(db_url)
    if db_url.startswith("postgresql"):
        with write_lock_held(db_url):
            started = time.monotonic()
            with pytest.raises(InvalidModel, match="is not a valid name"):
                models.set_owner("bad name!", "team:x", by="ops")
            assert time.monotonic() - started < 2
    else:
        with pytest.raises(InvalidModel, match="is not a valid name"):
            models.set_owner("bad name!", "team:x", by="ops")
    huge = "x" * 10_000 + "!"
    with pytest.raises(Refused, match=r"^change 2 \(scale x{128}…\) refused") as refused:
        models.apply_changes([commands.scale("m", 0, 2), commands.scale(huge, 0, 2)], by="ops")
    assert len(str(refused.value)) < 400
    assert count_events(db_url) == before
    kept = models.refusals(by="ops")
    assert [(r["model"][:9], r["event"]) for r in kept] == [
        ("bad name!", "OwnerSet"),
        ("x" * 9, "Scaled"),
    ]
    models.close()


def test_a_busy_database_keeps_the_write_connection(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting out another writer breaks nothing: the held connection (and, on
    SQLite, its page cache) serves the next write."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "0.2")
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("m"), by="setup")
    writer = models.store._writer
    with write_lock_held(db_url), pytest.raises(StorageBusy):
        models.scale("m", 0, 3, by="ops")
    assert models.store._writer is writer
    models.scale("m", 0, 3, by="ops")
    assert models.store._writer is writer
    assert models.get_model("m")["scaling"] == {"min": 0, "max": 3}
    models.close()


@pytest.mark.alone
def test_a_forked_child_uses_connections_of_its_own(db_url: str) -> None:
    """A process forked from one that wrote and read (multiprocessing's fork,
    a pre-forking server) writes and reads through connections it opened
    itself: the parent's SQLite locks are not its own, and a PostgreSQL
    session cannot serve two processes."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("a"), by="ops")
    assert models.store._writer is not None
    parents = [models.store._writer.connection.driver_connection]
    with models.store.read() as conn:  # checked out of the pool, and back
        parents.append(conn.connection.driver_connection)
    child = os.fork()
    if child == 0:
        code = 1
        try:
            models.scale("a", 0, 2, by="child")
            assert models.store._writer is not None
            used = [models.store._writer.connection.driver_connection]
            with models.store.read() as conn:
                used.append(conn.connection.driver_connection)
            code = 0 if all(u is not p for u in used for p in parents) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    models.scale("a", 0, 3, by="parent")
    assert models.get_model("a")["scaling"] == {"min": 0, "max": 3}
    models.close()
