"""Several nodes on one database: concurrent writer processes and a follower.

Each writer is a separate OS process with its own ``Models`` service, as
control-plane nodes are. Afterwards the log must hold exactly the commands
that reported success, with gapless revisions, and a replay of it must skip
nothing: an event written on stale grounds would be invalid where it stands
in the log, and replay would skip it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from catalog_es import application, commands
from catalog_es.application import Models
from catalog_es.cli import base
from catalog_es.errors import NoConfigGiven, Refused, StorageBusy
from catalog_es.inputs import DeclaredConfig, load_config, model_from_data
from catalog_es.mapper import decode_event
from catalog_es.persistence import PulledPage, SQLRecorder
from catalog_es.storage.engines import create_engine, database_unusable, prepared_elsewhere
from catalog_es.storage.waits import LOCK_WAIT_ENV
from catalog_es.web.tokens import TokenStore
from projections import snapshots
from tests.helpers import count_events, log_rows, model_data, put_back, round_trips, schema_of
from tests.serving import bearer, http_client, started

CONFIG = """
models:
  - name: declared
    engine: vllm
    source: hf://org/declared
    profiles: [{name: gpu, gpus: 1}]
"""
POOL = ["a", "b", "c", "d"]


def _definition(name: str, fallbacks: list[str]) -> Any:
    return model_from_data(
        {
            "name": name,
            "engine": "vllm",
            "source": f"hf://org/{name}",
            "profiles": [{"name": "gpu", "gpus": 1}],
            "fallbacks": fallbacks,
        },
        "test",
    )


def _writer(url: str, config: str, seed: int, commands: int, out: Any) -> None:
    """One node: random commands that race the other nodes' on shared names."""
    rng = random.Random(seed)
    models = Models(load_config(config), env={"CATALOG_ES_DB": url})
    written: list[tuple[int, str]] = []
    refused = 0
    for _ in range(commands):
        name = rng.choice(POOL)
        kind = rng.choice(["add", "add", "remove", "scale", "declared"])
        try:
            if kind == "add":
                others = [n for n in [*POOL, "declared"] if n != name]
                result = models.add(
                    _definition(name, rng.sample(others, rng.randint(0, 2))), by=f"node{seed}"
                )
            elif kind == "remove":
                result = models.remove(name, by=f"node{seed}")
            elif kind == "scale":
                result = models.scale(name, rng.randint(0, 1), rng.randint(1, 3), by=f"node{seed}")
            else:
                result = models.scale("declared", 0, 2, by=f"node{seed}")
            written.append((result.revision, kind))
        except Refused:
            refused += 1
    models.close()
    out.put((seed, written, refused))


@pytest.mark.parametrize("nodes", [4])
def test_concurrent_nodes_lose_nothing_and_write_nothing_on_stale_grounds(
    db_url: str, tmp_path: Path, nodes: int
) -> None:
    config = tmp_path / "catalog.yaml"
    config.write_text(CONFIG)
    # The follower starts before the load and must see every revision once, in order.
    follower = Models(load_config(str(config)), env={"CATALOG_ES_DB": db_url})
    seen: list[int] = []
    watch = follower.watch(0, poll_interval=0.02)

    def follow() -> None:
        seen.extend(event["revision"] for event in watch)

    watcher = threading.Thread(target=follow, daemon=True)
    watcher.start()

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    commands = 30
    workers = [
        context.Process(target=_writer, args=(db_url, str(config), seed, commands, results))
        for seed in range(nodes)
    ]
    for w in workers:
        w.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(timeout=30)
        assert w.exitcode == 0

    successes = [revision for _, written, _ in outcomes for revision, _ in written]
    assert sum(refused for *_, refused in outcomes) > 0, "the race should refuse something"
    assert len(set(successes)) == len(successes), "two commands answered the same revision"

    reader = Models(load_config(str(config)), env={"CATALOG_ES_DB": db_url})
    log = list(reader.log_events())
    revisions = [e["revision"] for e in log]
    declared_records = [e["revision"] for e in log if e["event"] == "ConfigDeclared"]
    # Exactly the successful commands, plus the one record of the declared config.
    assert sorted(successes + declared_records) == revisions
    assert len(declared_records) == 1
    assert revisions == list(range(1, len(revisions) + 1)), "revisions have a gap"
    assert count_events(db_url) == len(revisions)
    # Nothing was written on stale grounds: every event is valid where it stands.
    assert reader.skipped() == []
    for model in reader.list_models():
        for target in model["fallbacks"]:
            assert reader.get_model(target)
    assert all(e["model"] != "declared" for e in log)

    deadline = time.monotonic() + 10
    while len(seen) < len(revisions) and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.stop()
    watcher.join(timeout=10)
    assert not watcher.is_alive()
    assert seen == revisions
    follower.close()
    reader.close()


def test_two_nodes_cannot_both_remove_what_the_other_relies_on(db_url: str) -> None:
    """Node 1 points c at a while node 2 removes a: whichever commits second
    decides on the first's result, so one of them is refused, every time."""
    first = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    second = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    first.add(_definition("a", []), by="setup")
    first.add(_definition("c", []), by="setup")
    for _ in range(5):
        barrier = threading.Barrier(2)
        outcomes: dict[str, str] = {}

        def point_c_at_a(
            barrier: threading.Barrier = barrier, outcomes: dict[str, str] = outcomes
        ) -> None:
            barrier.wait()
            try:
                first.add(_definition("c", ["a"]), by="node1")
                outcomes["node1"] = "ok"
            except Refused as refusal:
                outcomes["node1"] = str(refusal)

        def remove_a(
            barrier: threading.Barrier = barrier, outcomes: dict[str, str] = outcomes
        ) -> None:
            barrier.wait()
            try:
                second.remove("a", by="node2")
                outcomes["node2"] = "ok"
            except Refused as refusal:
                outcomes["node2"] = str(refusal)

        threads = [threading.Thread(target=point_c_at_a), threading.Thread(target=remove_a)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert sorted(outcomes.values()).count("ok") == 1, outcomes
        # Put things back for the next round.
        first.add(_definition("c", []), by="setup")
        if first.catalog_at().get("a") is None:
            first.add(_definition("a", []), by="setup")
    assert Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url}).skipped() == []


def test_a_command_decides_on_the_one_event_another_node_wrote_just_before(
    db_url: str,
) -> None:
    """A node finds out that the log moved from the read its write begins with,
    and catches up before deciding, even when the log moved by one event."""
    first = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    second = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    first.add(_definition("a", []), by="setup")
    first.add(_definition("c", []), by="setup")
    second.remove("a", by="node2")
    with pytest.raises(Refused, match="'a'"):
        first.add(_definition("c", ["a"]), by="node1")
    assert first.revision == second.revision == 3
    first.scale("c", 0, 2, by="node1")
    scaled = second.scale("c", maximum=3, by="node2").model
    assert scaled is not None and scaled["scaling"] == {"min": 0, "max": 3}
    assert Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url}).skipped() == []


def test_a_write_after_the_server_dropped_the_idle_connection_still_lands(
    pg_url: str, pg_admin: sa.Engine
) -> None:
    """Writes go through a held connection; one the server closed while it sat
    idle (a restart, an idle timeout) is noticed and replaced, not failed on,
    after an idle second (it took a minute: the first write after a failover
    failed; operator walkthrough)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    models.add(_definition("a", []), by="setup")
    _end_the_writers_session(models, pg_admin)
    models.store._writer_used -= 1.5  # as if it had been idle a second and a half
    assert models.scale("a", 0, 2, by="ops").revision == models.revision
    assert models.get_model("a")["scaling"] == {"min": 0, "max": 2}
    models.close()


def test_a_write_just_after_the_server_ended_its_session_still_lands(
    pg_url: str, pg_admin: sa.Engine
) -> None:
    """A session ended within a second of the node's last write (a restart,
    a failover, pg_terminate_backend) left its next write failing with a
    503, while a node that had been idle longer asked first and went
    through: the server's word that it ends the session is read off the
    socket before the write relies on it (hostile test)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    models.add(_definition("a", []), by="setup")
    _end_the_writers_session(models, pg_admin)
    models.store._writer_used = time.monotonic()  # as if it had just written
    assert models.scale("a", 0, 2, by="ops").revision == models.revision
    assert models.get_model("a")["scaling"] == {"min": 0, "max": 2}
    models.close()


def test_a_read_just_after_the_server_ended_the_pooled_session_is_answered(
    pg_url: str, pg_admin: sa.Engine
) -> None:
    """Reads go through the pool's connections, each asked whether it is
    still connected, as the held writer is, only when it sat idle a second
    or the server sent it something: one whose session the server ended (a
    restart, a failover, pg_terminate_backend) just after it was handed
    back is replaced, and the read answered, not failed."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    models.add(_definition("a", []), by="setup")
    assert models.get_model("a")["name"] == "a"  # its connection back in the pool
    _end_sessions(pg_admin, _sessions_of(pg_admin, pg_url))
    assert models.get_model("a")["name"] == "a"
    assert models.scale("a", 0, 2, by="ops").revision == models.revision
    models.close()


def test_a_read_just_after_another_asks_the_server_once(pg_url: str) -> None:
    """A read of a log no one moved is one statement: the pool's check of
    its connection before each use (SQLAlchemy's pre-ping) made it two round
    trips. Its connection, idle a second, is still asked first."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    models.add(_definition("a", []), by="setup")
    with round_trips(models.store.engine) as trips:
        models.get_model("a")  # its connection handed back to the pool
        before = len(trips)
        models.get_model("a")
        just_after = len(trips)
        time.sleep(1.1)
        models.get_model("a")
    assert just_after - before == 1, trips
    assert len(trips) - just_after == 2, trips  # the check, then the read
    models.close()


def _end_the_writers_session(models: Models, pg_admin: sa.Engine) -> None:
    """The server ends the session of ``models``' held write connection, as a
    restart or a failover does; back once it is gone."""
    writer = models.store._writer
    assert writer is not None
    pid = writer.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    writer.rollback()
    _end_sessions(pg_admin, [pid])


def _sessions_of(pg_admin: sa.Engine, url: str) -> list[int]:
    """The server's sessions of the connections made with ``url`` (those of
    its ``application_name``: a test's own, as ``pg_schema_url`` names them)."""
    with pg_admin.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT pid FROM pg_stat_activity"
                    " WHERE application_name = :name AND pid <> pg_backend_pid()"
                ),
                {"name": sa.make_url(url).query["application_name"]},
            ).scalars()
        )


def _end_sessions(pg_admin: sa.Engine, pids: list[int]) -> None:
    """The server ends the sessions ``pids``, as a restart or a failover does;
    back once they are gone."""
    with pg_admin.connect() as conn:
        for pid in pids:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        deadline = time.monotonic() + 5
        while conn.execute(
            sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(:pids)"),
            {"pids": pids},
        ).scalar_one():
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_a_node_behind_a_pooler_in_transaction_mode_stops_preparing_statements(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """psycopg prepares a statement run five times on a connection, by a name
    of its own, on the server session it ran on then. A pooler in
    transaction mode (PgBouncer before 1.21) gives each transaction any
    session: the name was another's ("already exists") or not there ("does
    not exist"), and every few commands and reads failed as internal errors
    (hostile test, two nodes behind PgBouncer 1.18). The first such error
    is an outage, retried; from then on the node prepares nothing. Here each
    transaction is handed a session that forgot what was prepared on it."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})

    def another_session(conn: Any, *_: Any) -> None:
        driver = getattr(conn, "connection", conn)
        driver = getattr(driver, "driver_connection", driver)
        driver.pgconn.exec_(b"DEALLOCATE ALL")  # behind psycopg's back

    sa.event.listen(models.store.engine, "checkout", another_session)
    sa.event.listen(
        models.store.engine,
        "before_cursor_execute",
        lambda conn, _cursor, statement, *_: (
            another_session(conn) if statement.startswith("BEGIN") else None
        ),
    )
    models.add(_definition("a", []), by="setup")
    failed = []
    for n in range(30):
        try:
            models.scale("a", 0, 1 + n % 3, by="ops")
            assert models.get_model("a")["scaling"]["max"] == 1 + n % 3
        except sa.exc.DBAPIError as error:
            unusable = database_unusable(error)
            assert unusable is not None and not unusable.lasting, error
            failed.append(n)
    assert len(failed) <= 1
    told = [r.getMessage() for r in caplog.records if "pooler" in r.getMessage()]
    assert len(told) == 1 and "statements are no longer prepared" in told[0]
    assert models.revision == count_events(pg_url) == 1 + 30 - len(failed)
    models.close()


def test_preparing_is_turned_off_while_connections_are_being_made(pg_url: str) -> None:
    """The first statement to meet another session's prepared one turns
    preparing off on each of the engine's connections, gone through as
    other threads make new ones: a connection added meanwhile raised "Set
    changed size during iteration" (review), an internal error, and left
    the connections not yet gone through preparing. Here the connections
    are told to the engine's own listener of new connections, as fast as a thread
    can, while the switch between threads is as frequent as it can be."""

    class Driver:  # what the connect event is given: psycopg's connection
        prepare_threshold: int | None = 5

    class PreparedElsewhere(Exception):
        sqlstate = "42P05"

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(200):
            engine = create_engine(pg_url)
            # Its own listener alone: the dialect's would talk to the server.
            (tracked,) = (fn for fn in engine.pool.dispatch.connect if fn.__name__ == "_made")
            made = [Driver() for _ in range(50)]
            for driver in made:
                tracked(driver, None)
            stop = threading.Event()

            def connect(tracked: Any, made: list[Driver], stop: threading.Event) -> None:
                while not stop.is_set():
                    made.append(Driver())
                    tracked(made[-1], None)

            connecting = threading.Thread(target=connect, args=(tracked, made, stop))
            connecting.start()
            try:
                assert prepared_elsewhere(engine, PreparedElsewhere("already exists"))
            finally:
                stop.set()
                connecting.join()
            assert all(driver.prepare_threshold is None for driver in made)
            engine.dispose()
    finally:
        sys.setswitchinterval(interval)


def test_a_node_whose_pooler_dropped_the_urls_search_path_is_refused(pg_url: str) -> None:
    """A pooler passes no ``options`` on, and told to ignore them (as is done
    to get past its refusal of them) drops them: the node used the log of
    the public schema as its own, wrote into it and answered its revision
    (hostile test, PgBouncer). Here the session's search path is set back
    as it connects, as a pooler's session has its own."""
    engine = create_engine(pg_url)

    @sa.event.listens_for(engine, "connect", insert=True)
    def dropped(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.execute("SET search_path = public")
        dbapi_connection.commit()

    with pytest.raises(sa.exc.DBAPIError) as raised, engine.connect():
        pass
    unusable = database_unusable(raised.value)
    assert unusable is not None and unusable.lasting
    assert unusable.said.startswith(
        "the database URL sets the search path (options), but this session's is"
        " 'public', from its session: a connection pooler dropped them"
    )
    engine.dispose()


def test_a_new_connection_checks_the_urls_search_path_in_one_round_trip(pg_url: str) -> None:
    """Each new connection of a node whose URL sets the search path asks
    which schemas its session finds (above): in a transaction of its own,
    psycopg's BEGIN and the ROLLBACK made that three round trips."""
    engine = create_engine(pg_url)
    with round_trips(engine) as trips, engine.connect():
        pass
    engine.dispose()
    checked = trips[trips.index(['"ROLLBACK"']) + 1 :]  # past SQLAlchemy's first questions
    assert len(checked) == 1, checked
    assert "search_path" in checked[0][0]


@pytest.mark.parametrize("kept", ["{schema}", '"$user", {schema}, pg_catalog'])
def test_a_node_whose_pooler_dropped_a_search_path_its_role_also_has_uses_its_log(
    pg_url: str, kept: str
) -> None:
    """A role given the catalog's schema as its search path, as the refusal
    above asks, and a URL that also gives it (say, the URL of a node that
    connected to the server straight until a pooler came between): the
    node was refused though its sessions found the same log. Now a session
    whose own path finds the same schemas is the node's, written however
    it likes (here ``$user`` names no schema)."""
    added = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    added.add(_definition("a", []), by="setup")
    added.close()
    url = sa.make_url(pg_url)
    assert url.query["options"] == f"-csearch_path={schema_of(pg_url)}"
    # The same path, said in the other ways libpq's options may say it.
    ways = (f"--search-path={schema_of(pg_url)}", f"-c  Search_Path={schema_of(pg_url)}")
    for k, options in enumerate(ways):
        given = url.update_query_dict({"options": options}).render_as_string(False)
        models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": given})

        @sa.event.listens_for(models.store.engine, "connect", insert=True)
        def dropped(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.execute(f"SET search_path = {kept.format(schema=schema_of(pg_url))}")
            dbapi_connection.commit()

        models.store.engine.dispose()
        assert [model["name"] for model in models.list_models()] == ["a"]
        models.scale("a", maximum=2 + k, by="ops")
        assert models.revision == 2 + k
        models.close()


def test_a_refusal_whose_record_fails_is_told_in_the_drivers_line(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused command's record goes in a transaction of its own; when it
    fails (a node's sessions ended under it), the warning gave SQLAlchemy's
    whole message, the statement and the command's fields and reason, one
    long line of the server's log a refusal (hostile test, sessions swept
    every 0.7 s). Now the driver's first line."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    models.add(_definition("a", []), by="setup")
    with models.store.engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE FUNCTION refuse() RETURNS trigger AS"
            " $$ BEGIN RAISE EXCEPTION 'refused by a trigger'; END $$ LANGUAGE plpgsql"
        )
        conn.exec_driver_sql(
            "CREATE TRIGGER refuse BEFORE INSERT ON catalog_refusals"
            " FOR EACH ROW EXECUTE FUNCTION refuse()"
        )
    with pytest.raises(Refused, match="'nope'"):
        models.scale("nope", 0, 2, by="ops", reason="a reason of its own")
    told = [r.getMessage() for r in caplog.records if "could not record" in r.getMessage()]
    assert told == ["could not record the refusal of Scaled for 'nope': refused by a trigger"]
    models.close()


def test_a_node_writing_with_another_config_says_so(
    db_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two nodes with different configs take turns recording theirs, and the
    declared models go in and out of force: it was silent (operator walkthrough).
    A config the log never recorded is a deploy, no news; a node restarted (or
    a CLI run, a node of its own) on one the log recorded before another
    replaced it puts that one back, and says so: it was silent (review)."""
    configs = []
    for n, declared in enumerate((["base"], ["base", "extra"])):
        path = tmp_path / f"catalog-{n}.yaml"
        path.write_text(
            "models:\n"
            + "".join(
                f"- {{name: {m}, engine: vllm, source: hf://o/{m},"
                " profiles: [{name: g, gpus: 1}]}\n"
                for m in declared
            )
        )
        configs.append(load_config(str(path)))
    first, second = (Models(c, env={"CATALOG_ES_DB": db_url}) for c in configs)
    first.add(_definition("a", []), by="ops")  # 1 first's config, 2
    second.scale("a", 0, 2, by="ops")  # 3 second's, 4: a config changed, as deploys do
    assert "every node should run" not in caplog.text
    first.scale("a", 0, 3, by="ops")  # 5 first's again, 6
    second.scale("a", 0, 4, by="ops")  # 7 second's again, 8
    Models(configs[0], env={"CATALOG_ES_DB": db_url}).scale("a", 0, 5, by="ops")  # a restart
    told = _told_put_back(caplog)
    paths = [tmp_path / f"catalog-{n}.yaml" for n in range(2)]
    assert told == [
        f"this node's declared config ({paths[0]}), recorded at revision 1, was replaced by "
        "another at revision 3, and is recorded again at revision 5: every node should run "
        "the same one, unless it was put back on purpose",
        f"this node's declared config ({paths[1]}), recorded at revision 3, was replaced by "
        "another at revision 5, and is recorded again at revision 7: every node should run "
        "the same one, unless it was put back on purpose",
        f"this node's declared config ({paths[0]}), recorded at revision 5, was replaced by "
        "another at revision 7, and is recorded again at revision 9: every node should run "
        "the same one, unless it was put back on purpose",
    ]


def test_a_node_given_no_config_stops_writing_once_another_records_one(db_url: str) -> None:
    """A node given no config at all (none at ``Models()``, as a CLI run or a
    server from another folder) writes on a log that recorded none; once
    another node records one, its next write is refused, nothing written,
    decided as it holds the log (the check at its load saw none): it would
    record none over it, undeclaring every declared model. Given the empty
    layer on purpose, a node still records it."""
    (declared,) = _configs(1)
    bare = Models(env={"CATALOG_ES_DB": db_url})
    bare.add(_definition("a", []), by="ops")  # 1
    deployed = Models(declared, env={"CATALOG_ES_DB": db_url})
    deployed.scale("a", 0, 2, by="ops")  # 2 its config, 3
    rows = count_events(db_url)
    with pytest.raises(NoConfigGiven, match="recorded one at revision 2, and this write would"):
        bare.scale("a", 0, 3, by="ops")
    with pytest.raises(NoConfigGiven):
        bare.apply_changes([commands.scale("a", 0, 3)], by="ops")
    assert count_events(db_url) == rows
    # A rollback, and its dry run: a plan over none of the declared models.
    with pytest.raises(NoConfigGiven):
        bare.rollback(1, dry_run=True, by="ops")
    with pytest.raises(NoConfigGiven):
        bare.rollback(1, by="ops")
    assert [r["event"] for r in bare.refusals()] == ["Scaled", "Apply", "Rollback"]
    nothing = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    assert nothing.scale("a", 0, 4, by="ops").revision == rows + 2  # the empty layer, then it
    assert bare.scale("a", 0, 5, by="ops").revision == rows + 3
    for models in (bare, deployed, nothing):
        models.close()


def test_a_node_given_no_config_is_told_once_when_another_records_one(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A server started with no config at all read on, over no declared
    layer, without a word once another node recorded one; only its writes
    answered (NoConfigGiven) (review). Its catch-up says so, once."""
    (declared,) = _configs(1)
    bare = Models(env={"CATALOG_ES_DB": db_url})
    bare.add(_definition("a", []), by="ops")  # 1: no config recorded
    deployed = Models(declared, env={"CATALOG_ES_DB": db_url})
    deployed.scale("a", 0, 2, by="ops")  # 2 its config, 3

    def told() -> list[str]:
        return [r.getMessage() for r in caplog.records if "no declared config" in r.getMessage()]

    assert [m["name"] for m in bare.list_models()] == ["a"]  # base-0 left out
    assert told() == [
        "no declared config given (--config, $CATALOG_ES_CONFIG or ./catalog.yaml) as "
        "this node started: another node recorded one at revision 2, and this node's "
        "reads go without its models; restart it with that config"
    ]
    deployed.scale("a", 0, 3, by="ops")  # 4
    bare.list_models()
    assert len(told()) == 1
    for models in (bare, deployed):
        models.close()


def _configs(count: int) -> list[DeclaredConfig]:
    """``count`` declared configs, each of a model of its own, its path its index."""
    return [
        DeclaredConfig(models=(model_from_data(model_data(f"base-{n}"), "config"),), path=f"{n}")
        for n in range(count)
    ]


def _told_put_back(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings of a config recorded again over another's."""
    return [r.getMessage() for r in caplog.records if "every node should run" in r.getMessage()]


def _told_other_configs(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings of another node writing under another config, up to
    where they name this node's."""
    return [
        r.getMessage().split(";")[0]
        for r in caplog.records
        if "another node writes under" in r.getMessage()
    ]


def _other_config(config: DeclaredConfig, revision: int, by: str) -> str:
    """How that warning names ``config``, recorded at ``revision`` by ``by``."""
    return (
        f"another node writes under another declared config, fingerprint "
        f"{config.fingerprint[:12]} ({config.path}), recorded at revision {revision} by {by!r}"
    )


def test_a_config_recorded_several_deploys_back_is_told_when_it_comes_back(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A node (or a shell) on a config older than the last deploy but one:
    the log's records are looked through past the last two, in pages. The
    warning named the last record before the write as when the config was
    replaced, where the next deploy replaced it long before (review): it
    names both."""
    configs = _configs(20)
    nodes = [Models(c, env={"CATALOG_ES_DB": db_url}) for c in configs]
    nodes[0].add(_definition("a", []), by="ops")  # 1 config 0, 2
    for revision, node in enumerate(nodes[1:], start=3):
        node.scale("a", 0, revision, by="ops")  # deploys: each a config never recorded
    assert "every node should run" not in caplog.text
    nodes[0].scale("a", 0, 99, by="ops")  # 41 config 0 again, 42
    told = _told_put_back(caplog)
    assert told == [
        "this node's declared config (0), recorded at revision 1, was replaced by another at "
        "revision 3, last by another at revision 39, and is recorded again at revision 41: "
        "every node should run the same one, unless it was put back on purpose"
    ]
    for node in nodes:
        node.close()


def test_a_node_is_told_once_of_each_config_others_recorded_since_it_started(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A node catching up with several writes at once is told of each other
    config among them, not only of the last record's (config 1, recorded,
    then replaced by a node on this one's); not of one the log recorded
    before it started, until another node records it again; and once."""
    configs = _configs(3)
    url = {"CATALOG_ES_DB": db_url}
    early = Models(configs[2], env=url)
    early.add(_definition("a", []), by="early")  # 1 config 2, 2
    node = Models(configs[0], env=url)
    assert node.record_declaration(by="node") == 3
    others = [Models(configs[1], env=url)]
    others[0].scale("a", 0, 2, by="other")  # 4 config 1, 5
    # A node on this one's config, started after that (so told of nothing).
    others.append(Models(configs[0], env=url))
    others[1].scale("a", 0, 3, by="other")  # 6 config 0 again, 7
    fingerprints = [c.fingerprint[:12] for c in configs]

    def told() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if f"; this node's is fingerprint {fingerprints[0]}" in r.getMessage()
        ]

    node.list_models()
    early.scale("a", 0, 4, by="early")  # 8 config 2 again, 9
    others[0].scale("a", 0, 5, by="other")  # 10 config 1 again, 11
    node.scale("a", 0, 6, by="node")  # 12 config 0 again, 13
    node.list_models()
    assert told() == [
        f"another node writes under another declared config, fingerprint {fingerprints[n]} "
        f"({n}), recorded at revision {revision} by {by!r}; this node's is fingerprint "
        f"{fingerprints[0]} (0): the nodes serve different declared layers, and the log "
        "records each in turn; run every node on one config (told once for each other config)"
        for n, revision, by in ((1, 4, "other"), (2, 8, "early"))
    ]
    for models in (early, node, *others):
        models.close()


def test_a_config_recorded_as_a_node_starts_is_not_told(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A config another node records between a server's load and its start's
    record is one recorded before it started: the start records its own over
    it, and is not told of it (stress test: a node restarted under load told
    of one), until that node records it again."""
    configs = _configs(2)
    url = {"CATALOG_ES_DB": db_url}
    node = Models(configs[0], env=url)  # loaded, as a server's start does first
    other = Models(configs[1], env=url)
    other.add(_definition("a", []), by="other")  # 1 config 1, 2
    assert node.record_declaration(by="node") == 3
    node.list_models()

    assert _told_other_configs(caplog) == []
    other.scale("a", 0, 2, by="other")  # 4 config 1 again, 5
    node.list_models()
    assert _told_other_configs(caplog) == [_other_config(configs[1], 4, "other")]
    for models in (node, other):
        models.close()


def test_a_command_is_not_told_of_a_config_recorded_as_it_ran(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A command's run (loaded, then one write) is told of another config
    only as the docs say: its write warns when it records a config the log
    had recorded before another replaced it. The server's warning of
    another node writing under another config was told too, by a write
    whose catch-up met a record made after its load (stress test: a
    command-line write under load), and by none that met it at its load."""
    configs = _configs(2)
    url = {"CATALOG_ES_DB": db_url}
    command = Models(configs[0], env=url)  # loaded, as a command's run does first
    other = Models(configs[1], env=url)
    other.add(_definition("a", []), by="other")  # 1 config 1, 2
    command.scale("a", 0, 2, by="ops")  # 3 config 0 (a deploy), 4
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    for models in (command, other):
        models.close()


@pytest.mark.parametrize("meets", ["read", "write"])
def test_a_server_looks_up_another_config_holding_up_no_read_or_write(
    db_url: str, meets: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server whose read or write met another config's record looked the
    log's config records up holding the catalog's lock (a write's, the write
    lock too): every read and write of the process waited for that read
    (review). They go on meanwhile; and threads meeting another record of
    that config at once, as the lookup goes on, tell it no more: once, at
    its first record."""
    configs = _configs(2)
    node, other = _serving_beside(configs, db_url)
    looking, go_on = _first_lookup_held(monkeypatch)

    def read_and_write() -> None:
        node.list_models()
        node.scale("a", 0, 4, by="node")  # config 0 again

    threads = ThreadPoolExecutor(10)  # the first, held up, and 8 at once
    try:
        first = threads.submit(
            node.list_models if meets == "read" else lambda: node.scale("a", 0, 3, by="node")
        )
        assert looking.wait(10)  # its lookup held up: reads and writes go on
        threads.submit(read_and_write).result(timeout=5)
        other.scale("a", 0, 5, by="other")  # config 1 again
        at_once = threading.Barrier(8)

        def refresh() -> None:
            at_once.wait(5)
            node.refresh()

        refreshes = [threads.submit(refresh) for _ in range(8)]
        for refreshed in refreshes:
            refreshed.result(timeout=10)
    finally:
        go_on.set()
        threads.shutdown()
    first.result()
    node.refresh()
    assert _told_other_configs(caplog) == [_other_config(configs[1], 3, "other")]
    for models in (node, other):
        models.close()


def _serving_beside(configs: list[DeclaredConfig], db_url: str) -> list[Models]:
    """A server on ``configs[0]``, started at revision 2, and a node on each
    other config, the first of which wrote after it (revisions 3-4): the
    server, then those nodes."""
    url = {"CATALOG_ES_DB": db_url}
    node = Models(configs[0], env=url)
    node.add(_definition("a", []), by="node")  # 1 config 0, 2
    assert node.record_declaration(by="node") == 2
    others = [Models(c, env=url) for c in configs[1:]]
    others[0].scale("a", 0, 2, by="other")  # 3 config 1, 4
    return [node, *others]


def _first_lookup_held(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """The first lookup of the configs the log recorded, held up: set
    ``looking`` as it starts, and it goes on once ``go_on`` is."""
    looking, go_on = threading.Event(), threading.Event()
    looked_up = snapshots.configs_recorded_between

    def held_up(*args: Any, **kwargs: Any) -> Any:
        if not looking.is_set():
            looking.set()
            go_on.wait(30)
        return looked_up(*args, **kwargs)

    monkeypatch.setattr(snapshots, "configs_recorded_between", held_up)
    return looking, go_on


def test_a_server_looks_again_for_the_configs_noted_as_it_looked(
    db_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A thread whose catch-up met another config's record as another
    thread looked the records up left them to that one, which told those it
    had looked up and looked no more: the second config was told only at a
    later call, and never by a server gone idle (review). It looks again."""
    configs = _configs(3)
    node, other, third = _serving_beside(configs, db_url)
    looking, go_on = _first_lookup_held(monkeypatch)
    threads = ThreadPoolExecutor(2)
    try:
        first = threads.submit(node.list_models)
        assert looking.wait(10)
        third.scale("a", 0, 3, by="third")  # 5 config 2, 6
        threads.submit(node.refresh).result(timeout=10)  # noted, left to the first
    finally:
        go_on.set()
        threads.shutdown()
    first.result()
    assert _told_other_configs(caplog) == [
        _other_config(configs[1], 3, "other"),
        _other_config(configs[2], 5, "third"),
    ]
    for models in (node, other, third):
        models.close()


def test_a_server_looks_again_a_bounded_number_of_times(
    db_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another config recorded and met as each look goes on (writes on two
    configs that go on): a request's thread looks twice, not for as long as
    they do, and what was met as it looked last is told at the next call."""
    configs = _configs(5)
    node, *others = _serving_beside(configs, db_url)
    looked_up = snapshots.configs_recorded_between
    looks = 0

    def another_written_meanwhile(*args: Any, **kwargs: Any) -> Any:
        nonlocal looks
        looks += 1
        if looks < len(others):  # never ending, but for the configs this test has
            others[looks].scale("a", 0, looks + 2, by=f"other {looks}")  # 5, 7, 9: config 2, 3, 4
            node.refresh()  # noted, left to this lookup's thread
        return looked_up(*args, **kwargs)

    monkeypatch.setattr(snapshots, "configs_recorded_between", another_written_meanwhile)
    node.list_models()
    assert looks == 2
    assert _told_other_configs(caplog) == [
        _other_config(configs[1], 3, "other"),
        _other_config(configs[2], 5, "other 1"),
    ]
    node.list_models()
    assert _told_other_configs(caplog)[2:] == [
        _other_config(configs[3], 7, "other 2"),
        _other_config(configs[4], 9, "other 3"),
    ]
    for models in (node, *others):
        models.close()


@pytest.mark.parametrize("regrown", [1, 3])
def test_a_server_whose_log_went_back_is_told_of_the_configs_recorded_in_it_since(
    db_url: str, regrown: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A log that went back under a server (a backup restored, then a node on
    another config wrote): the server loaded it again, and was told nothing
    of that config, its records numbered below the revision it had been at
    (review). It is told, once, as of a config recorded since it started."""
    configs = _configs(2)
    url = {"CATALOG_ES_DB": db_url}
    node = Models(configs[0], env=url)
    node.add(_definition("a", []), by="node")  # 1 config 0, 2
    assert node.record_declaration(by="node") == 2
    saved = log_rows(db_url)
    for replicas in (3, 4, 5):
        node.scale("a", 0, replicas, by="node")  # 3, 4, 5: lost
    put_back(db_url, saved)
    other = Models(configs[1], env=url)
    for replicas in range(regrown):
        other.scale("a", 0, 6 + replicas, by="other")  # 3 config 1, 4; then 5, 6
        if replicas == 0:
            recorded = other.revision - 1  # PostgreSQL numbers on from 6: its sequence kept
    node.list_models()
    other.scale("a", 0, 9, by="other")
    node.list_models()
    assert "loading the catalog from the log" in caplog.text
    assert _told_other_configs(caplog) == [_other_config(configs[1], recorded, "other")]
    for models in (node, other):
        models.close()


def test_a_server_whose_lookup_of_another_config_failed_looks_again(
    db_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server's lookup of the configs another node recorded failed (the
    database away for that read): those configs were never told (review).
    They are looked up again at the next read, and told then."""
    configs = _configs(2)
    url = {"CATALOG_ES_DB": db_url}
    node = Models(configs[0], env=url)
    node.add(_definition("a", []), by="node")  # 1 config 0, 2
    assert node.record_declaration(by="node") == 2
    other = Models(configs[1], env=url)
    other.scale("a", 0, 2, by="other")  # 3 config 1, 4

    def failed(*_: Any, **__: Any) -> Any:
        raise sa.exc.OperationalError("SELECT", {}, Exception("the server closed the connection"))

    monkeypatch.setattr(snapshots, "configs_recorded_between", failed)
    node.list_models()
    assert _told_other_configs(caplog) == []
    monkeypatch.undo()
    node.list_models()
    assert _told_other_configs(caplog) == [_other_config(configs[1], 3, "other")]
    for models in (node, other):
        models.close()


def test_a_deploy_looks_up_the_configs_the_log_recorded_without_holding_its_writes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A write that records a config looks through the log's config records
    (up to 1,000, each every declared definition) for an earlier record of
    its own: under the log's write lock, every node's writes waited for it
    (181 ms for 40 records of 2,000 models on PostgreSQL, each deploy;
    review). Only a warning hangs on it, and the records it reads are
    committed before the write: it is read once the write is. Another node
    writes meanwhile, and the warning is told all the same."""
    path = tmp_path / "catalog.db"
    url = f"sqlite:///{path}"
    configs = _configs(2)
    nodes = [Models(c, env={"CATALOG_ES_DB": url}) for c in configs]
    nodes[0].add(_definition("a", []), by="ops")  # 1 config 0, 2
    nodes[1].scale("a", 0, 2, by="ops")  # 3 config 1, 4
    other_writes: list[bool] = []

    def another_node_writes(*args: Any) -> None:
        statement = str(args[2])
        if "RECURSIVE" not in statement or "state" not in statement:
            return  # not a read of the config's records
        other = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            other.execute("ROLLBACK")
            other_writes.append(True)
        except sqlite3.OperationalError:  # database is locked
            other_writes.append(False)
        finally:
            other.close()

    sa.event.listen(nodes[0].store.engine, "before_cursor_execute", another_node_writes)
    try:
        nodes[0].scale("a", 0, 3, by="ops")  # 5 config 0 again, 6
    finally:
        sa.event.remove(nodes[0].store.engine, "before_cursor_execute", another_node_writes)
    assert other_writes
    assert all(other_writes), other_writes
    told = _told_put_back(caplog)
    assert told == [
        "this node's declared config (0), recorded at revision 1, was replaced by another at "
        "revision 3, and is recorded again at revision 5: every node should run the same one, "
        "unless it was put back on purpose"
    ]
    for node in nodes:
        node.close()


def test_a_read_sees_one_state_of_the_log_while_others_write(db_url: str) -> None:
    """What verify and every multi-statement read rely on: a commit by another
    node in the middle of a read is not half seen."""
    reader = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    writer = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    writer.add(_definition("a", []), by="setup")
    with reader.store.read() as conn:
        head = reader.store.head(conn)
        writer.scale("a", 0, 2, by="other-node")
        assert reader.store.head(conn) == head
        assert [r for page in reader.store.scan(conn) for r in page][-1][0] == head
    assert reader.verify()["ok"] is True
    reader.close()
    writer.close()


def test_a_write_waits_out_its_own_node_catching_up_before_it_takes_the_log(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader catching up a backlog holds its node's catalog for as long as
    that takes; a write of that node waits for it before it takes the log's
    write lock, not holding it: other nodes' writes go on meanwhile (they
    waited 5.2 s behind a 300,000-event catch-up, or were refused as busy)."""
    behind, other, third = (Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url}) for _ in "123")
    other.add(_definition("a", []), by="setup")
    monkeypatch.setattr(third.store, "lock_wait", 0.5)
    catching_up, go_on = threading.Event(), threading.Event()
    catch_up = behind._catch_up

    def slow_for_the_reader(conn: sa.Connection, *, held: bool = False) -> None:
        if threading.current_thread().name == "reader":
            catching_up.set()
            assert go_on.wait(10)
        catch_up(conn, held=held)

    monkeypatch.setattr(behind, "_catch_up", slow_for_the_reader)
    written: list[int] = []
    writer = threading.Thread(
        target=lambda: written.append(behind.scale("a", 0, 2, by="node1").revision)
    )
    reader = threading.Thread(target=behind.list_models, name="reader")
    reader.start()
    assert catching_up.wait(10)
    writer.start()
    time.sleep(0.3)  # the write is under way, waiting for the reader
    try:
        assert third.scale("a", maximum=3, by="node3").revision == 2
    finally:
        go_on.set()
        reader.join(10)
        writer.join(10)
    assert written == [3]
    assert behind.get_model("a")["scaling"] == {"min": 0, "max": 2}
    for models in (behind, other, third):
        models.close()


def test_a_write_far_behind_the_log_catches_up_before_it_takes_the_lock(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that served nothing while others wrote catches up with the
    backlog first, not while holding the log's write lock, which every
    node's writes queue behind (it held it 5.2 s for 300,000 events); then
    decides on the log as it stands then."""
    monkeypatch.setattr(application, "CATCH_UP_HELD", 3)
    behind = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    other = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    for name in ("a", "b", "c", "d"):
        other.add(_definition(name, []), by="setup")
    monkeypatch.setattr(other.store, "lock_wait", 0.5)
    catch_up, meanwhile = behind._catch_up, list[int]()

    def catch_up_while_another_node_writes(conn: sa.Connection, *, held: bool = False) -> None:
        # The write's own look, under the lock, finds the backlog and leaves
        # it; the catch-up that follows must not hold up the other node.
        if not held and not meanwhile:
            meanwhile.append(other.scale("a", maximum=3, by="node2").revision)
        catch_up(conn, held=held)

    monkeypatch.setattr(behind, "_catch_up", catch_up_while_another_node_writes)
    result = behind.scale("a", minimum=0, by="node1")
    assert (meanwhile, result.revision) == ([5], 6)
    assert result.model is not None and result.model["scaling"] == {"min": 0, "max": 3}
    fresh = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    assert behind.list_models() == fresh.list_models()
    for models in (behind, other, fresh):
        models.close()


def test_a_write_behind_by_no_more_than_the_held_catch_up_takes_the_lock_once(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node up to ``CATCH_UP_HELD`` events behind catches up under the
    log's write lock, which it takes once: only a longer backlog is worth
    letting go of the lock for, and taking it again."""
    monkeypatch.setattr(application, "CATCH_UP_HELD", 3)
    behind = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    behind.add(_definition("a", []), by="setup")
    other = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    for name in ("b", "c", "d"):
        other.add(_definition(name, []), by="setup")
    write, takes = behind.store.write, list[int]()

    def counted(*args: Any, **kwargs: Any) -> Any:
        takes.append(1)
        return write(*args, **kwargs)

    monkeypatch.setattr(behind.store, "write", counted)
    assert behind.scale("a", 0, 2, by="node1").revision == 5
    assert len(takes) == 1
    for models in (behind, other):
        models.close()


def test_a_write_catches_up_outside_the_lock_once_however_far_behind_it_falls_again(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other nodes may write a backlog again while a node catches up outside
    the lock: its write then catches up inside, the second time round, rather
    than let go for good."""
    monkeypatch.setattr(application, "CATCH_UP_HELD", 3)
    behind = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    other = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    for name in ("a", "b", "c", "d"):
        other.add(_definition(name, []), by="setup")
    refresh, write, takes = behind.refresh, behind.store.write, list[int]()

    def refresh_while_others_write() -> None:
        refresh()
        other.apply_changes([commands.scale(n, 0, 2 + len(takes)) for n in "abcd"], by="node2")

    def counted(*args: Any, **kwargs: Any) -> Any:
        takes.append(1)
        return write(*args, **kwargs)

    monkeypatch.setattr(behind, "refresh", refresh_while_others_write)
    monkeypatch.setattr(behind.store, "write", counted)
    assert behind.scale("a", 1, 5, by="node1").revision == other.revision + 1 == 9
    assert len(takes) == 2
    behind.close()
    other.close()


def test_revisions_burned_past_the_last_event_are_no_backlog(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL's sequence moves on in a write that then fails, and stays
    moved: those numbers are nothing to catch up with, and a write takes the
    lock once for them (it took it twice every write until one appended)."""
    # (No snapshot to write at 5,002: it takes the lock too.)
    models = Models(DeclaredConfig(), snapshot_interval=10**6, env={"CATALOG_ES_DB": pg_url})
    models.add(_definition("a", []), by="setup")
    with models.store.engine.begin() as conn:
        conn.exec_driver_sql(
            "SELECT setval(pg_get_serial_sequence('catalog_events', 'revision'), 5001)"
        )
    write, takes = models.store.write, []

    def counted(*args: Any, **kwargs: Any) -> Any:
        takes.append(1)
        return write(*args, **kwargs)

    monkeypatch.setattr(models.store, "write", counted)
    assert models.write_plan(lambda _batch: None, by="x") == (1, [])
    assert models.scale("a", 0, 2, by="x").revision == 5002
    assert len(takes) == 2  # one each
    models.close()


@pytest.mark.parametrize("first", ["write", "read"])
def test_a_node_whose_log_lost_its_last_events_loads_it_afresh(
    db_url: str, first: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A node keeps in force what it wrote or read. Should the log lose its
    last events (a failover to a standby that had not received them, a
    backup restored), the node must not serve them, nor decide on them: a
    fallback naming a model the log no longer has was accepted, under a
    revision handed out again, and every other node skipped it as invalid."""
    node = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    node.add(_definition("a", []), by="ops")
    saved, head = log_rows(db_url), node.revision
    node.add(_definition("b", []), by="ops")
    put_back(db_url, saved)
    if first == "write":
        with pytest.raises(Refused, match="'b', which is not in the catalog"):
            node.add(_definition("c", ["b"]), by="ops")
        assert log_rows(db_url) == saved
    assert [m["name"] for m in node.list_models()] == ["a"]
    assert node.revision == head
    assert (
        f"the log ends at revision {head}, before this node's catalog (at {head + 1}): it lost"
        " events (a failover, or a restored backup?); catalog-es verify says whether the log"
        " was edited; loading the catalog from the log"
    ) in caplog.text
    assert node.add(_definition("c", ["a"]), by="ops").revision > head
    fresh = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    assert fresh.list_models() == node.list_models()
    for models in (node, fresh):
        models.close()


@pytest.mark.parametrize("first", ["write", "read"])
@pytest.mark.parametrize(("kept", "regrown"), [(1, 1), (1, 3), (0, 1)])
def test_a_node_whose_log_lost_events_and_took_others_since_loads_it_afresh(
    db_url: str, first: str, kept: int, regrown: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The log lost events, then other nodes wrote as many or more before this
    node looked (a backup restored under it, then an apply): its revision is
    still in the log, but the events there are others. It must not serve a
    mix of the lost models and the new, nor decide on it. Revision 1 too:
    the first event is chained like any other (kept 0)."""
    node = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    kept_names = ["a"][:kept]
    for name in kept_names:
        node.add(_definition(name, []), by="ops")
    saved = log_rows(db_url)
    head = node.add(_definition("b", []), by="ops").revision
    put_back(db_url, saved)
    other = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    for name in ("x", "y", "z")[:regrown]:
        other.add(_definition(name, []), by="elsewhere")
    assert other.revision >= node.revision
    now = log_rows(db_url)
    if first == "write":
        with pytest.raises(Refused, match="'b', which is not in the catalog"):
            node.add(_definition("c", ["b"]), by="ops")
        assert log_rows(db_url) == now
    assert [m["name"] for m in node.list_models()] == [*kept_names, "x", "y", "z"][: kept + regrown]
    assert node.revision == other.revision
    assert (
        f"the log holds other events at revision {head} than this node's catalog was built"
        " from: it lost events and took others since (a failover, or a restored backup?);"
        " catalog-es verify says whether the log was edited; loading the catalog from the log"
    ) in caplog.text
    node.add(_definition("c", ["x"]), by="ops")
    for models in (other, Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})):
        assert models.list_models() == node.list_models()
        models.close()
    node.close()


@pytest.mark.parametrize("regrown", [0, 3])
def test_a_node_whose_catch_up_was_cut_off_part_way_loads_the_log_afresh(
    db_url: str, regrown: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read whose catch-up fails half-way (the database failing over under
    it) leaves the node with events nothing vouches for: the chain only moves
    once a catch-up is done. Should the log have lost them, the node must not
    decide on them (review: it wrote a fallback on a lost model)."""
    node = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    node.add(_definition("a", []), by="ops")
    saved = log_rows(db_url)
    other = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    other.add(_definition("b", []), by="elsewhere")
    other.add(_definition("c", []), by="elsewhere")

    def cut_off(catalog: Any, store: Any, conn: sa.Connection, **_: Any) -> None:
        (first, *_rest), *_pages = store.scan(conn, after=catalog.revision)
        catalog.apply(decode_event(first[1], first[2]), first[0])
        raise sa.exc.OperationalError("scan", {}, Exception("the server closed the connection"))

    monkeypatch.setattr(application, "catch_up", cut_off)
    with pytest.raises(sa.exc.OperationalError):
        node.list_models()
    monkeypatch.undo()
    assert sorted(node.catalog.aggregates) == ["a", "b"]
    put_back(db_url, saved)
    for name in ("x", "y", "z")[:regrown]:
        Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url}).add(_definition(name, []), by="n")
    now = log_rows(db_url)
    with pytest.raises(Refused, match="'b', which is not in the catalog"):
        node.add(_definition("d", ["b"]), by="ops")
    assert log_rows(db_url) == now
    assert [m["name"] for m in node.list_models()] == ["a", "x", "y", "z"][: 1 + regrown]
    assert (
        "left part-way at revision 2" if regrown else "the log ends at revision 1"
    ) in caplog.text
    for models in (node, other):
        models.close()


def test_a_hash_edited_unreadable_at_a_nodes_revision_is_not_told_as_lost_events(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A hash a hand edit left unreadable at the revision a node is at is
    nothing to check against (verify tells of it): the node serves on, and
    a node starting on that log loads it, neither telling of lost events."""
    node = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    node.add(_definition("a", []), by="ops")
    node.add(_definition("b", []), by="ops")
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE catalog_events SET hash = '123' WHERE revision = 2"))
    engine.dispose()
    fresh = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    for models in (node, fresh, node, fresh):
        assert [m["name"] for m in models.list_models()] == ["a", "b"]
    assert "lost events" not in caplog.text
    for models in (node, fresh):
        models.close()


def test_a_snapshot_of_events_the_log_no_longer_holds_is_passed_over(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A snapshot taken before the log lost its events, and others took their
    revisions (a backup of the events alone restored, then new writes),
    would start every node on models the log does not have."""
    env = {"CATALOG_ES_DB": db_url}
    node = Models(DeclaredConfig(), snapshot_interval=2, env=env)
    node.add(_definition("a", []), by="ops")
    saved = log_rows(db_url)
    node.add(_definition("b", []), by="ops")
    node.add(_definition("c", []), by="ops")
    snapshots = log_rows(db_url)[-1]
    assert [row["revision"] for row in snapshots] == [2]
    put_back(db_url, [*saved[:-1], snapshots])
    other = Models(DeclaredConfig(), env=env)
    for name in ("x", "y", "z"):
        other.add(_definition(name, []), by="elsewhere")
    fresh = Models(DeclaredConfig(), snapshot_interval=2, env=env)
    assert [m["name"] for m in fresh.list_models()] == ["a", "x", "y", "z"]
    assert (
        "snapshot at 2 passed over: the log holds other events there now (a failover, or a"
        " restored backup?); catalog-es verify says whether the log was edited"
    ) in caplog.text
    for models in (node, other, fresh):
        models.close()


def test_a_node_started_on_a_snapshot_at_the_head_tells_a_log_that_took_other_events_since(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A node started on a snapshot with no event after it knows the log's
    hash at its revision from the snapshot or the log's head: should the log
    then lose that event and take another there (a failover), the node must
    not decide on the model it lost."""
    env = {"CATALOG_ES_DB": db_url}
    writer = Models(DeclaredConfig(), snapshot_interval=2, env=env)
    writer.add(_definition("a", []), by="ops")
    saved = log_rows(db_url)
    writer.add(_definition("b", []), by="ops")
    writer.close()
    assert [row["revision"] for row in log_rows(db_url)[-1]] == [2]
    node = Models(DeclaredConfig(), snapshot_interval=2, env=env)
    assert [m["name"] for m in node.list_models()] == ["a", "b"]
    put_back(db_url, saved)
    other = Models(DeclaredConfig(), env=env)
    other.add(_definition("x", []), by="elsewhere")
    assert other.revision >= node.revision  # PostgreSQL hands out no revision twice
    now = log_rows(db_url)
    with pytest.raises(Refused, match="'b', which is not in the catalog"):
        node.add(_definition("c", ["b"]), by="ops")
    assert log_rows(db_url) == now
    assert (
        "the log holds other events at revision 2 than this node's catalog was built from"
    ) in caplog.text
    assert [m["name"] for m in node.list_models()] == ["a", "x"]
    for models in (node, other):
        models.close()


# -- catalogs kept in schemas of one PostgreSQL database ----------------------------


def _odd_schema() -> str:
    """A new schema name as odd as an identifier may be, and as long (63
    bytes): what the locks and the channel of its catalog are named after
    must still serve."""
    return 'Team-B."ü"$' + uuid.uuid4().hex.ljust(51, "x")


# What 0.2.0 nodes lock by, the database over.
LOCKED_BY_0_2 = "SELECT pg_advisory_xact_lock(hashtext(:name))"


@pytest.mark.parametrize("lock", ["catalog_es.tables", "catalog_es.audit"])
def test_work_under_a_lock_does_not_wait_behind_another_schemas(
    pg_schema_url: Callable[..., str], monkeypatch: pytest.MonkeyPatch, lock: str
) -> None:
    """What a lock of ours guards (making the tables, writing the audit's
    rows) was one process at a time across the database: a catalog's waited
    for another schema's catalog to let go of it, and was refused as busy
    after its wait."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "1")
    a_url, b_url = pg_schema_url(), pg_schema_url(_odd_schema())
    team_a, team_b = (Models(DeclaredConfig(), env={"CATALOG_ES_DB": u}) for u in (a_url, b_url))
    team_a.add(_definition("a", []), by="setup")
    fresh = pg_schema_url()  # where a catalog's tables are yet to be made

    def make_tables() -> None:
        Models(DeclaredConfig(), env={"CATALOG_ES_DB": fresh}).close()

    work: dict[str, Callable[[], object]] = {
        "catalog_es.tables": make_tables,
        "catalog_es.audit": team_a.audit,
    }
    with team_b.store.locked(lock):
        work[lock]()
    for models in (team_a, team_b):
        models.close()


@pytest.mark.parametrize("lock", ["catalog_es.tables", "catalog_es.audit"])
def test_a_lock_still_keeps_out_a_previous_release_node_and_is_kept_out_by_one(
    pg_url: str, lock: str
) -> None:
    """During a rolling upgrade from 0.2.0, its nodes lock by name alone:
    they and this release's must still take turns at the same work."""
    node = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    old_node = sa.create_engine(pg_url)
    with old_node.begin() as conn:
        conn.execute(sa.text(LOCKED_BY_0_2), {"name": lock})
        with pytest.raises(StorageBusy), node.store.locked(lock, wait=0.3):
            pass
    with node.store.locked(lock), old_node.begin() as conn:
        conn.execute(sa.text("SET LOCAL lock_timeout = '300ms'"))
        with pytest.raises(sa.exc.OperationalError, match="lock timeout"):
            conn.execute(sa.text(LOCKED_BY_0_2), {"name": lock})
    old_node.dispose()
    node.close()


# What 0.2.0 nodes listen on, the database over.
CHANNEL_OF_0_2 = "catalog_events"


def _followed(models: Models, after: int) -> tuple[application.Watch, list[int], threading.Thread]:
    """A watch of ``models`` after ``after``, which only a notification wakes
    (it would look by itself only after a minute), followed in a thread into
    the list of revisions it gives; returned once it listens."""
    watch = models.watch(after, poll_interval=60)
    seen: list[int] = []
    thread = threading.Thread(
        target=lambda: seen.extend(event["revision"] for event in watch), daemon=True
    )
    thread.start()
    listener = models.store.listener()
    deadline = time.monotonic() + 10
    while not listener._listening and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the pull that listening starts with is done
    return watch, seen, thread


def _arrives(seen: list[int], revision: int, within: float = 3.0) -> bool:
    deadline = time.monotonic() + within
    while revision not in seen and time.monotonic() < deadline:
        time.sleep(0.01)
    return revision in seen


def test_a_follower_is_not_woken_by_another_schemas_writes_and_hears_its_own_at_once(
    pg_schema_url: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catalogs kept in two schemas of one database (as the README tells) had
    one NOTIFY channel: each write to one woke every follower of the other,
    which read the log for nothing."""
    a_url, b_url = pg_schema_url(_odd_schema()), pg_schema_url()
    team_a, team_b = (Models(DeclaredConfig(), env={"CATALOG_ES_DB": u}) for u in (a_url, b_url))
    team_a.add(_definition("a", []), by="setup")
    follower = Models(DeclaredConfig(), env={"CATALOG_ES_DB": a_url})
    reads: list[int] = []
    pull_page = follower.store.pull_page

    def counted(*args: Any, **kwargs: Any) -> PulledPage:
        reads.append(1)
        return pull_page(*args, **kwargs)

    monkeypatch.setattr(follower.store, "pull_page", counted)
    watch, seen, thread = _followed(follower, team_a.revision)
    read_before = len(reads)
    team_b.add(_definition("b", []), by="other team")
    team_b.scale("b", 0, 2, by="other team")
    time.sleep(0.5)  # long enough for a wake-up to have read
    assert len(reads) == read_before
    written = team_a.scale("a", 0, 2, by="ops").revision
    assert _arrives(seen, written)
    watch.stop()
    thread.join(5)
    for models in (team_a, team_b, follower):
        models.close()


@pytest.mark.parametrize("search_path", ["nowhere,{a}", '"$user",{a}', "{other},{a}"])
def test_a_follower_hears_writes_however_its_search_path_finds_the_log(
    pg_schema_url: Callable[..., str], search_path: str
) -> None:
    """The writer's notifications name its log's schema, and so must what the
    follower listens to, whatever schemas its search path names before the
    log's: one missing, the role's own (``$user``, missing too), or another
    that exists but holds no log (where new tables would go)."""
    a_url, other_url = pg_schema_url(), pg_schema_url()
    writer = Models(DeclaredConfig(), env={"CATALOG_ES_DB": a_url})
    writer.add(_definition("a", []), by="setup")
    schemas = {"a": schema_of(a_url), "other": schema_of(other_url)}
    options = f"-csearch_path={search_path.format(**schemas)}"
    follower_url = sa.make_url(a_url).update_query_dict({"options": options})
    follower = Models(
        DeclaredConfig(),
        env={"CATALOG_ES_DB": follower_url.render_as_string(hide_password=False)},
    )
    watch, seen, thread = _followed(follower, writer.revision)
    written = writer.scale("a", 0, 2, by="ops").revision
    assert _arrives(seen, written)
    watch.stop()
    thread.join(5)
    for models in (writer, follower):
        models.close()


def test_a_node_that_looked_before_the_tables_were_made_finds_them_where_they_were_made(
    pg_schema_url: Callable[..., str],
) -> None:
    """Before the tables are made, a node takes the first schema of its path
    for theirs; another node may then make them in another schema of that
    path. Kept, the guess had the first lock and notify in a schema no other
    node of the catalog used."""
    first_url, log_url = pg_schema_url(), pg_schema_url()
    schemas = f"{schema_of(first_url)},{schema_of(log_url)}"
    url = sa.make_url(log_url).update_query_dict({"options": f"-csearch_path={schemas}"})
    early = SQLRecorder(create_engine(url.render_as_string(False)), create_tables=False)
    assert early.log_schema() == schema_of(first_url)
    maker = Models(DeclaredConfig(), env={"CATALOG_ES_DB": log_url})
    assert early.log_schema() == maker.store.log_schema() == schema_of(log_url)
    early.engine.dispose()
    maker.close()


def test_a_lock_taken_in_two_steps_waits_one_wait_in_all(pg_url: str) -> None:
    """PostgreSQL's lock_timeout bounds each wait for a lock: behind a 0.2.0
    node for the first lock and another node for the second, a node waited
    its wait twice over before it was told it was busy."""
    node = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    others = sa.create_engine(pg_url)
    name = "catalog_es.audit"
    with others.begin() as new_node, others.begin() as old_node:
        new_node.execute(
            sa.text("SELECT pg_advisory_xact_lock(hashtext(:schema), hashtext(:name))"),
            {"schema": node.store.log_schema(), "name": name},
        )
        old_node.execute(sa.text(LOCKED_BY_0_2), {"name": name})
        # The old node lets go half way through the wait; the other holds on.
        threading.Timer(0.5, old_node.rollback).start()
        start = time.monotonic()
        with pytest.raises(StorageBusy), node.store.locked(name, wait=1.0):
            pass
        waited = time.monotonic() - start
    assert 0.9 <= waited < 1.3
    others.dispose()
    node.close()


def test_a_lock_taken_in_two_steps_takes_each_with_its_wait_in_one_round_trip(
    pg_url: str,
) -> None:
    """Each lock goes to the server with the SET of its wait, the first with
    the transaction's BEGIN: a command that writes the audit's rows or its
    use took five round trips to take the lock (BEGIN, SET, lock, SET,
    lock), three, then two (psycopg's BEGIN went alone)."""
    node = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    node.store.log_schema()  # found once per process, before any lock
    with round_trips(node.store.engine) as trips, node.store.locked("catalog_es.audit"):
        pass
    assert len(trips) == 3, trips  # the two locks, then COMMIT
    assert trips[0][0].startswith('"BEGIN; '), trips
    assert all("lock_timeout" in t[0] and "pg_advisory_xact_lock" in t[0] for t in trips[:2])
    node.close()


def test_a_start_on_a_log_asks_the_server_in_seven_round_trips(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Past what a first connection asks: whether the session's search path
    is the URL's, the tables with the log's columns (two round trips, then
    one), and the load in its transaction: BEGIN, the snapshot, the events
    after it, where the log stands with the head record (two, then one), and
    COMMIT. A log whose every event was deleted, its head record left, is
    still told as such at the start."""
    maker = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    maker.add(_definition("a", []), by="setup")
    maker.close()
    with round_trips(sa.Engine) as trips:
        node = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    node.close()
    started = trips[trips.index(['"ROLLBACK"']) + 1 :]  # past SQLAlchemy's first questions
    assert len(started) == 7, started
    engine = create_engine(pg_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM catalog_events")
    engine.dispose()
    Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url}).close()
    told = [r.getMessage() for r in caplog.records if "were deleted" in r.getMessage()]
    assert told == [
        "revision 1 is missing: the head is at revision 1 but the log ends at 0, so the last"
        " events were deleted (catalog-es verify); the next write is numbered after revision 1,"
        " leaving the gap"
    ]


def test_a_write_after_a_start_asks_nothing_more_of_where_the_log_is(
    pg_schema_url: Callable[..., str],
) -> None:
    """A start on a log finds its schema with its tables: a process's first
    write asked it again (its locks and notifications are the schema's),
    three round trips more, a command's on the command line. Found along a
    search path that names a missing schema before it, and a name that
    needs quotes."""
    schema = f"Team-{uuid.uuid4().hex[:8]}"
    log_url = pg_schema_url(schema)
    maker = Models(DeclaredConfig(), env={"CATALOG_ES_DB": log_url})
    maker.add(_definition("a", []), by="setup")
    maker.close()
    path = f'-csearch_path=nowhere,"{schema}"'
    url = sa.make_url(log_url).update_query_dict({"options": path})
    node = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url.render_as_string(False)})
    with round_trips(node.store.engine) as trips:
        node.scale("a", 0, 2, by="ops")
    assert len(trips) == 4, trips  # the lock, where the log stands, the append, COMMIT
    assert node.store.log_schema() == schema
    node.close()


def test_a_warm_command_asks_the_server_in_four_round_trips(pg_url: str) -> None:
    """A command on a node that has written (its write connection held, the
    write's statements prepared by psycopg): BEGIN with the write's settings
    and the log's lock; where the log stands, read once the lock is had; the
    append, which moves the streams and the head in its statement; COMMIT.
    Measured and not kept: the read sent in the lock's query
    (planned anew each command, as a query of several statements is: more
    of the server's time than the round trip saved), or with the lock in a
    psycopg pipeline (its closing Flush left the session without its idle
    bound, and the client's pipeline cost more than the round trip)."""
    maker = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    maker.add(_definition("a", []), by="setup")
    maker.close()
    node = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    with round_trips(node.store.engine) as trips:  # the write connection made in here
        for n in range(8):  # psycopg prepares a statement at its fifth run
            node.scale("a", 0, 1 + n % 3, by="ops")
    node.close()
    ends = [i for i, trip in enumerate(trips) if trip == ['"COMMIT"']]
    assert len(ends) == 8, trips
    warm = trips[ends[-2] + 1 : ends[-1] + 1]
    prepared = ["Bind", "Describe", "Execute", "Sync"]
    assert warm[1:] == [prepared, prepared, ['"COMMIT"']], warm
    assert warm[0][0].startswith('"BEGIN; ') and "LOCK TABLE catalog_events" in warm[0][0], warm


def test_a_first_postgresql_connection_does_not_look_up_hstore(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SQLAlchemy looks the hstore type up on an engine's first connection,
    three round trips, unless told not to (no column is one): the log's
    engine is, and so is the one a command that runs until stopped makes to
    wait for its database, which asked it on each start after an outage.
    Either's first connection asks what SQLAlchemy must know of the server
    (its version, schema, isolation and quoting) in four, with psycopg's
    BEGIN and ROLLBACK around them."""
    asked = [
        '"select pg_catalog.version()"',
        '"select current_schema()"',
        '"show transaction isolation level"',
        '"show standard_conforming_strings"',
    ]

    def first_connection(trips: list[list[str]]) -> list[list[str]]:
        end = trips.index(['"ROLLBACK"']) + 1
        assert trips[:end] == [['"BEGIN"'], *([s] for s in asked), ['"ROLLBACK"']], trips
        return trips[:end]

    engine = create_engine(pg_url)
    with round_trips(engine) as trips, engine.connect():
        pass
    engine.dispose()
    first_connection(trips)
    monkeypatch.setattr(base, "START_RETRY_SECONDS", 0.01)
    settings = base.Settings()
    settings.db = pg_url
    with socket.socket() as free:  # a port nothing answers on: an outage
        free.bind(("127.0.0.1", 0))
        nowhere = sa.make_url(pg_url).set(port=free.getsockname()[1])
    away = sa.create_engine(nowhere, poolclass=sa.pool.NullPool)
    tries: list[int] = []

    def start() -> str:
        tries.append(1)
        if len(tries) == 1:
            with away.connect():
                pass
        return "started"

    with round_trips(sa.Engine) as trips:
        assert base.once_it_answers(settings, "watch", start) == "started"
    assert "trying again every" in capsys.readouterr().err
    assert len(first_connection(trips)) == len(trips)  # the wait's engine's connection, alone


def test_a_previous_release_follower_still_hears_this_releases_writes(pg_url: str) -> None:
    """A 0.2.0 follower waits for a notification on the channel of the whole
    database, and has no other way to learn of a write (it does not look by
    itself): this release's writes still notify it."""
    node = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    conninfo = sa.make_url(pg_url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(conninfo, autocommit=True) as old_follower:
        old_follower.execute(f"LISTEN {CHANNEL_OF_0_2}")
        node.add(_definition("a", []), by="ops")
        assert node.store._writer is not None
        writer = node.store._writer.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        node.store._writer.rollback()
        # By whom: other test workers' writes notify that channel too.
        heard = {n.pid for n in old_follower.notifies(timeout=1)}
    assert writer in heard
    node.close()


# -- nodes as processes: `catalog-es serve`, as an operator runs them -------------

_CLI = [sys.executable, "-m", "catalog_es"]


def _serve(url: str, tokens: Path, *options: str) -> subprocess.Popen[str]:
    """A ``catalog-es serve`` process on ``url`` (``options``: the root's),
    its stderr piped."""
    command = [*_CLI, "--db", url, *options, "serve", "--port", "0", "--tokens", str(tokens)]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True)


def _stopped(servers: list[subprocess.Popen[str]]) -> list[str]:
    """Stop ``servers`` (SIGTERM; killed after 10 s); what each said on
    stderr after its start (:func:`started`) up to its end."""
    for server in servers:
        server.terminate()
    said = []
    for server in servers:
        try:
            said.append(server.communicate(timeout=10)[1])
        except subprocess.TimeoutExpired:
            server.kill()
            said.append(server.communicate()[1])
    return said


@contextmanager
def _serving_nodes(url: str, tokens: Path, count: int) -> Iterator[list[str]]:
    """``count`` ``catalog-es serve`` processes on ``url``, started together;
    yields their base URLs, and stops them (SIGTERM) afterwards."""
    servers = [_serve(url, tokens) for _ in range(count)]
    try:
        yield [started(server)[0] for server in servers]
    finally:
        _stopped(servers)


def test_a_server_is_told_once_of_each_other_config_another_node_writes_under(
    db_url: str, tmp_path: Path
) -> None:
    """Two ``serve`` nodes on two configs: each recorded its own as it wrote,
    and the declared models went in and out of force, but a server whose
    clients' writes were not the ones to record again said nothing, and
    over HTTP no refusal hints at it (the client cannot mend the server's
    config). A node is told in its log, once for each other config, as it
    catches up with the first write under it: at a read, or a write."""
    tokens = tmp_path / "tokens.json"
    secret = TokenStore(tokens).add("ops", "write")[1]
    paths = []
    for name in ("a", "b"):
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(
            f"models:\n- {{name: {name}, engine: vllm, source: hf://o/{name},"
            " profiles: [{name: g, gpus: 1}]}\n"
        )
    configs = [load_config(str(path)) for path in paths]
    setup = Models(configs[0], env={"CATALOG_ES_DB": db_url})
    setup.add(_definition("m", []), by="setup")  # 1 config a, 2
    setup.close()
    servers = [_serve(db_url, tokens, "--config", str(paths[0]), "--by", "node-a")]
    try:
        first = started(servers[0])[0]
        servers.append(_serve(db_url, tokens, "--config", str(paths[1]), "--by", "node-b"))
        second = started(servers[1])[0]  # 3: config b, recorded as it starts
        with http_client(headers=bearer(secret)) as http:

            def asked(node: str, method: str, path: str, body: Any = None) -> None:
                answer = http.request(method, f"{node}{path}", json=body)
                assert answer.status_code == 200, answer.text

            asked(first, "GET", "/models")  # told of b
            asked(second, "POST", "/models/m/scale", {"max": 2})  # 4
            asked(first, "GET", "/models")
            asked(first, "POST", "/models/m/scale", {"max": 3})  # 5 config a again, 6
            asked(second, "POST", "/models/m/scale", {"max": 4})  # told of a; 7 b again, 8
            asked(first, "GET", "/revision")
            asked(second, "GET", "/models")
    finally:
        said = _stopped(servers)
    fingerprints = [c.fingerprint[:12] for c in configs]
    told = [
        [line for line in node_said.splitlines() if "another declared config" in line]
        for node_said in said
    ]
    assert told == [
        [
            "warning: another node writes under another declared config, fingerprint "
            f"{fingerprints[1]} ({paths[1]}), recorded at revision 3 by 'node-b'; this "
            f"node's is fingerprint {fingerprints[0]} ({paths[0]}): the nodes serve "
            "different declared layers, and the log records each in turn; run every node on "
            "one config (told once for each other config)"
        ],
        [
            "warning: another node writes under another declared config, fingerprint "
            f"{fingerprints[0]} ({paths[0]}), recorded at revision 5 by 'ops'; this "
            f"node's is fingerprint {fingerprints[1]} ({paths[1]}): the nodes serve "
            "different declared layers, and the log records each in turn; run every node on "
            "one config (told once for each other config)"
        ],
    ]


def test_nodes_writing_as_their_sessions_are_ended_write_on(
    pg_url: str, pg_admin: sa.Engine, tmp_path: Path
) -> None:
    """Two ``serve`` nodes, each writing; every session of theirs ended at
    once (pg_terminate_backend, as a restart or a failover ends them), and
    each node's next write, within the second, answered 503 (hostile test,
    each of six rounds). Now each goes through."""
    tokens = tmp_path / "tokens.json"
    secret = TokenStore(tokens).add("ops", "write")[1]
    setup = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    setup.add(_definition("a", []), by="setup")
    setup.close()
    with _serving_nodes(pg_url, tokens, 2) as nodes, http_client(headers=bearer(secret)) as http:
        for n in range(2):
            for node in nodes:
                assert http.post(f"{node}/models/a/scale", json={"max": 1 + n}).status_code == 200
            _end_sessions(pg_admin, _sessions_of(pg_admin, pg_url))
            for node in nodes:
                answer = http.post(f"{node}/models/a/scale", json={"max": 2 + n})
                assert answer.status_code == 200, answer.text
    assert count_events(pg_url) == 1 + 2 * 4


@pytest.fixture
def pgbouncer(pg_admin: sa.Engine) -> Iterator[Callable[[str], str]]:
    """``pgbouncer(role)``: a URL of the test database as ``role`` through a
    PgBouncer of its own in transaction mode, told to pass over the
    ``options`` it does not take (as is done to get past its refusal of
    them). Fails, saying how to get it, where PgBouncer is not installed."""
    binary = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
    if binary is None:
        pytest.fail("PgBouncer is needed for this test: apt-get install pgbouncer", pytrace=False)
    admin = pg_admin.url
    # Its own folder, which the user it runs as (never root) can read.
    folder = Path(tempfile.mkdtemp(prefix="catalog-es-pgbouncer-"))
    folder.chmod(0o755)
    started_bouncers: list[subprocess.Popen[str]] = []

    def start(role: str) -> str:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        (folder / "users.txt").write_text(f'"{role}" ""\n')
        (folder / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"{admin.database} = host={admin.host or '127.0.0.1'} port={admin.port or 5432}"
            f" dbname={admin.database}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {port}\n"
            f"auth_type = trust\nauth_file = {folder / 'users.txt'}\n"
            "pool_mode = transaction\ndefault_pool_size = 4\n"
            "ignore_startup_parameters = options,extra_float_digits\n"
        )
        for name in ("users.txt", "pgbouncer.ini"):
            (folder / name).chmod(0o644)
        user = ["-u", "nobody"] if os.geteuid() == 0 else []
        bouncer = subprocess.Popen(
            [binary, *user, str(folder / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        started_bouncers.append(bouncer)
        deadline = time.monotonic() + 5
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert bouncer.poll() is None, bouncer.communicate()[1]
                assert time.monotonic() < deadline, "PgBouncer did not start"
                time.sleep(0.02)
        return f"postgresql+psycopg://{role}@127.0.0.1:{port}/{admin.database}"

    yield start
    for bouncer in started_bouncers:
        bouncer.terminate()
        bouncer.communicate(timeout=10)
    shutil.rmtree(folder)


def test_two_nodes_behind_pgbouncer_in_transaction_mode_answer_every_request(
    pg_url: str, pg_admin: sa.Engine, pgbouncer: Callable[[str], str], tmp_path: Path
) -> None:
    """The README's pooler in transaction mode, with two ``serve`` nodes
    behind it: one catalog's schema is its role's search path, as a pooler
    passes no URL ``options`` on. psycopg prepares a statement run five times
    on a connection, on the server session it ran on then, and the pooler
    hands the next transaction another: one request in ten failed as an
    internal error, writes and reads alike (hostile test, PgBouncer 1.18).
    Now each node's first such statement, and any under way beside it, is
    an outage (503, retried), and it prepares none from then on. A URL
    setting the search path through the pooler, which dropped it, used the
    public schema's log: refused."""
    schema = schema_of(pg_url)
    role = schema  # a name of the test's own
    with pg_admin.connect() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN"))
        conn.execute(sa.text(f"ALTER ROLE {role} SET search_path = {schema}"))
        conn.execute(sa.text(f"GRANT ALL ON SCHEMA {schema} TO {role}"))
    try:
        url = pgbouncer(role)
        # A path other than the role's: the pooler dropped it.
        with_options = sa.make_url(url).update_query_dict({"options": "-csearch_path=public"})
        # Asked while the nodes start.
        dropped = subprocess.Popen(
            [*_CLI, "--db", with_options.render_as_string(False), "revision"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        tokens = tmp_path / "tokens.json"
        secret = TokenStore(tokens).add("ops", "write")[1]
        answered: list[list[int]] = [[], [], []]
        # Each request's node and status.
        by_node: list[tuple[int, int]] = []
        with _serving_nodes(url, tokens, 2) as nodes:

            def client(k: int) -> None:
                statuses = answered[k]
                with http_client(headers=bearer(secret), timeout=30) as http:
                    for n in range(10):
                        node = (n + k) % 2
                        for method, path, body in (
                            ("POST", f"/models/m{k}/scale", {"max": 1 + n % 3}),
                            ("GET", f"/models/m{k}", None),
                            ("GET", f"/history/m{k}?limit=2", None),
                        ):
                            answer = http.request(method, f"{nodes[node]}{path}", json=body)
                            assert answer.status_code in (200, 503), answer.text
                            statuses.append(answer.status_code)
                            by_node.append((node, answer.status_code))

            with http_client(headers=bearer(secret)) as http:
                added = http.post(
                    f"{nodes[0]}/apply",
                    json=[{"add": model_data(f"m{k}")} for k in range(3)],
                )
                assert added.status_code == 200, added.text
            threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            with http_client(headers=bearer(secret)) as http:
                verified = http.get(f"{nodes[1]}/verify").json()
        _, said = dropped.communicate(timeout=30)
        assert dropped.returncode == 1
        assert "a connection pooler dropped them" in said, said
        assert [len(statuses) for statuses in answered] == [3 * 10] * 3
        # Only as each node first met another session's statement: the
        # requests then under way on it, and a few just after, where before
        # one in ten failed from then on. When that is depends on when the
        # node's connections first prepare (a loaded machine opens more of
        # them), and under load two requests of one client in a row met it:
        # not bounded in time, then, but in number (at most two or three a
        # node seen in every run).
        for node in (0, 1):
            outages = by_node.count((node, 503))
            assert outages <= 6, f"node {node}: {answered}"
        writes = [status for statuses in answered for status in statuses[::3]]
        assert verified["ok"] and verified["events"] == 3 + writes.count(200)
    finally:
        with pg_admin.connect() as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :role"
                ),
                {"role": role},
            )
            conn.execute(sa.text(f"DROP OWNED BY {role}"))
            conn.execute(sa.text(f"DROP ROLE {role}"))


def test_a_head_table_dropped_is_made_again_beside_the_log_not_first_on_the_path(
    pg_schema_url: Callable[..., str], pg_admin: sa.Engine
) -> None:
    """A log's catalog_head dropped by hand is made again by the next write
    (docs/audit.md), which is then refused. Found along a search path whose
    first schema is another one, it was made there, in the first schema of
    the path, apart from the log: the log's own schema went on missing it,
    and a node on that path read the stray table as the log's head."""
    log_url = pg_schema_url()
    schema = schema_of(log_url)
    first = schema_of(pg_schema_url())
    maker = Models(DeclaredConfig(), env={"CATALOG_ES_DB": log_url})
    maker.add(_definition("a", []), by="setup")
    maker.close()
    with pg_admin.connect() as conn:
        conn.execute(sa.text(f"DROP TABLE {schema}.catalog_head"))
    path = f"-csearch_path={first},{schema}"
    url = sa.make_url(log_url).update_query_dict({"options": path})
    node = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url.render_as_string(False)})
    with pytest.raises(Refused, match=r"head record \(catalog_head\) is missing"):
        node.scale("a", 0, 2, by="ops")
    node.close()
    with pg_admin.connect() as conn:
        made = conn.execute(
            sa.text("SELECT table_schema FROM information_schema.tables WHERE table_name = :t"),
            {"t": "catalog_head"},
        ).scalars()
        assert [s for s in made if s in (schema, first)] == [schema]
    assert count_events(log_url) == 1


def _split_log(
    pg_schema_url: Callable[..., str], pg_admin: sa.Engine, split: str
) -> tuple[str, str, str]:
    """A log of one event in a schema of its own, then ``split`` run with
    ``{log}`` and ``{first}`` named (another schema): the log's URL, a URL on
    the search path ``first,log``, and ``first``."""
    log_url = pg_schema_url()
    first = schema_of(pg_schema_url())
    maker = Models(DeclaredConfig(), env={"CATALOG_ES_DB": log_url})
    maker.add(_definition("a", []), by="setup")
    maker.close()
    with pg_admin.begin() as conn:
        conn.execute(sa.text(split.format(log=schema_of(log_url), first=first)))
    path = f"-csearch_path={first},{schema_of(log_url)}"
    url = sa.make_url(log_url).update_query_dict({"options": path}).render_as_string(False)
    return log_url, url, first


def test_a_table_of_another_first_on_the_path_shadowing_the_logs_is_refused(
    pg_schema_url: Callable[..., str], pg_admin: sa.Engine
) -> None:
    """A table named as one of the log's, of another layout, in a schema
    before the log's on the search path was found first: every command
    failed on PostgreSQL's 'column "revision" does not exist'. Refused in
    one line naming each table and its schema, nothing read or made."""
    log_url, url, first = _split_log(
        pg_schema_url, pg_admin, "CREATE TABLE {first}.catalog_head (id int, note text)"
    )
    saved = log_rows(log_url)
    for command in (["revision"], ["model", "scale", "a", "--max", "2", "--by", "ops"]):
        done = subprocess.run([*_CLI, "--db", url, *command], capture_output=True, text=True)
        assert (done.returncode, done.stdout) == (1, "")
        log_schema = schema_of(log_url)
        assert done.stderr == (
            "error: the log's tables are found in more than one schema of the search path"
            " (catalog_events, catalog_refusals, catalog_snapshots, catalog_streams,"
            f" catalog_tracking in schema {log_schema}; catalog_head in schema {first}),"
            f" and catalog_head in schema {first} is not the log's (it lacks hash, revision):"
            " nothing was read or made; move or drop that table (it may hold another"
            " application's data), or fix the search path (the URL's options, or the role's)\n"
        )
    assert log_rows(log_url) == saved
    with pg_admin.connect() as conn:
        made = conn.execute(
            sa.text("SELECT table_name FROM information_schema.tables WHERE table_schema = :s"),
            {"s": first},
        ).scalars()
        assert list(made) == ["catalog_head"]


def test_a_log_table_an_older_release_made_first_on_the_path_is_told(
    pg_schema_url: Callable[..., str], pg_admin: sa.Engine
) -> None:
    """0.2.0, bringing a 0.1.0 log over along a search path whose first
    schema is another, made catalog_streams there, apart from the log; such
    a log is read and written whole by the nodes on that path, so it is not
    refused, but it was used without a word, as a stray table of the log's
    layout left first on the path would be. Each command tells it."""
    log_url, url, first = _split_log(
        pg_schema_url, pg_admin, "ALTER TABLE {log}.catalog_streams SET SCHEMA {first}"
    )
    command = ["model", "scale", "a", "--max", "2", "--by", "ops"]
    done = subprocess.run([*_CLI, "--db", url, *command], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    told = [line for line in done.stderr.splitlines() if "more than one schema" in line]
    assert told == [
        "warning: the log's tables are found in more than one schema of the search path"
        " (catalog_events, catalog_head, catalog_refusals, catalog_snapshots,"
        f" catalog_tracking in schema {schema_of(log_url)}; catalog_streams in schema {first}):"
        " each is read"
        " and written where it is found first, which may be a stray table an older release"
        " made first on the path; move the log's into one schema (ALTER TABLE ... SET"
        " SCHEMA) and drop the stray one, or fix the search path (the URL's options, or the"
        " role's)"
    ]
    assert count_events(log_url) == 2


# Hand edits of the head record every write refuses (the log holding
# revision 1): what is wrong with it and where to look, as the refusal says.
_MISSING = (
    "is missing, but the log holds events up to revision 1, and maybe held more",
    "catalog-es verify; docs/audit.md says how to put the head back",
)
_DAMAGED = "catalog-es verify tells what else was edited"
_UNWRITABLE_HEADS = {
    "DELETE FROM catalog_head": _MISSING,
    "DROP TABLE catalog_head": _MISSING,
    "UPDATE catalog_head SET hash = '123'": (
        "is damaged: its hash is '123', not a sha256 digest in hex",
        _DAMAGED,
    ),
    # Text in an integer column: SQLite keeps it, PostgreSQL refuses the edit.
    "UPDATE catalog_head SET revision = 'eight'": (
        "is damaged: its revision is 'eight', not a whole number",
        _DAMAGED,
    ),
}


def _said_of_the_head_as_a_server_starts(db_url: str, tmp_path: Path, *edits: str) -> list[str]:
    """The lines ``serve`` says of the head record (catalog_head) from its start
    to its stop, on a log holding revision 1 after ``edits``, which it writes
    nothing to."""
    tokens = tmp_path / "tokens.json"
    TokenStore(tokens).add("ops", "write")
    setup = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    setup.add(_definition("a", []), by="setup")
    setup.close()
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        for edit in edits:
            conn.execute(sa.text(edit))
    engine.dispose()
    events = count_events(db_url)
    assert events == 1
    server = _serve(db_url, tokens)
    try:
        said = started(server)[1]
    finally:
        said += _stopped([server])[0]
    assert count_events(db_url) == events
    return [line for line in said.splitlines() if "catalog_head" in line]


@pytest.mark.parametrize("edit", _UNWRITABLE_HEADS)
def test_a_server_started_on_a_log_whose_head_is_missing_or_damaged_says_writes_are_refused(
    db_url: str, tmp_path: Path, edit: str
) -> None:
    """``serve`` on a log whose head record was deleted, or its table dropped
    (which the server, a writer, makes again), or whose head record was
    damaged, started without a word: its operator learnt of it only as the
    first write was refused. Its start says so in one line, worded as the
    refusal, and writes nothing."""
    if "'eight'" in edit and not db_url.startswith("sqlite"):
        pytest.skip("PostgreSQL keeps no text in an integer column")
    problem, advice = _UNWRITABLE_HEADS[edit]
    assert _said_of_the_head_as_a_server_starts(db_url, tmp_path, edit) == [
        f"warning: the log's head record (catalog_head) {problem}: every write will be"
        f" refused until it is put back ({advice})"
    ]


def test_a_server_started_on_a_log_whose_head_is_whole_says_nothing_of_it(
    db_url: str, tmp_path: Path
) -> None:
    """The warning is the head's no write can append after: one that a log
    with events has and can read is no cause (a mutant warning of every
    head of a log with events went unnoticed)."""
    assert _said_of_the_head_as_a_server_starts(db_url, tmp_path) == []
