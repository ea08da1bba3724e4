"""Poison events (issue 7): one bad record cannot take the cluster down.

Bad records are planted straight into the database, beside good ones written
through the service: bytes that are not JSON, a row cut in half, an event
type this code does not know, one from a newer version, one with a naive
time, payloads that decode but break the rules, an event under another
model's aggregate, and a runtime model the config now declares. Load must
skip exactly those, report each with its revision and why, serve everything
else (declared models always), and let a poisoned name be added again.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import msgspec
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from eventsourcing.persistence import StoredEvent

from catalog_es.application import Models
from catalog_es.cli import cli
from catalog_es.configuration import CONFIGURATION_ID, Configuration
from catalog_es.errors import DeclaredInConfig, ModelNotFound
from catalog_es.inputs import load_config
from catalog_es.mapper import topic_of
from catalog_es.model import Model, model_id, utc_now
from catalog_es.spec import Scaling
from catalog_es.storage.schema import events_table
from tests.helpers import model_spec

DECLARED = """
models:
  - name: base
    engine: vllm
    source: hf://org/base
    profiles: [{name: gpu, gpus: 1}]
"""
# Later the config also declares "shadowed", which was added at runtime before.
SHADOWED = DECLARED + DECLARED.split("models:")[1].replace("base", "shadowed")


class Planter:
    """Writes rows into the log by hand, as a bug, an old build or a person
    with a SQL prompt would: next to the service, not through it."""

    def __init__(self, models: Models) -> None:
        self.store = models.store

    def insert(self, topic: str, state: bytes, originator_id: UUID) -> int:
        with self.store.write() as conn:
            version = self.store.stream_version(conn, originator_id) + 1
            stored = StoredEvent(originator_id, version, topic, state)
            (revision,) = self.store.insert_events([stored], conn=conn) or [0]
        return revision

    def event(self, cls: type[Model.Event], name: str, **fields: Any) -> dict[str, Any]:
        """A well-formed event of ``cls`` for model ``name``, as stored data to spoil."""
        event = cls(
            originator_id=model_id(name),
            originator_version=0,  # the row's column is what counts
            timestamp=utc_now(),
            by="planted",
            model=name,
            **fields,
        )
        data: dict[str, Any] = msgspec.to_builtins(event)
        return data

    def plant(self, cls: type[Model.Event], name: str, data: dict[str, Any]) -> int:
        return self.insert(topic_of(cls), json.dumps(data).encode(), model_id(name))

    def spoil(self, revision: int, state: bytes) -> int:
        """Overwrite a stored row's bytes in place."""
        with self.store.write() as conn:
            conn.execute(
                sa.update(events_table)
                .where(events_table.c.revision == revision)
                .values(state=state)
            )
        return revision


@dataclass(frozen=True)
class Poison:
    """One kind of bad record: how to plant it, and how load must report it."""

    case: str
    model: str  # as the report names it; "" when not even that can be read
    event: str
    reason: str  # a pattern the reported reason matches
    plant: Callable[[Planter, Models], int]
    # Not even an event can be made of it (``log`` shows an error in its place).
    undecodable: bool = True


POISONS = [
    Poison(
        "bytes that are not JSON",
        "",
        "Added",
        r"^corrupt payload",
        lambda p, _: p.insert(
            topic_of(Model.Added), b"\x00\xff\xfe{{not json", model_id("p-bytes")
        ),
    ),
    Poison(
        "a row cut in half",
        "",
        "Scaled",
        r"^corrupt payload",
        lambda p, m: p.spoil(
            m.scale("good-b", 1, 3, by="x").revision,
            json.dumps(p.event(Model.Scaled, "good-b", scaling=Scaling(1, 3))).encode()[:60],
        ),
    ),
    Poison(
        "an event type this code does not know",
        "p-unknown",
        "Exploded",
        r"^unknown event type 'catalog_es\.model:Model\.Exploded'",
        lambda p, _: p.insert(
            "catalog_es.model:Model.Exploded",
            json.dumps({"model": "p-unknown", "blast_radius": 9}).encode(),
            model_id("p-unknown"),
        ),
    ),
    Poison(
        "a NUL in the name it gives (PostgreSQL's text cannot hold one)",
        "p-nul\0",
        "Exploded",
        r"^unknown event type 'catalog_es\.model:Model\.Exploded'",
        lambda p, _: p.insert(
            "catalog_es.model:Model.Exploded",
            json.dumps({"model": "p-nul\0"}).encode(),
            model_id("p-nul"),
        ),
    ),
    Poison(
        "an event type named longer than any this code has",
        "p-long",
        "E" * 70,
        r"^unknown event type 'catalog_es\.model:Model\.E{70}'",
        lambda p, _: p.insert(
            "catalog_es.model:Model." + "E" * 70,
            json.dumps({"model": "p-long"}).encode(),
            model_id("p-long"),
        ),
    ),
    Poison(
        "a time past the end of what UTC holds, in an offset of its own",
        "p-late",
        "Scaled",
        r"^model 'p-late' is not in the catalog",
        lambda p, _: p.plant(
            Model.Scaled,
            "p-late",
            p.event(Model.Scaled, "p-late", scaling=Scaling(0, 2))
            | {"timestamp": "9999-12-31T23:30:00-01:00"},
        ),
        undecodable=False,
    ),
    Poison(
        "an event from a newer version",
        "p-future",
        "Added",
        r"^written by a newer version of catalog-es \(Model\.Added class_version 99; ",
        lambda p, _: p.plant(
            Model.Added,
            "p-future",
            p.event(Model.Added, "p-future", spec=model_spec("p-future")) | {"class_version": 99},
        ),
    ),
    Poison(
        "a time without a time zone",
        "good-a",
        "OwnerSet",
        r"^invalid payload: Expected `datetime` with a timezone component - at `\$\.timestamp`",
        lambda p, _: p.plant(
            Model.OwnerSet,
            "good-a",
            p.event(Model.OwnerSet, "good-a", owner="team:x")
            | {"timestamp": "2024-01-01T00:00:00"},
        ),
    ),
    Poison(
        "a payload of the wrong shape",
        "good-a",
        "Scaled",
        r"^invalid payload: Expected `object`, got `str` - at `\$\.scaling`",
        lambda p, _: p.plant(
            Model.Scaled,
            "good-a",
            p.event(Model.Scaled, "good-a", scaling=Scaling()) | {"scaling": "lots"},
        ),
    ),
    Poison(
        "negative scaling",
        "good-a",
        "Scaled",
        r"^model 'good-a': scaling: min -1, max 2: need 0 <= min <= max",
        lambda p, _: p.plant(
            Model.Scaled, "good-a", p.event(Model.Scaled, "good-a", scaling=Scaling(-1, 2))
        ),
        undecodable=False,
    ),
    Poison(
        "a fallback to nothing",
        "p-fallback",
        "Added",
        r"^model 'p-fallback': fallbacks: names 'ghost', which is not in the catalog",
        lambda p, _: p.plant(
            Model.Added,
            "p-fallback",
            p.event(Model.Added, "p-fallback", spec=model_spec("p-fallback", fallbacks=["ghost"])),
        ),
        undecodable=False,
    ),
    Poison(
        "an event under another model's aggregate",
        "p-foreign",
        "Added",
        r"^its aggregate id does not belong to model 'p-foreign'",
        lambda p, _: p.insert(
            topic_of(Model.Added),
            json.dumps(
                p.event(Model.Added, "p-foreign", spec=model_spec("p-foreign"))
                | {"originator_id": str(model_id("good-a"))}
            ).encode(),
            model_id("good-a"),
        ),
        undecodable=False,
    ),
    Poison(
        "a declared-config record that is not JSON",
        "",
        "ConfigDeclared",
        r"^corrupt payload",
        lambda p, _: p.insert(topic_of(Configuration.Declared), b"\x00", CONFIGURATION_ID),
    ),
    Poison(
        "a runtime model the config now declares",
        "shadowed",
        "Added",
        r"^model 'shadowed' is declared in configuration, which wins every conflict",
        lambda _, m: m.add(model_spec("shadowed", source="hf://org/runtime"), by="x").revision,
        undecodable=False,
    ),
]
# Names left out of the catalog by their poison, which adding again heals.
POISONED_NAMES = ["p-fallback", "p-foreign", "p-future", "p-bytes", "p-unknown"]


@pytest.fixture
def configs(tmp_path: Path) -> tuple[Path, Path]:
    before, after = tmp_path / "before.yaml", tmp_path / "after.yaml"
    before.write_text(DECLARED)
    after.write_text(SHADOWED)
    return before, after


@pytest.fixture
def open_models(service: Callable[..., Models]) -> Callable[..., Models]:
    return lambda config, snapshot_interval=1000: service(
        config, snapshot_interval=snapshot_interval
    )


@pytest.fixture
def poisoned(open_models: Callable[..., Models], configs: tuple[Path, Path]) -> dict[int, Poison]:
    """Good models, every poison planted among them, and good changes after:
    the revision of each poison."""
    models = open_models(configs[0])
    models.add(model_spec("good-a"), by="x")
    models.add(model_spec("good-b", fallbacks=["good-a"]), by="x")
    planter = Planter(models)
    planted = {poison.plant(planter, models): poison for poison in POISONS}
    # The service goes on writing over the poison, on the config of the time.
    open_models(configs[0]).scale("good-a", 1, 4, by="x")
    return planted


def test_load_skips_exactly_the_poison_and_serves_everything_else(
    poisoned: dict[int, Poison], open_models: Callable[..., Models], configs: tuple[Path, Path]
) -> None:
    models = open_models(configs[1])
    skipped = {s.revision: s for s in models.skipped()}
    assert sorted(skipped) == sorted(poisoned)
    for revision, poison in poisoned.items():
        report = skipped[revision]
        assert (report.model, report.event) == (poison.model, poison.event), poison.case
        assert re.search(poison.reason, report.reason), (poison.case, report.reason)
    served = {m["name"]: m for m in models.list_models()}
    assert sorted(served) == ["base", "good-a", "good-b", "shadowed"]
    assert served["base"]["declared"] and served["shadowed"]["declared"]
    assert served["shadowed"]["source"] == "hf://org/shadowed"
    # What the poison tried is not in force; the good changes after it are.
    assert served["good-a"]["scaling"] == {"min": 1, "max": 4}
    assert served["good-a"]["owner"] == ""
    assert served["good-b"]["scaling"] == {"min": 1, "max": 1}
    assert served["good-b"]["fallbacks"] == ["good-a"]


def test_the_audit_shows_each_poison_with_why_and_answers_by_time(
    poisoned: dict[int, Poison], open_models: Callable[..., Models], configs: tuple[Path, Path]
) -> None:
    models = open_models(configs[1])
    skipped = {s.revision: s.reason for s in models.skipped()}
    rows = models.audit()
    assert {r["revision"]: r["skipped"] for r in rows if r["skipped"]} == skipped
    assert set(poisoned) <= set(skipped)
    # A record that cannot say its model is its stream's, for history to show.
    cut = next(r for r, p in poisoned.items() if p.case == "a row cut in half")
    assert next(r["model"] for r in rows if r["revision"] == cut) == "good-b"
    assert cut in [r["revision"] for r in models.history("good-b")]
    assert models.audit(model="p-nul\0")[0]["model"] == "p-nul\0"
    with pytest.raises(ModelNotFound):
        models.history("never\0")
    # The row from past the end of UTC keeps to that end: after every bound.
    late = next(r["revision"] for r in rows if r["model"] == "p-late")
    assert late not in [r["revision"] for r in models.audit(until=datetime.now(UTC))]
    assert late in [r["revision"] for r in models.audit(since=datetime(9999, 1, 1, tzinfo=UTC))]


def test_the_skips_survive_a_snapshot(
    poisoned: dict[int, Poison], open_models: Callable[..., Models], configs: tuple[Path, Path]
) -> None:
    full = open_models(configs[1])
    open_models(configs[1], snapshot_interval=1)  # loads, and snapshots what it loaded
    from_snapshot = open_models(configs[1], snapshot_interval=1)
    assert from_snapshot.skipped() == full.skipped()
    assert from_snapshot.list_models() == full.list_models()


@pytest.mark.parametrize(
    ("forged", "state", "model"),
    [
        ("catalog_es.model:Model.ConfigDeclared", b'{"model": "good-a"}', "good-a"),
        # As snapshots of older releases named the config's record, with no model.
        ("catalog_es.model:Model.Declared", b"{}", ""),
    ],
)
def test_a_models_record_whose_topic_only_ends_like_the_configs_is_a_models_skip(
    open_models: Callable[..., Models],
    configs: tuple[Path, Path],
    forged: str,
    state: bytes,
    model: str,
) -> None:
    """Only the config's own topic makes a record the config's: one whose
    topic merely ended in its name was a model's to a full replay, and the
    config's to a snapshot, the audit and the replay's summary, so a load
    from a snapshot and a full one disagreed on the config recorded (review)."""
    models = open_models(configs[0])
    models.add(model_spec("good-a"), by="x")
    planted = Planter(models).insert(forged, state, model_id("good-a"))
    full = open_models(configs[0])
    (skip,) = full.skipped()
    assert (skip.revision, skip.model) == (planted, model)
    assert skip.what() == f"model {repr(model) if model else '?'}, {forged!r}"
    (row,) = [r for r in full.audit() if r["revision"] == planted]
    assert row["event"] == repr(forged)
    open_models(configs[0], snapshot_interval=1)  # loads, and snapshots what it loaded
    from_snapshot = open_models(configs[0], snapshot_interval=1)
    assert from_snapshot.skipped() == full.skipped()
    assert from_snapshot.catalog.recorded_declaration == full.catalog.recorded_declaration


def test_the_cli_reports_each_skip_with_its_revision_and_reason(
    poisoned: dict[int, Poison], db_url: str, configs: tuple[Path, Path]
) -> None:
    base = ["--db", db_url, "--config", str(configs[1])]
    replay = CliRunner().invoke(cli, [*base, "replay"])
    assert replay.exit_code == 0, replay.stderr
    lines = replay.stdout.splitlines()
    assert lines[0].endswith(f"4 models in force, 0 snapshots, {len(POISONS)} events skipped")
    reported = {int(line.split()[2]): line for line in lines[1:]}
    assert sorted(reported) == sorted(poisoned)
    for revision, poison in poisoned.items():
        # Worded as the load's warning is. A stored name is shown as repr
        # shows it: 'p-nul\\x00', not a raw NUL; one that cannot be read as "?".
        what = f"model {repr(poison.model) if poison.model else '?'}, {poison.event}"
        if poison.event == "ConfigDeclared":
            what = "the declared config's record"
        prefix = f"skipped revision {revision} ({what}): "
        assert reported[revision].startswith(prefix), reported[revision]
        assert re.search(poison.reason, reported[revision].removeprefix(prefix))
    log = CliRunner().invoke(cli, [*base, "log", "--json"])
    assert log.exit_code == 0, (log.stderr, log.exception)
    errors = {e["revision"] for e in map(json.loads, log.stdout.splitlines()) if "error" in e}
    assert errors == {revision for revision, p in poisoned.items() if p.undecodable}
    # As text, an undecodable record has no time or actor: "?" in log and in
    # watch alike (watch printed "None None").
    log = CliRunner().invoke(cli, [*base, "log"])
    by_revision = {line.split()[0]: line.split() for line in log.stdout.splitlines()[1:]}
    watched = {line.split()[0]: line.split() for line in _watched(base, max(by_revision, key=int))}
    for revision in errors:
        assert by_revision[str(revision)][1:3] == ["?", "?"]
        assert watched[str(revision)][1:3] == ["?", "?"]


def _watched(base: list[str], last: str) -> list[str]:
    """The lines ``watch`` prints up to revision ``last``; then it is stopped.
    Its stderr is kept, to say what a watch that would not stop was doing."""
    with tempfile.TemporaryFile("w+") as stderr:
        watch = subprocess.Popen(
            [sys.executable, "-m", "catalog_es", *base, "watch"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        lines: queue.Queue[str] = queue.Queue()

        def read() -> None:
            for line in watch.stdout or ():
                lines.put(line)

        threading.Thread(target=read, daemon=True).start()
        seen: list[str] = []
        problem = ""
        try:
            while not seen or seen[-1].split()[0] != last:
                seen.append(lines.get(timeout=30))
        except queue.Empty:
            problem = f"watch printed nothing more for 30 s, short of revision {last}"
        watch.send_signal(signal.SIGINT)
        try:
            watch.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # Twice in eleven clean-clone CI runs (PostgreSQL, two workers) the
            # watch neither reached the last revision nor stopped.
            watch.kill()
            watch.wait()
            problem = problem or "watch did not stop on SIGINT within 30 s"
        if problem:
            stderr.seek(0)
            pytest.fail(f"{problem}; it printed {seen}, and on stderr {stderr.read()!r}")
    return seen


def test_a_rollback_past_records_whose_model_cannot_be_read_writes_nothing_for_them(
    poisoned: dict[int, Poison], open_models: Callable[..., Models], configs: tuple[Path, Path]
) -> None:
    """A whole rollback took an unreadable record's "" for a model that fell
    out of force, and wrote a Removed of the name "" (hostile test)."""
    models = open_models(configs[1])
    result = models.rollback(0, by="ops")
    assert result["written"]
    assert "" not in {e["model"] for e in result["events"]}
    assert not any("model ''" in note for note in result["notes"])
    assert "" not in {e["model"] for e in models.log_events(after=max(poisoned))}


def test_a_poisoned_name_can_be_added_again_which_heals_it(
    poisoned: dict[int, Poison], open_models: Callable[..., Models], configs: tuple[Path, Path]
) -> None:
    models = open_models(configs[1])
    skipped_before = models.skipped()
    replaced = {
        name for name in POISONED_NAMES if models.add(model_spec(name), by="healer").replaced
    }
    # A record of the name's own, load skipped, is replaced; one that could
    # not say its name, or was filed in another model's stream, was never its.
    assert replaced == {"p-fallback", "p-future", "p-unknown"}
    # A skipped model never blocks commands on the others.
    models.scale("good-b", 0, 2, by="x")
    with pytest.raises(DeclaredInConfig, match="edit that rather"):
        models.add(model_spec("shadowed"), by="x")
    reopened = open_models(configs[1])
    assert sorted(m["name"] for m in reopened.list_models()) == sorted(
        ["base", "good-a", "good-b", "shadowed", *POISONED_NAMES]
    )
    assert reopened.skipped() == skipped_before, "healing skips nothing new"


def test_a_record_from_the_far_future_does_not_stop_commands(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(DECLARED)
    models = Models(load_config(str(config)), env={"CATALOG_ES_DB": f"sqlite:///{tmp_path}/c.db"})
    models.add(model_spec("a"), by="x")
    planter = Planter(models)
    late = planter.event(Model.Scaled, "a", scaling=Scaling(0, 2))
    planter.plant(Model.Scaled, "a", late | {"timestamp": "9999-12-31T23:59:59.999999Z"})
    written = models.scale("a", 0, 3, by="x")
    # Stamped by this clock, not after the record from the end of time.
    (last,) = models.log_events(after=written.revision - 1)
    assert last["time"].startswith(str(datetime.now(UTC).year))
    assert models.get_model("a")["scaling"] == {"min": 0, "max": 3}


def test_a_row_holding_values_of_the_wrong_type_is_skipped_like_any_other(
    tmp_path: Path,
) -> None:
    # SQLite keeps whatever a hand-written INSERT gives a column: a topic
    # stored as bytes, a payload stored as a number.
    url = f"sqlite:///{tmp_path}/c.db"
    models = Models(env={"CATALOG_ES_DB": url})
    models.add(model_spec("a"), by="x")
    models.close()
    insert = (
        "INSERT INTO catalog_events (originator_id, originator_version, topic, state, hash,"
        " stream_previous) VALUES (?, 1, ?, ?, 'h', 0)"
    )
    with sa.create_engine(url).begin() as conn:
        conn.exec_driver_sql(insert, ("x", b"Scaled", b"{}"))
        conn.exec_driver_sql(insert, ("y", topic_of(Model.Scaled), 7))
    models = Models(env={"CATALOG_ES_DB": url})
    assert [(s.revision, s.event, s.reason) for s in models.skipped()] == [
        (2, "b'Scaled'", "unknown event type b'Scaled'"),
        (3, "Scaled", "corrupt payload: a bytes-like object is required, not 'int'"),
    ]
    assert [m["name"] for m in models.list_models(at=3)] == ["a"]
    assert models.get_model("a", at=3)["name"] == "a"
    assert [e["event"] for e in models.log_events()] == ["Added", "b'Scaled'", "Scaled"]
    assert [r["skipped"] is not None for r in models.audit()] == [False, True, True]
    assert models.verify()["broken"]["revision"] == 2


@pytest.mark.parametrize("named", ["p", "never-added"])
def test_a_record_filed_in_another_models_stream_leaves_both_models_usable(
    service: Callable[..., Models], named: str
) -> None:
    """A record naming one model, filed in another's stream (a hand edit, a
    bug), is skipped. Taken as the named model's, it put that model's version
    ahead of its own stream, and every command on it was refused as a log
    edited by hand, which ``verify`` did not find (conformance audit)."""
    models = service(None)
    models.add(model_spec("p"), by="x")
    models.add(model_spec("q"), by="x")
    planter = Planter(models)
    data = planter.event(Model.Scaled, named, scaling=Scaling(1, 4))
    data["originator_id"] = str(model_id("q"))  # the stream's, as the row's is
    misfiled = planter.insert(topic_of(Model.Scaled), json.dumps(data).encode(), model_id("q"))
    models = service(None)
    assert [(s.revision, s.model) for s in models.skipped()] == [(misfiled, named)]
    assert not models.catalog.was_skipped(named), "its own stream's last event stands"
    if named == "p":
        assert models.scale("p", 0, 2, by="x").model is not None
        assert models.add(model_spec("p"), by="x").replaced
        models.remove("p", by="x")
    else:
        with pytest.raises(ModelNotFound):
            models.remove(named, by="x")
        assert not models.add(model_spec(named), by="x").replaced
    assert models.scale("q", 0, 3, by="x").model is not None
    assert service(None).list_models() == models.list_models()
