"""The ``Models`` service on a real SQLite file: every command, what it answers,
what it writes, what it pushes to the applier, and its guards."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import sqlalchemy as sa
import yaml

from catalog_es import collector, commands
from catalog_es.application import Models
from catalog_es.bootstrap import open_models
from catalog_es.collector import collector_paused
from catalog_es.configuration import DeclaredConfig
from catalog_es.errors import (
    ConfigError,
    DeclaredInConfig,
    InputError,
    InvalidModel,
    ModelNotFound,
    Refused,
    RevisionConflict,
)
from catalog_es.inputs import load_config, model_from_data
from catalog_es.model import Model, model_id, utc_now
from catalog_es.spec import Adapter, Origin, Scaling
from tests.conftest import RecordingApplier, RefuseSources
from tests.helpers import (
    ACTOR,
    CPU,
    GPU,
    SHA,
    collections_seen,
    config_yaml,
    definition,
    spec,
)

KUBEAI_CATALOG = Path("/work/shared/data/kubeai-catalog.yaml")

MakeModels = Callable[..., Models]
Rows = Callable[[], int]


# -- what a command answers ------------------------------------------------------


@pytest.mark.parametrize("setting", ["COMPRESSOR_TOPIC", "CIPHER_TOPIC"])
def test_a_service_given_a_compressor_or_cipher_is_refused(tmp_path: Path, setting: str) -> None:
    """Every reader decodes the stored bytes as the mapper writes them: a
    script giving the service the event library's compressor or cipher had
    its events stored in a form the log, replay and audit took for corrupt."""
    topic = {"COMPRESSOR_TOPIC": "zlib", "CIPHER_TOPIC": "tests.test_service:NoCipher"}[setting]
    db = f"sqlite:///{tmp_path}/catalog.db"
    with pytest.raises(ValueError, match="no compressor or cipher"):
        Models(env={"CATALOG_ES_DB": db, setting: topic})


def test_a_service_takes_its_log_from_the_environment_as_the_command_line_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event library's settings are the service's own, not the
    environment's, but for the one that names the log: a script given
    CATALOG_ES_DB writes there, as ``catalog-es`` does."""
    db = tmp_path / "named.db"
    monkeypatch.setenv("CATALOG_ES_DB", f"sqlite:///{db}")
    monkeypatch.chdir(tmp_path)
    models = Models(DeclaredConfig())
    try:
        models.add(spec("m"), by="ops")
    finally:
        models.close()
    assert db.exists() and not (tmp_path / "catalog.db").exists()


def test_a_service_refuses_its_log_set_empty_in_the_environment_as_the_command_line_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CATALOG_ES_DB=$URL with URL unset: a script's service made and wrote
    ./catalog.db, another log than meant, where the command line refuses it;
    a log given by the script is taken all the same (hostile test)."""
    monkeypatch.setenv("CATALOG_ES_DB", "")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=r"^\$CATALOG_ES_DB is set but empty: give a database URL"):
        Models(DeclaredConfig())
    assert list(tmp_path.iterdir()) == []
    db = tmp_path / "named.db"
    Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{db}"}).close()
    assert list(tmp_path.iterdir()) == [db]


def test_a_service_given_its_log_empty_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script passing its database URL as given, empty (``sys.argv[1]``
    or ``$URL`` unset), had the service make and write ./catalog.db,
    another log than meant, taking the empty URL for none given."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=r"^CATALOG_ES_DB is given empty: give a database URL"):
        Models(DeclaredConfig(), env={"CATALOG_ES_DB": ""})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("first", ["catalog_es.application", "projections.audit"])
def test_a_script_builds_its_service_whatever_the_event_librarys_time_zone_says(
    tmp_path: Path, first: str
) -> None:
    """eventsourcing resolves $TZINFO_TOPIC as it is imported, for
    timestamps catalog-es does not take: another app's, not importable
    here, failed a script at ``import catalog_es.application`` (only the
    command line dropped it), or at the read sides' own import of the
    library. The script's own environment keeps it."""
    script = (
        f"import {first}\n"
        "import os\n"
        "from catalog_es.application import Models\n"
        "from catalog_es.configuration import DeclaredConfig\n"
        "from tests.helpers import spec\n"
        "models = Models(DeclaredConfig(), env={'CATALOG_ES_DB': os.environ['DB']})\n"
        "print(models.add(spec('m'), by='ops').revision, os.environ['TZINFO_TOPIC'])\n"
        "models.close()\n"
    )
    topic = "elsewhere.clock:LOCAL"
    ran = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "DB": f"sqlite:///{tmp_path}/catalog.db", "TZINFO_TOPIC": topic},
    )
    assert (ran.returncode, ran.stdout) == (0, f"1 {topic}\n"), ran.stderr


class NoCipher:
    """A cipher that keeps the bytes as they are: it is refused all the same."""

    def __init__(self, environment: object) -> None:
        pass


def test_add_answers_the_model_as_it_will_run(make_models: MakeModels) -> None:
    models = make_models()
    # As a person writes it: no scaling, no class, no owner.
    asked = model_from_data(definition("llama"), "test")
    result = models.add(asked, by=ACTOR)
    assert (result.revision, result.replaced, result.written) == (1, False, True)
    assert result.model is not None
    assert result.model["scaling"] == {"min": 1, "max": 1}
    assert result.model["profiles"][0] == {
        "name": "gpu",
        "gpus": 1,
        "gpu_memory_gb": 24,
        "min_memory_gb": 0,
        "cpu_cores": 0,
    }
    defaults = {"class": "", "effective_class": "standard", "owner": "", "declared": False}
    assert {key: result.model[key] for key in defaults} == defaults
    assert (result.model["adapters"], result.model["fallbacks"], result.model["origin"]) == (
        [],
        [],
        None,
    )
    assert result.model == models.get_model("llama")


@pytest.mark.parametrize(
    ("scaling", "capacity_class", "effective"),
    [
        (Scaling(min=1, max=3), "", "standard"),
        (Scaling(min=0, max=3), "", "opportunistic"),
        (Scaling(min=0, max=3), "critical", "critical"),
    ],
)
def test_the_effective_class_follows_scaling_unless_set(
    make_models: MakeModels, scaling: Scaling, capacity_class: str, effective: str
) -> None:
    models = make_models()
    result = models.add(spec("m", scaling=scaling, capacity_class=capacity_class), by=ACTOR)
    assert result.model is not None
    assert result.model["effective_class"] == effective


BASE = spec(
    "base",
    profiles=(GPU, CPU),
    scaling=Scaling(min=1, max=2),
    adapters=(Adapter(name="tone", source="s3://adapters/tone"),),
)
ORIGIN = Origin(repository="org/base", revision="0123abc", files={"model.gguf": SHA})


def _profiles(view: dict[str, Any], only: str = "", **changes: Any) -> list[dict[str, Any]]:
    return [p | changes if not only or p["name"] == only else p for p in view["profiles"]]


# (command, the change it makes to the model's view)
COMMANDS: list[Any] = [
    pytest.param(
        lambda m: m.scale("base", 2, 4, by=ACTOR),
        lambda v: {"scaling": {"min": 2, "max": 4}},
        id="scale",
    ),
    pytest.param(
        lambda m: m.scale("base", minimum=0, by=ACTOR),
        lambda v: {
            "scaling": {"min": 0, "max": v["scaling"]["max"]},
            "effective_class": "opportunistic",
        },
        id="scale-min-only",
    ),
    pytest.param(
        lambda m: m.scale("base", maximum=5, by=ACTOR),
        lambda v: {"scaling": {"min": v["scaling"]["min"], "max": 5}},
        id="scale-max-only",
    ),
    pytest.param(
        lambda m: m.set_resources("base", profile="cpu", memory_gb=16, by=ACTOR),
        lambda v: {"profiles": _profiles(v, "cpu", min_memory_gb=16)},
        id="resources-one-profile",
    ),
    pytest.param(
        lambda m: m.set_resources("base", memory_gb=64, cpu_cores=8, by=ACTOR),
        lambda v: {"profiles": _profiles(v, min_memory_gb=64, cpu_cores=8)},
        id="resources-all-profiles",
    ),
    pytest.param(
        lambda m: m.set_class("base", "critical", by=ACTOR),
        lambda v: {"class": "critical", "effective_class": "critical"},
        id="class",
    ),
    pytest.param(
        lambda m: m.set_owner("base", "project:rag", by=ACTOR),
        lambda v: {"owner": "project:rag"},
        id="owner",
    ),
    pytest.param(
        lambda m: m.set_adapters(
            "base", (Adapter(name="sql", source="s3://adapters/sql"),), by=ACTOR
        ),
        lambda v: {"adapters": [{"name": "sql", "source": "s3://adapters/sql"}]},
        id="adapters",
    ),
    pytest.param(
        lambda m: m.set_source("base", "s3://weights/base-v2", ORIGIN, by=ACTOR),
        lambda v: {"source": "s3://weights/base-v2", "origin": msgspec.to_builtins(ORIGIN)},
        id="source-with-origin",
    ),
    pytest.param(
        lambda m: m.set_origin("base", ORIGIN),
        lambda v: {"origin": msgspec.to_builtins(ORIGIN)},
        id="origin",
    ),
]


@pytest.mark.parametrize(("command", "change"), COMMANDS)
def test_each_command_writes_one_event_and_answers_the_model(
    make_models: MakeModels, rows: Rows, command: Any, change: Any
) -> None:
    models = make_models()
    models.add(BASE, by=ACTOR)
    before = models.get_model("base")

    result = command(models)

    assert (result.revision, result.written, result.replaced) == (2, True, False)
    assert rows() == 2
    assert result.model == before | change(before)
    # What was answered is what is in force, here and for a fresh reader of the log.
    assert result.model == models.get_model("base") == make_models().get_model("base")


def test_remove_answers_the_name_and_no_model(make_models: MakeModels) -> None:
    models = make_models()
    models.add(BASE, by=ACTOR)
    result = models.remove("base", by=ACTOR, reason="retired")
    assert (result.revision, result.model, result.removed) == (2, None, "base")
    with pytest.raises(ModelNotFound):
        models.get_model("base")
    assert [m["name"] for m in make_models().list_models()] == []


def test_re_adding_says_it_replaced_and_adding_after_removal_does_not(
    make_models: MakeModels,
) -> None:
    models = make_models()
    assert models.add(spec("a"), by=ACTOR).replaced is False
    replaced = models.add(spec("a", source="s3://w/a-v2"), by=ACTOR)
    assert replaced.replaced is True
    assert replaced.model is not None
    assert replaced.model["source"] == "s3://w/a-v2"
    models.remove("a", by=ACTOR)
    assert models.add(spec("a"), by=ACTOR).replaced is False


def test_re_adding_a_model_load_skipped_says_it_replaced_the_stored_one(
    make_models: MakeModels,
) -> None:
    """Given a runtime model whose engine left the config (skipped on load),
    when its name is added again, then the add heals it and says it replaced
    the stored definition, alone and in an ``apply`` alike."""
    make_models().add(spec("a", engine="tgi"), by=ACTOR)
    make_models().add(spec("b", engine="tgi"), by=ACTOR)
    models = make_models(config_yaml(engines=["vllm"]))
    assert models.catalog.unhealed() == ["a", "b"]
    assert models.add(spec("a"), by=ACTOR).replaced is True
    applied = models.apply_changes([commands.add(spec("b"))], by=ACTOR)
    assert applied["replaced"] == ["b"]
    assert [item["replaced"] for item in applied["models"]] == [True]
    assert models.catalog.unhealed() == []


def test_the_catalog_handed_out_is_the_callers_own(make_models: MakeModels) -> None:
    """The one in force was handed out: a command in another thread (a
    server's) changed it under the weights scan iterating it (review)."""
    models = make_models()
    models.add(spec("a"), by=ACTOR)
    now = models.catalog_at()
    models.scale("a", 0, 5, by=ACTOR)
    models.add(spec("b"), by=ACTOR)
    assert now.revision == 1 and [m.name for m in now.models()] == ["a"]
    assert now.get("a") == spec("a")
    assert models.get_model("a")["scaling"] == {"min": 0, "max": 5}


def test_remove_then_re_add_continues_the_same_stream(make_models: MakeModels) -> None:
    models = make_models()
    models.add(spec("a"), by=ACTOR)
    models.add(spec("other"), by=ACTOR)
    models.remove("a", by=ACTOR)
    models.add(spec("a"), by=ACTOR)
    stream = models.store.select_events(model_id("a"))
    assert [e.originator_version for e in stream] == [1, 2, 3]
    assert [e.topic.rpartition(".")[2] for e in stream] == ["Added", "Removed", "Added"]


def test_revisions_are_gapless_and_the_log_says_who_and_why(make_models: MakeModels) -> None:
    models = make_models()
    answered = [
        models.add(spec("a"), by="alice", reason="trial").revision,
        models.scale("a", 1, 3, by="bob").revision,
        models.set_owner("a", "team:x", by="carol", reason="handover").revision,
    ]
    with pytest.raises(Refused):
        models.scale("a", 5, 1, by="dave")  # refused: no revision used
    answered.append(models.remove("a", by="erin").revision)
    log = list(models.log_events())
    assert answered == [e["revision"] for e in log] == [1, 2, 3, 4]
    assert [(e["by"], e["reason"], e["event"]) for e in log] == [
        ("alice", "trial", "Added"),
        ("bob", "", "Scaled"),
        ("carol", "handover", "OwnerSet"),
        ("erin", "", "Removed"),
    ]
    assert log[1]["fields"] == {"scaling": {"min": 1, "max": 3}}
    assert all(e["time"].endswith("Z") for e in log)


def test_a_batch_larger_than_one_statement_lands_whole_and_chained(
    make_models: MakeModels,
) -> None:
    """PostgreSQL takes a batch a thousand events a statement, the last of them
    moving the head: revisions still come back in order, and the chain holds."""
    models = make_models()
    answer = models.apply_changes([commands.add(spec(f"m{i:04d}")) for i in range(2_100)], by=ACTOR)
    log = list(models.log_events())
    assert answer["revision"] == log[-1]["revision"] == models.revision
    assert [e["model"] for e in log] == [f"m{i:04d}" for i in range(2_100)]
    assert [e["revision"] for e in log] == sorted({e["revision"] for e in log})
    report = models.verify()
    assert (report["ok"], report["events"], report["head"]["revision"]) == (
        True,
        2_100,
        answer["revision"],
    )


def test_log_events_can_be_filtered(make_models: MakeModels) -> None:
    models = make_models()
    for name in ("a", "b", "a"):
        models.add(spec(name), by=ACTOR)
    assert [e["revision"] for e in models.log_events(model="a")] == [1, 3]
    assert [e["revision"] for e in models.log_events(after=1)] == [2, 3]
    assert [e["revision"] for e in models.log_events(limit=2)] == [1, 2]


# -- refusals write nothing ----------------------------------------------------------


REFUSED: list[Any] = [
    pytest.param(lambda m: m.add(spec("bad name"), by=ACTOR), InvalidModel, id="bad-name"),
    pytest.param(lambda m: m.add(spec("base", engine="x"), by=ACTOR), InvalidModel, id="engine"),
    pytest.param(lambda m: m.remove("ghost", by=ACTOR), ModelNotFound, id="remove-unknown"),
    pytest.param(lambda m: m.scale("base", by=ACTOR), InputError, id="scale-nothing"),
    pytest.param(lambda m: m.scale("base", 3, 2, by=ACTOR), InvalidModel, id="scale-range"),
    pytest.param(lambda m: m.scale("base", maximum=0, by=ACTOR), InvalidModel, id="scale-max-0"),
    pytest.param(lambda m: m.set_resources("base", by=ACTOR), InputError, id="resources-nothing"),
    pytest.param(
        lambda m: m.set_resources("base", profile="tpu", memory_gb=1, by=ACTOR),
        InvalidModel,
        id="resources-unknown-profile",
    ),
    pytest.param(
        lambda m: m.set_resources("base", memory_gb=-1, by=ACTOR), InvalidModel, id="resources-neg"
    ),
    pytest.param(lambda m: m.set_class("base", "gold", by=ACTOR), InvalidModel, id="class"),
    pytest.param(lambda m: m.set_owner("base", "bob", by=ACTOR), InvalidModel, id="owner"),
    pytest.param(
        lambda m: m.set_adapters(
            "base",
            (Adapter(name="a", source="s3://1"), Adapter(name="a", source="s3://2")),
            by=ACTOR,
        ),
        InvalidModel,
        id="adapters-duplicate",
    ),
    pytest.param(lambda m: m.set_source("base", "", by=ACTOR), InvalidModel, id="source-empty"),
    # Control and format characters: NUL, a terminal escape, a bidi override.
    pytest.param(
        lambda m: m.add(spec("n", source="hf://org/a\x00b"), by=ACTOR), InvalidModel, id="nul"
    ),
    pytest.param(
        lambda m: m.set_source("base", "hf://org/\x1b[31mred", by=ACTOR),
        InvalidModel,
        id="source-escape",
    ),
    pytest.param(
        lambda m: m.set_adapters(
            "base", (Adapter(name="a", source="s3://x\u202egpj.exe"),), by=ACTOR
        ),
        InvalidModel,
        id="adapter-bidi",
    ),
    pytest.param(lambda m: m.scale("declared", 2, 2, by=ACTOR), DeclaredInConfig, id="declared"),
    pytest.param(lambda m: m.add(spec("declared"), by=ACTOR), DeclaredInConfig, id="declared-add"),
    pytest.param(lambda m: m.add(spec("n"), by=""), InputError, id="no-actor"),
    pytest.param(lambda m: m.add(spec("n"), by="x" * 129), InputError, id="long-actor"),
    pytest.param(lambda m: m.add(spec("n"), by=ACTOR, reason="r" * 1001), InputError, id="reason"),
    # Every command's actor and reason, and its name before the log is looked at.
    pytest.param(lambda m: m.scale("base", 1, 2, by=""), InputError, id="scale-no-actor"),
    pytest.param(
        lambda m: m.remove("base", by=ACTOR, reason="r" * 1001), InputError, id="remove-reason"
    ),
    pytest.param(
        lambda m: m.scale("bad name", 1, 2, by=ACTOR, expected_revision=0),
        InvalidModel,
        id="scale-bad-name-stale",
    ),
]


def test_a_record_stored_before_the_printable_source_rule_still_loads(
    make_models: MakeModels,
) -> None:
    # The rule is the commands', not the stored rules a replay checks: a
    # model written with a control character in its source stays in force.
    models = make_models()
    old = spec("old", source="hf://org/a\x00b")
    event = Model.Added(
        originator_id=model_id("old"),
        originator_version=1,
        timestamp=utc_now(),
        by=ACTOR,
        model="old",
        spec=old,
    )
    models.store.insert_events([models.mapper.to_stored_event(event)])
    reopened = make_models()
    assert reopened.get_model("old")["source"] == "hf://org/a\x00b"
    assert reopened.catalog.skipped == []


@pytest.mark.parametrize(("command", "refusal"), REFUSED)
def test_a_refused_command_writes_and_pushes_nothing(
    make_models: MakeModels, rows: Rows, command: Any, refusal: type[Refused]
) -> None:
    applier = RecordingApplier()
    models = make_models(config_yaml(spec("declared")), applier=applier)
    models.add(BASE, by=ACTOR)
    in_force = models.list_models()
    with pytest.raises(refusal):
        command(models)
    # The declared config's record and the add: nothing since.
    assert rows() == 2
    assert applier.revisions == [2]
    assert (
        models.list_models() == in_force == make_models(config_yaml(spec("declared"))).list_models()
    )


def test_expected_revision_is_compare_and_set(make_models: MakeModels, rows: Rows) -> None:
    models = make_models()
    assert models.add(spec("a"), by=ACTOR, expected_revision=0).revision == 1
    assert models.scale("a", 1, 2, by=ACTOR, expected_revision=1).revision == 2
    for stale, why in (
        (0, "someone changed"),
        (1, "someone changed"),
        (3, "revision 3 was never written$"),  # not "retry": no retry can succeed
    ):
        with pytest.raises(RevisionConflict, match=f"the log is at revision 2, not {stale}: {why}"):
            models.scale("a", 1, 4, by=ACTOR, expected_revision=stale)
    assert rows() == 2
    assert models.get_model("a")["scaling"] == {"min": 1, "max": 2}


def test_an_expected_revision_deleted_since_is_said_to_be_gone_not_never_written(
    make_models: MakeModels, rows: Rows
) -> None:
    """Given the log's last events deleted by hand (the head, stored apart,
    still names the last revision written), when a command expects one of
    them, then it is refused saying the log no longer holds it, and nothing
    is written."""
    models = make_models()
    for name in ("a", "b", "c"):
        models.add(spec(name), by=ACTOR)
    with models.store.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM catalog_events WHERE revision >= 2"))
    loaded_after = make_models()
    before = rows()
    for deleted in (2, 3):
        with pytest.raises(RevisionConflict) as refusal:
            loaded_after.scale("a", 1, 2, by=ACTOR, expected_revision=deleted)
        assert str(refusal.value) == (
            f"the log is at revision 1, not {deleted}: revision {deleted} was written, but the"
            " log no longer holds it: the events after revision 1 were deleted"
            " (catalog-es verify); read it again and retry"
        )
    with pytest.raises(RevisionConflict, match=r"revision 4 was never written$"):
        loaded_after.scale("a", 1, 2, by=ACTOR, expected_revision=4)
    assert rows() == before


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(lambda m, rev: m.add(spec("b"), by=ACTOR, expected_revision=rev), id="add"),
        pytest.param(lambda m, rev: m.remove("a", by=ACTOR, expected_revision=rev), id="remove"),
        pytest.param(
            lambda m, rev: m.scale("a", 0, 3, by=ACTOR, expected_revision=rev), id="scale"
        ),
        pytest.param(
            lambda m, rev: m.set_resources("a", memory_gb=4, by=ACTOR, expected_revision=rev),
            id="resources",
        ),
        pytest.param(
            lambda m, rev: m.set_class("a", "critical", by=ACTOR, expected_revision=rev),
            id="class",
        ),
        pytest.param(
            lambda m, rev: m.set_owner("a", "org:x", by=ACTOR, expected_revision=rev), id="owner"
        ),
        pytest.param(
            lambda m, rev: m.set_adapters("a", (), by=ACTOR, expected_revision=rev), id="adapters"
        ),
        pytest.param(
            lambda m, rev: m.set_source("a", "s3://w", by=ACTOR, expected_revision=rev),
            id="source",
        ),
        pytest.param(lambda m, rev: m.set_origin("a", ORIGIN, expected_revision=rev), id="origin"),
    ],
)
def test_every_command_honours_expected_revision(
    make_models: MakeModels, rows: Rows, command: Any
) -> None:
    models = make_models()
    models.add(spec("a"), by=ACTOR)
    models.add(spec("z"), by=ACTOR)
    with pytest.raises(RevisionConflict):
        command(models, 1)
    assert rows() == 2
    assert command(models, 2).revision == 3


# -- the applier and the pre-add check ----------------------------------------------------


def test_the_applier_gets_the_catalog_in_force_after_every_change_in_log_order(
    make_models: MakeModels,
) -> None:
    applier = RecordingApplier()
    models = make_models(config_yaml(spec("declared")), applier=applier)
    assert applier.pushes == []  # opening is not a change
    results = [
        models.add(spec("a", fallbacks=("declared",)), by=ACTOR),
        models.add(spec("b"), by=ACTOR),
        models.scale("a", 0, 2, by=ACTOR),
        models.remove("b", by=ACTOR),
    ]
    # Revision 1 is the record of the declared config the first write found.
    assert applier.revisions == [r.revision for r in results] == [2, 3, 4, 5]
    names = [[m.name for m in catalog] for _, catalog in applier.pushes]
    assert names == [
        ["a", "declared"],
        ["a", "b", "declared"],
        ["a", "b", "declared"],
        ["a", "declared"],
    ]
    # Each push is the whole catalog in force, as a fresh reader rebuilds it.
    assert applier.pushes[-1][1] == make_models(config_yaml(spec("declared"))).catalog.models()
    assert applier.pushes[2][1][0].scaling == Scaling(min=0, max=2)


def test_the_pre_add_check_can_refuse_and_then_nothing_is_written(
    make_models: MakeModels, rows: Rows
) -> None:
    check, applier = RefuseSources("hf://broken/"), RecordingApplier()
    models = make_models(pre_add_check=check, applier=applier)
    with pytest.raises(Refused, match="the engine cannot load hf://broken/x"):
        models.add(spec("x", source="hf://broken/x"), by=ACTOR)
    assert (rows(), applier.pushes) == (0, [])
    assert models.add(spec("y"), by=ACTOR).revision == 1
    assert check.checked == ["x", "y"]


# -- several writers -------------------------------------------------------------------


def test_a_second_service_decides_on_the_first_ones_writes(make_models: MakeModels) -> None:
    first, second_applier = make_models(), RecordingApplier()
    second = make_models(applier=second_applier)  # opened on the empty log
    first.add(spec("a"), by=ACTOR)

    # The second has not looked since; its command must see "a" before deciding.
    assert second.add(spec("b", fallbacks=("a",)), by=ACTOR).revision == 2
    assert [m.name for m in second_applier.pushes[-1][1]] == ["a", "b"]
    # And the first, stale in turn, must see "b" name "a".
    with pytest.raises(InvalidModel, match="is a fallback of 'b'"):
        first.remove("a", by=ACTOR)
    with pytest.raises(RevisionConflict):
        first.scale("a", 1, 3, by=ACTOR, expected_revision=1)
    assert first.remove("b", by=ACTOR).revision == 3
    assert second.remove("a", by=ACTOR).revision == 4
    assert first.list_models() == second.list_models() == []
    assert [e["revision"] for e in first.log_events()] == [1, 2, 3, 4]


def test_a_service_writes_a_model_another_service_wrote_since(make_models: MakeModels) -> None:
    # What a service knows of a model's stream (its last version, saved a
    # read per write) no longer holds once another writer moved the log.
    first, second = make_models(), make_models()
    first.add(spec("a"), by=ACTOR)
    second.scale("a", 1, 2, by=ACTOR)
    assert first.scale("a", 1, 3, by=ACTOR).revision == 3
    assert second.get_model("a")["scaling"] == {"min": 1, "max": 3}
    assert first.verify()["ok"] is True


# -- declared models --------------------------------------------------------------------


def test_recording_an_origin_on_a_declared_model_is_a_silent_no_op(
    make_models: MakeModels, rows: Rows
) -> None:
    applier = RecordingApplier()
    declared = spec("declared")
    models = make_models(config_yaml(declared), applier=applier)
    result = models.set_origin("declared", ORIGIN)
    assert (result.written, result.revision, rows(), applier.pushes) == (False, 0, 0, [])
    assert result.model == models.get_model("declared")
    assert result.model is not None
    assert (result.model["declared"], result.model["origin"]) == (True, None)


def test_declared_models_are_listed_with_runtime_ones(make_models: MakeModels) -> None:
    models = make_models(config_yaml(spec("declared")))
    models.add(spec("runtime"), by=ACTOR)
    assert [(m["name"], m["declared"]) for m in models.list_models()] == [
        ("declared", True),
        ("runtime", False),
    ]


def test_a_runtime_model_a_declared_one_hid_is_told_when_it_comes_back(
    make_models: MakeModels, caplog: pytest.LogCaptureFixture
) -> None:
    """Configuration wins while it declares the name; once it no longer
    does, the runtime definition the log kept is in force again, and was so
    in silence (hostile test): the first load under the new config says so."""
    make_models(config_yaml()).add(spec("qwen", source="hf://runtime/old-trial"), by=ACTOR)
    adopted = make_models(config_yaml(spec("qwen", source="hf://declared/qwen")))
    adopted.record_declaration(by="deployer")  # as serve does at start
    caplog.clear()
    dropped = make_models(config_yaml())
    assert dropped.get_model("qwen")["source"] == "hf://runtime/old-trial"
    assert [r.getMessage() for r in caplog.records if "no longer declared" in r.getMessage()] == [
        "model 'qwen' is no longer declared: its runtime definition, which the declared one "
        "hid, is in force again (remove it if unwanted)"
    ]
    caplog.clear()
    dropped.record_declaration(by="deployer")
    make_models(config_yaml())
    assert "no longer declared" not in caplog.text  # told while the change is new


def test_a_model_out_of_force_because_load_skips_it_says_why_where_it_is_asked_for(
    make_models: MakeModels,
) -> None:
    """Its fallback no longer declared, a runtime model is skipped on load; asked
    for, it was only "not in the catalog", the reason among the load's warnings
    (operator walkthrough)."""
    models = make_models(config_yaml(spec("base")))
    models.add(spec("trial", fallbacks=("base",)), by=ACTOR)  # 2, after the config's record
    models.scale("trial", 0, 3, by=ACTOR)
    with pytest.raises(ModelNotFound) as refused:
        make_models(config_yaml()).get_model("trial")
    assert str(refused.value) == (
        "model 'trial' is not in the catalog (load skips 2 events of it, out of force since "
        "revision 2, Added: model 'trial': fallbacks: names 'base', which is not in the "
        "catalog; catalog-es verify lists them)"
    )
    with pytest.raises(ModelNotFound, match=r"^model 'other' is not in the catalog$"):
        models.get_model("other")
    # Removed since, it is gone because it was removed: no word of the skips.
    unconfigured = make_models(config_yaml())
    unconfigured.remove("trial", by=ACTOR)
    with pytest.raises(ModelNotFound, match=r"^model 'trial' is not in the catalog$"):
        unconfigured.get_model("trial")


def test_the_kubeai_catalog_loads_as_declared_config(make_models: MakeModels, rows: Rows) -> None:
    text = KUBEAI_CATALOG.read_text(encoding="utf-8")
    published = yaml.safe_load(text)
    models = make_models(text)

    listed = {m["name"]: m for m in models.list_models()}
    assert sorted(listed) == sorted(m["name"] for m in published["models"])
    assert all(m["declared"] for m in listed.values())
    for entry in published["models"]:
        cpu_without_memory = [
            p["name"]
            for p in entry["profiles"]
            if p.get("gpus", 0) == 0 and p.get("min_memory_gb", 0) == 0
        ]
        warnings = listed[entry["name"]].get("warnings", [])
        assert len(warnings) == len(cpu_without_memory), entry["name"]
        for profile, warning in zip(cpu_without_memory, warnings, strict=True):
            assert f"profile {profile!r}" in warning and "declares no memory" in warning
    assert any(m.get("warnings") for m in listed.values())  # the point of this data set

    # Its engines replace the default list.
    with pytest.raises(InvalidModel, match="'sglang' is not a known engine"):
        models.add(spec("mine", engine="sglang"), by=ACTOR)
    cpu_fallback = next(n for n, m in listed.items() if m.get("warnings"))
    added = models.add(
        spec("mine", engine="ollama", profiles=(CPU,), fallbacks=(cpu_fallback,)), by=ACTOR
    )
    assert added.revision == 2  # after the record of the declared config
    with pytest.raises(DeclaredInConfig, match="change its scaling there"):
        models.scale(cpu_fallback, 1, 4, by=ACTOR)
    assert rows() == 2


# -- queries ---------------------------------------------------------------------------


def test_sources_says_which_models_and_adapters_use_each_source(make_models: MakeModels) -> None:
    shared = "s3://adapters/shared"
    models = make_models(config_yaml(spec("declared", source="hf://org/common")))
    models.add(spec("a", source="hf://org/common"), by=ACTOR)
    models.add(
        spec(
            "b",
            adapters=(
                Adapter(name="x", source=shared),
                Adapter(name="y", source="s3://adapters/y"),
            ),
        ),
        by=ACTOR,
    )
    models.add(spec("c", adapters=(Adapter(name="z", source=shared),)), by=ACTOR)
    assert models.sources() == {
        "hf://org/b": [{"model": "b"}],
        "hf://org/c": [{"model": "c"}],
        "hf://org/common": [{"model": "a"}, {"model": "declared"}],
        "s3://adapters/shared": [{"model": "b", "adapter": "x"}, {"model": "c", "adapter": "z"}],
        "s3://adapters/y": [{"model": "b", "adapter": "y"}],
    }


# -- the declared config file --------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        pytest.param(
            "models: [{name: m, engine: vllm, source: s, profiles: [{name: g}], oops: 1}]",
            "models[0].oops: unknown field",
            id="unknown-field",
        ),
        pytest.param(
            "models: [{name: m, engine: vllm, source: s, profiles: [{name: g, gpus: '1'}]}]",
            "models[0].profiles[0].gpus",
            id="wrong-type",
        ),
        pytest.param(
            "models: [{name: m, engine: nope, source: s, profiles: [{name: g}]}]",
            "engine: 'nope' is not a known engine",
            id="unknown-engine",
        ),
        pytest.param(
            "models: [{name: m, engine: vllm, source: s, profiles: [{name: g}], fallbacks: [x]}]",
            "fallbacks: names 'x', which is not declared",
            id="fallback",
        ),
        pytest.param(
            "models: [{name: m, engine: vllm, source: s, profiles: []}]",
            "profiles: at least one profile",
            id="no-profiles",
        ),
        pytest.param(
            "models:\n- {name: m, engine: vllm, source: s, profiles: [{name: g}]}\n"
            "- {name: m, engine: vllm, source: s, profiles: [{name: g}]}",
            "declared more than once",
            id="duplicate",
        ),
    ],
)
def test_a_bad_declared_config_is_refused_naming_file_model_and_field(
    write_config: Callable[[str], str], db_url: str, body: str, problem: str
) -> None:
    path = write_config(body)
    with pytest.raises(ConfigError) as error:
        open_models(db_url, path)
    message = str(error.value)
    assert path in message
    assert "'m'" in message
    assert problem in message


@pytest.mark.parametrize(
    ("engines", "problem"),
    [
        pytest.param("[]", "engines: at least one is needed", id="none"),
        pytest.param("['', vllm]", "engines[0]: '' is not an engine name", id="empty"),
        pytest.param("[vllm, 'v llm']", "engines[1]: 'v llm' is not an engine name", id="space"),
        pytest.param('[vllm, "a\\tb"]', "engines[1]: 'a\\tb' is not an engine name", id="tab"),
        pytest.param(
            f"[{'x' * 129}]", f"engines[0]: '{'x' * 59}… is not an engine name", id="129-long"
        ),
        pytest.param(
            "[vllm, sglang, vllm]", "engines[2]: 'vllm' appears more than once", id="twice"
        ),
    ],
)
def test_a_config_whose_engines_no_model_could_name_is_refused(
    write_config: Callable[[str], str], db_url: str, engines: str, problem: str
) -> None:
    path = write_config(f"engines: {engines}\nmodels: []\n")
    with pytest.raises(ConfigError) as error:
        open_models(db_url, path)
    assert str(error.value).startswith(f"{path}: {problem}")


def test_a_config_s_engine_names_of_1_to_128_characters_are_taken(
    write_config: Callable[[str], str],
) -> None:
    engines = ("a", "x" * 128)
    path = write_config(f"engines: [{', '.join(engines)}]\nmodels: []\n")
    assert load_config(path).engines == engines


def test_an_origin_that_says_nothing_is_none_at_runtime_and_as_written_in_config(
    write_config: Callable[[str], str],
) -> None:
    """At runtime `origin: {}` is no origin, as the CLI's `model source`
    without its options records. A config keeps it as written: read as none,
    an unchanged config had a new fingerprint, recorded again by the first
    write after an upgrade and in turns with nodes of the release before (review)."""
    definition = {
        "name": "d",
        "engine": "vllm",
        "source": "hf://org/d",
        "profiles": [{"name": "gpu", "gpus": 1}],
        "origin": {},
    }
    assert model_from_data(definition, "d.yaml").origin is None
    config = load_config(write_config(yaml.safe_dump({"models": [definition]})))
    (declared,) = config.models
    assert declared.origin == Origin()


def test_a_config_past_its_size_is_refused_without_reading_it_all(
    tmp_path: Path, db_url: str
) -> None:
    endless = tmp_path / "catalog.yaml"
    endless.symlink_to("/dev/zero")  # a path to a device, or a runaway file
    with pytest.raises(ConfigError, match="the config is larger than 64 MiB"):
        open_models(db_url, str(endless))


def test_concurrent_writers_on_one_file_serialise_into_one_gapless_log(
    make_models: MakeModels,
) -> None:
    appliers = [RecordingApplier(), RecordingApplier()]
    services = [make_models(applier=applier) for applier in appliers]
    errors: list[BaseException] = []

    def work(models: Models, prefix: str) -> None:
        try:
            for i in range(15):
                models.add(spec(f"{prefix}-{i}"), by=prefix)
                models.scale(f"{prefix}-{i}", 0, 2, by=prefix)
        except BaseException as error:  # reported below, not lost in the thread
            errors.append(error)

    threads = [
        threading.Thread(target=work, args=(models, prefix))
        for models, prefix in zip(services, ("left", "right"), strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert [e["revision"] for e in services[0].log_events()] == list(range(1, 61))
    for applier in appliers:
        assert applier.revisions == sorted(applier.revisions)
        assert len(applier.revisions) == 30
    # Each push held every model written before it, whichever service wrote it.
    for revision, pushed in appliers[0].pushes + appliers[1].pushes:
        before = [e for e in services[0].log_events(limit=revision) if e["event"] == "Added"]
        assert {m.name for m in pushed} == {e["model"] for e in before}
    assert services[0].list_models() == services[1].list_models()


class FailingApplier(RecordingApplier):
    """A controller that cannot be reached."""

    def replace_catalog(self, models: Any, revision: int) -> None:
        raise Refused("controller unreachable")


def test_an_applier_that_fails_after_the_write_does_not_turn_it_into_a_refusal(
    make_models: MakeModels, rows: Rows, caplog: pytest.LogCaptureFixture
) -> None:
    models = make_models(applier=FailingApplier())
    result = models.add(spec("a"), by=ACTOR)
    assert result.written and result.revision == 1
    assert rows() == 1 and models.get_model("a")["name"] == "a"
    assert models.refusals() == []
    assert "the applier failed on the catalog at revision 1" in caplog.text


# -- the garbage collector -------------------------------------------------------


def test_bulk_work_leaves_the_collector_on_even_when_it_fails(make_models: MakeModels) -> None:
    # Commands, replays and reads of the past pause the cyclic collector while
    # they make thousands of objects; one that left it off would let a
    # server's cyclic garbage pile up for good.
    models = make_models()
    models.add(BASE, by=ACTOR)
    models.apply_changes([commands.scale(BASE.name, 1, 2)], by=ACTOR)
    assert models.list_models(at=1) and models.get_model(BASE.name, at=2)
    with pytest.raises(Refused):
        models.apply_changes([commands.scale("nowhere", 1, 2)], by=ACTOR)
    with pytest.raises(ModelNotFound):
        models.get_model("nowhere", at=2)
    models.rebuild(audit=True)
    assert make_models().list_models()
    assert gc.isenabled()


def test_a_caller_that_turned_the_collector_off_finds_it_off(make_models: MakeModels) -> None:
    models = make_models()
    gc.disable()
    try:
        models.add(BASE, by=ACTOR)
        models.list_models(at=1)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_only_the_outermost_pause_turns_the_collector_back_on() -> None:
    with collector_paused():
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_an_interrupt_as_the_pause_begins_leaves_the_collector_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Python runs signal handlers as a call returns: Ctrl-C can land just as
    # the collector has been turned off, before the body of the pause starts.
    real_disable = gc.disable

    def disable_then_interrupted() -> None:
        real_disable()
        raise KeyboardInterrupt

    monkeypatch.setattr(gc, "disable", disable_then_interrupted)
    with pytest.raises(KeyboardInterrupt), collector_paused():
        pass
    left_on = gc.isenabled()
    gc.enable()
    assert left_on


def test_pauses_in_other_threads_never_leave_the_collector_off() -> None:
    # Threads pausing it in turn could each find it off because another had
    # paused it, and none turn it back on: only the main thread pauses it.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, to open every window
    stop = threading.Event()
    worker_pauses: list[None] = []

    def pausing() -> None:
        while not stop.is_set():
            with collector_paused():
                worker_pauses.append(None)

    workers = [threading.Thread(target=pausing) for _ in range(3)]
    try:
        for worker in workers:
            worker.start()
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            with collector_paused():
                assert not gc.isenabled()
        stop.set()
        for worker in workers:
            worker.join()
    finally:
        stop.set()
        sys.setswitchinterval(interval)
    left_on = gc.isenabled()
    gc.enable()  # for the tests after this one, whatever happened here
    assert left_on
    assert worker_pauses  # the workers ran, alongside the main thread's pauses


def test_what_a_pause_made_goes_to_the_oldest_generation() -> None:
    # Young collections would walk a large answer, then walk it again: 30 ms
    # and more for 10,000 audit rows, on each read.
    with collector_paused(lasting=True):
        made = [{"row": [i]} for i in range(1000)]
    assert not any(o is made for o in gc.get_objects(generation=0))
    assert any(o is made for o in gc.get_objects(generation=2))


def test_a_pause_keeps_a_frozen_heap_frozen() -> None:
    # ``serve`` freezes what it loaded; thawing it would hand it back.
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with collector_paused(lasting=True):
            pass
        # Thawed, it would be none. A few frozen with the rest may die
        # meanwhile, in threads an earlier test left winding down (seen once).
        assert frozen - 1000 <= gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


class _Node:
    other: object = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_cycles_made_in_lasting_pauses_are_collected_unasked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What a lasting pause ages is not counted toward CPython's own full
    # collections: one runs as a lasting pause starts, once enough was aged.
    monkeypatch.setattr(collector, "FULL_COLLECTION_AFTER", 5_000)
    monkeypatch.setattr(collector, "_aged", 0)
    cycles = []
    for _ in range(4):
        with collector_paused(lasting=True):
            cycles.append(_cycle())
            kept = [dict[str, int]() for _ in range(2_000)]
        del kept
    # Over 5,000 aged after the third: the fourth began with a full collection.
    assert [cycle() for cycle in cycles[:3]] == [None, None, None]


def test_a_lasting_pause_that_makes_no_cycle_brings_no_full_collection_nearer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A decoded answer, or structs converted to builtins, is a tree that
    # reference counting frees whole: counted as aged, it brought on the full
    # collection meant for cycles every few answers of 10,000 audit rows.
    monkeypatch.setattr(collector, "FULL_COLLECTION_AFTER", 5_000)
    monkeypatch.setattr(collector, "_aged", 0)
    with collections_seen() as seen:
        for _ in range(4):
            with collector_paused(lasting=True, cycles=False):
                kept = [dict[str, int]() for _ in range(2_000)]
            del kept
    assert 2 not in seen


def test_a_callers_young_cycle_is_collected_before_a_lasting_pause() -> None:
    # Aged with the pause's own objects, it would wait for a full collection.
    # In the middle generation: it outlived one young collection before it
    # became garbage.
    node = _Node()
    node.other = node
    alive = weakref.ref(node)
    gc.collect(0)
    del node
    with collector_paused(lasting=True):
        assert alive() is None


def test_the_rules_refuse_before_the_pre_add_check_probes_the_weights(
    make_models: MakeModels,
) -> None:
    # The probe can be slow (a listing of the weights fetched); what the rules
    # refuse is answered without it, and with the rules' reason.
    check = RefuseSources("hf://broken/")
    models = make_models(config_yaml(spec("declared")), pre_add_check=check)
    models.add(spec("a"), by=ACTOR)
    head = models.revision
    check.checked.clear()
    with pytest.raises(DeclaredInConfig):
        models.add(spec("declared", source="hf://broken/declared"), by=ACTOR)
    with pytest.raises(RevisionConflict):
        models.add(spec("b", source="hf://broken/b"), by=ACTOR, expected_revision=head - 1)
    with pytest.raises(InvalidModel, match="fallbacks"):
        models.add(spec("c", fallbacks=("nowhere",)), by=ACTOR)
    with pytest.raises(Refused, match=r"change 2 \(scale nowhere\)"):
        models.apply_changes([commands.add(spec("d")), commands.scale("nowhere", 1, 2)], by=ACTOR)
    assert check.checked == []
    assert models.revision == head
    # What the rules accept is still probed, alone or in a batch.
    with pytest.raises(Refused, match="cannot load hf://broken/e"):
        models.add(spec("e", source="hf://broken/e"), by=ACTOR)
    with pytest.raises(Refused, match="cannot load hf://broken/g"):
        models.apply_changes(
            [commands.add(spec("f")), commands.add(spec("g", source="hf://broken/g"))], by=ACTOR
        )
    assert check.checked == ["e", "f", "g"]
    result = models.apply_changes([commands.add(spec("f")), commands.scale("a", 1, 2)], by=ACTOR)
    assert (result["revision"], result["changes"]) == (head + 2, 2)
    assert [r["event"] for r in models.refusals()] == [
        "Added",
        "Added",
        "Added",
        "Scaled",
        "Added",
        "Added",
    ]
