"""The audit trail: history and audit queries, refusals, the hash chain and verify.

Given a scripted history by several actors (with a clock of our own, so times
are known), each query returns exactly the expected rows; tampering with the
stored log makes ``verify`` fail at the revision touched.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import msgspec
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from eventsourcing.persistence import StoredEvent, Tracking
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Connection

import catalog_es.application
import catalog_es.audit
import projections.audit
from catalog_es import collector, commands
from catalog_es.application import Models
from catalog_es.chain import link
from catalog_es.cli import cli
from catalog_es.configuration import CONFIGS_KEPT, DeclaredConfig
from catalog_es.errors import (
    DamagedLog,
    DeclaredInConfig,
    InputError,
    InvalidModel,
    ModelNotFound,
    Refused,
    RevisionConflict,
    StorageBusy,
    json_line,
)
from catalog_es.inputs import load_config
from catalog_es.mapper import EventMapper
from catalog_es.model import Model, model_id, utc_text
from catalog_es.persistence import SQLRecorder
from catalog_es.ports import PreAddCheck
from catalog_es.spec import DEFAULT_ENGINES, Adapter, ModelSpec, Origin, Profile, Scaling
from catalog_es.storage.engines import create_engine
from catalog_es.storage.schema import events_table, head_table, streams_table
from catalog_es.values import MAX_REVISION
from projections import pointintime
from projections.audit import (
    ANY_CHANGES_TABLE,
    AuditView,
    ChangeFilters,
    TimeOrder,
    Tracked,
    changes_table_for,
    listed,
    read_record,
    stored_time,
    tracking_table,
)
from tests.helpers import (
    PUT_THE_HEAD_BACK,
    CountedOutput,
    collections_seen,
    config_yaml,
    definition,
    event,
    model_spec,
    schema_of,
    spec,
)

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)

CONFIG = """\
models:
  - name: base
    engine: vllm
    source: hf://org/base
    profiles: [{name: a100, gpus: 1, gpu_memory_gb: 40, min_memory_gb: 32}]
"""

CHAT = ModelSpec(
    name="chat",
    engine="vllm",
    source="hf://org/chat",
    profiles=(Profile(name="h100", gpus=1, gpu_memory_gb=80, min_memory_gb=64),),
    fallbacks=("base",),
)
EMBED = ModelSpec(
    name="embed",
    engine="tgi",
    source="hf://org/embed",
    profiles=(Profile(name="cpu", min_memory_gb=4, cpu_cores=2),),
)
CHAT_DEFINITION = {
    "name": "chat",
    "engine": "vllm",
    "source": "hf://org/chat",
    "profiles": [
        {"name": "h100", "gpus": 1, "gpu_memory_gb": 80, "min_memory_gb": 64, "cpu_cores": 0}
    ],
    "scaling": {"min": 1, "max": 1},
    "class": "",
    "owner": "",
    "adapters": [],
    "fallbacks": ["base"],
    "origin": None,
}
EMBED_DEFINITION = {
    "name": "embed",
    "engine": "tgi",
    "source": "hf://org/embed",
    "profiles": [
        {"name": "cpu", "gpus": 0, "gpu_memory_gb": 0, "min_memory_gb": 4, "cpu_cores": 2}
    ],
    "scaling": {"min": 1, "max": 1},
    "class": "",
    "owner": "",
    "adapters": [],
    "fallbacks": [],
    "origin": None,
}


def as_json(value: Any) -> Any:
    """``value`` as a row's JSON holds it (a definition's tuples as lists)."""
    return json.loads(msgspec.json.encode(value))


def at(minutes: int) -> str:
    return (T0 + timedelta(minutes=minutes)).isoformat().replace("+00:00", "Z")


def added(definition: dict[str, Any]) -> list[dict[str, Any]]:
    """The changes of adding a model: every field that has a value, from nothing."""
    return [
        {"field": k, "before": None, "after": v} for k, v in definition.items() if v is not None
    ]


def removed(definition: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"field": k, "before": v, "after": None} for k, v in definition.items() if v is not None
    ]


def with_changes(definition: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**definition, **changes}


class RefuseBrokenWeights(PreAddCheck):
    def check(self, model: ModelSpec) -> None:
        if model.source.startswith("s3://broken"):
            raise Refused(f"the engine cannot load {model.source}: no safetensors found")


class Clock:
    """``utc_now`` for the service: T0 plus the minutes the script says."""

    def __init__(self) -> None:
        self.minutes = 0

    def __call__(self) -> datetime:
        return T0 + timedelta(minutes=self.minutes)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(catalog_es.application, "utc_now", clock)
    monkeypatch.setattr(catalog_es.audit, "utc_now", clock)
    return clock


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "catalog.yaml"
    path.write_text(CONFIG)
    return path


@pytest.fixture
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'catalog.db'}"


def open_service(db: str, config: Path) -> Models:
    return Models(
        load_config(str(config)), pre_add_check=RefuseBrokenWeights(), env={"CATALOG_ES_DB": db}
    )


def refuse(command: Callable[[], Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        command()


def script(models: Models, clock: Clock) -> None:
    """Seven changes by three actors (revisions 2-8, at T0 + 1..7 minutes; the first
    write records the declared config as revision 1 before its own: its row,
    and one of `base`, which it declares), then four refused attempts (at
    T0 + 8..11 minutes) and one unreadable one."""
    broken = ModelSpec(
        name="broken", engine="vllm", source="s3://broken/w", profiles=(Profile("g", gpus=1),)
    )
    steps: list[Callable[[], object]] = [
        lambda: models.add(CHAT, by="alice", reason="first try"),
        lambda: models.scale("chat", 0, 3, by="bob", reason="save GPUs at night"),
        lambda: models.add(EMBED, by="alice"),
        lambda: models.set_resources("embed", profile="cpu", memory_gb=8, by="carol", reason="OOM"),
        lambda: models.set_class("chat", "critical", by="bob"),
        lambda: models.remove("embed", by="alice", reason="unused"),
        lambda: models.set_owner("chat", "team:search", by="carol"),
        lambda: refuse(
            lambda: models.add(load_base(models), by="dave", reason="laptop"), DeclaredInConfig
        ),
        lambda: refuse(
            lambda: models.scale("chat", maximum=5, by="erin", expected_revision=1),
            RevisionConflict,
        ),
        lambda: refuse(lambda: models.add(broken, by="dave"), Refused),
        lambda: refuse(
            lambda: models.set_class("chat", "gold", by="bob", reason="vip"), InvalidModel
        ),
        # Input that cannot be read is not a refusal by the rules: not recorded.
        lambda: refuse(lambda: models.remove("chat", by=""), InputError),
    ]
    for minute, step in enumerate(steps, start=1):
        clock.minutes = minute
        step()


# The revisions of the audit's rows of the script: the config record's and
# its row of `base`, then one row per event.
SCRIPTED_ROWS = [1, 1, 2, 3, 4, 5, 6, 7, 8]


def load_base(models: Models) -> ModelSpec:
    return models.declared.models[0]


def scripted_service(db: str, config: Path, clock: Clock) -> Iterator[Models]:
    service = open_service(db, config)
    script(service, clock)
    yield service
    service.close()


@pytest.fixture
def models(db: str, config: Path, clock: Clock) -> Iterator[Models]:
    yield from scripted_service(db, config, clock)


def event_count(models: Models) -> int:
    with models.store.read() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(events_table)).scalar_one())


# -- history and audit -------------------------------------------------------------


def test_history_is_every_change_to_one_model_field_by_field(models: Models) -> None:
    scaled = with_changes(CHAT_DEFINITION, scaling={"min": 0, "max": 3})
    critical = with_changes(scaled, **{"class": "critical"})
    owned = with_changes(critical, owner="team:search")
    history = models.history("chat")
    assert [(r["revision"], r["time"], r["by"], r["event"], r["reason"]) for r in history] == [
        (2, at(1), "alice", "Added", "first try"),
        (3, at(2), "bob", "Scaled", "save GPUs at night"),
        (6, at(5), "bob", "ClassSet", ""),
        (8, at(7), "carol", "OwnerSet", ""),
    ]
    assert [r["changes"] for r in history] == [
        added(CHAT_DEFINITION),
        [
            {"field": "scaling.min", "before": 1, "after": 0},
            {"field": "scaling.max", "before": 1, "after": 3},
        ],
        [{"field": "class", "before": "", "after": "critical"}],
        [{"field": "owner", "before": "", "after": "team:search"}],
    ]
    assert [(r["before"], r["after"]) for r in history] == [
        (None, CHAT_DEFINITION),
        (CHAT_DEFINITION, scaled),
        (scaled, critical),
        (critical, owned),
    ]
    assert history[1] == {
        "revision": 3,
        "time": at(2),
        "by": "bob",
        "reason": "save GPUs at night",
        "model": "chat",
        "event": "Scaled",
        "class_version": 1,
        "fields": {"scaling": {"min": 0, "max": 3}},
        "rollback_to": None,
        "skipped": None,
        "changes": history[1]["changes"],
        "before": CHAT_DEFINITION,
        "after": scaled,
    }


def test_a_list_of_plain_values_changed_is_one_change_of_the_whole_list(models: Models) -> None:
    """Only a list of items with names of their own (profiles, adapters) is
    compared item by item: a list of names (fallbacks), even of one, is one
    field, before and after whole."""
    models.add(spec("other"), by="alice")
    models.add(msgspec.structs.replace(CHAT, fallbacks=("other",)), by="alice")
    *_, replaced = models.history("chat")
    fallbacks = [c for c in replaced["changes"] if c["field"].startswith("fallbacks")]
    assert fallbacks == [{"field": "fallbacks", "before": ["base"], "after": ["other"]}]


def test_history_of_a_removed_model_ends_with_its_removal(models: Models) -> None:
    resized = with_changes(
        EMBED_DEFINITION,
        profiles=[
            {"name": "cpu", "gpus": 0, "gpu_memory_gb": 0, "min_memory_gb": 8, "cpu_cores": 2}
        ],
    )
    history = models.history("embed")
    assert [(r["revision"], r["by"], r["event"], r["changes"]) for r in history] == [
        (4, "alice", "Added", added(EMBED_DEFINITION)),
        (
            5,
            "carol",
            "ResourcesSet",
            [{"field": "profiles[cpu].min_memory_gb", "before": 4, "after": 8}],
        ),
        (7, "alice", "Removed", removed(resized)),
    ]
    assert history[2]["after"] is None


def test_history_is_filtered_as_the_audit_is(models: Models) -> None:
    """A model scaled every minute for a year has half a million rows: its
    history is narrowed as the audit's rows are, by actor, type, time and
    the most recent N."""
    cases: list[tuple[ChangeFilters, list[int]]] = [
        ({"by": "bob"}, [3, 6]),
        ({"event_type": "OwnerSet"}, [8]),
        ({"since": T0 + timedelta(minutes=2), "until": T0 + timedelta(minutes=7)}, [3, 6]),
        ({"limit": 2}, [6, 8]),
        ({"by": "nobody"}, []),
    ]
    for filters, expected in cases:
        assert [r["revision"] for r in models.history("chat", **filters)] == expected, filters
    assert models.history("chat", limit=1) == models.audit(model="chat", limit=1)
    with pytest.raises(ModelNotFound):
        models.history("never-seen", limit=1)


def test_a_model_a_removal_takes_out_of_force_has_a_row_of_its_own(
    make_models: Callable[..., Models],
) -> None:
    """Its fallback removed by a node whose config declared it (its runtime
    definition was not in force there), a model goes out of force when the
    config no longer declares it: `model show`, `diff` and `verify` said so,
    while its history ended with it in force (two hostile tests)."""
    models = make_models()
    models.add(spec("y"), by="alice")  # 1
    models.add(spec("x", fallbacks=("y",)), by="alice")  # 2
    models.add(spec("w", fallbacks=("x",)), by="alice")  # 3
    assert len(models.audit()) == 3  # built this far: the rows after are caught up
    declaring_x = make_models(config_yaml(spec("x"), spec("w")))
    declaring_x.remove("y", by="bob", reason="unused here")  # 4: the config's record, 5
    models.close()
    models = make_models()  # the first config again
    assert models.list_models() == []
    reason = (
        "model {}: fallbacks: names {}, which this revision removed; out of force until added again"
    )
    for name, fallback in (("x", "y"), ("w", "x")):
        # The config declaring x and w has a row of each, recorded before the removal.
        added_row, declared, last = models.history(name)
        assert (declared["revision"], declared["event"]) == (4, "Declared")
        assert (last["revision"], last["model"], last["event"], last["by"]) == (
            5,
            name,
            "Removed",
            "bob",
        )
        assert last["reason"] == "unused here"
        assert last["skipped"] == reason.format(repr(name), repr(fallback))
        assert (last["before"], last["after"]) == (added_row["after"], None)
        assert last["before"]["fallbacks"] == [fallback]
    # In the revision's place: after the removal, in the order load took them out.
    assert [(r["revision"], r["model"]) for r in models.audit()][-3:] == [
        (5, "y"),
        (5, "x"),
        (5, "w"),
    ]
    assert [r["model"] for r in models.audit(limit=2)] == ["x", "w"]
    assert models.audit(model="x", limit=1) == models.history("x")[-1:]
    # Built anew from the log, the rows are the same.
    rows = models.audit()
    models.rebuild_audit()
    assert models.audit() == rows
    # The next event's rows are its own: none of the models the removal took out.
    added = models.add(spec("v"), by="carol").revision  # after the config's record
    assert [r["model"] for r in models.audit() if r["revision"] == added] == ["v"]


def test_history_of_an_unknown_name_is_not_found_and_of_a_declared_one_is_its_declaration(
    models: Models,
) -> None:
    with pytest.raises(ModelNotFound):
        models.history("never-seen")
    # Nor is an empty name, asked of the library as of the CLI: no model's,
    # not a model filter left empty.
    for history in (models.history, models.history_json, models.history_rows):
        with pytest.raises(ModelNotFound, match=r"^model '' has no history"):
            history("")
    [declared] = models.history("base")
    assert (declared["revision"], declared["by"], declared["event"]) == (1, "alice", "Declared")
    assert declared["after"] == as_json(load_base(models))


def test_history_of_a_model_dropped_from_the_config_ends_with_its_undeclaring(
    models: Models, db: str, tmp_path: Path, clock: Clock
) -> None:
    """A model dropped from the config: `history` said it `was never in the
    log or the config`, where the log's config records declare it (hostile
    test). Its history is those records' rows of it, matched by any filter
    or none (no row of it matching is no answer, not "never there")."""
    undeclared = tmp_path / "undeclared.yaml"
    undeclared.write_text("models: []\n")
    reopened = open_service(db, undeclared)
    try:
        assert [r["event"] for r in reopened.history("base")] == ["Declared"]
        clock.minutes = 20
        dropped = reopened.add(EMBED, by="erin").revision - 1
        rows = reopened.history("base")
        assert [(r["revision"], r["by"], r["event"]) for r in rows] == [
            (1, "alice", "Declared"),
            (dropped, "erin", "Undeclared"),
        ]
        assert (rows[1]["before"], rows[1]["after"]) == (rows[0]["after"], None)
        assert reopened.history("base", by="nobody") == []
        with pytest.raises(ModelNotFound, match="was never in the log or the config"):
            reopened.history("never-seen")
    finally:
        reopened.close()


def test_history_shows_when_the_config_declared_changed_and_dropped_a_model(
    make_models: Callable[..., Models], db_url: str, tmp_path: Path
) -> None:
    """`history NAME` of a declared model showed none of its config changes,
    only runtime events: each config record that changed its declared
    definition has a row of it, with the record's revision, time, actor and
    reason, in revision order among the model's runtime rows; on the CLI,
    its table and --json too. The record is the first event of the deploy's
    write, so a read at its revision shows the model before the deploy: the
    table says where the write ends (only --json said it), and a read there
    shows what the deploy put in force."""
    base = spec("base")
    first = make_models(config_yaml(base))
    first.add(spec("chat"), by="alice", reason="try chat")  # 1: config, 2
    first.close()
    more_gpus = spec("base", profiles=(msgspec.structs.replace(base.profiles[0], gpus=2),))
    second = make_models(config_yaml(more_gpus))
    second.scale("chat", 1, 2, by="bob", reason="deploy 2")  # 3: config, 4
    second.close()
    third = make_models(config_yaml())
    third.set_owner("chat", "team:search", by="carol", reason="deploy 3")  # 5: config, 6
    third.add(spec("base", source="hf://org/base-v2"), by="dave")  # 7: at runtime now
    rows = third.history("base")
    assert [(r["revision"], r["by"], r["reason"], r["event"]) for r in rows] == [
        (1, "alice", "try chat", "Declared"),
        (3, "bob", "deploy 2", "Redeclared"),
        (5, "carol", "deploy 3", "Undeclared"),
        (7, "dave", "", "Added"),
    ]
    defined = as_json(base)
    assert (rows[0]["before"], rows[0]["after"], rows[0]["skipped"]) == (None, defined, None)
    assert rows[0]["changes"][0] == {"field": "name", "before": None, "after": "base"}
    assert rows[1]["changes"] == [{"field": "profiles[gpu].gpus", "before": 1, "after": 2}]
    assert (rows[2]["before"], rows[2]["after"]) == (rows[1]["after"], None)
    config_rows = {r["revision"]: r for r in third.audit(event_type="ConfigDeclared")}
    for row in rows[:3]:
        record = config_rows[row["revision"]]
        assert (row["time"], row["class_version"]) == (record["time"], record["class_version"])
        assert row["fields"] == {"fingerprint": record["fields"]["fingerprint"]}
    # The same query as the audit's of one model, and filtered as it is.
    assert third.audit(model="base") == rows
    assert third.history("base", event_type="Redeclared") == [rows[1]]
    assert [r["model"] for r in third.audit(event_type="Undeclared")] == ["base"]
    today = tmp_path / "today.yaml"
    today.write_text(config_yaml())
    printed = invoke(db_url, today, "history", "base", "--json")
    assert printed.exit_code == 0, printed.stderr
    assert json.loads(printed.stdout) == rows
    as_table = invoke(db_url, today, "history", "base")
    assert as_table.exit_code == 0, as_table.stderr
    lines = as_table.stdout.splitlines()
    assert [line.split()[3] for line in lines[1:] if line[:1].isdigit()] == [
        "Declared",
        "Redeclared",
        "Undeclared",
        "Added",
    ]
    assert "profiles[gpu].gpus: 1 → 2" in as_table.stdout
    for row in rows[:3]:
        assert row["write_end"] > row["revision"]  # the command's own events follow
        told = f"{row['event']} (the write ends at {row['write_end']})"
        assert [line for line in lines if f" {told} " in line], (told, as_table.stdout)
    assert "Added (" not in as_table.stdout  # a runtime row's write is its own

    def gpus_at(revision: int) -> int:
        at = ("--at", str(revision), "--declared-then")
        shown = invoke(db_url, today, "model", "show", "base", *at, "--json")
        assert shown.exit_code == 0, shown.stderr
        return int(json.loads(shown.stdout)["profiles"][0]["gpus"])

    redeclared = rows[1]
    assert (gpus_at(redeclared["revision"]), gpus_at(redeclared["write_end"])) == (1, 2)


def test_history_of_a_name_never_there_reads_no_config_record(
    make_models: Callable[..., Models],
) -> None:
    """`history` of a typo read every config record the log holds, to tell a
    model dropped from the config from one never there: 80 ms for 40 records
    of 2,000 models, on every typo, over HTTP too. It is an indexed read of
    the audit's rows now: no stored event's bytes are read to answer it."""
    for replicas in range(1, 4):  # each deploy a config of its own, recorded in the log
        node = make_models(config_yaml(spec("base", scaling=Scaling(1, replicas))))
        node.add(spec(f"chat-{replicas}"), by="alice")
        node.close()
    models = make_models(config_yaml())
    models.audit(limit=1)  # caught up: what follows is the query alone
    statements: list[str] = []

    def seen(*args: Any) -> None:
        statements.append(str(args[2]))

    sa.event.listen(models.store.engine, "before_cursor_execute", seen)
    try:
        with pytest.raises(ModelNotFound, match="was never in the log or the config"):
            models.history("chta")
        assert models.history("base", by="nobody") == []  # once declared: no error
    finally:
        sa.event.remove(models.store.engine, "before_cursor_execute", seen)
    assert statements
    assert not [s for s in statements if "state" in s], statements


@pytest.mark.parametrize(
    ("query", "revisions"),
    [
        # Revision 1 is the record of the declared config, by the first writer.
        ({}, SCRIPTED_ROWS),
        ({"by": "alice"}, [1, 1, 2, 4, 7]),
        ({"by": "bob"}, [3, 6]),
        ({"model": "embed"}, [4, 5, 7]),
        ({"model": "chat", "by": "carol"}, [8]),
        ({"event_type": "Added"}, [2, 4]),
        ({"event_type": "ConfigDeclared"}, [1]),
        ({"since": T0 + timedelta(minutes=3)}, [4, 5, 6, 7, 8]),
        ({"until": T0 + timedelta(minutes=3)}, [1, 1, 2, 3]),
        ({"since": T0 + timedelta(minutes=2), "until": T0 + timedelta(minutes=5)}, [3, 4, 5]),
        ({"limit": 2}, [7, 8]),
        ({"by": "alice", "limit": 2}, [4, 7]),
        # A time bound and a limit: the newest before the bound, oldest first.
        ({"until": T0 + timedelta(minutes=5), "limit": 2}, [4, 5]),
        ({"since": T0 + timedelta(minutes=3), "limit": 2}, [7, 8]),
        ({"since": T0 + timedelta(minutes=2), "until": T0 + timedelta(minutes=5), "limit": 1}, [5]),
        ({"since": T0 + timedelta(days=1), "limit": 3}, []),
        ({"model": "embed", "until": T0 + timedelta(minutes=6), "limit": 1}, [5]),
        ({"by": "nobody"}, []),
    ],
)
def test_audit_filters(models: Models, query: dict[str, Any], revisions: list[int]) -> None:
    assert [r["revision"] for r in models.audit(**query)] == revisions


def test_a_time_window_holds_every_row_of_each_event_in_it(
    make_models: Callable[..., Models], clock: Clock
) -> None:
    """A config record has a row of its own and one of each model it
    declares, all at its revision: a window ending after it holds them all,
    however many more rows than revisions there are."""
    models = make_models(config_yaml(spec("a"), spec("b"), spec("c")))
    clock.minutes = 1
    models.add(spec("chat"), by="alice")  # 1: the config record, 2
    clock.minutes = 2
    models.scale("chat", 1, 2, by="alice")  # 3
    window: ChangeFilters = {"since": T0, "until": T0 + timedelta(minutes=2)}
    assert [(r["revision"], r["model"]) for r in models.audit(**window)] == [
        (1, None),
        (1, "a"),
        (1, "b"),
        (1, "c"),
        (2, "chat"),
    ]
    assert [r["revision"] for r in models.history("c", **window)] == [1]


@pytest.mark.parametrize(
    ("moment", "text"),
    [
        pytest.param(datetime(2026, 11, 30, 12, tzinfo=UTC), "2026-11-30T12:00:00Z", id="utc"),
        pytest.param(datetime(2026, 11, 30, 12), "2026-11-30T12:00:00Z", id="naive-is-utc"),
        pytest.param(
            datetime(2026, 11, 30, 13, tzinfo=timezone(timedelta(hours=1))),
            "2026-11-30T12:00:00Z",
            id="offset-in-utc",
        ),
        # UTC cannot hold it: written in its own zone rather than refused.
        pytest.param(
            datetime(9999, 12, 31, 23, 30, tzinfo=timezone(timedelta(hours=-1))),
            "9999-12-31T23:30:00-01:00",
            id="past-utc",
        ),
    ],
)
def test_every_time_is_written_in_utc_unless_utc_cannot_hold_it(
    moment: datetime, text: str
) -> None:
    assert utc_text(moment) == text


def test_the_audit_keeps_whether_times_went_up_with_revisions(models: Models, clock: Clock) -> None:
    """While they do, a time bound is looked up as a revision bound. Commands
    follow the log's time, but not one more than an hour ahead of their clock
    (a bad clock): the next event is stamped earlier than it, which ends the
    order for good, and the bounds are then applied row by row."""
    view, latest = models._audit.view, stored_time(T0 + timedelta(minutes=7))
    models.audit(limit=1)
    assert view.resume_from(models.name).times == TimeOrder(True, latest)
    clock.minutes = 200
    models.scale("chat", 1, 2, by="bob")
    clock.minutes = 3
    models.scale("chat", 1, 3, by="bob")
    assert [r["revision"] for r in models.audit(until=T0 + timedelta(minutes=4))] == [
        1,
        1,
        2,
        3,
        4,
        10,
    ]
    assert view.resume_from(models.name).times == TimeOrder(False, latest + timedelta(minutes=193))
    assert [r["revision"] for r in models.audit(since=T0 + timedelta(minutes=7))] == [8, 9]


def test_a_command_is_stamped_after_the_last_one_this_clock_has_since_fallen_behind(
    models: Models, clock: Clock
) -> None:
    """Time in the log never runs backwards: a command after one this process
    wrote follows its time where the clock has since stepped back (by less
    than clocks drift apart)."""
    clock.minutes = 30
    first = models.scale("chat", 1, 2, by="bob").revision
    clock.minutes = 29
    second = models.scale("chat", 1, 3, by="bob").revision
    times = {
        e["revision"]: datetime.fromisoformat(e["time"]) for e in models.log_events(after=first - 1)
    }
    assert times[second] > times[first]


# Far enough apart for a command not to follow the log's time back (see above).
minutes = st.integers(min_value=0, max_value=12).map(lambda m: m * 20)
bound = st.none() | st.integers(min_value=0, max_value=250).map(lambda m: T0 + timedelta(minutes=m))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    writes=st.lists(st.tuples(minutes, st.booleans()), min_size=1, max_size=10),
    queries=st.lists(
        st.tuples(bound, bound, st.none() | st.integers(1, 4), st.sampled_from([None, "u0"])),
        min_size=1,
        max_size=6,
    ),
)
def test_time_bounds_answer_as_a_scan_of_every_row_would_whatever_the_clocks_did(
    tmp_path_factory: pytest.TempPathFactory,
    config: Path,
    clock: Clock,
    writes: list[tuple[int, bool]],
    queries: list[tuple[datetime | None, datetime | None, int | None, str | None]],
) -> None:
    db = f"sqlite:///{tmp_path_factory.mktemp('clocks') / 'catalog.db'}"
    models = open_service(db, config)
    try:
        models.add(EMBED, by="u1")
        for i, (minute, query_after) in enumerate(writes):
            clock.minutes = minute
            models.scale("embed", 1, 2 + i, by=f"u{i % 2}")
            if query_after:  # a catch-up between writes: the order is carried over
                models.audit(limit=1)
        every_row = models.audit()
        for since, until, limit, by in queries:
            if since is not None and until is not None and since >= until:
                # A window that holds no time is refused (check_filters).
                with pytest.raises(InputError, match="is not before until"):
                    models.audit(since=since, until=until, limit=limit, by=by)
                continue
            matches = [
                row
                for row in every_row
                if (since is None or datetime.fromisoformat(row["time"]) >= since)
                and (until is None or datetime.fromisoformat(row["time"]) < until)
                and by in (None, row["by"])
            ]
            expected = matches[-limit:] if limit else matches
            assert models.audit(since=since, until=until, limit=limit, by=by) == expected
    finally:
        models.close()


def test_audit_rows_are_the_history_rows(models: Models) -> None:
    everything = models.audit()
    assert [r for r in everything if r["model"] == "chat"] == models.history("chat")
    assert [(r["revision"], r["model"], r["by"], r["event"]) for r in everything] == [
        (1, None, "alice", "ConfigDeclared"),
        (1, "base", "alice", "Declared"),
        (2, "chat", "alice", "Added"),
        (3, "chat", "bob", "Scaled"),
        (4, "embed", "alice", "Added"),
        (5, "embed", "carol", "ResourcesSet"),
        (6, "chat", "bob", "ClassSet"),
        (7, "embed", "alice", "Removed"),
        (8, "chat", "carol", "OwnerSet"),
    ]


def test_a_config_records_row_says_what_it_changed_of_the_declared_layer(
    models: Models, db: str, config: Path
) -> None:
    """A record of a changed config was "(no change)" in the audit, whatever
    it changed of the declared models (design audit). Its changes are to the
    declared layer, against the record before it; the first's, all it declares."""
    (first,) = models.audit(event_type="ConfigDeclared")
    assert [(c["field"], c["before"]) for c in first["changes"]] == [
        ("engines", []),
        ("models[base]", None),
    ]
    assert first["changes"][0]["after"] == sorted(DEFAULT_ENGINES)
    assert first["changes"][1]["after"]["source"] == "hf://org/base"
    config.write_text(
        "engines: [vllm, tgi]\n"
        + CONFIG.replace("gpus: 1,", "gpus: 2,")
        + "  - {name: rerank, engine: tgi, source: hf://org/rerank,"
        " profiles: [{name: cpu, min_memory_gb: 4}]}\n"
    )
    deployed = open_service(db, config)  # a node that has not read the first record
    recorded = deployed.scale("chat", 0, 2, by="dave").revision - 1
    *_, row = deployed.audit(event_type="ConfigDeclared")
    assert (row["revision"], row["by"]) == (recorded, "dave")
    assert [(c["field"], c["before"]) for c in row["changes"]] == [
        ("engines", sorted(DEFAULT_ENGINES)),
        ("models[base].profiles[a100].gpus", 1),
        ("models[rerank]", None),
    ]
    assert [c["after"] for c in row["changes"][:2]] == [["tgi", "vllm"], 2]
    assert row["changes"][2]["after"]["engine"] == "tgi"
    assert row in models.audit()  # as any node reads it
    # Engines are a set: the same in another order is no change (review).
    config.write_text(
        config.read_text().replace("[vllm, tgi]", "[tgi, vllm]").replace("gpus: 2,", "gpus: 4,")
    )
    reordered = open_service(db, config)
    reordered.scale("chat", 0, 3, by="dave")
    *_, row = reordered.audit(event_type="ConfigDeclared")
    assert [c["field"] for c in row["changes"]] == ["models[base].profiles[a100].gpus"]
    reordered.close()
    deployed.close()


def append_directly(models: Models, *stored: StoredEvent) -> None:
    """What another writer (a rollback, an older or newer version) put in the log."""
    with models.store.write() as conn:
        models.store.insert_events(list(stored), conn=conn)


def test_rollback_rows_name_the_revision_rolled_back_to(models: Models, clock: Clock) -> None:
    compensating = Model.Scaled(
        originator_id=model_id("chat"),
        originator_version=5,
        timestamp=T0 + timedelta(hours=1),
        model="chat",
        by="frank",
        reason="roll back to 1",
        rollback_to=1,
        scaling=Scaling(min=1, max=1),
    )
    append_directly(models, models.mapper.to_stored_event(compensating))
    (row,) = models.audit(model="chat", limit=1)
    assert (row["revision"], row["by"], row["event"], row["rollback_to"]) == (
        9,
        "frank",
        "Scaled",
        1,
    )
    assert row["changes"] == [
        {"field": "scaling.min", "before": 0, "after": 1},
        {"field": "scaling.max", "before": 3, "after": 1},
    ]


def test_large_answers_bring_on_no_collection_of_the_oldest_generation(
    models: Models, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A collection of the oldest generation rescans everything the process
    # holds (20 ms with 10,000 models loaded). Rows that young collections
    # promoted there as they were fetched, or that were counted as aged once
    # decoded, brought one on every few answers of 10,000 rows: their slowest reads.
    monkeypatch.setattr(collector, "FULL_COLLECTION_AFTER", 100_000)
    monkeypatch.setattr(collector, "_aged", 0)
    scalings = 8_000
    append_directly(
        models,
        *(
            models.mapper.to_stored_event(
                Model.Scaled(
                    originator_id=model_id("chat"),
                    originator_version=version,
                    timestamp=T0 + timedelta(hours=1, seconds=version),
                    model="chat",
                    by="frank",
                    scaling=Scaling(min=version % 2, max=2),
                )
            )
            for version in range(5, 5 + scalings)
        ),
    )
    assert models.audit(model="chat", limit=1)[0]["revision"] == 8 + scalings  # caught up
    gc.collect()
    with collections_seen() as seen:
        answer = models.audit_json(model="chat")
    assert not {1, 2} & set(seen)  # no young collection ran often enough to promote
    with collections_seen() as seen:
        answers = [models.audit(model="chat") for _ in range(2)]
    assert 2 not in seen
    assert [len(rows) for rows in answers] == [len(msgspec.json.decode(answer))] * 2
    assert len(answers[0]) == 4 + scalings


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "table"])
def test_the_cli_writes_a_large_audit_out_a_row_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_json: bool
) -> None:
    """Each row holds the definitions before and after it, a model with a
    hundred adapters twice over: 200,000 rows took the CLI 1.4 GB for --json
    and 1.3 GB for the table, every row decoded and held, then the whole
    array dumped as one string (these 1,000 rows, 12 MB of JSON: 80 MB and
    67 MB beyond their stored views). Beyond the views the rows are read
    from, it then held a row at a time, or a piece of 64 as JSON (and the
    table's cells, their text): 2 MB and 0.4 MB. Nor are the views all held
    now (13 MB in all, then; 7.2 MB): what the spool keeps in memory, and a
    page of them as it is written to it (three times: read, joined and
    encoded)."""
    db = f"sqlite:///{tmp_path}/catalog.db"
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db})
    adapters = [{"name": f"ad{i}", "source": f"s3://adapters/wide/ad{i}"} for i in range(100)]
    models.add(model_spec("wide", adapters=adapters), by="ops")
    models.apply_changes([commands.scale("wide", 0, 1 + i % 7) for i in range(1_000)], by="ops")
    stored = len(models.audit_json())  # caught up: what the views hold
    expected = json_line(models.audit()) + "\n"
    models.close()
    out = CountedOutput()
    monkeypatch.setattr(sys, "stdout", out)
    tracemalloc.start()
    try:
        cli.main(["--db", db, *(["--json"] if as_json else []), "audit"], standalone_mode=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    answer = len(expected)
    assert answer > 10_000_000
    if as_json:
        assert (out.size, out.digest.hexdigest()) == (
            answer,
            hashlib.sha256(expected.encode()).hexdigest(),
        )
    else:
        assert out.lines > 1_000  # the header, a line a scaling, several for the add
    spooled = catalog_es.audit.SPOOLED_IN_MEMORY + 3 * catalog_es.audit.SPOOLED_PAGE_BYTES
    assert peak < spooled + answer / 8 < stored, (peak, stored, answer)


def test_skipped_events_are_in_the_audit_with_why(models: Models) -> None:
    unreadable = StoredEvent(
        originator_id=model_id("chat"),
        originator_version=5,
        topic="catalog_es.model:Model.Renamed",
        state=b'{"model": "chat", "by": "zed"}',
    )
    over_declared = Model.Added(
        originator_id=model_id("base"),
        originator_version=1,
        timestamp=T0 + timedelta(hours=1),
        model="base",
        by="mallory",
        spec=CHAT,
    )
    append_directly(models, unreadable, models.mapper.to_stored_event(over_declared))
    eight, nine = models.audit(limit=2)
    assert (eight["revision"], eight["model"], eight["event"], eight["by"]) == (
        9,
        "chat",
        "Renamed",
        None,
    )
    assert eight["skipped"] == "unknown event type 'catalog_es.model:Model.Renamed'"
    assert eight["changes"] == [] and eight["before"] == eight["after"]
    assert (nine["revision"], nine["model"], nine["by"], nine["changes"]) == (
        10,
        "base",
        "mallory",
        [],
    )
    assert "declared in configuration" in nine["skipped"]
    assert nine["before"] == nine["after"] != CHAT_DEFINITION
    # The chain is intact: skipped is not tampered.
    report = models.verify()
    assert report["ok"] is True
    assert [s["revision"] for s in report["skipped"]] == [9, 10]


def test_a_record_that_cannot_say_its_model_is_in_its_streams_history(models: Models) -> None:
    """`history` and `audit --model` filter on each record's model: one whose
    bytes could not be read at all named none, so it was missing from its
    model's history while `log --model` showed it. Its stream says whose it
    is; a stream no readable record ever named stays nameless."""
    chat, nameless = (
        StoredEvent(
            originator_id=model_id(name),
            originator_version=version,
            topic="catalog_es.model:Model.Scaled",
            state=b"\x00\xff{{not json",
        )
        for name, version in (("chat", 5), ("never-named", 1))
    )
    append_directly(models, chat, nameless)
    skipped = [(r["revision"], r["model"]) for r in models.audit() if r["skipped"]]
    assert skipped == [(9, "chat"), (10, "")]
    (row,) = [r for r in models.history("chat") if r["skipped"]]
    assert (row["revision"], row["skipped"]) == (
        9,
        "corrupt payload: JSON is malformed: invalid character (byte 0)",
    )
    assert row["before"] == row["after"] and row["changes"] == []
    assert row in models.audit(model="chat")
    # The log asked for the model's events says whose it is too.
    assert [e["model"] for e in models.log_events(model="chat") if e["revision"] == 9] == ["chat"]


def test_a_log_of_a_name_no_model_can_have_is_refused_when_asked(models: Models) -> None:
    """Not once its first event is: a query returns its answer's refusal (review)."""
    with pytest.raises(InvalidModel, match="is not a valid name"):
        models.log_events(model="bad name!")


# -- refusals ----------------------------------------------------------------------


def test_refused_commands_are_kept_apart_with_who_what_and_why(models: Models) -> None:
    refusals = models.refusals()
    assert [
        (r["id"], r["time"], r["by"], r["model"], r["event"], r["reason"]) for r in refusals
    ] == [
        (1, at(8), "dave", "base", "Added", "laptop"),
        (2, at(9), "erin", "chat", "Scaled", ""),
        (3, at(10), "dave", "broken", "Added", ""),
        (4, at(11), "bob", "chat", "ClassSet", "vip"),
    ]
    why = [r["refusal"] for r in refusals]
    assert why[0].startswith("model 'base' is declared in configuration")
    assert why[1].startswith("the log is at revision 8, not 1")
    assert why[2] == "the engine cannot load s3://broken/w: no safetensors found"
    assert why[3].startswith("model 'chat': class: 'gold' is not one of")
    assert refusals[0]["fields"]["spec"]["source"] == "hf://org/base"
    assert refusals[3]["fields"] == {"class": "gold"}
    # A scale's bounds are worked out in the write; refused before, it keeps what was asked.
    assert refusals[1]["fields"] == {"max": 5}
    assert [r["id"] for r in models.refusals(by="dave")] == [1, 3]
    assert [r["id"] for r in models.refusals(model="chat", limit=1)] == [4]
    assert [r["id"] for r in models.refusals(since=T0 + timedelta(minutes=10))] == [3, 4]
    assert [r["id"] for r in models.refusals(until=T0 + timedelta(minutes=11), limit=2)] == [2, 3]


def test_a_refusal_of_text_no_codec_could_read_is_kept_written_out(models: Models) -> None:
    """A lone surrogate (an argument from a file name no codec could read) has
    no UTF-8: the refusal is kept with it as Python writes it."""
    with pytest.raises(Refused, match="is not org/name"):
        models.set_source("chat", "hf://org/x", Origin(repository="org/\udcff"), by="bob")
    kept = models.refusals()[-1]
    assert (kept["by"], kept["event"]) == ("bob", "SourceSet")
    assert kept["fields"]["origin"]["repository"] == "org/\\udcff"


def test_a_refusals_fields_are_kept_up_to_their_bound_and_written_out_whole(
    models: Models,
) -> None:
    """Fields of exactly MAX_KEPT_FIELDS bytes are kept, as the note of those
    omitted says ("at most N are kept"); a byte more, omitted. Fields holding
    a lone surrogate are kept written out, every value beside it as it was."""
    bound = catalog_es.audit.MAX_KEPT_FIELDS
    empty_note = len(msgspec.json.encode({"note": ""}))
    refusal = Refused("no")
    for extra, kept in ((0, True), (1, False)):
        fields = {"note": "x" * (bound - empty_note + extra)}
        models.record_refusal("Scaled", "chat", "ops", "", fields, refusal)
        expected = (
            fields
            if kept
            else {"omitted": f"{bound + 1} bytes of fields; at most {bound} are kept"}
        )
        assert models.refusals()[-1]["fields"] == expected
    unreadable = {"names": ["a\udcff", "b"], "count": 2, "spec": {"gpus": [1]}}
    models.record_refusal("Scaled", "chat", "ops", "", unreadable, refusal)
    assert models.refusals()[-1]["fields"] == {
        "names": ["a\\udcff", "b"],
        "count": 2,
        "spec": {"gpus": [1]},
    }


def test_a_limit_keeps_the_last_matches_in_log_order_when_clocks_disagree(
    models: Models, clock: Clock
) -> None:
    # Refusals take each node's own clock: one running behind stamps a later
    # refusal earlier. "The N most recent" are the last N of the unlimited
    # answer, in the order they were recorded, not the N latest clock readings.
    clock.minutes = 5
    refuse(lambda: models.set_class("chat", "gold", by="frank"), InvalidModel)
    since = T0 + timedelta(minutes=1)
    assert [r["id"] for r in models.refusals(since=since)] == [1, 2, 3, 4, 5]
    assert [r["id"] for r in models.refusals(since=since, limit=2)] == [4, 5]
    assert [r["id"] for r in models.refusals(until=T0 + timedelta(minutes=10), limit=2)] == [2, 5]


def test_a_refusal_writes_nothing_to_the_log(models: Models) -> None:
    catalog, refused = models.list_models(), len(models.refusals())
    refuse(lambda: models.set_owner("chat", "someone", by="eve"), InvalidModel)
    assert event_count(models) == 8
    assert models.list_models() == catalog
    assert len(models.refusals()) == refused + 1


def test_an_answer_of_at_most_rows_is_answered_and_one_of_more_refused(models: Models) -> None:
    """``at_most`` (the HTTP API's page) bounds an answer asked without a
    limit: one of that many rows is answered, one of a row more is refused
    saying how to page; a limit is a bound of its own, answered as asked."""

    def too_many(at_most: int, narrowing: str) -> str:
        return (
            f"more than {at_most} rows match: give limit (the most recent N, at most "
            f"{at_most}), or narrow them with {narrowing}"
        )

    everything, history, refusals = models.audit(), models.history("chat"), models.refusals()
    assert (len(everything), len(history), len(refusals)) == (9, 4, 4)
    assert json.loads(models.audit_json(at_most=9)) == everything
    with pytest.raises(InputError) as refused:
        models.audit_json(at_most=8)
    assert str(refused.value) == too_many(8, "model, by, type, since or until")
    assert json.loads(models.audit_json(at_most=1, limit=3)) == everything[-3:]
    assert json.loads(models.history_json("chat", at_most=4)) == history
    with pytest.raises(InputError) as refused:
        models.history_json("chat", at_most=3)
    assert str(refused.value) == too_many(3, "by, type, since or until")
    assert json.loads(models.history_json("chat", at_most=1, limit=2)) == history[-2:]
    assert models.refusals(at_most=4) == refusals
    with pytest.raises(InputError) as refused:
        models.refusals(at_most=3)
    assert str(refused.value) == too_many(3, "model, by, type, since or until")
    assert models.refusals(at_most=1, limit=2) == refusals[-2:]


# -- the read model ----------------------------------------------------------------


def all_answers(models: Models) -> dict[str, Any]:
    return {
        "audit": models.audit(),
        "chat": models.history("chat"),
        "embed": models.history("embed"),
        "alice": models.audit(by="alice"),
    }


def test_rebuilt_audit_tables_give_the_same_answers(models: Models, db: str, config: Path) -> None:
    first = all_answers(models)
    models.rebuild_audit()
    assert all_answers(models) == first
    with models.store.engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE {table_of(models)}"))
        conn.execute(sa.text(f"DROP TABLE {tracking_table.name}"))
    again = open_service(db, config)
    assert all_answers(again) == first
    again.close()


def test_audit_tables_of_an_earlier_layout_are_left_to_the_nodes_of_that_version(
    db: str, config: Path, clock: Clock
) -> None:
    """Up to 0.1.0 a row kept its JSON in four columns, in tables of the same
    names without the layout. A node of that version may still share the
    database: its tables are neither read nor touched."""
    engine = create_engine(db)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE TABLE audit_changes (revision INTEGER PRIMARY KEY, time DATETIME,"
                " actor TEXT, model TEXT NOT NULL, event VARCHAR(64) NOT NULL,"
                " class_version INTEGER, reason TEXT, rollback_to INTEGER, skipped TEXT,"
                " fields TEXT NOT NULL, before TEXT, after TEXT, changes TEXT NOT NULL)"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO audit_changes (revision, actor, model, event, fields, changes)"
                " VALUES (1, 'mallory', 'chat', 'Removed', '{}', '[]')"
            )
        )
    models = open_service(db, config)
    script(models, clock)
    assert [r["revision"] for r in models.audit()] == SCRIPTED_ROWS
    assert models.audit(by="mallory") == []
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT actor FROM audit_changes")).scalars().all() == [
            "mallory"
        ]
    models.close()
    engine.dispose()


def test_audit_tables_built_before_the_declared_rows_are_built_anew_with_them(
    scripted: Models, db_url: str, config: Path
) -> None:
    """A database whose audit was built by a release before a config record
    had a row of each model it changed (layout 8) answered `history` of a
    declared model from those tables, without them. The rows are of a new
    layout, in tables of its own: the first query builds them from the log,
    with no step of the operator's, and leaves the old ones to their nodes."""
    scripted.audit(limit=1)
    layout = projections.audit.LAYOUT
    now, before = table_of(scripted), table_of(scripted).replace(f"_v{layout}_", "_v8_")
    tracking = tracking_table.name
    run_sql(
        scripted,
        # What a node of layout 8 left: the same rows, but the models' own of the config's.
        f"CREATE TABLE old_rows AS SELECT * FROM {now} WHERE place = 0 OR event = 'Removed'",
        "CREATE TABLE old_tracking AS SELECT * FROM " + tracking,
        f"DROP TABLE {now}",
        f"DROP TABLE {tracking}",
        f"ALTER TABLE old_rows RENAME TO {before}",
        f"ALTER TABLE old_tracking RENAME TO {tracking.replace(f'_v{layout}', '_v8')}",
    )
    upgraded = open_service(db_url, config)
    try:
        assert [(r["revision"], r["event"]) for r in upgraded.history("base")] == [(1, "Declared")]
        assert len(upgraded.audit()) == len(SCRIPTED_ROWS)
    finally:
        upgraded.close()
    with scripted.store.engine.connect() as conn:
        kept = conn.execute(sa.text(f"SELECT count(*) FROM {before}")).scalar()
    assert kept == len(SCRIPTED_ROWS) - 1


def test_the_audit_resumes_from_its_position_and_never_applies_twice(
    models: Models, db: str, config: Path
) -> None:
    assert len(models.audit()) == len(SCRIPTED_ROWS)
    models.scale("chat", 1, 2, by="bob")
    other = open_service(db, config)  # another process: resumes from the tracked position
    assert [r["revision"] for r in other.audit(by="bob")] == [3, 6, 9]
    models.set_owner("chat", "", by="carol")
    assert [r["revision"] for r in models.audit()] == [*SCRIPTED_ROWS, 9, 10]
    assert [r["revision"] for r in other.audit(limit=1)] == [10]
    view = AuditView(models.store, models.declared.fingerprint)
    assert view.max_tracking_id(models.name) == 10
    with pytest.raises(sa.exc.IntegrityError):
        view.insert_tracking(Tracking(models.name, 10))
    with models.store.read() as conn:
        count = conn.execute(
            sa.select(sa.func.count()).select_from(view.table(models.name))
        ).scalar()
    assert count == len(SCRIPTED_ROWS) + 2
    # One past it is written, vouching for no log: the rows are made again.
    view.insert_tracking(Tracking(models.name, 11))
    assert view.max_tracking_id(models.name) == 11
    assert [r["revision"] for r in models.audit()] == [*SCRIPTED_ROWS, 9, 10]
    assert view.max_tracking_id(models.name) == 10
    other.close()


def test_a_new_process_catches_up_from_a_snapshot_with_the_rows_a_full_replay_writes(
    db: str, config: Path, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each CLI query is a new process, whose catalog starts empty: after any
    write it replayed the whole log to write one row (200,000 events, 1.4 s).
    It starts from the newest snapshot at or before the view's position, and
    its rows, a config record's among them, are those a full replay writes."""
    monkeypatch.setattr(projections.audit, "SNAPSHOT_AFTER", 1, raising=False)
    env = {"CATALOG_ES_DB": db}
    writer = Models(
        load_config(str(config)),
        pre_add_check=RefuseBrokenWeights(),
        env=env,
        snapshot_interval=2,
    )
    script(writer, clock)
    writer.audit()  # the view at the head, 8
    other_config = tmp_path / "other.yaml"
    other_config.write_text(CONFIG.replace("min_memory_gb: 32", "min_memory_gb: 48"))
    other = Models(load_config(str(other_config)), env=env)
    other.scale("chat", 1, 2, by="erin")  # records its config first
    writer.set_class("chat", "", by="bob")  # and this one records the first again
    # A record whose bytes say no model, in the stream of one with no event
    # since the snapshot: its stream names it (it went unnamed; review).
    unreadable = StoredEvent(model_id("embed"), 4, "catalog_es.model:Model.Scaled", b"\x00{")
    append_directly(writer, unreadable)
    writer.close()
    other.close()
    decoded: list[int] = []

    def counted(topic: str, state: bytes) -> Any:
        decoded.append(1)
        return read_record(topic, state)

    monkeypatch.setattr(projections.audit, "read_record", counted)
    fresh = open_service(db, config)
    rows = fresh.audit()
    assert len(decoded) < 9  # from the snapshot at 8 (or 6), not from the first event
    assert [(r["revision"], r["event"], r["model"]) for r in rows[-7:]] == [
        (9, "ConfigDeclared", None),
        (9, "Redeclared", "base"),
        (10, "Scaled", "chat"),
        (11, "ConfigDeclared", None),
        (11, "Redeclared", "base"),
        (12, "ClassSet", "chat"),
        (13, "Scaled", "embed"),
    ]
    # Each config record's rows say what it changed of the one before it.
    memory = "models[base].profiles[a100].min_memory_gb"
    assert [(c["field"], c["before"], c["after"]) for c in rows[-7]["changes"]] == [
        (memory, 32, 48)
    ]
    assert [(c["field"], c["before"], c["after"]) for c in rows[-6]["changes"]] == [
        ("profiles[a100].min_memory_gb", 32, 48)
    ]
    assert [(c["field"], c["before"], c["after"]) for c in rows[-3]["changes"]] == [
        ("profiles[a100].min_memory_gb", 48, 32)
    ]
    fresh.rebuild_audit()  # a replay from the first event
    assert fresh.audit() == rows
    fresh.close()


def rows_sent_by(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """The rows the server sends the reads of ``module.name(conn, ...)``, as
    they are made (on PostgreSQL: psycopg reads every row asked for)."""
    sent: list[int] = []
    read = getattr(module, name)

    def rows_sent(*args: Any) -> None:
        sent.append(args[1].rowcount)  # the cursor's: the rows the server sent

    def counted(conn: Connection, *args: Any) -> Any:
        sa.event.listen(conn, "after_cursor_execute", rows_sent)
        try:
            return read(conn, *args)
        finally:
            sa.event.remove(conn, "after_cursor_execute", rows_sent)

    monkeypatch.setattr(module, name, counted)
    return sent


def test_a_catch_up_from_a_snapshot_reads_the_config_record_it_follows_on_from_alone(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new process catching up from a snapshot takes the config record the
    view follows on from, the newest at the snapshot: PostgreSQL sent it every
    record back to the first (psycopg reads every row asked for), each holding
    every declared definition, 160 ms of each history or audit read after a
    write among 30 records of 2,000 models (review)."""
    monkeypatch.setattr(projections.audit, "SNAPSHOT_AFTER", 1, raising=False)
    env = {"CATALOG_ES_DB": pg_url}
    configs = [
        DeclaredConfig(models=(model_spec("d", scaling={"min": 1, "max": n}),))
        for n in range(1, 13)
    ]
    for declared in configs:  # each records its config, then adds
        writer = Models(declared, env=env, snapshot_interval=2)
        writer.add(model_spec("r"), by="x")
        writer.close()
    writer = Models(configs[-1], env=env)
    writer.audit()  # the view at the head
    writer.scale("r", 1, 2, by="x")
    writer.close()
    sent = rows_sent_by(monkeypatch, projections.audit, "_declaration_at")
    fresh = Models(configs[-1], env=env)
    assert [(r["event"], r["model"]) for r in fresh.audit()[-3:]] == [
        ("Redeclared", "d"),
        ("Added", "r"),
        ("Scaled", "r"),
    ]
    assert sent  # it started from a snapshot
    assert sum(sent) <= 2  # of 12 records
    fresh.close()


def test_a_config_records_write_end_is_found_reading_the_write_alone(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config record's rows say where its write ends, found as the audit
    is built by reading the log on past the record: a thousand rows at a
    time, each with its whole state, where a write is mostly an event or
    two. With two nodes' configs taking turns, every write records one, and
    each record read the next thousand events, configs among them: building
    the audit of 800 events took 2.5 times as long (review)."""
    env = {"CATALOG_ES_DB": pg_url}
    writer = Models(DeclaredConfig(models=(model_spec("d"),)), env=env)
    recorded = writer.add(model_spec("r"), by="x").revision - 1  # the config first
    for n in range(2, 42):
        writer.scale("r", 1, n, by="x")
    writer.close()
    sent = rows_sent_by(monkeypatch, pointintime, "write_end")
    reader = Models(DeclaredConfig(models=(model_spec("d"),)), env=env)
    (row,) = reader.audit(event_type="ConfigDeclared")
    assert (row["revision"], row["write_end"]) == (recorded, recorded + 1)
    assert sum(sent) <= 3  # the record's row, its write's other event and the next's
    reader.close()


def test_a_catch_up_writes_its_rows_before_they_hold_too_much(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each row holds the model before and after: rows were written 5,000 at
    a time whatever their size, and 5,000 changes to a model of 800 KB took a
    catch-up to 3.3 GB (hostile test)."""
    monkeypatch.setattr(projections.audit, "BATCH_BYTES", 1 << 20, raising=False)
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db})
    adapters = tuple(Adapter(f"ad{i}", f"s3://adapters/wide/ad{i}") for i in range(500))
    models.add(msgspec.structs.replace(CHAT, name="wide", fallbacks=(), adapters=adapters), by="a")
    models.apply_changes([commands.scale("wide", 0, 1 + i % 5) for i in range(400)], by="a")
    tracemalloc.start()
    try:
        assert [r["revision"] for r in models.audit(limit=1)] == [models.revision]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    written = len(models.audit_json())
    assert written > 20_000_000
    assert peak < written / 4, (peak, written)
    models.close()


@pytest.mark.parametrize("log_goes_on", [False, True], ids=["to-its-end", "in-part"])
def test_a_catch_up_that_another_process_overtook_writes_only_what_is_left(
    models: Models, db: str, config: Path, monkeypatch: pytest.MonkeyPatch, log_goes_on: bool
) -> None:
    other = open_service(db, config)
    assert len(other.audit()) == len(models.audit()) == len(SCRIPTED_ROWS)
    models.scale("chat", 1, 2, by="bob")
    models.scale("chat", 1, 3, by="bob")
    view = other._audit.view
    real_resume_from = view.resume_from

    def resume_from(name: str) -> Tracked:
        # ``other`` reads position 8; ``models`` then writes rows 9 and 10
        # before ``other`` writes the rows it staged: all of them, or all
        # but 11 when the log goes on meanwhile.
        tracked = real_resume_from(name)
        models.audit()
        if log_goes_on:
            models.scale("chat", 1, 4, by="bob")
        return tracked

    monkeypatch.setattr(view, "resume_from", resume_from)
    head = 11 if log_goes_on else 10
    assert [r["revision"] for r in other.audit(limit=3)] == [head - 2, head - 1, head]
    monkeypatch.undo()
    models.scale("chat", 1, 5, by="bob")
    assert other.audit() == models.audit()
    assert [r["revision"] for r in models.audit()] == [*SCRIPTED_ROWS, *range(9, head + 2)]
    other.close()


def test_a_catch_up_racing_a_rebuild_leaves_no_gap(
    models: Models, db: str, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``other`` reads its position, then ``models`` drops the tables to rebuild
    them: the rows ``other`` staged follow a position that is gone, and are not
    written over the gap; it starts again from the rebuilt rows."""
    other = open_service(db, config)
    assert len(other.audit()) == len(SCRIPTED_ROWS)
    models.scale("chat", 1, 2, by="bob")
    view = other._audit.view
    real_resume_from = view.resume_from
    resets: list[None] = []

    def resume_from(name: str) -> Tracked:
        tracked = real_resume_from(name)
        if not resets:
            models._audit.view.reset(models.name)
            resets.append(None)
        return tracked

    monkeypatch.setattr(view, "resume_from", resume_from)
    assert [r["revision"] for r in other.audit()] == [*SCRIPTED_ROWS, 9]
    monkeypatch.undo()
    models.rebuild_audit()
    assert [r["revision"] for r in open_service(db, config).audit()] == [*SCRIPTED_ROWS, 9]
    other.close()


def test_a_catch_up_across_a_rebuild_keeps_nothing_of_the_old_tables(
    models: Models, db: str, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``other`` reads position 8 of the old tables; ``models`` rebuilds them past
    it. The position alone cannot tell, the generation does: ``other`` goes on
    from the new tables, not with the time order it read from the old ones."""
    other = open_service(db, config)
    assert len(other.audit()) == len(SCRIPTED_ROWS)
    with models.store.engine.begin() as conn:  # a wrong order, for the rebuild to right
        conn.execute(sa.update(tracking_table).values(times_in_order=False))
    models.scale("chat", 1, 2, by="bob")
    view = other._audit.view
    real_resume_from = view.resume_from

    def resume_from(name: str) -> Tracked:
        monkeypatch.undo()
        tracked = real_resume_from(name)
        models.rebuild_audit()
        models.scale("chat", 1, 3, by="bob")
        return tracked

    monkeypatch.setattr(view, "resume_from", resume_from)
    assert [r["revision"] for r in other.audit()] == [*SCRIPTED_ROWS, 9, 10]
    assert view.resume_from(models.name).times.in_order is True
    other.close()


def test_a_catch_up_kept_waiting_keeps_its_rows_for_the_next_query(
    models: Models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy database refuses the write: the rows it staged wait for the next
    query, which goes on from where this one stopped rather than replaying the
    whole log again."""
    assert len(models.audit()) == len(SCRIPTED_ROWS)
    models.scale("chat", 1, 2, by="bob")
    view = models._audit.view

    def busy(*args: Any) -> str:
        raise StorageBusy("the database stayed locked by another writer for 1 s")

    monkeypatch.setattr(view, "record", busy)
    refuse(models.audit, StorageBusy)
    monkeypatch.undo()
    real_scan, scans = models.store.scan_hashed, []

    def scan(conn: Any, after: int) -> Any:
        scans.append(after)
        return real_scan(conn, after=after)

    monkeypatch.setattr(models.store, "scan_hashed", scan)
    assert [r["revision"] for r in models.audit()] == [*SCRIPTED_ROWS, 9]
    assert scans == [9]


@contextmanager
def audit_lock_held_by_another_query(
    models: Models, wait_left: float | None = None
) -> Iterator[None]:
    """The audit's lock held by another thread for the block, as a query
    catching up holds it, with ``wait_left`` of its bounded wait."""
    audit = models._audit
    taken, done = threading.Event(), threading.Event()

    def catching_up() -> None:
        with audit.lock:
            audit._wait = wait_left
            taken.set()
            done.wait(10)

    holder = threading.Thread(target=catching_up)
    holder.start()
    try:
        assert taken.wait(10)
        yield
    finally:
        done.set()
        holder.join(10)


def test_a_query_on_tables_at_the_head_does_not_wait_for_another_querys_catch_up(
    models: Models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forty audit queries at once each took the lock to catch up, found
    nothing to catch up, and waited for one another in turn: four were
    refused when the lock wait ran out (hostile test). Tables already at the
    head of the log are read without the lock; behind it, a query waits."""
    assert len(models.audit()) == len(SCRIPTED_ROWS)
    monkeypatch.setattr(models.store, "lock_wait", 0.2)
    with audit_lock_held_by_another_query(models):
        assert [r["revision"] for r in models.audit()] == SCRIPTED_ROWS
        models.scale("chat", 1, 2, by="bob")
        refuse(models.audit, StorageBusy)
    assert [r["revision"] for r in models.audit()] == [*SCRIPTED_ROWS, 9]


def test_a_query_refused_the_audit_lock_leaves_the_holders_wait_alone(
    models: Models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What is left of the bounded wait of the query holding the lock is
    its own: one refused the lock cleared it, and the holder then waited
    the whole bound again for the database (review)."""
    monkeypatch.setattr(models.store, "lock_wait", 0.2)
    with audit_lock_held_by_another_query(models, wait_left=0.42):
        refuse(models.audit, StorageBusy)
        assert models._audit._wait == 0.42


def test_a_catch_up_that_fails_otherwise_starts_again_from_the_view(
    models: Models, db: str, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert len(models.audit()) == len(SCRIPTED_ROWS)
    models.scale("chat", 1, 2, by="bob")
    monkeypatch.setattr(models._audit, "_stage", lambda *args: 1 / 0)
    refuse(models.audit, ZeroDivisionError)
    monkeypatch.undo()
    assert [r["revision"] for r in models.audit()] == [*SCRIPTED_ROWS, 9]
    fresh = open_service(db, config)
    assert models.audit() == fresh.audit()
    fresh.close()


def test_an_answer_is_not_read_from_tables_another_process_is_rebuilding(
    models: Models, db: str, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between this process's catch-up and its read, another drops the tables
    to rebuild them: the read sees it, and catches up again, rather than
    answering the few rows (or none) written so far."""
    other = open_service(db, config)
    real_catch_up = models._audit.catch_up

    def catch_up(*args: Any) -> None:
        monkeypatch.undo()
        real_catch_up(*args)
        other._audit.view.reset(other.name)

    monkeypatch.setattr(models._audit, "catch_up", catch_up)
    assert [r["revision"] for r in models.audit()] == SCRIPTED_ROWS
    assert models.history("embed")[0]["revision"] == 4
    other.close()


def declaring(tmp_path: Path, *names: str) -> Path:
    """A config declaring ``base`` and the models named, each a config of its own."""
    path = tmp_path / f"declares-{'-'.join(names)}.yaml"
    model = (
        "  - {{name: {0}, engine: vllm, source: hf://x/{0}, profiles: [{{name: g, gpus: 1}}]}}\n"
    )
    path.write_text(CONFIG + "".join(model.format(name) for name in names))
    return path


def audit_tables(db: str) -> set[str]:
    engine = create_engine(db)
    try:
        return {n for n in sa.inspect(engine).get_table_names() if ANY_CHANGES_TABLE.fullmatch(n)}
    finally:
        engine.dispose()


def table_of(node: Models) -> str:
    return changes_table_for(node.name, node.declared.fingerprint).name


def rebuilt_audit(db: str, declared: Path) -> list[dict[str, Any]]:
    """The audit over ``declared``, its rows made anew from the log."""
    fresh = open_service(db, declared)
    fresh.rebuild_audit()
    answer = fresh.audit()
    fresh.close()
    return answer


@pytest.fixture
def scripted(db_url: str, config: Path, clock: Clock) -> Iterator[Models]:
    """:func:`models`, on either backend."""
    yield from scripted_service(db_url, config, clock)


def age_uses(models: Models, hours: int) -> None:
    """Every audit table's last use ``hours`` further back, as the database keeps it."""
    t = tracking_table.c
    if models.store.dialect == "sqlite":
        older: sa.ColumnElement[Any] = sa.func.strftime(
            "%Y-%m-%d %H:%M:%f", t.used_at, f"-{hours * 3600} seconds"
        )
    else:
        older = t.used_at - sa.literal_column(f"interval '{hours} hours'")
    with models.store.engine.begin() as conn:
        conn.execute(sa.update(tracking_table).values(used_at=older))


def test_nodes_declaring_different_configs_each_keep_their_own_audit(
    scripted: Models, db_url: str, config: Path, tmp_path: Path
) -> None:
    """A rolling deploy: nodes on the old config and the new one share the
    database. Each answers from rows of its own config, at the head, with no
    catch-up over the other's. (One set of tables had them take turns
    rebuilding it over their own config: most queries failed under load.)"""
    declares_chat = declaring(tmp_path, "chat")
    other = open_service(db_url, declares_chat)
    assert scripted.history("chat")[0]["skipped"] is None
    assert all("declared in configuration" in r["skipped"] for r in other.history("chat"))
    for replicas in (2, 3, 4):
        scripted.scale("chat", 1, replicas, by="bob")
        other.audit()
        scripted.audit()
        for node in (scripted, other):
            assert node._audit.view.current_changes({}, node.name, listed) is not None
    assert scripted.audit() == rebuilt_audit(db_url, config)
    assert other.audit() == rebuilt_audit(db_url, declares_chat)
    assert audit_tables(db_url) == {table_of(scripted), table_of(other)}
    other.close()


def test_tables_in_use_are_kept_however_many_configs_use_them(
    scripted: Models, db_url: str, tmp_path: Path
) -> None:
    """Four configs at once, each used within the hour: none is dropped for
    another's, and none is made again (each table's generation holds)."""
    nodes = [scripted] + [open_service(db_url, declaring(tmp_path, f"d{i}")) for i in (1, 2, 3)]
    for node in nodes:
        node.audit()
    generations = [node._audit.view.resume_from(node.name).generation for node in nodes]
    for replicas in (2, 3):
        scripted.scale("chat", 1, replicas, by="bob")
        for node in nodes:
            node.audit()
    assert [node._audit.view.resume_from(node.name).generation for node in nodes] == generations
    assert audit_tables(db_url) == {table_of(node) for node in nodes}
    for node in nodes[1:]:
        node.close()


def test_tables_of_configs_no_longer_in_use_go_beyond_the_three_used_last(
    scripted: Models, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each edit of the config would otherwise leave a copy of the audit behind
    for good. A config whose table went builds it again when next asked."""
    monkeypatch.setattr(projections.audit, "USED_EVERY", 0.0)
    nodes = [scripted] + [open_service(db_url, declaring(tmp_path, f"d{i}")) for i in (1, 2, 3)]
    first, second, third, fourth = nodes
    answers = [node.audit() for node in nodes[:3]]
    assert CONFIGS_KEPT == 3 and len(audit_tables(db_url)) == 3
    copy = f"{table_of(second)}_before_incident"  # an operator's: not the audit's to drop
    with scripted.store.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {copy} AS SELECT * FROM {table_of(second)}"))

    def kept() -> set[str]:
        t = tracking_table.c
        with scripted.store.read() as conn:
            rows = set(conn.execute(sa.select(t.application_name, t.config)).tuples())
        assert audit_tables(db_url) == {changes_table_for(*row).name for row in rows}
        return {config for _, config in rows}

    for node in (second, first, third):  # used in this order, an hour or more ago
        age_uses(node, 2)
        node.audit()
    age_uses(scripted, 2)
    fourth.audit()
    assert kept() == {n.declared.fingerprint for n in (first, third, fourth)}
    assert second.audit() == rebuilt_audit(db_url, declaring(tmp_path, "d1"))
    assert second.audit() == answers[1]
    assert kept() == {n.declared.fingerprint for n in (second, third, fourth)}
    with scripted.store.read() as conn:
        assert conn.execute(sa.text(f"SELECT count(*) FROM {copy}")).scalar() == len(answers[1])
    for node in nodes[1:]:
        node.close()


def test_a_node_that_only_reads_still_uses_its_table(
    scripted: Models, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quiet log: the production node writes nothing, and only answers. Three
    configs made since (operators' one-off runs with an edited file) do not
    take its table, as long as it keeps reading."""
    monkeypatch.setattr(projections.audit, "USED_EVERY", 0.0)
    scripted.audit()
    generation = scripted._audit.view.resume_from(scripted.name).generation
    for i in (1, 2, 3):
        age_uses(scripted, 2)
        scripted.audit()  # read at the head: no row written, only its use
        one_off = open_service(db_url, declaring(tmp_path, f"d{i}"))
        one_off.audit()
        one_off.close()
    assert table_of(scripted) in audit_tables(db_url)
    assert scripted._audit.view.resume_from(scripted.name).generation == generation


def test_an_audit_table_dropped_by_hand_is_made_again(scripted: Models, db_url: str) -> None:
    """Its tracking row left behind: the next query makes the table again,
    rather than failing on every query until a rebuild."""
    expected = scripted.audit()
    with scripted.store.engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE {table_of(scripted)}"))
    assert scripted.audit() == expected
    assert scripted.history("chat") == [r for r in expected if r["model"] == "chat"]


def test_an_audit_table_made_again_asks_for_the_tables_once(
    scripted: Models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made under the audit's lock, the table is looked for (with the tracking
    table) in one statement: SQLAlchemy's inspector asked three times in a
    row, a round trip each on PostgreSQL (4 ms on a first read). Found
    missing by the read, it is not read again before the lock (on
    PostgreSQL a failed lock of the table, four round trips each)."""
    expected = scripted.audit()
    with scripted.store.engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE {table_of(scripted)}"))
    statements: list[str] = []

    def seen(*args: Any) -> None:
        statements.append(str(args[2]))

    real_locked, real_read = scripted.store.locked, scripted.store.read

    @contextmanager
    def locked(*args: Any, **kwargs: Any) -> Iterator[Connection]:
        with real_locked(*args, **kwargs) as conn:
            statements.append("locked")
            yield conn

    @contextmanager
    def read() -> Iterator[Connection]:
        with real_read() as conn:
            statements.append("read")
            yield conn

    monkeypatch.setattr(scripted.store, "locked", locked)
    monkeypatch.setattr(scripted.store, "read", read)
    sa.event.listen(scripted.store.engine, "before_cursor_execute", seen)
    try:
        assert scripted.audit() == expected
    finally:
        sa.event.remove(scripted.store.engine, "before_cursor_execute", seen)
    made = next(i for i, s in enumerate(statements) if "CREATE TABLE" in s)
    start = max(i for i, s in enumerate(statements[:made]) if s == "locked")
    lookups = [s for s in statements[start:made] if any(w in s for w in LOOKUPS)]
    assert len(lookups) == 1, lookups
    assert statements[:start].count("read") == 1, statements[:start]


# What a statement asking which tables there are says, on either backend.
LOOKUPS = ("pg_class", "sqlite_master", "table_info")


def log_rows(models: Models) -> dict[sa.Table, list[dict[str, Any]]]:
    """The rows of the log's tables, as a backup keeps them."""
    with models.store.read() as conn:
        return {
            table: [dict(row._mapping) for row in conn.execute(sa.select(table))]
            for table in (events_table, head_table, streams_table)
        }


def restore_log(models: Models, backup: dict[sa.Table, list[dict[str, Any]]]) -> None:
    """The log's tables as ``backup`` kept them, the audit's left as they are."""
    with models.store.engine.begin() as conn:
        for table, rows in backup.items():
            conn.execute(sa.delete(table))
            conn.execute(sa.insert(table), rows)


def audit_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "catalog_es.audit"]


def test_a_long_catch_up_says_what_it_is_doing_once(
    models: Models, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first audit query after an upgrade (a new layout) replays the whole
    log, about a minute a million events, and said nothing (hostile test)."""
    monkeypatch.setattr(projections.audit, "TOLD_FROM", 8)
    models.audit()
    models.audit()
    assert audit_warnings(caplog) == [
        "making the audit's rows from 8 events of the log, once (about a minute a million)"
    ]


def test_audit_rows_of_events_a_restored_log_no_longer_holds_are_made_again(
    scripted: Models, db_url: str, config: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The log's tables restored from a backup, then written to: the audit
    answered the changes the log had lost, and none of those it took in their
    place (at the same revisions on SQLite, whose head came back to the
    position). The log's hash there tells: the rows are made again, once,
    with a warning."""
    backup = log_rows(scripted)
    scripted.scale("chat", 1, 2, by="bob")
    scripted.scale("chat", 1, 3, by="bob")
    assert [r["revision"] for r in scripted.audit(by="bob")] == [3, 6, 9, 10]
    restore_log(scripted, backup)
    other = open_service(db_url, config)
    other.scale("chat", 1, 4, by="erin")
    other.scale("chat", 1, 5, by="erin")
    rows = scripted.audit()
    assert rows == other.audit() == rebuilt_audit(db_url, config)
    assert [r["by"] for r in rows[len(SCRIPTED_ROWS) :]] == ["erin", "erin"]
    assert scripted.audit(by="bob") == [r for r in rows if r["by"] == "bob"]
    assert [r["revision"] for r in rows if r["by"] == "bob"] == [3, 6]
    [warning] = audit_warnings(caplog)
    assert warning == (
        "audit rows made again from the log: the log holds other events at revision 10 "
        "than they were built from (a failover, or a restored backup?); catalog-es verify "
        "says whether the log was edited"
    )
    other.close()


def test_audit_rows_another_process_made_again_meanwhile_are_kept(
    scripted: Models,
    db_url: str,
    config: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two processes read the position the restored log no longer vouches
    for; one makes the rows again up to the head before the other acts on
    its read. The other dropped those rows and made them all again (about
    50 s a million events), a second warning, and a moved table for every
    reader: it checks what is there now, and keeps it."""
    backup = log_rows(scripted)
    scripted.scale("chat", 1, 2, by="bob")
    scripted.scale("chat", 1, 3, by="bob")
    scripted.audit()
    restore_log(scripted, backup)
    a, b = open_service(db_url, config), open_service(db_url, config)
    a.scale("chat", 1, 4, by="erin")
    view = a._audit.view
    real_resume_from = view.resume_from

    def resume_from(name: str) -> Tracked:
        monkeypatch.undo()
        stale = real_resume_from(name)
        b.audit()  # made again, up to the head
        return stale

    monkeypatch.setattr(view, "resume_from", resume_from)
    rows = a.audit()
    assert a._audit.generation == b._audit.generation  # b's table, not one made after
    assert len(audit_warnings(caplog)) == 1
    assert rows == b.audit() == rebuilt_audit(db_url, config)
    assert [r["by"] for r in rows[len(SCRIPTED_ROWS) :]] == ["erin"]
    a.close()
    b.close()


def test_an_audit_catch_up_reads_the_log_in_one_statement_more_than_its_replay(
    db: str,
) -> None:
    """Checked against the log, the rows cost one statement in the replay's
    transaction (the hash at the position, and the head): the rows' end is
    read with the position, and the hash the new position is written with is
    the replay's (each was a statement more, a round trip on PostgreSQL). A
    query with nothing to catch up reads the log once."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db})
    models.add(model_spec("a"), by="setup")
    models.audit()
    statements: list[str] = []

    def traced(driver: Any, *_: Any) -> None:
        driver.set_trace_callback(statements.append)

    sa.event.listen(models.store.engine, "checkout", traced)
    with models.store._writer_connection() as writer:
        traced(writer.connection.driver_connection)
    models.scale("a", 0, 2, by="ops")
    del statements[:]
    assert [r["revision"] for r in models.audit()] == [1, 2]
    table = table_of(models)
    log_reads = [s.split(" WHERE ")[0] for s in statements if "FROM catalog_events" in s]
    assert log_reads == [
        "SELECT revision, hash FROM catalog_events",  # whether to catch up
        "SELECT revision, hash FROM catalog_events",  # in the replay's transaction
        "SELECT revision, topic, state, hash FROM catalog_events",
    ], statements
    assert not [s for s in statements if s.startswith(f"SELECT max({table}")], statements
    del statements[:]
    models.audit()
    assert len([s for s in statements if "FROM catalog_events" in s]) == 1, statements
    models.close()


def test_an_audit_position_past_the_head_of_the_log_is_made_again(
    scripted: Models, caplog: pytest.LogCaptureFixture
) -> None:
    """A position past the head (a log that lost its last events, or an edit
    by hand): the changes written after it were never answered."""
    scripted.audit()
    with scripted.store.engine.begin() as conn:
        conn.execute(sa.update(tracking_table).values(notification_id=99))
    scripted.scale("chat", 1, 2, by="bob")
    assert scripted.history("chat")[-1]["revision"] == scripted.revision == 9
    [warning] = audit_warnings(caplog)
    assert warning == (
        "audit rows made again from the log: the log ends at revision 9, before their "
        "position (99): it lost events (a failover, or a restored backup?); catalog-es "
        "verify says whether the log was edited"
    )


@pytest.mark.parametrize(
    "position",
    [
        {"notification_id": 0},
        {"notification_id": -1},
        # As a table just made has it: nothing the log could contradict.
        {"notification_id": 0, "log_hash": None},
    ],
)
def test_an_audit_position_set_behind_its_rows_has_them_made_again(
    scripted: Models, position: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The usual way to have a read model made again: every query failed on
    the rows it would write twice (``UNIQUE constraint failed``) until
    ``catalog-es replay``."""
    expected = scripted.audit()
    with scripted.store.engine.begin() as conn:
        conn.execute(sa.update(tracking_table).values(**position))
    assert scripted.audit() == expected
    scripted.scale("chat", 1, 2, by="bob")
    assert scripted.history("chat", by="bob")[-1]["revision"] == 9
    [warning] = audit_warnings(caplog)
    assert warning == (
        f"audit rows made again from the log: their position (revision "
        f"{position['notification_id']}) is behind them (up to 8)"
    )


def test_a_page_holds_its_bytes_whatever_rows_came_before_it(db_url: str) -> None:
    """Pages were sized from the rows of the page before: one small row, then
    large ones, made a second page of 50 rows of 100,000 characters where
    1 MiB was asked (of thousands, had there been as many; review). Each
    page now ends once it holds the bytes asked for."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    views = sa.Table(
        "probe_views",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("view", sa.Text),
    )
    rows = ["x" * 300] + ["y" * 100_000] * 50
    with models.store.engine.begin() as conn:
        views.create(conn)
        conn.execute(sa.insert(views), [{"id": i, "view": view} for i, view in enumerate(rows)])
    with models.store.read() as conn:
        query = sa.select(views.c.view).order_by(views.c.id)
        pages = [list(page) for page in models.store.column_pages(conn, query, 250_000)]
    assert [view for page in pages for view in page] == rows
    # Each ends with the row that brings it to 250,000 characters.
    assert [len(page) for page in pages] == [4, *[3] * 15, 2]
    models.close()


@pytest.mark.parametrize(
    "query",
    [
        ["history", "chat"],
        ["history", "chat", "--json"],
        ["audit"],
        ["audit", "--json"],
        ["audit", "--json", "--limit", "7"],
    ],
    ids=" ".join,
)
@pytest.mark.parametrize(
    "page_bytes", [catalog_es.audit.SPOOLED_PAGE_BYTES, 1], ids=["pages of 1 MiB", "a row a page"]
)
def test_an_audit_row_damaged_by_hand_is_one_error_naming_replay(
    scripted: Models,
    db_url: str,
    config: Path,
    query: list[str],
    page_bytes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its view no longer JSON: an unexpected DecodeError. The rows are a
    read model, which replay makes again. The row is well into the answer,
    the rows before it sound: ``--json``, written as it is decoded, had
    written ``[`` (and the rows before it, past a piece) by then. Read and
    checked a page at a time, the row is past the first page (the last
    rows' page, read first, of a limit), which the spool holds by then."""
    monkeypatch.setattr(catalog_es.audit, "SPOOLED_PAGE_BYTES", page_bytes)
    expected = scripted.history("chat")
    table = sa.table(table_of(scripted), sa.column("revision"), sa.column("view"))
    with scripted.store.engine.begin() as conn:
        conn.execute(sa.update(table).where(table.c.revision == 6).values(view='{"revision": 6,'))
    result = invoke(db_url, config, *query)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == (
        "error: an audit row cannot be read (Input data was truncated): the audit's rows "
        "were damaged; run catalog-es replay to make them again from the log\n"
    )
    assert invoke(db_url, config, "replay").exit_code == 0
    assert scripted.history("chat") == expected


@pytest.mark.parametrize(
    "filters",
    [{}, {"limit": 5}, {"by": "bob"}, {"by": "alice", "limit": 3}],
    ids=str,
)
def test_an_answer_read_a_page_at_a_time_is_the_one_read_at_once(
    scripted: Models,
    db_url: str,
    config: Path,
    filters: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the CLI writes out, read a page at a time into a spool (a page of
    one row, then of two or more; a file past the first of them), is the
    answer read whole: in order, a limit's last rows too, which are read
    newest first."""
    assert scripted.audit()  # the rows are made
    table = sa.table(table_of(scripted), sa.column("size"))
    with scripted.store.read() as conn:
        largest = conn.execute(sa.select(sa.func.max(table.c.size))).scalar_one()
    monkeypatch.setattr(catalog_es.audit, "SPOOLED_PAGE_BYTES", 2 * largest)
    monkeypatch.setattr(catalog_es.audit, "SPOOLED_IN_MEMORY", 1000)
    options = [text for key, value in filters.items() for text in (f"--{key}", str(value))]
    audit = invoke(db_url, config, "audit", "--json", *options)
    assert json.loads(audit.stdout) == scripted.audit(**filters)
    history = invoke(db_url, config, "history", "chat", "--json", *options)
    assert json.loads(history.stdout) == scripted.history("chat", **filters)


def test_an_audit_row_made_a_blob_by_hand_is_the_same_error(
    models: Models, db: str, config: Path
) -> None:
    """SQLite keeps a blob in a text column: a decode read it as if it were
    text, and the HTTP API's join of the rows failed on it as a bug."""
    assert models.audit()  # the rows are made
    table = sa.table(table_of(models), sa.column("revision"), sa.column("view"))
    with models.store.engine.begin() as conn:
        conn.execute(sa.update(table).where(table.c.revision == 6).values(view=b"{}"))
    result = invoke(db, config, "audit", "--json")
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == (
        "error: an audit row cannot be read (a bytes, not text): the audit's rows "
        "were damaged; run catalog-es replay to make them again from the log\n"
    )


def test_a_postgresql_read_never_answers_from_a_table_made_anew_under_it(
    pg_url: str, config: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another node on the same config makes the table anew (a rebuild) as a
    read goes on. Read after the read's snapshot was taken, the new table
    showed it none of its rows: an answer of ``[]``, without an error. Locked
    first, the table is not dropped until the read ends. (A SQLite read is one
    snapshot, tables and all.)"""
    models = open_service(pg_url, config)
    script(models, clock)
    expected = models.audit()
    other = open_service(pg_url, config)
    view = models._audit.view
    real_tracked = view._tracked
    rebuilt = threading.Event()

    def tracked(conn: Connection, name: str) -> Tracked | None:
        monkeypatch.undo()
        found = real_tracked(conn, name)

        def rebuild() -> None:
            other.rebuild_audit()
            rebuilt.set()

        threading.Thread(target=rebuild).start()
        rebuilt.wait(1)  # it waits for this read to end, or is done by now
        return found

    monkeypatch.setattr(view, "_tracked", tracked)
    assert models.audit() == expected
    assert rebuilt.wait(10)
    assert models.audit() == expected
    other.close()
    models.close()


def test_a_catch_up_of_many_rows_in_few_revisions_refreshes_the_statistics(
    db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config record writes a row for each model it changed: a catch-up
    counted revisions, so 20 deploys of 2,000 models (40,040 rows in 22
    revisions) left SQLite without statistics, and a query on a model and an
    actor read every row of the actor (20 ms, where 0.5 with them). It counts
    the rows it writes."""
    monkeypatch.setattr(projections.audit, "ANALYZE_AFTER", 50)
    config = tmp_path / "many.yaml"
    config.write_text(config_yaml(*(spec(f"m{i}") for i in range(60))))
    models = open_service(db, config)
    models.add(EMBED, by="alice")  # records the config: 62 rows in 2 revisions
    assert len(models.audit(model="m7", by="alice")) == 1
    with models.store.engine.connect() as conn:
        plan = conn.execute(
            sa.text(
                f"EXPLAIN QUERY PLAN SELECT revision FROM {table_of(models)}"
                " WHERE model = 'm7' AND actor = 'alice' ORDER BY revision, place"
            )
        ).all()
    assert f"{table_of(models)}_model" in " ".join(str(step[-1]) for step in plan)
    models.close()


def test_an_audit_table_gone_before_its_statistics_are_refreshed_is_no_error(
    scripted: Models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between a large catch-up and its ANALYZE, the table is made anew or
    dropped (by hand, a rebuild): the statistics are skipped, and the answer
    is read from the table made again (it was "the database could not be
    used", a 500 over HTTP)."""
    expected = scripted.audit()
    view = scripted._audit.view
    real_analyze = view.analyze

    def analyze(name: str) -> None:
        monkeypatch.undo()
        with scripted.store.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE {table_of(scripted)}"))
        real_analyze(name)

    monkeypatch.setattr(projections.audit, "ANALYZE_AFTER", 1)
    monkeypatch.setattr(view, "analyze", analyze)
    view.reset(scripted.name)  # its rows to write again: a catch-up that analyzes
    assert scripted.audit() == expected


def test_a_postgresql_audit_read_waits_for_its_table_no_longer_than_a_write_would(
    pg_url: str, config: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process stalled holding the table (a drop not yet committed) kept a
    read waiting until the server ended that session, a minute later. The
    read is refused as busy after the lock wait. (SQLite reads take no lock.)"""
    monkeypatch.setenv("CATALOG_ES_LOCK_WAIT", "1")
    for models in scripted_service(pg_url, config, clock):
        expected = models.audit()
        engine = create_engine(pg_url)
        with engine.connect() as holder, holder.begin():
            holder.execute(sa.text(f"LOCK TABLE {table_of(models)} IN ACCESS EXCLUSIVE MODE"))
            started = time.monotonic()
            refuse(models.audit, StorageBusy)
            assert time.monotonic() - started < 3
        assert models.audit() == expected
        engine.dispose()


@pytest.fixture
def unused(
    pg_url: str, config: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Models]:
    """A PostgreSQL node whose audit table the next config's would drop: one
    config kept, and this one's unused for two hours."""
    monkeypatch.setattr(projections.audit, "CONFIGS_KEPT", 1)
    for models in scripted_service(pg_url, config, clock):
        models.audit()
        age_uses(models, 2)
        yield models


def test_a_drop_that_waits_for_a_read_gives_way_at_once(
    unused: Models, pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A table no longer in use that a read still holds: its drop waited the
    whole lock wait (10 s), holding the lock every other process's audit
    rows wait for. It gives way after a moment, and is tried again later."""
    engine = create_engine(pg_url)
    with engine.connect() as reader, reader.begin():
        reader.execute(sa.text(f"LOCK TABLE {table_of(unused)} IN ACCESS SHARE MODE"))
        other = open_service(pg_url, declaring(tmp_path, "chat"))
        started = time.monotonic()
        other.audit()
        assert time.monotonic() - started < 3
    assert "no longer in use left: canceling statement due to lock timeout" in caplog.text
    assert table_of(unused) in audit_tables(pg_url)
    engine.dispose()
    other.close()


def test_a_node_whose_role_may_not_drop_an_unused_configs_table_still_answers(
    unused: Models,
    pg_url: str,
    pg_admin: sa.Engine,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Dropping unused configs' tables is housekeeping: a table another role
    owns is left, with a warning, and the query is answered."""
    url = sa.make_url(pg_url)
    schema = schema_of(pg_url)
    role = f"node_{schema}"
    with pg_admin.connect() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN"))
        conn.execute(sa.text(f"GRANT USAGE, CREATE ON SCHEMA {schema} TO {role}"))
        conn.execute(
            sa.text(
                f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}"
            )
        )
    try:
        declares_chat = declaring(tmp_path, "chat")
        other = open_service(url.set(username=role).render_as_string(False), declares_chat)
        answer = other.audit()
        other.close()
        assert "no longer in use left: must be owner of table" in caplog.text
        assert table_of(unused) in audit_tables(pg_url)
        # Its position is left with it: its node goes on from there, not from nothing.
        assert unused._audit.view.max_tracking_id(unused.name) == SCRIPTED_ROWS[-1]
        assert answer == rebuilt_audit(pg_url, declares_chat)
    finally:
        with pg_admin.connect() as conn:
            conn.execute(sa.text(f"DROP OWNED BY {role}"))
            conn.execute(sa.text(f"DROP ROLE {role}"))


# -- the hash chain and verify -----------------------------------------------------


def test_an_untouched_log_verifies(models: Models) -> None:
    report = models.verify()
    with models.store.read() as conn:
        last_hash = conn.execute(
            sa.select(events_table.c.hash).order_by(events_table.c.revision.desc()).limit(1)
        ).scalar()
    assert report == {
        "ok": True,
        "events": 8,
        "head": {"revision": 8, "hash": last_hash},
        "broken": None,
        "skipped": [],
        "snapshots_since_break": [],
    }


def test_each_hash_is_the_one_docs_audit_md_says_how_to_compute(models: Models) -> None:
    """Anyone can check the chain without this code, and every log written
    so far was chained so: each hash covers the bytes docs/audit.md lists,
    64 "0"s before the first event. Computed here from the document, not
    from :func:`~catalog_es.chain.link`, which verify shares with the write."""
    with models.store.read() as conn:
        rows = conn.execute(sa.select(events_table).order_by(events_table.c.revision)).all()
    assert len(rows) == 8
    previous = "0" * 64
    for row in rows:
        topic = row.topic.encode("utf-8")
        documented = hashlib.sha256(
            previous.encode("ascii")
            + uuid.UUID(str(row.originator_id)).bytes
            + row.originator_version.to_bytes(8, "big")
            + len(topic).to_bytes(4, "big")
            + topic
            + row.state
        ).hexdigest()
        assert row.hash == documented, row.revision
        previous = documented


def test_an_empty_log_verifies(db: str, config: Path) -> None:
    empty = open_service(db, config)
    assert empty.verify() == {
        "ok": True,
        "events": 0,
        "head": None,
        "broken": None,
        "skipped": [],
        "snapshots_since_break": [],
    }
    empty.close()


def run_sql(models: Models, *statements: str) -> None:
    with models.store.engine.begin() as conn:
        for statement in statements:
            conn.execute(sa.text(statement))


def stored_log(models: Models) -> list[tuple[Any, ...]]:
    """Every row of the log, its streams and its head, as stored."""
    with models.store.engine.connect() as conn:
        return [
            tuple(row)
            for table in (
                "catalog_events ORDER BY revision",
                "catalog_streams ORDER BY originator_id",
                "catalog_head",
            )
            for row in conn.execute(sa.text(f"SELECT * FROM {table}"))
        ]


def swap(models: Models, first: int, second: int) -> None:
    """Swap two stored events, hash and all, keeping their revisions."""
    t = events_table.c
    columns = [t.originator_id, t.originator_version, t.topic, t.state, t.hash, t.stream_previous]
    with models.store.engine.begin() as conn:
        rows = {
            r.revision: r._asdict()
            for r in conn.execute(
                sa.select(t.revision, *columns).where(t.revision.in_([first, second]))
            )
        }
        conn.execute(sa.delete(events_table).where(t.revision.in_([first, second])))
        conn.execute(
            sa.insert(events_table),
            [{**rows[second], "revision": first}, {**rows[first], "revision": second}],
        )


def rewrite_last_with_its_hash(models: Models) -> None:
    """Alter the last event and recompute its own hash: only the head can tell."""
    t = events_table.c
    with models.store.engine.begin() as conn:
        previous = conn.execute(sa.select(t.hash).where(t.revision == 7)).scalar_one()
        last = conn.execute(sa.select(events_table).where(t.revision == 8)).one()
        state = last.state.replace(b"team:search", b"team:mallory")
        conn.execute(
            sa.update(events_table)
            .where(t.revision == 8)
            .values(
                state=state,
                hash=link(previous, last.originator_id, last.originator_version, last.topic, state),
            )
        )


def skip_a_version(models: Models) -> None:
    """Raise the last event's version, rehashed, with the head and its
    stream's row to match: only the versions' order can tell."""
    t = events_table.c
    with models.store.engine.begin() as conn:
        previous = conn.execute(sa.select(t.hash).where(t.revision == 7)).scalar_one()
        last = conn.execute(sa.select(events_table).where(t.revision == 8)).one()
        version = last.originator_version + 1
        rehashed = link(previous, last.originator_id, version, last.topic, last.state)
        conn.execute(
            sa.update(events_table)
            .where(t.revision == 8)
            .values(originator_version=version, hash=rehashed)
        )
        conn.execute(sa.update(head_table).values(hash=rehashed))
        conn.execute(
            sa.update(streams_table).where(streams_table.c.revision == 8).values(version=version)
        )


def file_in_another_stream(models: Models) -> None:
    """A copy of chat's last event appended through the write path, but to
    embed's stream: the chain and the streams hold, only the payload tells."""
    t = events_table.c
    with models.store.write() as conn:
        last = conn.execute(sa.select(t.topic, t.state).where(t.revision == 8)).one()
        embed = model_id("embed")
        version = models.store.stream_version(conn, embed) + 1
        models.store.insert_events(
            [StoredEvent(embed, version, last.topic, bytes(last.state))], conn=conn
        )


TAMPERING: dict[str, tuple[Callable[[Models], None], int, str]] = {
    "an event filed in another model's stream": (
        file_in_another_stream,
        9,
        f"but it is stored as version 4 of stream {model_id('embed')}: edited by hand",
    ),
    "a version skipped, everything rehashed to match": (
        skip_a_version,
        8,
        "its model's versions skip or repeat one there",
    ),
    "one event's bytes edited": (
        lambda m: run_sql(
            m,
            "UPDATE catalog_events SET state = replace(state, 'save GPUs', 'save CPUs') "
            "WHERE revision = 3",
        ),
        3,
        "does not match its hash",
    ),
    "one event's model edited": (
        lambda m: run_sql(m, "UPDATE catalog_events SET topic = topic || ' ' WHERE revision = 5"),
        5,
        "does not match its hash",
    ),
    "one event deleted": (
        lambda m: run_sql(m, "DELETE FROM catalog_events WHERE revision = 4"),
        4,
        "revision 4 is missing",
    ),
    "the first event deleted": (
        lambda m: run_sql(m, "DELETE FROM catalog_events WHERE revision = 1"),
        1,
        "revision 1 is missing",
    ),
    "two events deleted": (
        lambda m: run_sql(m, "DELETE FROM catalog_events WHERE revision IN (3, 4)"),
        3,
        "revisions 3..4 are missing",
    ),
    "the last event deleted": (
        lambda m: run_sql(m, "DELETE FROM catalog_events WHERE revision = 8"),
        8,
        "the last events were deleted",
    ),
    "the last events deleted and the head moved back": (
        lambda m: run_sql(
            m,
            "DELETE FROM catalog_events WHERE revision >= 7",
            "UPDATE catalog_head SET revision = 6",
        ),
        6,
        "the head's hash does not match this revision's: the event or the head record was "
        "rewritten, or events after it were deleted and the head moved back",
    ),
    "the head moved back over events still there": (
        lambda m: run_sql(
            m,
            "UPDATE catalog_head SET revision = 7,"
            " hash = (SELECT hash FROM catalog_events WHERE revision = 7)",
        ),
        8,
        "the head is at revision 7: the events after it were not written through the log's "
        "write path",
    ),
    "two events swapped": (lambda m: swap(m, 3, 4), 3, "does not match its hash"),
    "the last event rewritten and rehashed": (
        rewrite_last_with_its_hash,
        8,
        "the head's hash does not match",
    ),
    "the head deleted": (
        lambda m: run_sql(m, "DELETE FROM catalog_head"),
        9,
        "the head record (catalog_head) is missing",
    ),
    "one event's version made a fraction": (
        lambda m: run_sql(
            m,
            "UPDATE catalog_events SET originator_version = originator_version + 0.5"
            " WHERE revision = 6",
        ),
        6,
        "does not match its hash",
    ),
    "a row put before the first revision": (
        lambda m: run_sql(
            m,
            "INSERT INTO catalog_events (revision, originator_id, originator_version, topic,"
            " state, hash, stream_previous) SELECT -1, originator_id, 99, topic, state, hash, 0"
            " FROM catalog_events WHERE revision = 2",
        ),
        -1,
        "does not match its hash",
    ),
    "an event's link to its model's event before it": (
        lambda m: run_sql(
            m, "UPDATE catalog_events SET stream_previous = stream_previous + 1 WHERE revision = 6"
        ),
        6,
        "its link to its model's event before it (stream_previous) is",
    ),
    "a model's last version in catalog_streams": (
        lambda m: run_sql(
            m,
            "UPDATE catalog_streams SET version = version + 1"
            " WHERE revision = (SELECT max(revision) FROM catalog_streams)",
        ),
        8,
        "but its last event is version",
    ),
    "a row in catalog_streams for a model with no events": (
        lambda m: run_sql(
            m,
            "INSERT INTO catalog_streams (originator_id, version, revision)"
            f" VALUES ('{model_id('ghost').hex}', 1, 5)",
        ),
        5,
        f"catalog_streams records stream {model_id('ghost').hex} as at version 1 at revision "
        "5, but its last event is none",
    ),
    "a model's row in catalog_streams deleted": (
        lambda m: run_sql(
            m,
            "DELETE FROM catalog_streams"
            " WHERE revision = (SELECT max(revision) FROM catalog_streams)",
        ),
        8,
        "as at none, but its last event is version",
    ),
    "the head's revision made text": (
        lambda m: run_sql(m, "UPDATE catalog_head SET revision = 'eight'"),
        9,
        "the head record (catalog_head) is damaged (its revision is 'eight', not a whole number)",
    ),
    "the head's hash made bytes": (
        lambda m: run_sql(m, "UPDATE catalog_head SET hash = x'ff'"),
        9,
        "the head record (catalog_head) is damaged (its hash is b'\\xff', not a sha256",
    ),
}

# Hand edits the write path cannot append after: each refuses every command
# with one line naming what is wrong, and writes nothing.
UNWRITABLE: dict[str, tuple[tuple[str, ...], str]] = {
    "the head's revision made text": (
        ("UPDATE catalog_head SET revision = 'eight'",),
        "error: the log's head record (catalog_head) is damaged: its revision is 'eight', "
        "not a whole number; nothing was written",
    ),
    "the head's hash made other text": (
        ("UPDATE catalog_head SET hash = '123'",),
        "error: the log's head record (catalog_head) is damaged: its hash is '123', "
        "not a sha256 digest in hex; nothing was written",
    ),
    "the head's hash made bytes": (
        ("UPDATE catalog_head SET hash = x'ff'",),
        "error: the log's head record (catalog_head) is damaged: its hash is b'\\xff', "
        "not a sha256 digest in hex; nothing was written",
    ),
    "a stream's last version made text": (
        ("UPDATE catalog_streams SET version = 'x'",),
        "error: the log holds a revision or a model's version that is not a whole number",
    ),
    "the head raised to the largest revision": (
        ("UPDATE catalog_head SET revision = 9223372036854775807",),
        "error: the log's next revision or a model's next version would pass "
        "9,223,372,036,854,775,807",
    ),
    "a stream's row in catalog_streams deleted": (
        ("DELETE FROM catalog_streams",),
        "error: model 'chat' has events up to version 4, but catalog_streams records it at"
        " version 0: edited by hand; nothing was written",
    ),
    "a stream's last version lowered": (
        ("UPDATE catalog_streams SET version = 1",),
        "error: model 'chat' has events up to version 4, but catalog_streams records it at"
        " version 1",
    ),
    "a stream's last version raised to the largest": (
        ("UPDATE catalog_streams SET version = 9223372036854775807",),
        "error: the log's next revision or a model's next version would pass",
    ),
}


@pytest.mark.parametrize("how", ["command", "apply", "rollback"])
@pytest.mark.parametrize("edit", UNWRITABLE, ids=list(UNWRITABLE))
def test_a_log_edited_past_what_can_be_appended_refuses_writes_and_is_left_as_it_is(
    models: Models, db: str, config: Path, tmp_path: Path, edit: str, how: str
) -> None:
    """Whichever write meets it, a rollback too (whose steps, each refused
    one tried again, could have told the damage as a rollback that would
    make the catalog invalid, and kept it as a refusal)."""
    statements, message = UNWRITABLE[edit]
    run_sql(models, *statements)
    before, refusals = stored_log(models), models.refusals()
    changes = tmp_path / "changes.yaml"
    changes.write_text("- owner: {name: chat, owner: 'team:other'}\n")
    args = {
        "command": ["model", "owner", "chat", "team:other"],
        "apply": ["apply", str(changes)],
        "rollback": ["rollback", "--to", "2"],
    }[how]
    result = invoke(db, config, *args)
    assert result.exit_code == 1
    assert result.stderr.startswith(message)
    assert result.stderr.count("\n") == 1
    assert stored_log(models) == before
    assert models.refusals() == refusals  # the storage's state refused it, not a rule


@pytest.mark.parametrize("tampering", TAMPERING, ids=list(TAMPERING))
def test_tampering_makes_verify_fail_at_that_revision(
    models: Models, db: str, config: Path, tampering: str
) -> None:
    tamper, revision, problem = TAMPERING[tampering]
    tamper(models)
    report = models.verify()
    assert report["ok"] is False
    assert report["broken"]["revision"] == revision
    assert problem in report["broken"]["problem"]

    result = invoke(db, config, "verify")
    assert result.exit_code == 1
    assert f"error: chain broken at revision {revision}: " in result.stderr
    assert "chain intact" not in result.stdout


@pytest.mark.parametrize(
    "spelt", [str.upper, lambda text: text.replace("-", "")], ids=["capitals", "no dashes"]
)
def test_an_event_whose_payload_spells_its_id_otherwise_is_no_break(
    models: Models, spelt: Callable[[str], str]
) -> None:
    """Load reads a payload's id as a UUID, however it is spelt: one written
    in capitals, or without its dashes, belongs where it is stored, and
    verify, which compares the text first to be quick, does not call it
    filed elsewhere."""
    t = events_table.c
    chat = str(model_id("chat"))
    with models.store.write() as conn:
        last = conn.execute(sa.select(t.topic, t.state).where(t.revision == 8)).one()
        payload = json.loads(last.state)
        assert (payload["originator_id"], payload["originator_version"]) == (chat, 4)
        payload.update(originator_id=spelt(chat), originator_version=5)
        state = json.dumps(payload).encode()
        models.store.insert_events([StoredEvent(model_id("chat"), 5, last.topic, state)], conn=conn)
    report = models.verify()
    assert (report["ok"], report["events"], report["skipped"]) == (True, 9, [])


def test_a_new_event_after_a_deleted_last_one_does_not_hide_it(models: Models) -> None:
    run_sql(models, "DELETE FROM catalog_events WHERE revision = 7")
    models.set_owner("chat", "team:other", by="carol")
    assert models.verify()["broken"]["revision"] == 7


def test_a_row_put_past_the_head_by_hand_is_numbered_after_not_collided_with(
    models: Models,
) -> None:
    """A row appended without moving the head (by hand, by another tool) is
    followed: the next command takes the revision after it, not the head's
    next, which that row holds."""
    run_sql(
        models,
        "INSERT INTO catalog_events (originator_id, originator_version, topic, state, hash,"
        " stream_previous) SELECT originator_id, 99, topic, state, hash, 0 FROM catalog_events"
        " WHERE revision = 8",
    )
    assert models.set_owner("chat", "team:other", by="carol").revision == 10
    assert models.verify()["broken"]["revision"] == 9


@pytest.mark.parametrize(
    ("raised", "missing"), [(1, "revision 9 is"), (5, "revisions 9..13 are")], ids=["1", "5"]
)
def test_a_head_raised_by_hand_is_still_named_after_the_next_write(
    models: Models, raised: int, missing: str
) -> None:
    """SQLite numbers revisions without gaps: a gap the chain links across is
    an edit too. The head's revision raised by hand is followed by the next
    write, and its hash still names the last event, so nothing breaks the
    chain; the gap it leaves is what verify names, one revision wide too."""
    last = models.verify()["events"]
    assert last == 8
    run_sql(models, f"UPDATE catalog_head SET revision = revision + {raised}")
    written = models.set_owner("chat", "team:other", by="carol").revision
    assert written == last + raised + 1
    broken = models.verify()["broken"]
    assert broken["revision"] == last + 1
    assert broken["problem"].startswith(
        f"{missing} missing, but revision {written} chains onto revision {last}: "
        "nothing was deleted there"
    )


def test_a_head_put_below_the_largest_revision_leaves_room_for_one_more_write(
    models: Models,
) -> None:
    """The largest revision the database stores is written; only past it is
    a write refused, nothing written."""
    run_sql(models, f"UPDATE catalog_head SET revision = {MAX_REVISION - 1}")
    assert models.set_owner("chat", "team:other", by="carol").revision == MAX_REVISION
    before = stored_log(models)
    with pytest.raises(DamagedLog, match="would pass"):
        models.set_owner("chat", "team:third", by="carol")
    assert stored_log(models) == before


def test_a_new_log_numbers_revisions_without_sqlite_sequence(models: Models) -> None:
    """Every command's transaction writes one page fewer than AUTOINCREMENT's."""
    run_sql(models, "DELETE FROM catalog_events WHERE revision = 8")
    # Not chat: its last event is gone, and a write to it is refused as damage.
    with pytest.raises(DamagedLog, match="not its last event's"):
        models.set_owner("chat", "team:other", by="carol")
    models.add(EMBED, by="carol")
    with models.store.read() as conn:
        sequences = conn.execute(sa.text("SELECT name FROM sqlite_sequence")).scalars().all()
        revisions = (
            conn.execute(sa.select(events_table.c.revision).order_by(events_table.c.revision))
            .scalars()
            .all()
        )
    assert "catalog_events" not in sequences
    assert revisions == [1, 2, 3, 4, 5, 6, 7, 9]


# What the log's table was on SQLite before the appender numbered revisions.
AUTOINCREMENT_TABLE = """
CREATE TABLE catalog_events (
    revision INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    originator_id CHAR(32) NOT NULL,
    originator_version INTEGER NOT NULL,
    topic TEXT NOT NULL,
    state BLOB NOT NULL,
    hash VARCHAR(64) NOT NULL,
    CONSTRAINT catalog_events_stream UNIQUE (originator_id, originator_version)
)
"""


def test_a_log_made_with_autoincrement_goes_on_numbering(
    db: str, config: Path, clock: Clock
) -> None:
    """A log made before revisions were numbered by the append keeps its
    AUTOINCREMENT table: the sequence follows the numbers given, and is read."""
    engine = create_engine(db)
    with engine.begin() as conn:
        conn.execute(sa.text(AUTOINCREMENT_TABLE))
    engine.dispose()
    models = open_service(db, config)
    script(models, clock)
    run_sql(models, "DELETE FROM catalog_events WHERE revision = 8")
    # Not chat: its last event is gone, and a write to it is refused as damage.
    assert models.add(EMBED, by="carol").revision == 9
    with models.store.read() as conn:
        sequence = conn.execute(
            sa.text("SELECT seq FROM sqlite_sequence WHERE name = 'catalog_events'")
        ).scalar()
    assert sequence == 9
    assert models.verify()["broken"]["revision"] == 8
    # The sequence still remembers 9 when its row and the head are both gone
    # (writes wait for the head to be put back, docs/audit.md's way).
    run_sql(models, "DELETE FROM catalog_events WHERE revision = 9", "DELETE FROM catalog_head")
    third = msgspec.structs.replace(CHAT, name="third")
    with pytest.raises(DamagedLog, match=r"head record \(catalog_head\) is missing"):
        models.add(third, by="carol")
    run_sql(models, PUT_THE_HEAD_BACK)
    assert models.add(third, by="carol").revision == 10
    models.close()


def test_a_recorder_opened_before_the_log_was_made_reads_how_it_was_made(
    tmp_path: Path,
) -> None:
    """A recorder that looked before the table existed decides again once it
    does: an AUTOINCREMENT table made after it still has its sequence read."""
    url = f"sqlite:///{tmp_path / 'late.db'}"
    recorder = SQLRecorder(create_engine(url), create_tables=False)
    mapper = EventMapper()

    def append(version: int, name: str = "m") -> int:
        stored = mapper.to_stored_event(event(Model.Removed, name, version=version))
        (revision,) = recorder.insert_events([stored]) or [0]
        return revision

    with pytest.raises(sa.exc.OperationalError, match="no such table"):
        append(1)
    with recorder.engine.begin() as conn:
        conn.execute(sa.text(AUTOINCREMENT_TABLE))
    recorder.create_tables()
    assert [append(1), append(2), append(3)] == [1, 2, 3]
    with recorder.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM catalog_events WHERE revision = 3"))
        conn.execute(sa.text("DELETE FROM catalog_head"))
        conn.execute(sa.text(PUT_THE_HEAD_BACK))
    assert append(1, "n") == 4
    recorder.close()
    recorder.engine.dispose()


def test_a_head_deleted_while_a_postgresql_write_runs_is_put_back(
    pg_url: str, config: Path, clock: Clock
) -> None:
    """The write lock is the events table's: the head can be deleted by hand
    between a write's first read and its append, which then puts it back."""
    models = open_service(pg_url, config)
    script(models, clock)
    stored = models.mapper.to_stored_event(
        event(Model.OwnerSet, "chat", version=5, owner="team:late")
    )
    with models.store.write() as conn:
        standing = models.store.standing(conn)
        run_sql(models, "DELETE FROM catalog_head")
        (revision,) = models.store.insert_events([stored], conn=conn, standing=standing) or [0]
    assert revision == 9
    assert models.verify()["ok"] is True
    models.close()


def test_a_second_head_row_put_in_by_hand_is_not_read(
    pg_url: str, config: Path, clock: Clock
) -> None:
    """PostgreSQL: with the head's CHECK dropped and a copy of it added, writes
    and verify read the head (id 1) alone."""
    models = open_service(pg_url, config)
    script(models, clock)
    run_sql(
        models,
        "ALTER TABLE catalog_head DROP CONSTRAINT catalog_head_id_check",
        "INSERT INTO catalog_head (id, revision, hash) SELECT 2, revision, hash FROM catalog_head",
    )
    assert models.set_owner("chat", "team:other", by="carol").revision == 9
    assert models.verify()["ok"] is True
    models.close()


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(revision=st.integers(min_value=1, max_value=7), data=st.data())
def test_any_flipped_byte_is_found_at_its_revision(
    models: Models, revision: int, data: st.DataObject
) -> None:
    t = events_table.c
    with models.store.engine.begin() as conn:
        state = conn.execute(sa.select(t.state).where(t.revision == revision)).scalar_one()
        at_byte = data.draw(st.integers(min_value=0, max_value=len(state) - 1))
        flipped = state[:at_byte] + bytes([state[at_byte] ^ 0x01]) + state[at_byte + 1 :]
        conn.execute(sa.update(events_table).where(t.revision == revision).values(state=flipped))
    try:
        assert models.verify()["broken"]["revision"] == revision
    finally:
        with models.store.engine.begin() as conn:
            conn.execute(sa.update(events_table).where(t.revision == revision).values(state=state))
    assert models.verify()["ok"] is True


def test_the_head_moves_with_every_write(models: Models) -> None:
    with models.store.read() as conn:
        head = conn.execute(sa.select(head_table)).one()
        last = conn.execute(sa.select(sa.func.max(events_table.c.revision))).scalar()
    assert (head.id, head.revision) == (1, last)


# -- the command line --------------------------------------------------------------


def invoke(db: str, config: Path, *args: str) -> Any:
    return CliRunner().invoke(cli, ["--db", db, "--config", str(config), *args])


def test_cli_history_table_shows_field_changes(models: Models, db: str, config: Path) -> None:
    result = invoke(db, config, "history", "embed")
    assert result.exit_code == 0, result.stderr
    assert "profiles[cpu].min_memory_gb: 4 → 8" in result.stdout
    assert "carol" in result.stdout and "OOM" in result.stdout
    # A line per field (an addition sets them all), not one line of "\n"s.
    assert "\\n" not in result.stdout
    (name,) = [line for line in result.stdout.splitlines() if 'name: null → "embed"' in line]
    (engine,) = [line for line in result.stdout.splitlines() if "engine: null → " in line]
    assert "engine" not in name and "name" not in engine


def test_cli_json_is_what_the_queries_return(models: Models, db: str, config: Path) -> None:
    cases = {
        ("history", "chat", "--json"): models.history("chat"),
        ("history", "chat", "--since", "2026-11-30T12:02:00Z", "--limit", "2", "--json"): (
            models.history("chat", since=T0 + timedelta(minutes=2), limit=2)
        ),
        ("audit", "--by", "alice", "--json"): models.audit(by="alice"),
        ("--json", "audit", "--type", "scaled", "--since", "2026-11-30T12:00:00Z"): models.audit(
            event_type="Scaled", since=T0
        ),
        ("audit", "--until", "2026-11-30T13:02:00+01:00", "--json"): models.audit(
            until=T0 + timedelta(minutes=2)
        ),
        ("refusals", "--by", "dave", "--json"): models.refusals(by="dave"),
        ("verify", "--json"): models.verify(),
    }
    for args, expected in cases.items():
        result = invoke(db, config, *args)
        assert result.exit_code == 0, (args, result.stderr)
        assert json.loads(result.stdout) == expected, args
    # --by filters here, and its help says so (it said who makes the change).
    for command in ("history", "audit", "refusals"):
        helped = invoke(db, config, command, "--help")
        assert "Only this actor's" in helped.stdout and "making the change" not in helped.stdout


def test_the_type_filter_takes_every_event_the_rows_carry(
    models: Models, db: str, config: Path
) -> None:
    """A declared-config record is a ConfigDeclared row, a refused rollback a
    Rollback refusal: values the --json rows carry, refused by the filter
    (hostile test)."""
    with pytest.raises(Refused):
        models.rollback(10**6, by="erin")
    declared = invoke(db, config, "audit", "--type", "configdeclared", "--json")
    assert declared.exit_code == 0, declared.stderr
    rows = json.loads(declared.stdout)
    assert rows and {r["event"] for r in rows} == {"ConfigDeclared"}
    assert rows == [r for r in models.audit() if r["event"] == "ConfigDeclared"]
    # Each row is its log line plus what it did: a config record names no model
    # there either (it said "" here; docs review, consistency test).
    logged = {e["revision"]: e for e in models.log_events()}
    for row in rows:
        assert {k: row[k] for k in logged[row["revision"]]} == logged[row["revision"]]
    refused = invoke(db, config, "refusals", "--type", "Rollback", "--json")
    assert refused.exit_code == 0, refused.stderr
    assert [(r["event"], r["by"]) for r in json.loads(refused.stdout)] == [("Rollback", "erin")]


TAKEN_BY_A_HISTORY = (
    "Added, Removed, Scaled, ResourcesSet, ClassSet, OwnerSet, AdaptersSet, SourceSet, "
    "OriginSet, UpstreamChanged, Declared, Redeclared, Undeclared"
)


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (
            ("audit", "--type", "Rollback"),
            f"type 'Rollback': the audit has none; it takes {TAKEN_BY_A_HISTORY}, ConfigDeclared",
        ),
        (
            ("audit", "--type", "apply"),
            f"type 'Apply': the audit has none; it takes {TAKEN_BY_A_HISTORY}, ConfigDeclared",
        ),
        (
            ("history", "embed", "--type", "Rollback"),
            f"type 'Rollback': a model's history has none; it takes {TAKEN_BY_A_HISTORY}",
        ),
        (
            ("history", "embed", "--type", "ConfigDeclared"),
            f"type 'ConfigDeclared': a model's history has none; it takes {TAKEN_BY_A_HISTORY}",
        ),
        (
            ("refusals", "--type", "Declared"),
            "type 'Declared': the record of refusals has none; it takes Added, Removed, "
            "Scaled, ResourcesSet, ClassSet, OwnerSet, AdaptersSet, SourceSet, OriginSet, "
            "UpstreamChanged, ConfigDeclared, Rollback, Apply, CheckUpdates",
        ),
    ],
)
def test_a_type_the_query_never_carries_is_refused_naming_the_ones_it_takes(
    models: Models, db: str, config: Path, args: tuple[str, ...], refusal: str
) -> None:
    """Rollback and Apply are refusals' alone, a declared-config record is no
    model's: asked of the audit or a history, they answered nothing, exit 0,
    as if nothing had been done (operator's docs walk)."""
    with pytest.raises(Refused):
        models.rollback(10**6, by="erin")
    result = invoke(db, config, *args)
    # A usage error, as a type no query takes is (review).
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr.splitlines()[-1] == f"Error: --{refusal}"


def test_a_bound_between_two_microseconds_is_not_rounded_down(
    models: Models, db: str, config: Path
) -> None:
    """Times are kept to the microsecond; a bound written finer (as `date
    --iso-8601=ns` writes them) lies between two. An event at 12:01:00 is
    before 12:01:00.0000005: `--until` (before it) has it, `--since` (at or
    after it) does not."""
    bound = "2026-11-30T12:01:00.000000500Z"
    listed = {
        option: json.loads(invoke(db, config, "audit", option, bound, "--json").stdout)
        for option in ("--until", "--since")
    }
    assert 2 in [r["revision"] for r in listed["--until"]]
    assert 2 not in [r["revision"] for r in listed["--since"]]
    next_microsecond = T0 + timedelta(minutes=1, microseconds=1)
    assert listed["--until"] == models.audit(until=next_microsecond)
    assert listed["--since"] == models.audit(since=next_microsecond)


def test_cli_verify_lists_skipped_events_either_way(models: Models, db: str, config: Path) -> None:
    unreadable = StoredEvent(
        originator_id=uuid.uuid4(), originator_version=1, topic="x:Gone", state=b"{}"
    )
    append_directly(models, unreadable)
    result = invoke(db, config, "verify")
    assert result.exit_code == 0
    assert "chain intact: 9 events, head at revision 9" in result.stdout
    assert "unknown event type 'x:Gone'" in result.stdout
    run_sql(models, "DELETE FROM catalog_events WHERE revision = 2")
    result = invoke(db, config, "verify")
    assert result.exit_code == 1
    assert "unknown event type 'x:Gone'" in result.stdout


def test_cli_verify_counts_one_event_as_one(db: str, tmp_path: Path) -> None:
    """Its line said "chain intact: 1 events" of a log of one."""
    no_models = tmp_path / "none.yaml"
    no_models.write_text("models: []\n")
    definition = tmp_path / "a.yaml"
    definition.write_text(
        "name: a\nengine: vllm\nsource: hf://o/a\nprofiles: [{name: g, gpus: 1}]\n"
    )
    assert invoke(db, no_models, "model", "add", str(definition)).exit_code == 0
    result = invoke(db, no_models, "verify")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("chain intact: 1 event, head at revision 1 (")


def test_verify_names_the_snapshots_taken_over_an_edit(
    db: str, config: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot vouches for the log by the hash at its own revision, which an
    edit of an event before it leaves as it was: loads from it went on giving
    the owner the edited event set, a replay none, and verify said nothing of
    it (hostile test). It names them, and how to make them again."""
    writer = Models(
        load_config(str(config)),
        pre_add_check=RefuseBrokenWeights(),
        env={"CATALOG_ES_DB": db},
        snapshot_interval=3,
    )
    script(writer, clock)  # revisions 1-8: snapshots at 3 and 6
    assert writer.verify()["snapshots_since_break"] == []
    run_sql(writer, "UPDATE catalog_events SET state = X'7B7B' WHERE revision = 2")
    report = writer.verify()
    assert (report["broken"]["revision"], report["snapshots_since_break"]) == (2, [3, 6])
    result = invoke(db, config, "verify")
    assert result.exit_code == 1
    assert (
        "2 snapshots taken at or after revision 2: one made before the edit holds the catalog"
        " as it was, and loads start from it (what they skip and read is not a replay's);"
        " unless one ran since the edit, catalog-es replay makes them again from the log as it is"
    ) in result.stdout
    writer.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("history", "nope"), "error: model 'nope' has no history"),
        (("history", ""), "error: model '' has no history"),  # not every row's
        # Not the declared-config records, which have no model.
        (("audit", "--model", ""), "error: model: the name is empty"),
        (("refusals", "--model", ""), "error: model: the name is empty"),
        # No actor is empty: the filter matched nothing, as if there were nothing (hostile test).
        (("audit", "--by", ""), "error: by: the actor is empty"),
        (("refusals", "--by", ""), "error: by: the actor is empty"),
        # A window closed before it opens: it matched nothing, as if there were nothing.
        (
            ("audit", "--since", "2026-12-08", "--until", "2026-12-07"),
            "error: since 2026-12-08T00:00:00Z is not before until 2026-12-07T00:00:00Z",
        ),
        (
            (
                "history",
                "m",
                "--since",
                "2026-12-07T13:00:00+01:00",
                "--until",
                "2026-12-07T12:00:00Z",
            ),
            "error: since 2026-12-07T12:00:00Z is not before until 2026-12-07T12:00:00Z",
        ),
        (
            ("refusals", "--since", "2026-12-08", "--until", "2026-12-07"),
            "error: since 2026-12-08T00:00:00Z is not before until",
        ),
    ],
)
def test_cli_bad_input_is_one_error_line_and_exit_1(
    models: Models, db: str, config: Path, args: tuple[str, ...], message: str
) -> None:
    result = invoke(db, config, *args)
    assert result.exit_code == 1
    assert result.stderr.startswith(message)
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("audit", "--since", "yesterday"), "--since 'yesterday': not a UTC time"),
        (("refusals", "--until", "2026-11-30T12:00"), "--until '2026-11-30T12:00': not a"),
        (("history", "m", "--since", "noon"), "--since 'noon': not a UTC time"),
        (("audit", "--type", "Renamed"), "--type 'Renamed': not an event type"),
        (
            ("audit", "--until", "9999-12-31T23:00:00-02:00"),
            "--until '9999-12-31T23:00:00-02:00': outside the times UTC can hold",
        ),
    ],
)
def test_cli_a_filter_that_cannot_be_read_is_a_usage_error(
    models: Models, db: str, config: Path, args: tuple[str, ...], message: str
) -> None:
    """DESIGN: exit 2 on usage errors, as for a --limit click's type refuses;
    these exited 1 as refusals (hostile test)."""
    result = invoke(db, config, *args)
    assert result.exit_code == 2, result.stderr
    assert result.stderr.splitlines()[-1].startswith(f"Error: {message}")


def test_refusals_are_found_by_a_name_no_model_can_have(
    db: str, config: Path, tmp_path: Path
) -> None:
    """A definition naming a model as none can be named is refused and
    recorded: the refusals filter takes the name as it was tried (as the
    audit's takes the name a poison record in the log gives)."""
    definition_file = tmp_path / "bad.yaml"
    definition_file.write_text(json.dumps(definition("bad!n")))
    assert invoke(db, config, "model", "add", str(definition_file)).exit_code == 1
    found = json.loads(invoke(db, config, "refusals", "--model", "bad!n", "--json").stdout)
    assert [(r["model"], r["event"]) for r in found] == [("bad!n", "Added")]


def test_cli_refused_add_is_recorded(db: str, config: Path, tmp_path: Path, clock: Clock) -> None:
    not_yaml = tmp_path / "bad.yaml"
    not_yaml.write_text("name: [unclosed")
    assert invoke(db, config, "model", "add", str(not_yaml), "--by", "gina").exit_code == 1
    declared = tmp_path / "base.yaml"
    declared.write_text(
        "name: base\nengine: vllm\nsource: hf://x\nprofiles: [{name: g, gpus: 1}]\n"
    )
    result = invoke(db, config, "--by", "gina", "model", "add", str(declared), "--reason", "mine")
    assert result.exit_code == 1
    rows = invoke(db, config, "refusals", "--json")
    (row,) = json.loads(rows.stdout)
    assert (row["by"], row["model"], row["event"], row["reason"]) == (
        "gina",
        "base",
        "Added",
        "mine",
    )
    assert invoke(db, config, "audit", "--json").stdout.strip() == "[]"


# -- PostgreSQL --------------------------------------------------------------------


def test_commands_do_not_wait_behind_an_audit_catch_up_on_postgresql(
    pg_url: str, config: Path, clock: Clock
) -> None:
    """The audit's rows are written under a lock of their own, on a connection
    of their own: a catch-up waiting for another node's does not hold up this
    node's commands."""
    models = open_service(pg_url, config)
    holder = sa.create_engine(pg_url)
    try:
        script(models, clock)
        with holder.begin() as conn:  # another node writing audit rows
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext('catalog_es.audit'))"))
            waiting = threading.Thread(target=models.audit)
            waiting.start()
            time.sleep(0.3)
            assert waiting.is_alive()
            started = time.perf_counter()
            models.scale("chat", 1, 2, by="bob")
            assert time.perf_counter() - started < 1
        waiting.join(10)
        assert models.audit(limit=1)[0]["revision"] == 9
    finally:
        models.close()
        holder.dispose()


def test_the_hash_chain_on_postgresql(pg_url: str, config: Path, clock: Clock) -> None:
    models = open_service(pg_url, config)
    try:
        script(models, clock)
        assert models.verify()["ok"] is True
        assert [r["revision"] for r in models.audit(by="alice")] == [1, 1, 2, 4, 7]
        until = T0 + timedelta(minutes=5)
        assert [r["revision"] for r in models.audit(until=until, limit=2)] == [4, 5]
        assert len(models.refusals()) == 4
        run_sql(models, "DELETE FROM catalog_events WHERE revision = 4")
        assert models.verify()["broken"]["revision"] == 4
    finally:
        models.close()


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE catalog_head SET revision = 9223372036854775807",
        "UPDATE catalog_streams SET version = 9223372036854775807",
    ],
    ids=["head raised", "version raised"],
)
def test_a_postgresql_log_edited_past_appending_refuses_writes_as_sqlites_does(
    pg_url: str, config: Path, clock: Clock, statement: str
) -> None:
    """PostgreSQL numbers the rows itself: a head raised past them would have
    been moved back by the next write, and the edit with it."""
    models = open_service(pg_url, config)
    try:
        script(models, clock)
        run_sql(models, statement)
        before = stored_log(models)
        with pytest.raises(DamagedLog):
            models.set_owner("chat", "team:other", by="carol")
        assert stored_log(models) == before
    finally:
        models.close()
