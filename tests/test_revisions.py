"""Revisions: point-in-time reads, snapshots, diff, rollback, watch, replay (issue 3).

Replay-driven: a history is written through the service, then every read of
the past is checked against what the live service answered at that moment.
"""

from __future__ import annotations

import _thread
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from unittest.mock import patch

import msgspec
import psycopg
import pytest
import sqlalchemy as sa
import zstandard
from click.testing import CliRunner
from eventsourcing.persistence import StoredEvent
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import projections.catalog
from catalog_es import commands, cpu, persistence
from catalog_es.application import Models, Watch
from catalog_es.batch import Batch
from catalog_es.catalog import Catalog, Skipped
from catalog_es.cli import cli
from catalog_es.configuration import DeclaredConfig
from catalog_es.errors import (
    DeclaredInConfig,
    InputError,
    InvalidModel,
    LogRewritten,
    ModelNotFound,
    Refused,
    RevisionConflict,
    StorageBusy,
)
from catalog_es.inputs import load_config
from catalog_es.mapper import EventMapper
from catalog_es.model import Model, model_id, utc_now, utc_text
from catalog_es.spec import ModelSpec, Origin, Scaling
from catalog_es.storage.schema import channel_of, events_table
from catalog_es.values import revision_or_time, utc_time
from catalog_es.views import model_view
from projections import pointintime, snapshots
from projections.catalog import catch_up
from projections.snapshots import MODELS_AT_A_TIME, snapshots_table
from tests.helpers import config_yaml, count_events, following, log_rows, put_back
from tests.helpers import parsed as spec

DECLARED_YAML = """
models:
  - name: base
    engine: vllm
    source: hf://org/base
    profiles: [{name: gpu, gpus: 1}]
"""


def runtime(models: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in models if not m["declared"]]


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "catalog.yaml"
    path.write_text(DECLARED_YAML)
    return path


@pytest.fixture
def open_models(service: Callable[..., Models], config_file: Path) -> Callable[..., Models]:
    """Services on one database (SQLite file or PostgreSQL schema), closed after."""

    def factory(config: Path | None = config_file, interval: int = 1000) -> Models:
        return service(config, snapshot_interval=interval)

    return factory


# -- point-in-time reads over a generated history -------------------------------------

NAMES = ["m1", "m2", "m3"]
command = st.one_of(
    st.tuples(
        st.just("add"),
        st.sampled_from(NAMES),
        st.lists(st.sampled_from([*NAMES, "base"]), max_size=2, unique=True),
    ),
    st.tuples(st.just("remove"), st.sampled_from(NAMES), st.none()),
    st.tuples(
        st.just("scale"), st.sampled_from(NAMES), st.tuples(st.integers(0, 2), st.integers(1, 3))
    ),
    st.tuples(st.just("owner"), st.sampled_from(NAMES), st.sampled_from(["", "team:a", "org:b"])),
    st.tuples(st.just("rollback"), st.integers(0, 40), st.none()),
)


def run(models: Models, step: tuple[str, Any, Any]) -> None:
    kind, target, arg = step
    try:
        if kind == "add":
            models.add(spec(target, fallbacks=arg), by="prop")
        elif kind == "remove":
            models.remove(target, by="prop")
        elif kind == "scale":
            models.scale(target, arg[0], arg[1], by="prop")
        elif kind == "owner":
            models.set_owner(target, arg, by="prop")
        else:
            models.rollback(min(target, models.revision), by="prop")
    except Refused:
        pass


def full_replay(models: Models, revision: int) -> Catalog:
    """The catalog at ``revision`` replayed from the first event, no snapshot."""
    catalog = Catalog(models.declared.models, models.declared.engines)
    with models.store.read() as conn:
        catch_up(catalog, models.store, conn, upto=revision)
    return catalog


@contextmanager
def history_models() -> Iterator[Models]:
    """A service on a new file, snapshots every 3 revisions: hypothesis runs
    many examples in one test, so not the function-scoped fixture."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp, "catalog.yaml")
        config.write_text(DECLARED_YAML)
        models = Models(
            load_config(str(config)),
            snapshot_interval=3,
            env={"CATALOG_ES_DB": f"sqlite:///{tmp}/c.db"},
        )
        try:
            yield models
        finally:
            models.close()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=st.lists(command, min_size=1, max_size=14))
def test_the_catalog_at_every_revision_is_the_one_in_force_then(steps: list[Any]) -> None:
    with history_models() as models:
        seen = {0: models.list_models()}
        for step in steps:
            run(models, step)
            seen[models.revision] = models.list_models()
        for revision, expected in seen.items():
            assert models.list_models(at=revision) == expected
            # Snapshots (every 3 revisions here) answer as a full replay does.
            at = models.catalog_at(revision)
            whole = full_replay(models, revision)
            assert [repr(m) for m in at.models()] == [repr(m) for m in whole.models()]


# -- a read of one model over any history -----------------------------------------------

# Written straight into the log, as history can hold what no command writes
# today: definitions that break the rules, fallbacks to nothing, removals of
# fallbacks, events of a declared name, stray and unreadable records.
T0 = datetime(2026, 1, 1, tzinfo=UTC)
written_event = st.one_of(
    st.tuples(
        st.just("add"),
        st.sampled_from([*NAMES, "base"]),
        st.lists(st.sampled_from([*NAMES, "base", "ghost"]), max_size=2, unique=True),
    ),
    st.tuples(st.just("remove"), st.sampled_from([*NAMES, "base"]), st.none()),
    st.tuples(
        st.just("scale"), st.sampled_from(NAMES), st.tuples(st.integers(0, 3), st.integers(0, 3))
    ),
    st.tuples(st.just("resources"), st.sampled_from(NAMES), st.sampled_from(["gpu", "tpu", ""])),
    # A change of the first model under the second's aggregate id, and one
    # with its own id filed in the second's stream.
    st.tuples(st.just("stray"), st.sampled_from(NAMES), st.sampled_from(NAMES)),
    st.tuples(st.just("misfiled"), st.sampled_from(NAMES), st.sampled_from(NAMES)),
    st.tuples(st.just("misfiled-add"), st.sampled_from(NAMES), st.sampled_from(NAMES)),
    # Filed in its own stream, or in another's.
    st.tuples(st.just("unreadable"), st.sampled_from(NAMES), st.sampled_from([None, *NAMES])),
)


def write(models: Models, revision: int, step: tuple[str, str, Any]) -> None:
    """Append ``step`` to the log as the next event of its stream, stamped a second apart."""
    kind, name, arg = step
    elsewhere = kind in ("stray", "misfiled", "misfiled-add") or (kind == "unreadable" and arg)
    stream = model_id(arg if elsewhere else name)
    envelope: dict[str, Any] = {
        "originator_id": model_id(name) if kind.startswith("misfiled") else stream,
        "originator_version": 0,
        "timestamp": T0 + timedelta(seconds=revision),
        "by": "history",
        "model": name,
    }
    event: Model.Event
    if kind == "add":
        event = Model.Added(**envelope, spec=spec(name, fallbacks=arg))
    elif kind == "misfiled-add":
        event = Model.Added(**envelope, spec=spec(name))
    elif kind == "remove":
        event = Model.Removed(**envelope)
    elif kind == "scale":
        event = Model.Scaled(**envelope, scaling=Scaling(min=arg[0], max=arg[1]))
    elif kind == "resources":
        event = Model.ResourcesSet(**envelope, profile=arg, memory_gb=64)
    elif kind == "misfiled":
        event = Model.Scaled(**envelope, scaling=Scaling(min=2, max=3))
    else:
        event = Model.OwnerSet(**envelope, owner="team:a")
    stored = EventMapper().to_stored_event(event)
    if kind == "unreadable":
        stored = StoredEvent(
            stream, 0, stored.topic, b'{"model": "%s", "owner": 7}' % name.encode()
        )
    with models.store.write() as conn:
        version = models.store.stream_version(conn, stream) + 1
        models.store.insert_events(
            [StoredEvent(stream, version, stored.topic, stored.state)], conn=conn
        )


def answer(models: Models, name: str, revision: int) -> dict[str, Any] | str:
    """What reading ``name`` at ``revision`` answers: its view, or the refusal."""
    try:
        return models.get_model(name, at=revision)
    except ModelNotFound as error:
        return str(error)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=st.lists(written_event, min_size=1, max_size=14))
# Each after the snapshot at 3, where random histories seldom put them: the
# two events that read other models, a removal of a model another names (it
# stands) and an add naming a fallback that exists (it is accepted).
@example(
    steps=[("add", "m2", []), ("add", "m1", ["m2"]), ("add", "m3", []), ("remove", "m2", None)]
)
@example(steps=[("add", "m2", []), ("add", "m3", []), ("add", "m3", []), ("add", "m1", ["m2"])])
# A change filed in another model's stream still names its own: replay applies it.
@example(steps=[("add", "m1", []), ("add", "m2", []), ("add", "m3", []), ("misfiled", "m1", "m2")])
def test_a_read_of_one_model_at_any_revision_is_the_whole_replays(steps: list[Any]) -> None:
    with history_models() as models:
        for revision, step in enumerate(steps, start=1):
            write(models, revision, step)
        models.rebuild(audit=False)
        for revision in range(len(steps) + 1):
            whole = full_replay(models, revision)
            for name in [*NAMES, "base", "ghost"]:
                definition = whole.get(name)
                expected = (
                    model_view(definition, declared=whole.is_declared(name))
                    if definition is not None
                    else f"model {name!r} is not in the catalog at revision {revision}"
                )
                assert answer(models, name, revision) == expected


def replay_state(catalog: Catalog) -> tuple[Any, ...]:
    """Everything a replay leaves in a catalog (not its cache of ids)."""
    names = [*NAMES, "base", "ghost"]
    return (
        catalog.aggregates,
        catalog.revision,
        catalog.last_timestamp,
        catalog.recorded_declaration,
        catalog.skipped,
        {name: (catalog.referrers(name), catalog.was_skipped(name)) for name in names},
    )


def split_replay(models: Models, cores: float = 2.0) -> tuple[Catalog, list[Skipped] | None]:
    """The log replayed in two processes from the start, however short it is:
    the catalog, and the skips (``None``: the split left it to a whole replay).
    ``cores``: the CPU time the process is taken to have."""
    catalog = Catalog(models.declared.models, models.declared.engines)
    with (
        models.store.read() as conn,
        patch.object(projections.catalog, "SPLIT_AFTER", 0),
        # On a machine of one core too: what is tested is the outcome.
        patch.object(cpu, "allowance", lambda: cores),
    ):
        assert projections.catalog._can_split(catalog, models.store)
        return catalog, projections.catalog._split_replay(catalog, models.store, conn, None)


@pytest.mark.alone
@settings(max_examples=40, deadline=None)
@given(steps=st.lists(written_event, min_size=1, max_size=14))
# m1's streams are odd, m2's and m3's even: a fallback within one half is
# decided there; one across, a change filed in the other half's stream, or
# a skip of the other half's model, leaves the replay to the whole log.
@example(
    steps=[("add", "m3", []), ("add", "m2", ["m3"]), ("add", "m1", []), ("remove", "m3", None)]
)
@example(steps=[("add", "m2", []), ("add", "m1", ["m2"])])
@example(steps=[("add", "m1", []), ("add", "m2", []), ("misfiled", "m1", "m2")])
@example(steps=[("add", "m1", []), ("add", "m2", []), ("stray", "m1", "m2")])
@example(steps=[("add", "m1", []), ("unreadable", "m1", None), ("scale", "m2", (1, 2))])
@example(steps=[("unreadable", "m1", "m2")])
@example(steps=[("misfiled-add", "m1", "m2")])
def test_a_replay_split_in_two_is_the_whole_replay_or_leaves_it_to_it(steps: list[Any]) -> None:
    with history_models() as models:
        for revision, step in enumerate(steps, start=1):
            write(models, revision, step)
        whole = Catalog(models.declared.models, models.declared.engines)
        with models.store.read() as conn:
            whole_skipped = catch_up(whole, models.store, conn)
        fresh = replay_state(Catalog(models.declared.models, models.declared.engines))
        split, skipped = split_replay(models)
        if skipped is None:
            assert replay_state(split) == fresh  # left as it was, for the whole replay
        else:
            assert skipped == whole_skipped
            assert replay_state(split) == replay_state(whole)


@pytest.mark.alone
def test_a_split_load_answers_its_skips_and_no_read_of_one_model_or_rebuild_splits() -> None:
    """``catch_up`` asked to split answers the skips of the split replay, as
    a whole one does. A read of one model replays only the events naming it,
    and a rebuild reports each revision (where it writes a snapshot): a
    split replay would take in every model, and report none."""
    steps: list[Any] = [
        ("add", "m1", []),
        ("add", "m2", []),
        ("unreadable", "m1", None),
        ("scale", "m2", (1, 2)),
    ]
    with history_models() as models:
        for revision, step in enumerate(steps, start=1):
            write(models, revision, step)
        assert split_replay(models)[1] is not None  # a log that splits
        whole = full_replay(models, len(steps))
        assert [skip.revision for skip in whole.skipped] == [3]
        loaded, one, rebuilt = (
            Catalog(models.declared.models, models.declared.engines) for _ in range(3)
        )
        reported: list[int] = []
        with (
            models.store.read() as conn,
            patch.object(projections.catalog, "SPLIT_AFTER", 0),
            patch.object(cpu, "allowance", lambda: 2.0),
        ):
            assert catch_up(loaded, models.store, conn, split=True) == whole.skipped
            catch_up(one, models.store, conn, model="m2", split=True)
            catch_up(rebuilt, models.store, conn, progress=reported.append, split=True)
        assert replay_state(loaded) == replay_state(whole)
        assert one.get("m1") is None and one.get("m2") == whole.get("m2")
        assert reported == [1, 2, 3, 4]
        assert replay_state(rebuilt) == replay_state(whole)


@pytest.mark.alone
@pytest.mark.parametrize(
    ("steps", "splits"),
    [
        ([("add", "m1", []), ("add", "m2", []), ("scale", "m1", (1, 2))], True),
        ([("add", "m3", []), ("add", "m2", ["m3"]), ("remove", "m3", None)], True),
        ([("add", "m2", []), ("add", "m1", ["m2"])], False),
        ([("add", "m1", []), ("add", "m2", []), ("misfiled", "m1", "m2")], False),
        ([("misfiled-add", "m1", "m2")], False),
        ([("unreadable", "m1", "m2")], False),
    ],
)
def test_a_replay_is_split_unless_an_event_reaches_across_the_halves(
    steps: list[Any], splits: bool
) -> None:
    with history_models() as models:
        for revision, step in enumerate(steps, start=1):
            write(models, revision, step)
        _, skipped = split_replay(models)
        assert (skipped is not None) == splits


@pytest.mark.alone
@pytest.mark.parametrize(
    ("cores", "splits"),
    [(projections.catalog.SPLIT_CORES, True), (projections.catalog.SPLIT_CORES - 0.01, False)],
)
def test_a_replay_is_split_from_one_and_a_half_cores_on(cores: float, splits: bool) -> None:
    with history_models() as models:
        write(models, 1, ("add", "m1", []))
        write(models, 2, ("add", "m2", []))
        _, skipped = split_replay(models, cores)
        assert (skipped is not None) == splits


@pytest.mark.alone
def test_a_split_replay_whose_second_process_fails_is_made_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(*_: Any) -> bytes:
        raise OSError("the second process could not read the log")

    with history_models() as models:
        for revision, step in enumerate(
            [("add", "m1", []), ("add", "m2", []), ("scale", "m1", (1, 2))], start=1
        ):
            write(models, revision, step)
        expected = replay_state(full_replay(models, 3))
        monkeypatch.setattr(projections.catalog, "_replay_odd", fail)
        catalog, skipped = split_replay(models)
        assert skipped is None
        monkeypatch.setattr(projections.catalog, "SPLIT_AFTER", 0)
        with models.store.read() as conn:
            catch_up(catalog, models.store, conn, split=True)
        assert replay_state(catalog) == expected


@pytest.mark.alone
def test_a_split_replay_in_a_process_that_ignores_sigchld_is_made_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where SIGCHLD is ignored (some servers do), a child that stops early is
    reaped as it ends: the parent, giving up its half, must still leave the
    replay to a whole one, not fail to kill it (or kill what took its pid)."""

    def fail(*_: Any) -> bytes:
        raise OSError("the second process could not read the log")

    def once_the_child_is_gone(pages: Any, answer: Any) -> Iterator[Any]:
        assert answer.read() == b""  # it ended with no answer
        time.sleep(0.05)  # and the system has reaped it
        raise projections.catalog._Crossed()
        yield  # a generator, as the one it stands for

    with history_models() as models:
        for revision, step in enumerate(
            [("add", "m1", []), ("add", "m2", []), ("scale", "m1", (1, 2))], start=1
        ):
            write(models, revision, step)
        fresh = replay_state(Catalog(models.declared.models, models.declared.engines))
        monkeypatch.setattr(projections.catalog, "_replay_odd", fail)
        monkeypatch.setattr(projections.catalog, "_while_answering", once_the_child_is_gone)
        previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        try:
            catalog, skipped = split_replay(models)
        finally:
            signal.signal(signal.SIGCHLD, previous)
        assert skipped is None
        assert replay_state(catalog) == fresh


@pytest.mark.parametrize("answer", [b"", b"the child's half"])
def test_the_parent_gives_up_its_half_once_the_child_has_failed(answer: bytes) -> None:
    # A child that stops at an early crossing closes its pipe with nothing
    # in it; the parent stops after the page it is on, not at the end of
    # its half. A child that answered early leaves the parent to go on.
    reader, writer = os.pipe()
    os.write(writer, answer)
    os.close(writer)
    pages: list[list[tuple[int, str, bytes]]] = [[(1, "t", b"")], [(2, "t", b"")]]
    with os.fdopen(reader, "rb") as pipe:
        read = projections.catalog._while_answering(pages, pipe)
        assert next(read) == pages[0]
        if answer:
            assert list(read) == pages[1:]
        else:
            with pytest.raises(projections.catalog._Crossed):
                next(read)


def _threading_thread(wait: Callable[[], object]) -> None:
    threading.Thread(target=wait).start()


def _bare_thread(wait: Callable[[], object]) -> None:
    # As a C library or _thread starts one: the threading module does not know it.
    _thread.start_new_thread(wait, ())


@pytest.mark.alone
@pytest.mark.parametrize(
    "start",
    [
        _threading_thread,
        pytest.param(
            _bare_thread,
            marks=pytest.mark.skipif(
                not Path("/proc/self/task").is_dir(), reason="the system lists no threads"
            ),
        ),
    ],
)
def test_a_replay_is_not_split_while_another_thread_runs(
    start: Callable[[Callable[[], object]], None],
) -> None:
    # Forking copies one thread: a lock another holds would stay held in the child.
    with history_models() as models:
        catalog = Catalog(models.declared.models, models.declared.engines)
        assert projections.catalog._can_split(catalog, models.store)
        stop, stopped = threading.Event(), threading.Event()

        def wait() -> None:
            stop.wait()
            stopped.set()

        start(wait)
        try:
            assert not projections.catalog._can_split(catalog, models.store)
        finally:
            stop.set()
            stopped.wait()
        # Gone from the system's list of threads too, before the next test forks.
        deadline = time.monotonic() + 5
        while not projections.catalog._can_split(catalog, models.store):
            assert time.monotonic() < deadline
            time.sleep(0.001)


@pytest.mark.alone
def test_a_replay_is_split_only_from_a_catalog_whose_runtime_fallbacks_stay_in_one_half() -> None:
    """Each half decides a model by the models its fallbacks link it to: a
    catalog linking runtime models of the two halves (a snapshot's, say) is
    replayed whole. A declared fallback links nothing: both halves hold it."""
    with history_models() as models:
        # Given m1 (odd) naming the declared base (even)
        write(models, 1, ("add", "m1", ["base"]))
        catalog = Catalog(models.declared.models, models.declared.engines)
        with models.store.read() as conn:
            catch_up(catalog, models.store, conn)
        assert projections.catalog._can_split(catalog, models.store)
        # When m1 is added again naming m2 (even), at runtime
        write(models, 2, ("add", "m2", []))
        write(models, 3, ("add", "m1", ["m2"]))
        with models.store.read() as conn:
            catch_up(catalog, models.store, conn)
        m1 = catalog.get("m1")
        assert m1 is not None and m1.fallbacks == ("m2",)
        # Then a replay from it is not split.
        assert not projections.catalog._can_split(catalog, models.store)


@pytest.mark.alone
def test_a_replay_split_in_two_takes_the_config_record_from_its_half() -> None:
    """The declared config's stream is odd: the record a replay passes is read
    by the second process, and the catalog says it is the one in force."""
    with history_models() as models:
        models.add(spec("m1"), by="x")
        whole = Catalog(models.declared.models, models.declared.engines)
        with models.store.read() as conn:
            catch_up(whole, models.store, conn)
        assert whole.recorded_declaration == (models.declared.fingerprint, 1)
        split, skipped = split_replay(models)
        assert skipped == []
        assert split.recorded_declaration == whole.recorded_declaration


@pytest.mark.alone
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="the system lists no descriptors")
def test_a_replay_split_in_two_leaves_no_descriptor_open() -> None:
    """Each load or read of the past may be split: a descriptor left open by
    each (the pipe, the handle on the child) runs a service out of them."""
    with history_models() as models:
        write(models, 1, ("add", "m1", []))
        write(models, 2, ("add", "m2", []))
        split_replay(models)  # the connections the pool keeps, opened
        fds = Path("/proc/self/fd")
        before = sum(1 for _ in fds.iterdir())
        for _ in range(3):
            assert split_replay(models)[1] == []
        assert sum(1 for _ in fds.iterdir()) == before


def test_a_read_of_one_model_agrees_with_the_list_past_snapshots(
    open_models: Callable[..., Models],
) -> None:
    models = open_models(interval=2)
    models.add(spec("a"), by="alice")
    models.add(spec("b", fallbacks=["a"]), by="alice")
    models.scale("a", 0, 2, by="bob")
    models.scale("b", 1, 3, by="bob")
    models.set_owner("a", "team:a", by="carol")
    models.remove("b", by="carol")
    models.scale("a", 2, 2, by="dave")
    for revision in range(models.revision + 1):
        listed = {m["name"]: m for m in models.list_models(at=revision)}
        for name in ("a", "b", "base"):
            if name in listed:
                assert models.get_model(name, at=revision) == listed[name]
            else:
                # A revision inside a transaction reads the boundary before it.
                boundary = models.resolve(revision)
                with pytest.raises(ModelNotFound, match=f"at revision {boundary}$"):
                    models.get_model(name, at=revision)


def test_at_zero_is_the_declared_config_alone(open_models: Callable[..., Models]) -> None:
    models = open_models()
    models.add(spec("a"), by="alice")
    assert [m["name"] for m in models.list_models(at=0)] == ["base"]


def test_at_beyond_the_head_is_refused(open_models: Callable[..., Models]) -> None:
    models = open_models()
    models.add(spec("a"), by="alice")
    with pytest.raises(Refused, match="beyond the head"):
        models.list_models(at=models.revision + 1)


def test_at_a_time_reads_the_last_revision_written_by_then(
    open_models: Callable[..., Models],
) -> None:
    models = open_models()
    models.add(spec("a"), by="alice")
    between = datetime.now(UTC)
    time.sleep(0.002)
    models.scale("a", 0, 3, by="bob")
    assert models.get_model("a", at=between)["scaling"] == {"min": 1, "max": 1}
    assert models.get_model("a", at=datetime.now(UTC))["scaling"] == {"min": 0, "max": 3}
    assert models.list_models(at=between - timedelta(days=1)) == models.list_models(at=0)
    with pytest.raises(Refused, match=r"^time 2999-01-01T00:00:00Z is in the future$"):
        # Written as every time is written out, whatever zone it was given in.
        models.list_models(at=datetime(2999, 1, 1, 1, tzinfo=timezone(timedelta(hours=1))))


def test_a_time_the_log_shows_reads_though_a_fast_clock_wrote_it(
    open_models: Callable[..., Models],
) -> None:
    """A node ten minutes fast stamps its changes ahead of the reader's
    clock, within the hour the log trusts: each time `log` showed was refused
    as "in the future" until the reader's clock caught up (hostile test)."""
    models = open_models()
    fast = datetime.now(UTC) + timedelta(minutes=10)
    with patch("catalog_es.application.utc_now", lambda: fast):
        models.add(spec("a"), by="fast-node")
        models.scale("a", 0, 3, by="fast-node")
    *_, added, scaled = (datetime.fromisoformat(e["time"]) for e in models.log_events())
    assert added == fast and scaled > fast  # each after the one before it
    assert models.get_model("a", at=added)["scaling"] == {"min": 1, "max": 1}
    assert models.get_model("a", at=scaled)["scaling"] == {"min": 0, "max": 3}
    assert models.diff(added, scaled)["changed"]
    # Past the log's newest time and this clock, a change may yet come before it.
    with pytest.raises(Refused, match="is in the future"):
        models.list_models(at=scaled + timedelta(microseconds=1))


def test_a_change_after_a_config_recorded_alone_by_a_fast_clock_is_stamped_after_it(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    """A node ten minutes fast records its config alone (as a server starts):
    its next change, its clock back, is stamped after that record, so time in
    the log never runs backwards."""
    open_models().add(spec("a"), by="x")
    other = tmp_path / "other.yaml"
    other.write_text(DECLARED_YAML.replace("base", "b"))
    models = open_models(config=other)
    fast = datetime.now(UTC) + timedelta(minutes=10)
    with patch("catalog_es.application.utc_now", lambda: fast):
        models.record_declaration(by="fast-node")
    models.scale("a", 0, 3, by="x")
    # The first config's record and the add, one transaction, share a time.
    *_, recorded, scaled = (e["time"] for e in models.log_events())
    assert scaled > recorded == utc_text(fast)


def test_a_revision_inside_a_transaction_reads_the_boundary_before_it(
    open_models: Callable[..., Models],
) -> None:
    models = open_models()
    models.add(spec("a"), by="alice")
    models.add(spec("b"), by="alice")
    before = models.revision
    models.remove("a", by="bob")
    models.remove("b", by="bob")
    result = models.rollback(before, by="carol")
    assert len(result["events"]) == 2
    first_of_rollback = result["revision"] - 1
    boundary = result["revision"] - 2
    assert models.resolve(first_of_rollback) == boundary
    assert models.list_models(at=first_of_rollback) == models.list_models(at=boundary)
    # Said where it is asked, not answered as another revision without a word
    # (operator walkthrough); a boundary asked for is read without a word.
    db = models.store.engine.url.render_as_string(hide_password=False)
    told = (
        f"warning: no write ends at revision {first_of_rollback} (a write of several changes "
        f"lands whole): taken as revision {boundary}, the last one that does before it\n"
    )
    catalog_es = [sys.executable, "-m", "catalog_es", "--db", db]
    for asked, warned in ((first_of_rollback, told), (boundary, "")):
        for command in (
            ["model", "list", "--at", str(asked)],
            ["diff", str(asked)],
            ["rollback", "--dry-run", "--to", str(asked)],
        ):
            done = subprocess.run(
                [*catalog_es, *command], capture_output=True, text=True, timeout=60, check=False
            )
            assert (done.returncode, done.stderr.endswith(warned)) == (0, True), command
            assert done.stderr.count("warning:") == (1 if warned else 0), command
    # A refusal is its one line, and says it too: it named only the revision
    # read, which the operator never gave (operator walkthrough).
    shown = CliRunner().invoke(
        cli, ["--db", db, "model", "show", "a", "--at", str(first_of_rollback)]
    )
    refusal = (
        f"error: model 'a' is not in the catalog at revision {boundary}; {told[len('warning: ') :]}"
    )
    assert (shown.exit_code, shown.stderr) == (1, refusal)
    at_the_boundary = CliRunner().invoke(
        cli, ["--db", db, "model", "show", "a", "--at", str(boundary)]
    )
    assert (
        at_the_boundary.stderr == f"error: model 'a' is not in the catalog at revision {boundary}\n"
    )
    # Each revision taken as another is told: diff's told only the last one's.
    inside_the_next = models.rollback(0, by="carol")["revision"] - 1
    both = subprocess.run(
        [*catalog_es, "diff", str(first_of_rollback), str(inside_the_next), "--model", "a"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert both.returncode == 0
    assert both.stderr.splitlines(keepends=True) == [
        told,
        f"warning: no write ends at revision {inside_the_next} (a write of several changes"
        f" lands whole): taken as revision {inside_the_next - 1}, the last one that does"
        " before it\n",
    ]


def test_every_revision_inside_a_long_write_reads_its_boundaries(
    open_models: Callable[..., Models],
) -> None:
    """Inside a write of more events than the first page read along it (a
    rollback of five removals), every revision still resolves to the
    boundary before the write, and the write's end is its last event: not
    the end of a page taken for the end of the log."""
    models = open_models()
    names = [f"m{n}" for n in range(5)]
    for name in names:
        models.add(spec(name), by="alice")
    before = models.revision
    for name in names:
        models.remove(name, by="bob")
    result = models.rollback(before, by="carol")
    last = result["revision"]
    first = last - len(names) + 1
    assert len(result["events"]) == len(names)
    with models.store.engine.connect() as conn:
        ends = {r: pointintime.write_end(conn, r) for r in range(first, last + 1)}
    assert {r: models.resolve(r) for r in range(first, last)} == dict.fromkeys(
        range(first, last), first - 1
    )
    assert ends == dict.fromkeys(range(first, last + 1), last)


def test_a_revision_deleted_from_the_log_is_told_as_not_in_it(
    open_models: Callable[..., Models], caplog: pytest.LogCaptureFixture
) -> None:
    """With a revision deleted by hand, `--at` it said no write ends there (a
    write of several changes lands whole), where verify names the deletion
    (hostile test): it says the revision is not in the log."""
    models = open_models()
    models.add(spec("a"), by="alice")
    kept = models.scale("a", maximum=2, by="alice").revision
    deleted = models.scale("a", maximum=3, by="alice").revision
    models.scale("a", maximum=4, by="alice")
    with models.store.engine.begin() as conn:
        conn.execute(sa.delete(events_table).where(events_table.c.revision == deleted))
    db = models.store.engine.url.render_as_string(hide_password=False)
    rows = count_events(db)
    told = (
        f"revision {deleted} is not in the log (deleted, or on PostgreSQL burned by a write "
        f"that failed: verify tells which): taken as revision {kept}, the last before it"
    )
    at = ["--at", str(deleted)]
    shown = CliRunner().invoke(cli, ["--db", db, "model", "show", "a", *at, "--json"])
    assert shown.exit_code == 0 and told in caplog.text  # a warning, told after the answer
    assert json.loads(shown.stdout)["scaling"]["max"] == 2
    refused = CliRunner().invoke(cli, ["--db", db, "model", "show", "b", *at])
    assert (refused.exit_code, refused.stdout) == (1, "")
    assert refused.stderr == f"error: model 'b' is not in the catalog at revision {kept}; {told}\n"
    assert count_events(db) == rows
    verified = CliRunner().invoke(cli, ["--db", db, "verify"])
    assert f"revision {deleted} is missing" in verified.stderr


# -- reads of the past over the declared config recorded then --------------------------


def _a_deploy_declaring_a_trial(
    open_models: Callable[..., Models], tmp_path: Path
) -> tuple[Models, Path, int]:
    """'trial' added and scaled at runtime over the config declaring 'base';
    then a deploy declares 'trial' itself, 'base' scaled up and a new 'fresh',
    recorded by the next write. Answers the service on the new config, that
    config, and the last revision before the deploy."""
    models = open_models()
    models.add(spec("trial"), by="alice")  # 2 (1: the first config's record)
    models.scale("trial", 0, 3, by="alice")  # 3
    deployed = tmp_path / "deployed.yaml"
    deployed.write_text(
        config_yaml(
            spec("base", scaling={"min": 2, "max": 4}),
            spec("trial", source="hf://org/trial-reviewed"),
            spec("fresh"),
        )
    )
    after = open_models(config=deployed)
    after.add(spec("other"), by="bob")  # 4: the deployed config's record, 5: the add
    return after, deployed, 3


def test_a_read_of_the_past_over_the_config_recorded_then_shows_what_ran(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    models, _, before = _a_deploy_declaring_a_trial(open_models, tmp_path)
    ran = {m["name"]: m for m in models.list_models(before, declared_then=True)}
    assert sorted(ran) == ["base", "trial"]
    assert ran["base"]["declared"] and ran["base"]["scaling"] == {"min": 1, "max": 1}
    assert not ran["trial"]["declared"] and ran["trial"]["scaling"] == {"min": 0, "max": 3}
    assert models.get_model("trial", before, declared_then=True) == ran["trial"]
    # Over today's config, the same revision shows today's declared layer.
    today = {m["name"]: m for m in models.list_models(before)}
    assert sorted(today) == ["base", "fresh", "trial"]
    assert today["trial"]["declared"] and today["trial"]["source"] == "hf://org/trial-reviewed"
    # From the deploy's first write on (its record and the add: 4 reads as 3,
    # the boundary before them), both agree.
    assert models.list_models(4, declared_then=True) == models.list_models(3, declared_then=True)
    assert models.list_models(5, declared_then=True) == models.list_models(5)


def test_a_diff_over_the_configs_recorded_then_shows_what_the_deploy_changed(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    models, _, before = _a_deploy_declaring_a_trial(open_models, tmp_path)
    diff = models.diff(before, declared_then=True)
    assert [m["name"] for m in diff["added"]] == ["fresh", "other"]
    changed = {c["model"]: c["fields"] for c in diff["changed"]}
    assert changed["base"]["scaling"] == {
        "before": {"min": 1, "max": 1},
        "after": {"min": 2, "max": 4},
    }
    assert changed["trial"]["declared"] == {"before": False, "after": True}
    # Over today's config at both ends only the runtime change shows.
    assert [m["name"] for m in models.diff(before)["added"]] == ["other"]
    assert models.diff(before)["changed"] == []


def test_a_diff_over_the_configs_recorded_then_shows_a_model_declared_as_it_ran(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    """Declared with the very definition it ran with at runtime, a model
    changed nothing but who decides it (runtime changes to it are refused
    from then on): the diff said "no change" (hostile test)."""
    models = open_models()
    models.add(spec("same"), by="alice")  # 2 (1: the first config's record)
    deployed = tmp_path / "deployed.yaml"
    deployed.write_text(config_yaml(spec("base"), spec("same")))
    after = open_models(config=deployed)
    after.add(spec("other"), by="bob")  # 3: the deployed config's record, 4: the add
    changed = {c["model"]: c["fields"] for c in after.diff(2, declared_then=True)["changed"]}
    assert changed["same"] == {"declared": {"before": False, "after": True}}
    (same,) = after.diff(2, model="same", declared_then=True)["changed"]
    assert same == {"model": "same", "fields": changed["same"]}
    assert after.diff(2, model="same")["changed"] == []  # over today's config at both ends


def test_a_read_of_the_past_over_a_config_before_any_was_recorded_is_refused(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    models, _, _ = _a_deploy_declaring_a_trial(open_models, tmp_path)
    with pytest.raises(Refused, match=r"^no declared config was recorded at or before revision 0 "):
        models.list_models(0, declared_then=True)


def test_a_read_of_the_past_over_a_config_declaring_nothing_reads_it(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    """Declaring nothing, a config is the layer a log that recorded none has,
    so the first write records none; a read over the config of then was
    refused as if none had been known (differential test)."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("models: []\n")
    models = open_models(config=empty)
    models.add(spec("r1"), by="alice")  # 1: the add, and no record
    (listed,) = models.list_models(1, declared_then=True)
    assert (listed["name"], listed["declared"]) == ("r1", False)
    assert models.get_model("r1", 1, declared_then=True) == listed


def test_a_config_record_that_cannot_be_read_is_refused_by_a_read_over_it(
    open_models: Callable[..., Models], tmp_path: Path, db_url: str
) -> None:
    models, _, before = _a_deploy_declaring_a_trial(open_models, tmp_path)
    with models.store.write() as conn:
        conn.execute(sa.update(events_table).where(events_table.c.revision == 1).values(state=b"{"))
    message = "the declared config recorded at revision 1 cannot be read: "
    with pytest.raises(Refused, match=f"^{message}"):
        models.get_model("trial", before, declared_then=True)
    # Reads over today's config, and over the later record, are not held up.
    assert models.get_model("trial", before)["declared"]
    assert models.list_models(5, declared_then=True) == models.list_models(5)


def test_a_refused_diff_between_two_revisions_taken_as_others_tells_both(
    open_models: Callable[..., Models], tmp_path: Path, config_file: Path, db_url: str
) -> None:
    """A diff whose ends are each inside a write reads each as the boundary
    before it, and a refusal's one line tells both, in the order given
    (untested: last session's notes), after the reason; nothing is written."""
    models, _, _ = _a_deploy_declaring_a_trial(open_models, tmp_path)  # 4 and 5: one write
    open_models().scale("other", 1, 2, by="carol")  # 6 the first config again, 7: one write
    with models.store.write() as conn:
        conn.execute(sa.update(events_table).where(events_table.c.revision == 1).values(state=b"{"))
    with pytest.raises(Refused) as unreadable:  # 4, read as 3, is over revision 1's config
        models.diff(3, 5, declared_then=True)
    rows = count_events(db_url)
    refused = CliRunner().invoke(
        cli,
        ["--db", db_url, "--config", str(config_file), "diff", "4", "6", "--declared-then"],
    )
    taken = [
        f"no write ends at revision {inside} (a write of several changes lands whole): taken as"
        f" revision {inside - 1}, the last one that does before it"
        for inside in (4, 6)
    ]
    assert (refused.exit_code, refused.stdout) == (1, "")
    assert refused.stderr == f"error: {unreadable.value}; {taken[0]}; {taken[1]}\n"
    assert count_events(db_url) == rows


def test_the_cli_reads_the_past_over_the_config_recorded_then(
    open_models: Callable[..., Models], tmp_path: Path, db_url: str
) -> None:
    _, deployed, before = _a_deploy_declaring_a_trial(open_models, tmp_path)
    base = ["--db", db_url, "--config", str(deployed)]
    runner = CliRunner()
    listed = runner.invoke(cli, [*base, "model", "list", "--at", str(before), "--declared-then"])
    assert listed.exit_code == 0, listed.stderr
    assert [line.split()[:2] for line in listed.stdout.splitlines()[1:]] == [
        ["base", "declared"],
        ["trial", "runtime"],
    ]
    shown = runner.invoke(
        cli, [*base, "--json", "model", "show", "trial", "--at", str(before), "--declared-then"]
    )
    assert json.loads(shown.stdout)["scaling"] == {"min": 0, "max": 3}
    used = runner.invoke(cli, [*base, "--json", "sources", "--at", str(before), "--declared-then"])
    assert json.loads(used.stdout)["hf://org/trial"] == [{"model": "trial"}]
    used_today = runner.invoke(cli, [*base, "--json", "sources", "--at", str(before)])
    assert "hf://org/trial" not in json.loads(used_today.stdout)  # the reviewed source instead
    assert json.loads(used_today.stdout)["hf://org/trial-reviewed"] == [{"model": "trial"}]
    diffed = runner.invoke(cli, [*base, "--json", "diff", str(before), "--declared-then"])
    assert [m["name"] for m in json.loads(diffed.stdout)["added"]] == ["fresh", "other"]
    written = count_events(db_url)
    refused = runner.invoke(cli, [*base, "model", "list", "--at", "0", "--declared-then"])
    assert refused.exit_code == 1
    assert refused.stderr.splitlines() == [
        "error: no declared config was recorded at or before revision 0 "
        "(the first write records the one in force)"
    ]
    now = runner.invoke(cli, [*base, "model", "list", "--declared-then"])
    assert now.exit_code == 2
    assert "--declared-then reads the past: give --at too" in now.stderr
    assert count_events(db_url) == written


# -- snapshots ------------------------------------------------------------------------


def test_a_restart_resumes_from_the_newest_snapshot(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    models = open_models(interval=5)
    for i in range(12):
        models.scale("a", 0, i + 1, by="x") if i else models.add(spec("a"), by="x")
    with models.store.read() as conn:
        revisions = list(conn.execute(sa.select(snapshots_table.c.revision)).scalars())
    assert revisions == [5, 10]
    again = open_models(interval=5)
    assert again.list_models() == models.list_models()
    assert again.catalog.revision == models.revision


@pytest.mark.parametrize(
    "count", [0, 1, 15, 16, MODELS_AT_A_TIME, 2 * MODELS_AT_A_TIME + 17, 2**16]
)
def test_a_snapshot_encoded_a_slice_of_models_at_a_time_is_as_encoded_whole(count: int) -> None:
    """A snapshot's models are encoded a slice at a time, so that no other
    thread of the process waits for the GIL through the whole encoding: its
    bytes are still those of the state encoded in one call, as every
    release reads them (each header msgpack gives a list: 1, 3 and 5 bytes)."""
    defined = spec("m", owner="team:a")
    state = snapshots.SnapshotState(
        revision=count + 3,
        last_timestamp=utc_now(),
        recorded_declaration=("f" * 64, 1),
        aggregates=[Model(f"m{i}", i + 1, defined if i % 7 else None) for i in range(count)],
        skipped=[Skipped(2, "gone", "Scaled", "not in the catalog")],
        unhealed=["gone"],
        rules=snapshots.RULES,
        chain_hash="0" * 64,
    )
    stored = zstandard.ZstdDecompressor().decompress(snapshots.encode(state))
    assert stored == msgspec.msgpack.encode(state)


def test_a_snapshot_of_more_models_than_are_encoded_at_a_time_restores_them_all(
    open_models: Callable[..., Models],
) -> None:
    models = open_models(interval=2)
    count = 2 * MODELS_AT_A_TIME + 17
    models.apply_changes([commands.add(spec(f"m{i:04d}")) for i in range(count)], by="x")
    with models.store.read() as conn:
        assert snapshots.taken_since(conn, models.declared.fingerprint, 0) == [models.revision]
        restored = Catalog()
        assert snapshots.restore(conn, restored, models.declared.fingerprint, upto=None)
    assert restored.revision == models.revision
    assert restored.aggregates == models.catalog.aggregates
    assert len(restored.aggregates) == count


def test_a_start_on_a_log_without_snapshots_asks_for_them_once(
    open_models: Callable[..., Models],
) -> None:
    """A log younger than its first snapshot has none older either: every
    start on it asked twice (a round trip more on PostgreSQL, each command's)."""
    open_models().add(spec("a"), by="x")
    asked: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "catalog_snapshots" in statement:
            asked.append(statement)

    sa.event.listen(sa.Engine, "before_cursor_execute", seen)
    try:
        again = open_models()
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", seen)
    assert [r["name"] for r in runtime(again.list_models())] == ["a"]
    assert len(asked) == 1, asked


def test_a_replay_keeps_the_snapshots_of_nodes_on_other_configs(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    """A rolling deploy: ``catalog-es replay`` on a node of the new config
    deleted the old config's snapshots too, and every node still on it
    replayed the log from its start on its next start or read of the past.
    Kept: those of the two other configs the log recorded last (nodes record
    theirs as they first write, or start serving). One-off runs over edited
    configs record nothing: theirs go (they took the old config's place when
    the newest snapshots were kept)."""

    def declaring(name: str) -> Path:
        path = tmp_path / f"{name}.yaml"
        model = (
            f"{{name: {name}, engine: vllm, source: hf://o/m, profiles: [{{name: g, gpus: 1}}]}}"
        )
        path.write_text(f"{DECLARED_YAML}  - {model}\n")
        return path

    def snapshotted(models: Models) -> list[int]:
        t = snapshots_table.c
        with models.store.read() as conn:
            query = sa.select(t.revision).where(t.fingerprint == models.declared.fingerprint)
            return sorted(conn.execute(query).scalars())

    old = open_models(interval=5)
    for i in range(12):
        old.scale("a", 0, i + 1, by="x") if i else old.add(spec("a"), by="x")
    assert snapshotted(old) == [5, 10]
    one_offs = [open_models(declaring(name), interval=5) for name in ("e1", "e2")]
    assert [snapshotted(one_off) for one_off in one_offs] == [[13], [13]]  # saved as they load
    new = open_models(declaring("new"), interval=5)
    new.rebuild()
    assert snapshotted(old) == [5, 10]
    assert snapshotted(new) == [5, 10]
    assert [snapshotted(one_off) for one_off in one_offs] == [[], []]
    for name in ("third", "fourth"):  # two more configs' nodes write, recording theirs
        open_models(declaring(name), interval=5).scale("a", 0, 2, by=name)
    new.rebuild()
    assert snapshotted(old) == []
    assert snapshotted(new) == [5, 10, 15]


def _rebuilt_after_a_fast_clock(
    open_models: Callable[..., Models], monkeypatch: pytest.MonkeyPatch
) -> Models:
    """A log whose last event a node with a clock 30 minutes fast wrote, then
    rebuilt (``catalog-es replay``), which left a snapshot at its head."""
    import catalog_es.application

    models = open_models(interval=3)
    models.add(spec("a"), by="x")
    real_now = utc_now
    ahead = lambda: real_now() + timedelta(minutes=30)  # noqa: E731
    monkeypatch.setattr(catalog_es.application, "utc_now", ahead)
    models.scale("a", 0, 2, by="fast-node")
    monkeypatch.setattr(catalog_es.application, "utc_now", real_now)
    models.rebuild()
    assert models.revision == 3  # the config's record, the add, the scale: a snapshot's
    return models


def _starts_after_the_newest_time(open_models: Callable[..., Models], models: Models) -> None:
    again = open_models(interval=3)
    assert again.catalog.last_timestamp == models.catalog.last_timestamp
    again.scale("a", 0, 3, by="slow-node")
    times = [event["time"] for event in again.log_events()]
    assert times == sorted(times) and len(set(times)) == 3


def test_a_start_on_a_snapshot_the_rebuild_wrote_follows_the_logs_newest_time(
    open_models: Callable[..., Models], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``catalog-es replay`` writes snapshots as it goes. A start on one with
    nothing after it must still know the log's newest time: a node whose
    clock is a little behind the one that wrote last stamps its next command
    after that time, so time in the log never runs backwards."""
    models = _rebuilt_after_a_fast_clock(open_models, monkeypatch)
    with models.store.read() as conn:
        blob = conn.execute(
            sa.select(snapshots_table.c.state).where(snapshots_table.c.revision == 3)
        ).scalar_one()
    kept = msgspec.msgpack.decode(zstandard.ZstdDecompressor().decompress(blob))["last_timestamp"]
    assert kept == models.catalog.last_timestamp  # so a start can use it
    _starts_after_the_newest_time(open_models, models)


def test_a_start_passes_over_a_snapshot_holding_no_time(
    open_models: Callable[..., Models], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a rebuild wrote them before it kept the time."""
    models = _rebuilt_after_a_fast_clock(open_models, monkeypatch)
    with models.store.write() as conn:
        t = snapshots_table.c
        for revision, blob in conn.execute(sa.select(t.revision, t.state)).all():
            state = msgspec.msgpack.decode(zstandard.ZstdDecompressor().decompress(blob))
            state["last_timestamp"] = None
            conn.execute(
                sa.update(snapshots_table)
                .where(t.revision == revision)
                .values(state=zstandard.ZstdCompressor().compress(msgspec.msgpack.encode(state)))
            )
    _starts_after_the_newest_time(open_models, models)


def test_a_snapshot_over_another_config_is_not_used(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    models = open_models(interval=2)
    models.add(spec("a"), by="x")
    models.add(spec("b"), by="x")
    models.scale("b", 0, 2, by="x")
    other = tmp_path / "other.yaml"
    other.write_text(DECLARED_YAML.replace("base", "b"))
    reopened = open_models(config=other, interval=2)
    names = {m["name"]: m["declared"] for m in reopened.list_models()}
    # 'b' is declared now: the runtime 'b' in the old snapshot must not come back.
    assert names == {"a": False, "b": True}
    assert [s.model for s in reopened.skipped()] == ["b", "b"]
    assert "declared in configuration" in reopened.skipped()[0].reason


@pytest.mark.parametrize(
    "damaged",
    [
        b"\x00\xff",
        bytes.fromhex("28b52ffd") + b"\x00\xff",
        # A frame whose size, edited, says petabytes: allocated, it failed the read.
        bytes.fromhex("28b52ffd") + bytes([0xC0]) + (2**62).to_bytes(8, "little") + b"\x00" * 8,
    ],
    ids=["not-a-stream", "a-broken-zstd-frame", "a-frame-claiming-exabytes"],
)
def test_a_corrupt_snapshot_is_passed_over(
    open_models: Callable[..., Models], tmp_path: Path, damaged: bytes
) -> None:
    models = open_models(interval=2)
    models.add(spec("a"), by="x")
    models.scale("a", 0, 2, by="x")
    with models.store.write() as conn:
        conn.execute(sa.update(snapshots_table).values(state=damaged))
    assert open_models(interval=2).list_models() == models.list_models()
    assert open_models(interval=2).list_models(at=2) == models.list_models(at=2)


@pytest.mark.parametrize("value", ["'not a snapshot'", "12345", "1.5"])
def test_a_snapshot_edited_into_no_bytes_is_passed_over(tmp_path: Path, value: str) -> None:
    """SQLite keeps any type in the state column: text or a number there
    failed every command over that config, a start included, with an
    unexpected TypeError, where a corrupt snapshot is passed over."""
    env = {"CATALOG_ES_DB": f"sqlite:///{tmp_path}/catalog.db"}
    models = Models(DeclaredConfig(), snapshot_interval=2, env=env)
    models.add(spec("a"), by="x")
    models.scale("a", 0, 2, by="x")
    models.scale("a", 0, 3, by="x")
    expected = [models.list_models(at=r) for r in (2, 3)], models.get_model("a", 3)
    models.close()
    with sa.create_engine(env["CATALOG_ES_DB"]).begin() as conn:
        conn.exec_driver_sql(f"UPDATE catalog_snapshots SET state = {value}")
    again = Models(DeclaredConfig(), snapshot_interval=2, env=env)
    try:
        assert again.list_models() == models.list_models()
        assert ([again.list_models(at=r) for r in (2, 3)], again.get_model("a", 3)) == expected
    finally:
        again.close()


def test_a_snapshot_whose_revision_is_edited_into_text_is_passed_over_in_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The snapshots' revision is no rowid: SQLite keeps text there. Passed
    over, it was told with %d, which printed a logging traceback of thirty
    lines on every start."""
    env = {"CATALOG_ES_DB": f"sqlite:///{tmp_path}/catalog.db"}
    models = Models(DeclaredConfig(), snapshot_interval=2, env=env)
    models.add(spec("a"), by="x")
    models.scale("a", 0, 2, by="x")
    models.close()
    with sa.create_engine(env["CATALOG_ES_DB"]).begin() as conn:
        conn.exec_driver_sql("UPDATE catalog_snapshots SET revision = 'two'")
    again = Models(DeclaredConfig(), snapshot_interval=2, env=env)
    try:
        assert again.list_models() == models.list_models()
    finally:
        again.close()
    told = capfd.readouterr().err
    assert "Traceback" not in told and "Logging error" not in told


def test_a_snapshot_with_a_definition_of_the_wrong_shape_is_passed_over_by_one_models_read(
    open_models: Callable[..., Models],
) -> None:
    """The read of one model decodes its definition alone: one of the wrong
    shape passes the snapshot over there too (it failed the read, where the
    whole catalog's answered)."""
    models = open_models(interval=2)
    models.add(spec("a"), by="x")
    models.scale("a", 0, 2, by="x")
    models.scale("a", 0, 3, by="x")
    with models.store.write() as conn:
        t = snapshots_table.c
        for revision, blob in conn.execute(sa.select(t.revision, t.state)).all():
            state = msgspec.msgpack.decode(zstandard.ZstdDecompressor().decompress(blob))
            state["aggregates"][0]["spec"]["engine"] = 7
            conn.execute(
                sa.update(snapshots_table)
                .where(t.revision == revision)
                .values(state=zstandard.ZstdCompressor().compress(msgspec.msgpack.encode(state)))
            )
    again = open_models(interval=2)
    for revision in (2, 3):
        assert again.get_model("a", revision) == models.get_model("a", revision)
    assert again.list_models(at=2) == models.list_models(at=2)


def test_a_snapshot_0_2_0_wrote_is_passed_over_as_built_under_older_rules(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    """0.2.0 compressed snapshots with zlib and built them under rules 2,
    where what upstream did to a model out of force healed its skip: from
    one, a start took that model for removed (its absence unexplained, its
    removal refused), where a replay of the log keeps it out and removable.
    The snapshots here hold what a 0.2.0 replay wrote (checked with its code)."""
    open_models().add(spec("x", engine="sglang"), by="x")
    upstream = Origin(repository="org/x", revision="b" * 40)

    def seen_upstream(batch: Batch) -> None:
        batch.decide(
            batch.event(
                Model.UpstreamChanged, "x", ref="main", revision="a" * 40, upstream=upstream
            )
        )

    open_models().write_plan(seen_upstream, by="cron")
    narrower = tmp_path / "narrower.yaml"
    narrower.write_text("engines: [vllm]\n" + DECLARED_YAML)
    models = open_models(config=narrower, interval=1)
    models.rebuild(audit=False)
    head = models.revision
    expected = {revision: models.list_models(revision) for revision in range(1, head + 1)}
    with models.store.write() as conn:
        t = snapshots_table.c
        for revision, blob in conn.execute(sa.select(t.revision, t.state)).all():
            state = msgspec.msgpack.decode(zstandard.ZstdDecompressor().decompress(blob))
            del state["chain_hash"]
            state["rules"] = 2
            if revision == head:
                state["unhealed"] = []  # healed by the observation, under rules 2
            conn.execute(
                sa.update(snapshots_table)
                .where(t.revision == revision)
                .values(state=zlib.compress(msgspec.msgpack.encode(state), 1))
            )
    again = open_models(config=narrower, interval=1)
    assert again.catalog.was_skipped("x")
    with pytest.raises(ModelNotFound, match="load skips 1 event of it"):
        again.get_model("x")
    for revision, listed in expected.items():
        assert again.list_models(revision) == listed
    assert again.remove("x", by="x").removed == "x"


def _skipped_then_removed(
    open_models: Callable[..., Models], tmp_path: Path
) -> tuple[Models, Path, int]:
    """'x' added over the default engines, then skipped by a config without
    its engine, and removed there (which heals it): a snapshot at every
    revision. Answers the service and the config, and the revision before the
    removal."""
    open_models(interval=1).add(spec("x", engine="sglang"), by="x")
    narrower = tmp_path / "narrower.yaml"
    narrower.write_text("engines: [vllm]\n" + DECLARED_YAML)
    models = open_models(config=narrower, interval=1)
    assert models.catalog.was_skipped("x")
    before = models.revision
    models.remove("x", by="x")
    return models, narrower, before


def test_a_removal_that_healed_a_skipped_model_holds_past_a_snapshot(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    """A restart from a snapshot decides as one that replays the whole log:
    the model is gone, and a second removal is refused."""
    models, narrower, _ = _skipped_then_removed(open_models, tmp_path)
    with pytest.raises(ModelNotFound):
        models.remove("x", by="x")
    again = open_models(config=narrower, interval=1)
    assert again.catalog.revision == models.revision  # from the snapshot, nothing after it
    assert not again.catalog.was_skipped("x")
    with pytest.raises(ModelNotFound):
        again.remove("x", by="x")
    assert again.revision == models.revision


def test_a_snapshot_built_under_older_replay_rules_is_passed_over_by_loads_and_reads(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    """Under older rules the same log may have made another catalog (a
    removal skipped where it now stands, say): such a snapshot serves
    neither a start nor a read of the past, which replay the log instead."""
    models, narrower, before = _skipped_then_removed(open_models, tmp_path)
    expected = {revision: models.list_models(revision) for revision in range(1, before + 1)}
    with models.store.write() as conn:
        t = snapshots_table.c
        for revision, blob in conn.execute(sa.select(t.revision, t.state)).all():
            state = msgspec.msgpack.decode(zstandard.ZstdDecompressor().decompress(blob))
            # As an older version wrote it, holding what the log no longer makes.
            del state["rules"], state["unhealed"]
            state["aggregates"].append(msgspec.to_builtins(Model("ghost", 1, spec("ghost"))))
            conn.execute(
                sa.update(snapshots_table)
                .where(t.revision == revision)
                .values(state=zlib.compress(msgspec.msgpack.encode(state)))
            )
    again = open_models(config=narrower, interval=1)
    assert "ghost" not in {m["name"] for m in again.list_models()}
    with pytest.raises(ModelNotFound):
        again.remove("x", by="x")
    assert again.revision == models.revision
    for revision, listed in expected.items():
        assert again.list_models(revision) == listed
        with pytest.raises(ModelNotFound):
            again.get_model("ghost", revision)


# -- declared config records ------------------------------------------------------------


def test_a_changed_declared_config_is_recorded_by_the_next_write_only(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    models = open_models()
    models.add(spec("a"), by="alice")
    events = [e["event"] for e in models.log_events()]
    assert events == ["ConfigDeclared", "Added"]
    other = tmp_path / "other.yaml"
    other.write_text(DECLARED_YAML.replace("base", "a"))
    reopened = open_models(config=other)
    reopened.list_models()  # a read writes nothing
    assert len(list(reopened.log_events())) == 2
    skipped = reopened.skipped()
    assert [(s.model, s.event) for s in skipped] == [("a", "Added")]
    # Nor does a write that changes nothing (a rollback to now): it says it wrote nothing.
    assert reopened.rollback(reopened.revision, by="bob")["written"] is False
    assert len(list(reopened.log_events())) == 2
    reopened.add(spec("c"), by="bob")
    log = list(reopened.log_events())
    assert [e["event"] for e in log] == ["ConfigDeclared", "Added", "ConfigDeclared", "Added"]
    assert log[2]["fields"]["fingerprint"] == load_config(str(other)).fingerprint


# -- diff ---------------------------------------------------------------------------------


def test_diff_names_models_added_removed_and_each_changed_field(
    open_models: Callable[..., Models],
) -> None:
    models = open_models()
    models.add(spec("a"), by="x")
    models.add(spec("b"), by="x")
    since = models.revision
    models.remove("b", by="y")
    models.add(spec("c"), by="y")
    models.scale("a", 0, 4, by="y")
    diff = models.diff(since)
    assert [m["name"] for m in diff["added"]] == ["c"]
    assert [m["name"] for m in diff["removed"]] == ["b"]
    assert diff["changed"] == [
        {
            "model": "a",
            "fields": {
                "scaling": {"before": {"min": 1, "max": 1}, "after": {"min": 0, "max": 4}},
                "effective_class": {"before": "standard", "after": "opportunistic"},
            },
        }
    ]

    # A name no model can have is a typo, refused, not "no change".
    with pytest.raises(InvalidModel, match="is not a valid name"):
        models.diff(0, model="Bad Name!")


# -- rollback -------------------------------------------------------------------------------


def test_rollback_then_list_equals_the_list_at_that_revision(
    open_models: Callable[..., Models],
) -> None:
    models = open_models()
    models.add(spec("a", owner="team:a"), by="x")
    models.add(spec("b", fallbacks=["a"]), by="x")
    target = models.revision
    models.set_owner("a", "org:z", by="y")
    models.set_adapters("a", (), by="y")
    models.remove("b", by="y")
    models.add(spec("c", fallbacks=["a"]), by="y")
    models.scale("c", 0, 2, by="y")
    result = models.rollback(target, by="ops", reason="bad deploy")
    assert result["written"]
    assert runtime(models.list_models()) == runtime(models.list_models(at=target))
    stored = list(models.log_events(after=result["revision"] - len(result["events"])))
    assert {e["rollback_to"] for e in stored} == {target}
    assert {e["reason"] for e in stored} == {"bad deploy"}


def test_rollback_orders_its_events_so_every_step_is_valid(
    open_models: Callable[..., Models],
) -> None:
    models = open_models()
    models.add(spec("a"), by="x")
    models.add(spec("b", fallbacks=["a"]), by="x")
    models.add(spec("c", fallbacks=["b"]), by="x")
    # Back to nothing: c before b before a, or some step names a missing fallback.
    result = models.rollback(0, by="ops")
    assert [e["model"] for e in result["events"]] == ["c", "b", "a"]
    forward = models.revision
    result = models.rollback(forward - 3, by="ops")
    assert [e["model"] for e in result["events"]] == ["a", "b", "c"]


def test_a_rollback_removes_a_fallback_once_the_model_naming_it_is_put_back_without_it(
    open_models: Callable[..., Models],
) -> None:
    """Removals go first, but x's is refused while a names it: a's re-add
    without x lets it go, on a second pass, rather than refuse the rollback."""
    models = open_models()
    models.add(spec("a"), by="x")
    target = models.revision
    models.add(spec("x"), by="x")
    models.add(spec("a", fallbacks=["x"]), by="x")
    result = models.rollback(target, by="ops")
    assert [(e["model"], e["event"]) for e in result["events"]] == [
        ("a", "Added"),
        ("x", "Removed"),
    ]
    assert models.list_models() == models.list_models(at=target)


def count_decisions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The models of the events batches decide from now on, one an event."""
    decided: list[str] = []
    real_decide = Batch.decide

    def counted(batch: Batch, event: Model.Event) -> ModelSpec | None:
        decided.append(event.model)
        return real_decide(batch, event)

    monkeypatch.setattr(Batch, "decide", counted)
    return decided


def test_a_rollback_removes_the_models_naming_one_in_name_order(
    open_models: Callable[..., Models],
) -> None:
    """They came out in the order of a set, which changes from one process
    to the next: each node's dry run told another order (review)."""
    models = open_models()
    models.add(spec("target"), by="x")
    names = [f"m{i}" for i in range(8)]
    models.apply_changes([commands.add(spec(n, fallbacks=["target"])) for n in names], by="x")
    dry = models.rollback(0, by="ops", dry_run=True)
    assert [e["model"] for e in dry["events"]] == [*names, "target"]


def test_a_rollback_of_a_long_fallback_chain_decides_each_step_once(
    open_models: Callable[..., Models], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps were tried in name order, again and again until all went: a
    chain undid a link a pass, its rollback quadratic in its length, the
    log locked throughout (8,000 links: 120 s; on PostgreSQL the server ends
    so idle a transaction; hostile test). Removals go referrers first,
    additions fallbacks first, and each step is decided once."""
    models = open_models()
    links = 300
    # Named so that name order is the wrong one: each falls back to the one
    # before it, which sorts first, so the removals in name order all wait.
    chain = [spec(f"c{i:03d}", fallbacks=[f"c{i - 1:03d}"] if i else []) for i in range(links)]
    models.apply_changes([commands.add(m) for m in chain], by="x")
    decided = count_decisions(monkeypatch)
    removed = models.rollback(0, by="ops")
    assert [e["model"] for e in removed["events"]] == [m.name for m in reversed(chain)]
    assert len(decided) == links
    # And back: each added after its fallback, which name order has the
    # other way round when each falls back to the one after it.
    reversed_chain = [
        spec(f"d{i:03d}", fallbacks=[f"d{i + 1:03d}"] if i < links - 1 else [])
        for i in range(links)
    ]
    monkeypatch.undo()
    models.apply_changes([commands.add(m) for m in reversed(reversed_chain)], by="x")
    present = models.revision
    models.apply_changes([commands.remove(m.name) for m in reversed_chain], by="x")
    decided = count_decisions(monkeypatch)
    added = models.rollback(present, by="ops")
    assert [e["model"] for e in added["events"]] == [m.name for m in reversed(reversed_chain)]
    assert len(decided) == links
    assert models.list_models() == models.list_models(at=present)


def test_a_rollback_re_adds_each_model_after_those_its_fallbacks_lead_back_through(
    open_models: Callable[..., Models], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Then, each ``n`` fell back to a ``t`` that falls back to the next
    ``n``; now each ``n`` falls back to the one before it. Putting one back
    would close a loop through its ``t`` until the next ``n`` is back: the
    order followed only the re-added, and settled one a pass (review)."""
    models = open_models()
    size = 60
    n = [f"n{i:03d}" for i in range(size)]
    t = [f"t{i:03d}" for i in range(size)]
    then = [commands.add(spec(t[-1])), commands.add(spec(n[-1], fallbacks=[t[-1]]))]
    for i in reversed(range(size - 1)):
        then += [
            commands.add(spec(t[i], fallbacks=[n[i + 1]])),
            commands.add(spec(n[i], fallbacks=[t[i]])),
        ]
    models.apply_changes(then, by="x")
    target = models.revision
    now = [commands.add(spec(n[i], fallbacks=[n[i - 1]] if i else [])) for i in range(size)]
    models.apply_changes(now, by="x")
    decided = count_decisions(monkeypatch)
    result = models.rollback(target, by="ops")
    assert len(result["events"]) == len(decided) == size
    assert models.list_models() == models.list_models(at=target)


def test_a_rollback_that_would_break_a_fallback_is_refused_and_writes_nothing(
    open_models: Callable[..., Models], db_url: str
) -> None:
    models = open_models()
    models.add(spec("b"), by="x")
    models.add(spec("a", fallbacks=["b"]), by="x")
    target = models.revision
    models.add(spec("a"), by="y")  # a no longer falls back to b...
    models.remove("b", by="y")  # ...so b could go
    rows = count_events(db_url)
    with pytest.raises(Refused, match="fallbacks: names 'b'"):
        models.rollback(target, model="a", by="ops", reason="undo the split")
    assert count_events(db_url) == rows
    # Kept apart, as every refused command is: who tried, what, and why.
    [kept] = models.refusals()
    assert (kept["by"], kept["model"], kept["event"], kept["reason"]) == (
        "ops",
        "a",
        "Rollback",
        "undo the split",
    )
    assert kept["fields"] == {"to": target}
    assert "fallbacks: names 'b'" in kept["refusal"]


def scaled_after_adding(open_models: Callable[..., Models]) -> tuple[Models, int]:
    """Model ``a`` added, then scaled: and the revision between the two."""
    models = open_models()
    models.add(spec("a"), by="x")
    added = models.revision
    models.scale("a", 2, 5, by="y")
    return models, added


def test_a_refused_rollback_of_the_whole_catalog_is_kept_but_not_a_dry_runs(
    open_models: Callable[..., Models], db_url: str
) -> None:
    models, stale = scaled_after_adding(open_models)
    rows = count_events(db_url)
    with pytest.raises(RevisionConflict):
        models.rollback(1, only="scaling", dry_run=True, expected_revision=stale, by="ops")
    assert models.refusals() == []
    with pytest.raises(RevisionConflict):
        models.rollback(1, only="scaling", expected_revision=stale, by="ops")
    [kept] = models.refusals()
    assert (kept["model"], kept["event"], kept["fields"]) == (
        None,  # the whole catalog, as the audit's rows name no model
        "Rollback",
        {"to": 1, "only": "scaling"},
    )
    assert count_events(db_url) == rows


def test_the_cli_records_a_refused_rollback_as_asked_as_the_api_does(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The CLI worked out the revision first: a refusal recorded the one a
    time or a revision inside a write was read as, not what was asked, and
    a revision past the head or a time to come was refused unrecorded; the
    HTTP API recorded what it was sent (doc audit)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(spec("a"), by="x")
    models.apply_changes([commands.scale("a", 0, 2), commands.scale("a", 0, 3)], by="x")
    stale = models.revision - 1
    rows = count_events(db_url)
    later = "2099-12-06T16:30:00Z"
    runner = CliRunner()
    base = ["--db", db_url, "--by", "ops", "rollback"]
    for to in ("2", "99", later):
        done = runner.invoke(cli, [*base, "--to", to, "--expected-revision", str(stale)])
        assert done.exit_code == 1, done.stderr
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    asked = [r["fields"]["to"] for r in models.refusals()]
    assert asked == [2, 99, later]
    assert count_events(db_url) == rows
    # A revision inside the write is still said to be read as the one before it.
    done = runner.invoke(cli, [*base, "--to", "2", "--dry-run"])
    assert done.exit_code == 0, done.stderr
    assert "no write ends at revision 2 (" in caplog.text
    assert "taken as revision 1," in caplog.text
    models.close()


def test_a_refused_name_is_kept_as_text_can_hold_it(
    open_models: Callable[..., Models], db_url: str
) -> None:
    # The name is whatever the caller sent (HTTP does not check it first): a
    # NUL, which PostgreSQL's text refuses, and a megabyte, are not lost with
    # the record, nor kept whole.
    models = open_models()
    models.add(spec("a"), by="x")
    for name in ("a\0b", "x" * 1_000_000):
        with pytest.raises(InvalidModel, match="is not a valid name"):
            models.rollback(0, model=name, by="ops")
    kept = [r["model"] for r in models.refusals()]
    assert kept == ["a\ufffdb", "x" * 256 + "…"]
    assert [r["model"] for r in models.refusals(model="a\0b")] == ["a\ufffdb"]


def test_rollback_dry_run_and_rollback_to_now_write_nothing(
    open_models: Callable[..., Models], db_url: str
) -> None:
    models, target = scaled_after_adding(open_models)
    rows = count_events(db_url)
    dry = models.rollback(target, dry_run=True, by="ops")
    assert not dry["written"]
    assert dry["events"] == [
        {"model": "a", "event": "Scaled", "fields": {"scaling": {"min": 1, "max": 1}}}
    ]
    assert dry["diff"]["changed"][0]["fields"]["scaling"]["after"] == {"min": 1, "max": 1}
    # As `diff` from the head to the revision rolled back to answers it.
    assert dry["diff"] == models.diff(models.revision, target)
    now = models.rollback(models.revision, by="ops")
    assert not now["written"] and now["events"] == []
    assert count_events(db_url) == rows


@pytest.mark.parametrize(
    ("only", "expected"),
    [
        ("scaling", {"scaling": {"min": 1, "max": 1}, "owner": "org:new"}),
        ("owner", {"scaling": {"min": 0, "max": 9}, "owner": "team:old"}),
    ],
)
def test_rollback_limited_to_one_dimension(
    open_models: Callable[..., Models], only: str, expected: dict[str, Any]
) -> None:
    models = open_models()
    models.add(spec("a", owner="team:old"), by="x")
    target = models.revision
    models.scale("a", 0, 9, by="y")
    models.set_owner("a", "org:new", by="y")
    models.rollback(target, only=only, by="ops")
    a = models.get_model("a")
    assert {"scaling": a["scaling"], "owner": a["owner"]} == expected


def test_a_rollback_of_scaling_alone_shows_the_effective_class_that_follows_from_it(
    open_models: Callable[..., Models],
) -> None:
    """No class set, the minimum decides the class placement uses: rolled
    back, the diff shows that too, and not the owner changed since."""
    models = open_models()
    models.add(spec("a"), by="x")
    target = models.revision
    models.scale("a", 0, 2, by="y")
    models.set_owner("a", "org:new", by="y")
    result = models.rollback(target, only="scaling", dry_run=True, by="ops")
    assert result["diff"]["changed"] == [
        {
            "model": "a",
            "fields": {
                "scaling": {"before": {"min": 0, "max": 2}, "after": {"min": 1, "max": 1}},
                "effective_class": {"before": "opportunistic", "after": "standard"},
            },
        }
    ]


def test_rollback_leaves_out_a_model_the_config_now_declares(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    models = open_models()
    models.add(spec("a"), by="x")
    models.add(spec("shadow"), by="x")
    target = models.revision
    models.remove("a", by="y")
    other = tmp_path / "other.yaml"
    other.write_text(DECLARED_YAML + DECLARED_YAML.split("models:")[1].replace("base", "shadow"))
    reopened = open_models(config=other)
    result = reopened.rollback(target, by="ops")
    assert [e["model"] for e in result["events"]] == ["a"]
    assert any("'shadow' is declared in configuration now" in n for n in result["notes"])
    # Asked for by name, a declared model is refused, as any runtime change to it.
    head = reopened.revision
    for name in ("shadow", "base"):  # with a runtime history, and without
        with pytest.raises(DeclaredInConfig, match=f"'{name}' is declared in configuration;"):
            reopened.rollback(target, model=name, by="ops")
    with reopened.store.read() as conn:
        assert reopened.store.head(conn) == head  # nothing written


def test_rollback_notes_a_declared_model_whose_runtime_history_came_after_the_target(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    """A runtime model added after R, then declared: a rollback to R left its
    runtime history without a word, where it had one at R was noted; that
    history comes back in force the day the config drops the name, as a
    rollback to R would not have it (hostile test)."""
    models = open_models()
    models.add(spec("a"), by="x")
    target = models.revision
    models.add(spec("shadow"), by="x")
    other = tmp_path / "other.yaml"
    other.write_text(DECLARED_YAML + DECLARED_YAML.split("models:")[1].replace("base", "shadow"))
    result = open_models(config=other).rollback(target, by="ops", dry_run=True)
    assert result["notes"] == [
        "model 'shadow' is declared in configuration now; its runtime history is left out"
    ]


def test_rollback_notes_a_model_todays_config_cannot_take_as_it_was(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    """At the revision rolled back to, ``a`` fell back to the declared
    ``base``, which today's config no longer declares: over today's config
    ``a`` cannot be put back, and the rollback says so rather than answer
    that all is as it was (hostile test)."""
    models = open_models()
    added = models.add(spec("a", fallbacks=["base"]), by="x").revision
    # Skipped too, only as a change to a model already out: not why it is out.
    target = models.scale("a", 0, 2, by="x").revision
    models.remove("a", by="y")
    other = tmp_path / "other.yaml"
    other.write_text(DECLARED_YAML.replace("base", "other"))
    reopened = open_models(config=other)
    for model in (None, "a"):
        result = reopened.rollback(target, model=model, dry_run=True, by="ops")
        assert result["events"] == []
        (note,) = result["notes"]
        assert note.startswith(
            f"model 'a' is left out: over today's config its record at revision {added} "
            "does not load (model 'a': fallbacks: names 'base', which is not in the catalog"
        )
    # In force now: as read today it was not then, so the rollback removes it.
    reopened.add(spec("a"), by="z")
    result = reopened.rollback(target, dry_run=True, by="ops")
    assert [(e["model"], e["event"]) for e in result["events"]] == [("a", "Removed")]
    (note,) = result["notes"]
    assert note.startswith("model 'a' is removed: over today's config its record at revision")


def test_rollback_removes_a_model_skipped_now_that_was_not_there_then(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    """A model added since the revision rolled back to, which today's config
    cannot take (its engine is no longer allowed): not in force now, nor
    then, yet its record would come back the day the engine is allowed
    again. Rolled back, it is removed, with a note (hostile test)."""
    models = open_models()
    target = models.revision
    added = models.add(spec("x", engine="sglang"), by="x").revision
    narrower = tmp_path / "narrower.yaml"
    narrower.write_text("engines: [vllm]\n" + DECLARED_YAML)
    reopened = open_models(config=narrower)
    assert reopened.catalog.was_skipped("x")
    # Rolled back to its record's own revision: no record written since stands.
    at_the_record = reopened.rollback(added, dry_run=True, by="ops")
    assert at_the_record["events"] == []
    assert [note.split(":")[0] for note in at_the_record["notes"]] == ["model 'x' is left out"]
    result = reopened.rollback(target, by="ops")
    assert [(e["model"], e["event"]) for e in result["events"]] == [("x", "Removed")]
    (note,) = result["notes"]
    assert note.startswith(
        "model 'x' is removed: it is not in force now, as its record at revision "
        f"{added} does not load over today's config"
    )
    assert reopened.rollback(target, by="ops")["events"] == []
    # Allowed again, the engine brings back nothing the rollback took away.
    assert "x" not in {m["name"] for m in open_models().list_models()}


def test_rollback_removes_a_record_written_since_that_today_s_config_cannot_take_either(
    open_models: Callable[..., Models], tmp_path: Path
) -> None:
    """Skipped at both revisions, but the record standing now is another,
    written since: it would come back as what never was at the target
    (review). --only leaves it, and says so."""
    models = open_models()
    models.add(spec("x", engine="sglang"), by="x")
    target = models.revision
    models.remove("x", by="x")
    again = models.add(spec("x", engine="sglang", source="hf://org/other"), by="x").revision
    narrower = tmp_path / "narrower.yaml"
    narrower.write_text("engines: [vllm]\n" + DECLARED_YAML)
    reopened = open_models(config=narrower)
    only = reopened.rollback(target, only="scaling", dry_run=True, by="ops")
    assert (only["events"], only["notes"]) == (
        [],
        ["model 'x' is in force at neither revision; --only scaling leaves its record"],
    )
    result = reopened.rollback(target, by="ops")
    assert [(e["model"], e["event"]) for e in result["events"]] == [("x", "Removed")]
    (note,) = result["notes"]
    assert note.startswith(
        f"model 'x' is removed: it is not in force now, as its record at revision {again} "
    )


def test_rollback_of_resources_alone_takes_the_profiles_both_revisions_have(
    open_models: Callable[..., Models],
) -> None:
    """A profile added since: the one both have still goes back, and the note
    says the other is left (it was answered as already as it was)."""
    models = open_models()
    gpu = {"name": "g", "gpus": 1, "min_memory_gb": 32, "cpu_cores": 4}
    models.add(spec("a", profiles=[gpu]), by="x")
    target = models.revision
    models.add(spec("a", profiles=[gpu, {"name": "c", "gpus": 0, "min_memory_gb": 8}]), by="x")
    models.set_resources("a", profile="g", memory_gb=64, cpu_cores=16, by="y")
    result = models.rollback(target, only="resources", by="ops")
    assert result["notes"] == [
        "model 'a': --only resources leaves the profiles only one revision has as they are (c)"
    ]
    profiles = {p["name"]: p for p in models.get_model("a")["profiles"]}
    assert (profiles["g"]["min_memory_gb"], profiles["g"]["cpu_cores"]) == (32, 4)
    assert set(profiles) == {"g", "c"}


def test_rollback_of_resources_alone_says_it_leaves_the_gpus(
    open_models: Callable[..., Models], db_url: str
) -> None:
    """A resources change sets memory and cores: GPUs changed since were
    left as they were, with "already as at" the revision (review)."""
    models = open_models()
    models.add(spec("a", profiles=[{"name": "g", "gpus": 1, "min_memory_gb": 32}]), by="x")
    target = models.revision
    bigger = {"name": "g", "gpus": 2, "gpu_memory_gb": 80, "min_memory_gb": 32}
    models.add(spec("a", profiles=[bigger]), by="x")
    result = models.rollback(target, only="resources", dry_run=True, by="ops")
    assert (result["events"], result["notes"]) == (
        [],
        [
            "model 'a': --only resources leaves the GPUs of profiles as they are (g); "
            "a rollback without --only restores them"
        ],
    )
    printed = CliRunner().invoke(
        cli, ["--db", db_url, "rollback", "--to", str(target), "--only", "resources"]
    )
    assert printed.exit_code == 0, printed.output
    assert printed.stdout.splitlines()[-1] == (
        f"nothing written: what differs from revision {target} is left out"
    )
    assert "note: model 'a': --only resources leaves the GPUs" in printed.stderr
    assert models.rollback(target, by="ops")["events"][0]["event"] == "Added"
    assert models.get_model("a")["profiles"][0]["gpus"] == 1


def test_rollback_of_resources_alone_refuses_a_cpu_only_profile_the_memory_of_a_gpu_one(
    open_models: Callable[..., Models],
) -> None:
    """Today's CPU-only profile given the no memory its GPU profile had then is
    a definition never in force: held to the memory rule, not spared it."""
    models = open_models()
    models.add(spec("a", profiles=[{"name": "g", "gpus": 1}]), by="x")
    target = models.revision
    models.add(spec("a", profiles=[{"name": "g", "gpus": 0, "min_memory_gb": 16}]), by="x")
    head = models.revision
    with pytest.raises(Refused, match="--only resources would leave it without a GPU"):
        models.rollback(target, only="resources", by="ops")
    assert models.revision == head
    assert models.get_model("a")["profiles"][0]["min_memory_gb"] == 16


def test_a_rollbacks_notes_are_told_ten_at_most_then_how_many_more(
    open_models: Callable[..., Models], db_url: str
) -> None:
    """One note for each of 10,000 models buried the warning after them (hostile test)."""
    models = open_models()
    models.add(spec("a"), by="x")
    target = models.revision
    models.apply_changes([commands.add(spec(f"m{i:02d}")) for i in range(12)], by="x")
    assert len(models.rollback(target, only="scaling", dry_run=True, by="ops")["notes"]) == 12
    printed = CliRunner().invoke(
        cli, ["--db", db_url, "rollback", "--to", str(target), "--only", "scaling", "--dry-run"]
    )
    assert printed.exit_code == 0, printed.output
    notes = [line for line in printed.stderr.splitlines() if line.startswith("note: ")]
    assert notes[:10] == [
        f"note: model 'm{i:02d}' is in force at only one of the two revisions; "
        "--only scaling leaves it"
        for i in range(10)
    ]
    assert notes[10:] == ["note: … and 2 more notes (rollback --json gives them all)"]


# -- watch ------------------------------------------------------------------------------------


def test_a_watch_asked_from_no_revision_gives_every_change_from_the_first(
    open_models: Callable[..., Models],
) -> None:
    models = open_models()
    models.add(spec("a"), by="x")
    watch = models.watch(poll_interval=0.02)
    events = iter(watch)
    first = next(events)
    watch.stop()
    assert first["revision"] == 1


def test_watch_delivers_every_change_after_a_revision_once_across_a_restart(
    open_models: Callable[..., Models],
) -> None:
    writer = open_models()
    writer.add(spec("a"), by="x")
    start = writer.revision
    received: list[int] = []
    stop = threading.Event()

    def follow(after: int, until: int) -> None:
        watcher = open_models()
        for event in watcher.watch(after, poll_interval=0.02):
            received.append(event["revision"])
            if event["revision"] >= until or stop.is_set():
                break

    first = threading.Thread(target=follow, args=(start, start + 5))
    first.start()
    for i in range(10):
        writer.scale("a", 0, i + 2, by="x")
    first.join(timeout=10)
    assert not first.is_alive()
    # The watcher restarts from the last revision it saw.
    follow(received[-1], writer.revision)
    assert received == list(range(start + 1, writer.revision + 1))


def test_watch_notices_a_new_event_within_a_second(open_models: Callable[..., Models]) -> None:
    writer = open_models()
    writer.add(spec("a"), by="x")
    seen: list[float] = []
    # Opened, and its start taken, here: opened in the thread on a loaded
    # machine, it read the revision after the change below and waited for
    # the next (a full run beside others on PostgreSQL).
    watcher, after = open_models(), writer.revision

    def follow() -> None:
        for _ in watcher.watch(after):
            seen.append(time.monotonic())
            return

    thread = threading.Thread(target=follow)
    thread.start()
    time.sleep(0.3)
    written = time.monotonic()
    writer.scale("a", 0, 2, by="x")
    thread.join(timeout=5)
    assert seen and seen[0] - written < 1.0


def test_a_follower_far_behind_holds_one_page_of_the_log_not_ten(
    open_models: Callable[..., Models],
) -> None:
    """A watch that has taken one change holds at most a page of those after
    it, however long the log. On PostgreSQL eventsourcing's subscription read
    ten pages ahead, in a thread of its own: two hundred slow watches from an
    early revision held 900 MB, never given back (hostile test)."""
    writer = open_models()
    writer.add(spec("a"), by="x")
    steps = [commands.scale("a", 0, 2 + i % 3) for i in range(1000)]
    for _ in range(12):
        writer.apply_changes(steps, by="x")
    follower = open_models()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        watches = [iter(follower.watch(0)) for _ in range(10)]
        assert [next(w)["revision"] for w in watches] == [1] * 10
        time.sleep(1)  # what reads ahead has read ahead by now
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    for watch in watches:
        watch.close()
    # A page of 500 small changes is about 300 KB; ten pages each were 30 MB.
    assert held < 10 * 1_000_000


def test_a_stopped_watch_ends_at_once_even_mid_page(open_models: Callable[..., Models]) -> None:
    """Stopped from another thread, a watch gives nothing more: not the rest
    of a page it has read (review)."""
    writer = open_models()
    writer.add(spec("a"), by="x")
    writer.apply_changes([commands.scale("a", 0, 2 + i % 3) for i in range(50)], by="x")
    watch = writer.watch(0)
    events = iter(watch)
    assert next(events)["revision"] == 1
    watch.stop()
    assert list(events) == []


def test_a_stop_just_as_a_watch_looks_for_more_is_not_lost(
    open_models: Callable[..., Models], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop landing after a watch saw it was not stopped, as it reset its
    wake-up to read again, was wiped by that reset: finding nothing, the
    watch waited on (on PostgreSQL until another commit; forever once its
    LISTEN connection had failed). Forced here at that moment (review)."""
    writer = open_models()
    writer.add(spec("a"), by="x")
    watch = writer.watch(1, poll_interval=60)

    class StoppedAsItIsReset(threading.Event):
        def clear(self) -> None:
            watch.stop()  # another thread's, in life
            super().clear()

    made = persistence.PullingSubscription.__init__

    def made_so(self: persistence.PullingSubscription, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        self._woken = StoppedAsItIsReset()

    monkeypatch.setattr(persistence.PullingSubscription, "__init__", made_so)
    seen: list[Any] = []
    follower = threading.Thread(target=lambda: seen.extend(watch), daemon=True)
    follower.start()
    follower.join(timeout=10)
    assert not follower.is_alive() and seen == []


REWRITTEN_AT_3 = (
    "the log no longer holds revision 3 as this watch gave it: it lost events and took"
    " others (a failover, or a restored backup?); catalog-es verify says whether the log"
    " was edited; watch again from a revision before the loss"
)


def _until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


def _sqlite_log(path: Path, names: list[str]) -> None:
    """A SQLite log at ``path`` holding the adds of ``names``, closed (so all
    of it is in the file, as a backup taken of it would be)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{path}"})
    for name in names:
        models.add(spec(name), by="setup")
    models.close()


def test_a_watch_resumed_just_before_an_event_edited_by_hand_reports_it_and_goes_on(
    db_url: str,
) -> None:
    """The page check recomputed the first event's hash from its content:
    a hand-edited event (skipped on load, reported in the log) at the start
    of a page ended the watch as if the log had been replaced (review)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    for name in ("a", "b", "c", "d"):
        models.add(spec(name), by="ops")
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(
            sa.update(events_table)
            .where(events_table.c.revision == 3)
            .values(topic="catalog_es.model:Model.Exploded")
        )
    engine.dispose()
    watch = models.watch(2, poll_interval=0.02)
    thread, seen, ended = following(watch)
    _until(lambda: seen == [3, 4])
    watch.stop()
    thread.join(10)
    assert ended == []
    models.close()


def test_a_watch_of_a_log_put_back_to_before_its_last_event_ends_at_once(db_url: str) -> None:
    """A backup of the same log, older than the last event a watch gave, put
    back: the watch went on, silent, until the log grew past that revision,
    and gave none of the events written at its revisions meanwhile (retest)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    for name in ("a", "b", "c"):
        models.add(spec(name), by="ops")
    saved = log_rows(db_url)
    models.scale("a", 0, 2, by="ops")
    watch = models.watch(0, poll_interval=0.02)
    thread, seen, ended = following(watch)
    _until(lambda: seen == [1, 2, 3, 4])
    put_back(db_url, saved)
    thread.join(10)
    assert [type(e) for e in ended] == [LogRewritten]
    assert str(ended[0]).startswith("the log no longer holds revision 4 as this watch gave it")
    models.close()


@pytest.mark.parametrize("replaced_by", ["copied over", "renamed over"])
def test_a_sqlite_watch_whose_file_is_replaced_by_another_log_ends_saying_so(
    tmp_path: Path, replaced_by: str
) -> None:
    """A catalog restored from a backup in place of the one a watch follows
    (``cat other.db > catalog.db``): the watch went on giving the other log's
    revisions after its head as if they followed those it gave, without a
    word (hostile test). Renamed over, it read the deleted file for good and
    saw no write again. It ends, told why."""
    followed, other = tmp_path / "catalog.db", tmp_path / "other.db"
    _sqlite_log(followed, ["a", "b", "c"])
    _sqlite_log(other, [f"y{i}" for i in range(6)])
    follower = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{followed}"})
    watch = follower.watch(0, poll_interval=0.02)
    thread, seen, ended = following(watch)
    _until(lambda: seen == [1, 2, 3])
    if replaced_by == "copied over":
        followed.write_bytes(other.read_bytes())
        # A write there, which the watch's connection reads (till then it
        # may read the pages it has cached of the old log).
        writer = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{followed}"})
        writer.add(spec("z"), by="after")  # revision 7 of the other log
        writer.close()
    else:  # with nothing written after it: the watch sees no write
        renamed = tmp_path / "renamed.db"
        renamed.write_bytes(other.read_bytes())
        renamed.replace(followed)
    thread.join(10)
    watch.stop()
    follower.close()
    assert not thread.is_alive()
    assert seen == [1, 2, 3]
    assert [type(e) for e in ended] == [LogRewritten]
    if replaced_by == "copied over":
        assert str(ended[0]) == REWRITTEN_AT_3
    else:  # not read: the -wal and -shm beside it are the old file's
        assert str(ended[0]) == (
            f"the database file {followed} was replaced while this process ran (renamed over):"
            " the -wal and -shm files beside it are the old file's, and reading on would mix"
            " the two; stop every process using it, and remove those two before starting them"
            " again; watch again from revision 3, the last it gave"
        )


def test_a_postgresql_watch_whose_log_is_replaced_under_it_ends_saying_so(pg_url: str) -> None:
    """The log's tables emptied and filled with another log's events (a
    restored backup) under a watch that follows them: it took the new log's
    revisions after the last it gave for those that follow it."""
    writer = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    empty = log_rows(pg_url)
    for name in ("a", "b", "c"):
        writer.add(spec(name), by="setup")
    follower = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    watch = follower.watch(0, poll_interval=0.1)
    thread, seen, ended = following(watch)
    _until(lambda: seen == [1, 2, 3])
    put_back(pg_url, empty)
    other = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    for i in range(6):
        other.add(spec(f"y{i}"), by="elsewhere")
    thread.join(10)
    watch.stop()
    for models in (writer, follower, other):
        models.close()
    assert not thread.is_alive()
    assert seen == [1, 2, 3]
    assert [type(e) for e in ended] == [LogRewritten]
    assert str(ended[0]) == REWRITTEN_AT_3


def test_an_unread_follower_holds_a_page_of_a_bounded_size(
    open_models: Callable[..., Models],
) -> None:
    """A page was 500 events whatever their size: of definitions with
    thousands of profiles, 32 unread event streams held 5 GB (hostile test).
    It ends once a megabyte is reached, with one event at least."""
    models = open_models()
    models.add(spec("first"), by="x")  # and the declared config's record
    before = models.revision
    adapters = [{"name": f"lora-{i:05d}", "source": f"s3://a/lora-{i:05d}"} for i in range(6000)]
    for i in range(5):
        models.add(spec(f"big{i}", adapters=adapters), by="x")
    models.add(spec("small"), by="x")
    size = min(len(n.state) for n in models.store.select_notifications(before + 1, 5))
    assert size > 300_000
    subscription = models.store.subscribe(gt=before)
    assert isinstance(subscription, persistence.PullingSubscription)
    # Ended as the service ends its own: on PostgreSQL, leaving its `with`
    # lets the process's LISTEN thread go (stop() alone left it running into
    # every later test of the worker).
    with subscription:
        first = next(subscription)
        held = [first, *subscription._buffer]  # the page it pulled
        assert 1 < len(held) <= (1 << 20) // size
        rest = [next(subscription) for _ in range(5)]
    assert [n.id for n in [first, *rest]] == list(range(before + 1, before + 7))
    assert models.store.page_end(before, 500, 1) == before + 1  # one, however large
    assert models.store.page_end(before + 6, 500, 1 << 20) is None


# -- the CLI ------------------------------------------------------------------------------------


def test_cli_reads_at_a_revision_diffs_and_rolls_back(
    tmp_path: Path, config_file: Path, db_url: str
) -> None:
    base = ["--db", db_url, "--config", str(config_file)]
    runner = CliRunner()
    definition = tmp_path / "a.yaml"
    definition.write_text(
        "name: a\nengine: vllm\nsource: hf://o/a\nprofiles: [{name: g, gpus: 1}]\n"
    )
    assert (
        runner.invoke(cli, [*base, "model", "add", str(definition), "--by", "alice"]).exit_code == 0
    )
    assert runner.invoke(cli, [*base, "model", "scale", "a", "--max", "3"]).exit_code == 0

    shown = runner.invoke(cli, [*base, "--json", "model", "show", "a", "--at", "2"])
    assert shown.exit_code == 0
    assert '"scaling": {"min": 1, "max": 1}' in shown.stdout

    diff = runner.invoke(cli, [*base, "diff", "2", "--json"])
    assert diff.exit_code == 0 and '"fields": {"scaling"' in diff.stdout

    rows = count_events(db_url)
    dry = runner.invoke(cli, [*base, "rollback", "--to", "2", "--dry-run"])
    assert dry.exit_code == 0 and "nothing was" in dry.stdout
    assert count_events(db_url) == rows
    done = runner.invoke(cli, [*base, "rollback", "--to", "2", "--by", "ops", "--reason", "r"])
    assert done.exit_code == 0, done.stderr
    assert count_events(db_url) == rows + 1

    beyond = runner.invoke(cli, [*base, "model", "list", "--at", "99"])
    assert beyond.exit_code == 1
    assert beyond.stderr.strip().splitlines() == [
        "error: revision 99 is beyond the head of the log (4)"
    ]
    assert runner.invoke(cli, [*base, "model", "list", "--at", "noon"]).exit_code == 2
    # Digits to str.isdigit, not to int (fuzzing found "diff ¹" escaping as ValueError).
    for not_a_number in ("¹", "②", "3²"):
        odd = runner.invoke(cli, [*base, "diff", not_a_number])
        assert odd.exit_code == 2 and "neither a revision nor" in odd.stderr, odd.stderr
    assert (
        runner.invoke(cli, [*base, "model", "list", "--at", "2026-01-01T00:00:00"]).exit_code == 2
    )

    replay = runner.invoke(cli, [*base, "replay"])
    assert replay.exit_code == 0 and "replayed to revision 4" in replay.stdout
    assert replay.stderr == ""  # the progress bar is for a terminal, and leaves nothing piped


def test_a_replay_whose_audit_is_refused_says_what_was_made_again(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The audit's part of a replay refused as busy: the catalog and its
    snapshots were made again already, and the one line says so (it said only
    why the audit was refused, as if nothing had been done)."""
    definition = tmp_path / "a.yaml"
    definition.write_text(
        "name: a\nengine: vllm\nsource: hf://o/a\nprofiles: [{name: g, gpus: 1}]\n"
    )
    runner = CliRunner()
    assert runner.invoke(cli, ["--db", db_url, "model", "add", str(definition)]).exit_code == 0
    rows = count_events(db_url)

    def refused(self: Models) -> None:
        raise StorageBusy("the audit rows stayed locked for 10 s; try again")

    monkeypatch.setattr(Models, "rebuild_audit", refused)
    replay = runner.invoke(cli, ["--db", db_url, "replay"])
    assert replay.exit_code == 1
    assert replay.stderr.splitlines() == [
        "error: the catalog and its snapshots were made again, the audit's rows not: "
        "the audit rows stayed locked for 10 s; try again"
    ]
    assert count_events(db_url) == rows


def test_a_replay_counts_one_model_as_one(db_url: str, tmp_path: Path) -> None:
    """Its line said "1 models in force" of a catalog of one model."""
    definition = tmp_path / "a.yaml"
    definition.write_text(
        "name: a\nengine: vllm\nsource: hf://o/a\nprofiles: [{name: g, gpus: 1}]\n"
    )
    runner = CliRunner()
    assert runner.invoke(cli, ["--db", db_url, "model", "add", str(definition)]).exit_code == 0
    replay = runner.invoke(cli, ["--db", db_url, "replay"])
    assert replay.exit_code == 0, replay.stderr
    assert replay.stdout.splitlines() == [
        "replayed to revision 1: 1 model in force, 0 snapshots, 0 events skipped"
    ]


def test_the_snapshot_interval_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = f"sqlite:///{tmp_path}/catalog.db"
    definition = tmp_path / "a.yaml"
    definition.write_text(
        "name: a\nengine: vllm\nsource: hf://o/a\nprofiles: [{name: g, gpus: 1}]\n"
    )
    runner = CliRunner()
    monkeypatch.setenv("CATALOG_ES_SNAPSHOT_EVERY", "often")
    refused = runner.invoke(cli, ["--db", db, "model", "list"])
    assert refused.exit_code == 1
    assert refused.stderr.strip().splitlines() == [
        "error: CATALOG_ES_SNAPSHOT_EVERY must be a whole number of revisions, at least 1, "
        "not 'often'"
    ]
    monkeypatch.setenv("CATALOG_ES_SNAPSHOT_EVERY", "2")
    assert runner.invoke(cli, ["--db", db, "model", "add", str(definition)]).exit_code == 0
    for maximum in ("2", "3", "4"):
        assert (
            runner.invoke(cli, ["--db", db, "model", "scale", "a", "--max", maximum]).exit_code == 0
        )
    engine = sa.create_engine(db)
    with engine.connect() as conn:
        revisions = list(conn.execute(sa.select(snapshots_table.c.revision)).scalars())
    engine.dispose()
    assert revisions == [2, 4]


def test_a_node_with_a_fast_clock_does_not_hide_later_changes_from_reads_by_time(
    open_models: Callable[..., Models], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One write from a node whose clock is two hours fast: the nodes after it
    stamp their own time (not after it), and a read at now still sees them."""
    import catalog_es.application

    models = open_models()
    models.add(spec("a"), by="x")
    real_now = utc_now
    monkeypatch.setattr(catalog_es.application, "utc_now", lambda: real_now() + timedelta(hours=2))
    models.add(spec("b"), by="fast-node")
    monkeypatch.setattr(catalog_es.application, "utc_now", real_now)
    models.add(spec("c"), by="y")
    now = datetime.now(UTC)
    assert models.resolve(now) == models.revision
    assert [m["name"] for m in runtime(models.list_models(at=now))] == ["a", "b", "c"]
    dry = models.rollback(now, dry_run=True, by="ops")
    assert dry["events"] == []


def test_a_time_ahead_of_this_clock_is_found_behind_many_untimed_records(
    open_models: Callable[..., Models], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record from a node half an hour fast, then more records from one two
    hours fast (beyond the horizon, untimed) than are read at a time: a read
    at the first's time is no read of the future, and resolves to it."""
    import catalog_es.application

    models = open_models()
    models.add(spec("a"), by="x")
    real_now = utc_now
    monkeypatch.setattr(
        catalog_es.application, "utc_now", lambda: real_now() + timedelta(minutes=30)
    )
    ahead = models.add(spec("b"), by="fast-node").revision
    monkeypatch.setattr(catalog_es.application, "utc_now", lambda: real_now() + timedelta(hours=2))
    for maximum in range(2, 2 + pointintime._TIMED_PAGE + 2):
        models.scale("b", maximum=maximum, by="very-fast-node")
    monkeypatch.setattr(catalog_es.application, "utc_now", real_now)
    (stamped,) = (e["time"] for e in models.log_events() if e["revision"] == ahead)
    assert models.resolve(datetime.fromisoformat(stamped)) == ahead


def test_no_node_follows_a_bad_clocks_record_once_another_stands_after_it(
    open_models: Callable[..., Models], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record from a node two hours fast is not followed while it is the
    log's last, and once a later one stands after it, by no node: one that
    read the log while it was last and one started since stamp alike, with
    their own clocks, and the bad record drags no one forward."""
    import catalog_es.application

    start = datetime.now(UTC).replace(microsecond=0)

    def at(minutes: int) -> None:
        moment = start + timedelta(minutes=minutes)
        monkeypatch.setattr(catalog_es.application, "utc_now", lambda: moment)

    at(0)
    writer = open_models()
    writer.add(spec("a"), by="x")
    reader = open_models()
    at(121)
    writer.scale("a", 0, 2, by="fast-node")
    at(1)
    reader.refresh()  # the bad record is the log's last
    at(2)
    open_models().scale("a", 0, 3, by="good-node")
    at(65)
    reader.refresh()
    reader.scale("a", 0, 4, by="node-up-since-before")
    open_models().scale("a", 0, 5, by="node-started-now")
    times = [datetime.fromisoformat(e["time"]) for e in reader.log_events()][-4:]
    assert times == [
        start + timedelta(minutes=121),
        start + timedelta(minutes=2),
        start + timedelta(minutes=65),
        start + timedelta(minutes=65, microseconds=1),
    ]


def test_a_rollback_brings_back_a_model_stored_before_the_memory_rule(
    open_models: Callable[..., Models],
) -> None:
    models = open_models()
    legacy = spec("legacy", profiles=[{"name": "cpu", "gpus": 0, "cpu_cores": 2}])
    with models.store.write() as conn:
        # As an older version stored it: CPU-only, no host memory declared.
        stored = Model.Added(
            originator_id=model_id("legacy"),
            originator_version=1,
            timestamp=datetime.now(UTC),
            by="old-version",
            model="legacy",
            spec=legacy,
        )
        models.events.put([stored], conn=conn)
    reopened = open_models()
    target = reopened.revision
    reopened.remove("legacy", by="ops")
    result = reopened.rollback(target, by="ops")
    assert [e["event"] for e in result["events"]] == ["Added"]
    assert reopened.get_model("legacy")["warnings"]
    # A new add of the same definition is still refused by the rule.
    with pytest.raises(Refused, match="declares no memory"):
        reopened.add(spec("legacy2", profiles=[{"name": "cpu", "gpus": 0, "cpu_cores": 2}]), by="x")


def test_a_time_without_a_zone_is_refused_rather_than_guessed(
    open_models: Callable[..., Models], db_url: str
) -> None:
    # UTC, or the machine's local time? A library caller's naive datetime says
    # neither; the CLI and HTTP already refuse one as they parse it.
    models = open_models()
    models.add(spec("a"), by="x")
    naive = datetime(2026, 1, 1)
    reads: list[Callable[[], object]] = [
        lambda: models.list_models(at=naive),
        lambda: models.diff(naive),
        lambda: models.audit(since=naive),
        lambda: models.refusals(until=naive),
        lambda: models.rollback(naive, by="ops"),
    ]
    rows = count_events(db_url)
    for read in reads:
        with pytest.raises(InputError, match="has no time zone"):
            read()
    assert count_events(db_url) == rows
    assert models.refusals() == []
    # The same time with its zone reads the catalog before "a" was added.
    assert "a" not in [m["name"] for m in models.list_models(at=naive.replace(tzinfo=UTC))]


@pytest.mark.parametrize(
    ("written", "example"),
    [
        ("2026-01-01T10:00", "2026-01-01T10:00Z"),
        ("2026-01-01 10:00", "2026-01-01 10:00Z"),
        # A date alone: its example must name a time, or it too is refused.
        ("2026-01-01", "2026-01-01T00:00:00Z"),
        ("2026-01-01t10:00", "2026-01-01t10:00Z"),
    ],
)
def test_a_time_without_a_zone_is_refused_with_an_example_that_reads(
    written: str, example: str
) -> None:
    with pytest.raises(InputError) as refusal:
        revision_or_time(written)
    assert str(refusal.value) == f"{written!r} has no time zone: give UTC, e.g. {example}"
    assert revision_or_time(example) == datetime.fromisoformat(example).astimezone(UTC)


@pytest.mark.parametrize(
    "written", ["2026-12-06T10:00:00z", "2026-12-06t10:00:00z", "2026-12-06 10:00:00.25z"]
)
def test_a_utc_time_written_with_a_lowercase_z_reads_as_with_a_capital(written: str) -> None:
    """RFC 3339 lets both letters of a time be lowercase: a ``t`` was read,
    a ``z`` refused (hostile tester). ``--at``, ``?at=`` and the audit's
    bounds read it as UTC, as they read ``Z``."""
    capital = datetime.fromisoformat(f"{written[:-1]}Z")
    assert revision_or_time(written) == capital
    assert revision_or_time(f" {written} ") == capital
    assert utc_time(written, "--since") == capital


@pytest.mark.parametrize("written", [str(2**63), "9" * 19, "9" * 20, "9" * 5000])
def test_a_revision_past_what_a_log_can_hold_is_refused_as_such(written: str) -> None:
    with pytest.raises(InputError, match="is past any revision a log can hold"):
        revision_or_time(written)
    assert revision_or_time(str(2**63 - 1)) == 2**63 - 1
    assert revision_or_time("0" * 5000 + "7") == 7


def test_a_postgresql_watch_that_hears_no_notification_still_follows(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind a connection pooler in transaction mode notifications are lost
    on the way to the LISTEN connection: a watch waiting for one waited for
    good. It looks
    anyway every ``poll_interval`` seconds (10 by default). (Here its LISTEN
    is on a channel no write notifies.)"""
    writer = Models(load_config(None), env={"CATALOG_ES_DB": pg_url})
    writer.add(spec("a"), by="x")
    follower = Models(load_config(None), env={"CATALOG_ES_DB": pg_url})
    monkeypatch.setattr(persistence, "channel_of", lambda schema: "nobody_notifies_this")
    seen: list[int] = []

    def follow() -> None:
        for event in follower.watch(writer.revision, poll_interval=0.3):
            seen.append(event["revision"])
            return

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    listener = follower.store.listener()
    deadline = time.monotonic() + 10
    while not listener._listening and time.monotonic() < deadline:
        time.sleep(0.01)
    monkeypatch.setattr(persistence, "channel_of", channel_of)
    time.sleep(0.5)  # the watch has looked, once listening, and waits
    written = writer.scale("a", 0, 2, by="x").revision
    thread.join(timeout=5)
    assert seen == [written]
    writer.close()
    follower.close()


def test_a_stop_the_driver_told_as_a_lost_connection_still_stops_a_watch() -> None:
    """Ctrl-C in a query comes back from psycopg as its own error, the
    connection lost, which a watch took for an outage: it waited on, the
    stop forgotten (a watch in a clean-clone CI run outlived its SIGINT)."""
    tries: list[int] = []

    def subscribe(after: int, given: Any) -> Any:
        tries.append(after)
        if len(tries) > 1:  # waited on, and tried again: stopped here, not for good
            watch.stop()
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise sa.exc.OperationalError(
                "SELECT 1", None, psycopg.OperationalError("consuming input failed")
            ) from None

    watch = Watch(subscribe, 0, None, where="at the test's")
    watch.retry_seconds = 0.01
    with pytest.raises(sa.exc.OperationalError):
        list(watch)
    assert tries == [0]
