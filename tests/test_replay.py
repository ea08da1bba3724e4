"""Skip on load: one bad record cannot take the cluster down.

Each poison is planted straight into ``catalog_events`` (good events written
by the service, then rows altered with SQLAlchemy) or comes from a config that
changed under the log. On reopening, exactly the poisoned records are skipped
and reported with their revision and reason; everything else loads, declared
models always; and the poisoned name stays usable.
"""

from __future__ import annotations

import gc
import json
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import projections.catalog
from catalog_es.application import Models
from catalog_es.batch import Batch
from catalog_es.configuration import DeclaredConfig
from catalog_es.errors import DeclaredInConfig, InvalidModel, ModelNotFound
from catalog_es.inputs import load_config
from catalog_es.model import Model
from catalog_es.spec import DEFAULT_ENGINES, Origin, Scaling
from catalog_es.storage.schema import events_table
from tests.helpers import ACTOR, config_yaml, spec

MakeModels = Callable[..., Models]
Tamper = Callable[[sa.Engine, int], None]

ANCHOR = spec("anchor")  # declared, and gone from the config in one case
KEPT = spec("kept-declared")  # declared throughout


def _update_row(engine: sa.Engine, revision: int, **values: Any) -> None:
    with engine.begin() as conn:
        updated = conn.execute(
            sa.update(events_table).where(events_table.c.revision == revision).values(**values)
        )
        assert updated.rowcount == 1


def _edit_payload(edit: Callable[[dict[str, Any]], None]) -> Tamper:
    """Rewrites the stored JSON of a row: what an older or newer writer, or a
    hand-edit of the database, could have left there."""

    def tamper(engine: sa.Engine, revision: int) -> None:
        with engine.connect() as conn:
            state = conn.execute(
                sa.select(events_table.c.state).where(events_table.c.revision == revision)
            ).scalar_one()
        data = json.loads(state)
        edit(data)
        _update_row(engine, revision, state=json.dumps(data).encode())

    return tamper


def _set(path: Sequence[str], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = value

    return edit


def _move_to_another_model(data: dict[str, Any]) -> None:
    # The record claims a model its stream id does not belong to.
    data["model"] = data["spec"]["name"] = "someone-else"


@dataclass(frozen=True)
class Poison:
    id: str
    victim: Any  # the definition added at runtime, before the poisoning
    reason: str  # what the skip report must say
    tamper: Tamper | None = None
    declare_victim: bool = False  # the new config declares the victim's name
    drop_anchor: bool = False  # the new config no longer declares ``anchor``
    drop_engine: str | None = None  # the new config's engines leave this one out
    reported_as: str | None = None  # the model the report names, if not the victim

    @property
    def model(self) -> str:
        return self.victim.name if self.reported_as is None else self.reported_as


POISONS = [
    Poison("declared-now", spec("v-declared"), "is declared in configuration", declare_victim=True),
    Poison(
        "engine-gone",
        spec("v-engine", engine="tgi"),
        "engine: 'tgi' is not a known engine",
        drop_engine="tgi",
    ),
    Poison(
        "fallback-gone",
        spec("v-fallback", fallbacks=("anchor",)),
        "fallbacks: names 'anchor', which is not in the catalog",
        drop_anchor=True,
    ),
    Poison(
        "corrupt-payload",
        spec("v-corrupt"),
        "corrupt payload",
        tamper=lambda engine, rev: _update_row(engine, rev, state=b'{"model": "v-corr\x00\xff'),
        reported_as="",
    ),
    Poison(
        "unknown-topic",
        spec("v-topic"),
        "unknown event type 'catalog_es.model:Model.Exploded'",
        tamper=lambda engine, rev: _update_row(
            engine, rev, topic="catalog_es.model:Model.Exploded"
        ),
    ),
    Poison(
        "future-class-version",
        spec("v-future"),
        "written by a newer version of catalog-es (Model.Added class_version 99",
        tamper=_edit_payload(_set(["class_version"], 99)),
    ),
    Poison(
        "negative-scaling",
        spec("v-negative"),
        "scaling: min -1, max 1",
        tamper=_edit_payload(_set(["spec", "scaling", "min"], -1)),
    ),
    Poison(
        "wrong-type",
        spec("v-wrong-type"),
        "invalid payload",
        tamper=_edit_payload(_set(["spec", "scaling", "min"], "one")),
    ),
    Poison(
        "foreign-stream",
        spec("v-foreign"),
        "its aggregate id does not belong to model 'someone-else'",
        tamper=_edit_payload(_move_to_another_model),
        reported_as="someone-else",
    ),
]

GOOD = ("good-a", "good-b", "good-c")


def _poisoned_log(
    make_models: MakeModels, db_url: str, poisons: Sequence[Poison]
) -> tuple[Models, dict[str, int], str]:
    """Good models around the victims, the victims poisoned, and the service
    reopened over the config as it is now. Returns it, each victim's revision
    and that config."""
    before = make_models(config_yaml(ANCHOR, KEPT))
    before.add(spec("good-a", fallbacks=("kept-declared",)), by=ACTOR)
    revisions = {p.id: before.add(p.victim, by=ACTOR).revision for p in poisons}
    before.add(spec("good-b", fallbacks=("good-a",)), by=ACTOR)
    before.add(spec("good-c", engine="sglang"), by=ACTOR)
    before.scale("good-a", 1, 3, by=ACTOR)

    engine = sa.create_engine(db_url)
    try:
        for p in poisons:
            if p.tamper is not None:
                p.tamper(engine, revisions[p.id])
    finally:
        engine.dispose()

    declared = [KEPT]
    if not any(p.drop_anchor for p in poisons):
        declared.append(ANCHOR)
    declared += [
        spec(p.victim.name, source="hf://config/owned") for p in poisons if p.declare_victim
    ]
    dropped = {p.drop_engine for p in poisons}
    engines = [e for e in DEFAULT_ENGINES if e not in dropped]
    config_now = config_yaml(*declared, engines=engines)
    return make_models(config_now), revisions, config_now


def _names(models: Models) -> set[str]:
    return {m["name"] for m in models.list_models()}


@pytest.mark.parametrize("poison", POISONS, ids=lambda p: p.id)
def test_a_poisoned_record_is_skipped_and_reported_and_the_rest_loads(
    make_models: MakeModels, db_url: str, caplog: pytest.LogCaptureFixture, poison: Poison
) -> None:
    caplog.set_level(logging.WARNING, logger="catalog_es.replay")
    models, revisions, config_now = _poisoned_log(make_models, db_url, [poison])

    (skipped,) = models.skipped()
    assert (skipped.revision, skipped.model) == (revisions[poison.id], poison.model)
    assert poison.reason in skipped.reason
    assert f"skipped revision {skipped.revision} " in caplog.text

    expected = {*GOOD, "kept-declared"} | ({"anchor"} if not poison.drop_anchor else set())
    assert _names(models) == expected | ({poison.victim.name} if poison.declare_victim else set())
    assert models.get_model("good-a")["scaling"] == {"min": 1, "max": 3}  # later events apply

    # Other models stay commandable, on top of the skip.
    head = models.revision
    result = models.scale("good-b", 0, 2, by=ACTOR)
    written = [e["event"] for e in models.log_events(after=head)]
    # A write over a changed config records the declared layer first.
    assert written in (["Scaled"], ["ConfigDeclared", "Scaled"])
    assert result.revision == head + len(written)

    if poison.declare_victim:
        # Configuration wins: the declared definition is in force and cannot
        # be changed at runtime.
        assert models.get_model(poison.victim.name)["declared"] is True
        with pytest.raises(DeclaredInConfig):
            models.add(poison.victim, by=ACTOR)
        return
    with pytest.raises(ModelNotFound):
        models.get_model(poison.victim.name)
    # The poisoned name can be re-added, which heals it, and stays healed.
    healed = spec(poison.victim.name)
    assert models.add(healed, by=ACTOR).revision == result.revision + 1
    assert models.scale(healed.name, 1, 2, by=ACTOR).revision == result.revision + 2
    reopened = make_models(config_now)
    assert reopened.get_model(healed.name)["scaling"] == {"min": 1, "max": 2}
    assert [s.revision for s in reopened.skipped()] == [revisions[poison.id]]


def test_a_load_warns_of_the_skips_that_still_count_and_only_counts_the_rest(
    make_models: MakeModels, caplog: pytest.LogCaptureFixture
) -> None:
    """Every skip was told on every command, for good: a model healed and
    removed long ago kept nine lines coming, and pushed a new conflict past
    the ten told (operator walkthrough). Told now: the skip that keeps each
    model out; the rest, counted, in the process's log only."""
    declared = config_yaml(spec("base"))
    models = make_models(declared)
    a = models.add(spec("a", fallbacks=("base",)), by=ACTOR).revision
    models.scale("a", 0, 2, by=ACTOR)  # skipped too, as a change to a model out
    b = models.add(spec("b", fallbacks=("base",)), by=ACTOR).revision
    without_base = config_yaml()

    def warned_on_load() -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="catalog_es"):
            make_models(without_base)
        told = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        counted = [
            r.getMessage() for r in caplog.records if "more: later changes" in r.getMessage()
        ]
        return told + counted

    cause = "fallbacks: names 'base', which is not in the catalog"
    assert [line.split(":", 1)[0] for line in warned_on_load()] == [
        f"skipped revision {a} (model 'a', Added)",
        f"skipped revision {b} (model 'b', Added)",
        "load skips 1 event more",
    ]
    assert cause in warned_on_load()[0]
    healing = make_models(without_base)
    healing.add(spec("a"), by=ACTOR)
    healing.remove("b", by=ACTOR)
    assert warned_on_load() == [
        "load skips 3 events more: later changes to those models, and records of models "
        "re-added or removed since (catalog-es verify lists them)"
    ]


def test_a_record_skipped_while_following_another_writer_is_reported(
    make_models: MakeModels, caplog: pytest.LogCaptureFixture
) -> None:
    """Skips were reported as a node loaded only: one that runs on (`serve`)
    was never told of the records another node's config let it write and its
    own cannot take (hostile test)."""
    caplog.set_level(logging.WARNING, logger="catalog_es")
    following = make_models(config_yaml(engines=["vllm", "sglang"]))
    writing = make_models(config_yaml())
    revision = writing.add(spec("r9", engine="tgi"), by=ACTOR).revision
    caplog.clear()
    following.refresh()
    assert [s.revision for s in following.skipped()] == [revision]
    assert f"skipped revision {revision} (model 'r9', Added): " in caplog.text
    caplog.clear()
    following.refresh()  # told once
    assert "skipped" not in caplog.text


def test_exactly_the_poisoned_records_are_skipped_together(
    make_models: MakeModels, db_url: str
) -> None:
    models, revisions, _ = _poisoned_log(make_models, db_url, POISONS)
    report = {s.revision: (s.model, s.reason) for s in models.skipped()}
    assert sorted(report) == sorted(revisions.values())
    for p in POISONS:
        model, reason = report[revisions[p.id]]
        assert model == p.model
        assert p.reason in reason
    declared = {"kept-declared", *(p.victim.name for p in POISONS if p.declare_victim)}
    assert _names(models) == {*GOOD, *declared}
    assert {m["name"] for m in models.list_models() if m["declared"]} == declared


def test_an_undecodable_record_is_shown_in_the_log_with_its_error(
    make_models: MakeModels, db_url: str
) -> None:
    poisons = [p for p in POISONS if p.id in ("corrupt-payload", "unknown-topic")]
    models, revisions, _ = _poisoned_log(make_models, db_url, poisons)
    log = {e["revision"]: e for e in models.log_events()}
    assert len(log) == models.revision  # nothing hidden
    for p in poisons:
        shown = log[revisions[p.id]]
        assert p.reason in shown["error"]
        assert shown["time"] is None and shown["fields"] == {}


def test_a_poisoned_later_event_leaves_the_model_as_it_was_and_usable(
    make_models: MakeModels, db_url: str
) -> None:
    models = make_models()
    models.add(spec("m", scaling=Scaling(min=1, max=2)), by=ACTOR)
    poisoned = models.scale("m", 2, 8, by=ACTOR).revision
    engine = sa.create_engine(db_url)
    _update_row(engine, poisoned, state=b"\x00")
    engine.dispose()

    reopened = make_models()
    assert [s.revision for s in reopened.skipped()] == [poisoned]
    assert reopened.get_model("m")["scaling"] == {"min": 1, "max": 2}
    # Its stream moves on past the bad record: the next version is free.
    assert reopened.scale("m", 1, 4, by=ACTOR).revision == poisoned + 1
    assert make_models().get_model("m")["scaling"] == {"min": 1, "max": 4}


def test_a_skipped_model_can_be_removed(make_models: MakeModels, db_url: str) -> None:
    (engine_gone,) = [p for p in POISONS if p.id == "engine-gone"]
    models, _, config_now = _poisoned_log(make_models, db_url, [engine_gone])
    models.remove(engine_gone.victim.name, by=ACTOR)
    with pytest.raises(ModelNotFound, match="is not in the catalog"):
        models.remove(engine_gone.victim.name, by=ACTOR)  # healed: once is enough
    reopened = make_models(config_now)
    assert engine_gone.victim.name not in _names(reopened)
    # Removed for good: the engine coming back does not bring the model back.
    restored = make_models(config_yaml(KEPT, ANCHOR))
    assert engine_gone.victim.name not in _names(restored)
    with pytest.raises(ModelNotFound, match="is not in the catalog"):
        restored.remove(engine_gone.victim.name, by=ACTOR)


def test_what_upstream_did_to_a_skipped_model_leaves_it_skipped(make_models: MakeModels) -> None:
    """An observation (``check-updates`` recording upstream's move) of a
    model the config has since left out of force healed the skip on load,
    as if it had put a definition back: the model could then not be
    removed, nor its absence explained (review). A command would have
    refused the record, as of a model not in the catalog."""
    first = make_models()
    first.add(spec("x", engine="sglang"), by=ACTOR)
    upstream = Origin(repository="org/x", revision="b" * 40)

    def seen_upstream(batch: Batch) -> None:
        batch.decide(
            batch.event(
                Model.UpstreamChanged, "x", ref="main", revision="a" * 40, upstream=upstream
            )
        )

    first.write_plan(seen_upstream, by="cron")
    without_sglang = make_models(config_yaml(engines=[e for e in DEFAULT_ENGINES if e != "sglang"]))
    assert [(s.revision, s.model, s.event) for s in without_sglang.skipped()] == [(1, "x", "Added")]
    out = "load skips 1 event of it, out of force since revision 1"
    with pytest.raises(ModelNotFound, match=out):
        without_sglang.get_model("x")
    assert without_sglang.remove("x", by=ACTOR).removed == "x"
    assert "x" not in _names(make_models())


@pytest.mark.parametrize("while_away", ["declared", "engine-gone"])
def test_a_removal_stands_when_the_models_naming_it_come_back(
    make_models: MakeModels, db_url: str, while_away: str
) -> None:
    """A fallback removed while the models naming it were skipped (their name
    declared for a while, or their engine out of the build) stays removed
    when they come back: they fall out of force with it, each reported at
    the removal's revision, and can be added again or removed. The original
    control plane ends the same way (the row deleted, the model naming it
    skipped on load); putting the removed model back would run what its
    operator took away."""
    engine = "vllm" if while_away == "declared" else "sglang"
    first = make_models(snapshot_interval=1)
    first.add(spec("f"), by=ACTOR)
    first.add(spec("x", engine=engine, fallbacks=("f",)), by=ACTOR)
    first.add(spec("y", fallbacks=("x",)), by=ACTOR)
    away = (
        config_yaml(spec("x"))
        if while_away == "declared"
        else config_yaml(engines=[e for e in DEFAULT_ENGINES if e != "sglang"])
    )
    # Nothing in force names f meanwhile: the runtime x is skipped (and y with
    # it, or y names the declared x), so f can go.
    removed = make_models(away).remove("f", by=ACTOR).revision

    back = make_models()
    assert _names(back) == set()
    fell = {s.model: s for s in back.skipped() if s.revision == removed}
    assert sorted(fell) == ["x", "y"]
    assert fell["x"].event == "Removed"
    assert "names 'f', which this revision removed" in fell["x"].reason
    assert "names 'x', which this revision removed" in fell["y"].reason
    # Read at a past revision, one model at a time or the whole catalog, from
    # the snapshots the first service wrote before the removal: the same answer.
    for revision in range(1, removed + 1):
        listed = {m["name"]: m for m in back.list_models(revision)}
        for name in ("f", "x", "y"):
            if name in listed:
                assert back.get_model(name, revision) == listed[name]
            else:
                with pytest.raises(ModelNotFound):
                    back.get_model(name, revision)
    assert sorted(m["name"] for m in back.list_models(removed - 1)) == ["f", "x", "y"]
    assert back.list_models(removed) == []
    # Out of force, not gone from the log: each can be added again, or removed.
    back.remove("y", by=ACTOR)
    with pytest.raises(InvalidModel, match="names 'f', which is not in the catalog"):
        back.add(spec("x", fallbacks=("f",)), by=ACTOR)
    back.add(spec("x"), by=ACTOR)
    assert _names(make_models()) == {"x"}
    assert _names(make_models(snapshot_interval=1)) == {"x"}


@pytest.mark.alone
def test_a_replay_split_in_two_lets_fall_what_a_whole_one_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The models a removal takes out of force are skips of the half that
    replays it: a load in two processes reports them as one does."""
    url = f"sqlite:///{tmp_path / 'c.db'}"
    declaring_b = tmp_path / "declaring-b.yaml"
    declaring_b.write_text(config_yaml(spec("b")))

    def load(config: Path | None = None) -> Models:
        declared = load_config(str(config)) if config else DeclaredConfig()
        return Models(declared, env={"CATALOG_ES_DB": url})

    first = load()
    # g, b and e replay in the same half (their streams' parity is 0).
    for name, fallbacks in [("g", ()), ("b", ("g",)), ("e", ("b",))]:
        first.add(spec(name, fallbacks=fallbacks), by=ACTOR)
    removed = load(declaring_b).remove("g", by=ACTOR).revision
    whole = load()
    split = projections.catalog._split_replay
    answers: list[object] = []
    monkeypatch.setattr(projections.catalog, "SPLIT_AFTER", 0)
    monkeypatch.setattr(projections.catalog, "SPLIT_CORES", 0)

    def answered(*args: Any) -> Any:
        answers.append(split(*args))
        return answers[-1]

    monkeypatch.setattr(projections.catalog, "_split_replay", answered)
    halves = load()
    assert answers and answers[0] is not None, "the load was split"
    assert [(s.revision, s.model) for s in halves.skipped()] == [(removed, "b"), (removed, "e")]
    assert halves.skipped() == whole.skipped()
    assert halves.list_models() == whole.list_models() == []


def test_a_replay_page_reader_closed_after_its_connection_says_nothing(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during a long replay closed the connection while its page
    reader was suspended; collected later, the reader's cursor close printed
    "Exception ignored in: <generator object SQLRecorder._pages>" and a
    traceback before "Aborted!" (hostile tester). It closes quietly."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(spec("a"), by=ACTOR)
    unraised: list[sys.UnraisableHookArgs] = []
    monkeypatch.setattr(sys, "unraisablehook", unraised.append)
    with models.store.engine.connect() as conn:
        pages = models.store.scan(conn)
        assert [revision for revision, _, _ in next(pages)] == [1]
        conn.invalidate()  # closes the driver's connection under the reader
        del pages
        gc.collect()
    models.close()
    assert [str(u.exc_value) for u in unraised] == []
