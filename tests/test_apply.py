"""``apply``: a list of changes in one transaction, all or nothing."""

from __future__ import annotations

import json
import re
import tracemalloc
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from catalog_es import commands, errors
from catalog_es.application import Models
from catalog_es.cli import cli
from catalog_es.configuration import DeclaredConfig
from catalog_es.errors import InputError, Refused, json_in_pieces, json_line
from catalog_es.inputs import MAX_CHANGES, read_changes
from catalog_es.spec import ModelSpec
from tests.conftest import RefuseSources
from tests.helpers import count_events, model_spec

CHANGES = """
- add: {name: a, engine: vllm, source: hf://o/a, profiles: [{name: g, gpus: 1}]}
- add: {name: b, engine: vllm, source: hf://o/b, profiles: [{name: g, gpus: 1}], fallbacks: [a]}
- scale: {name: a, max: 3}
- resources: {name: a, profile: g, memory_gb: 64}
- class: {name: b, class: critical}
- owner: {name: b, owner: "team:x"}
- adapters: {name: a, adapters: [{name: sql, source: "s3://adapters/sql"}]}
- source: {name: b, source: "hf://o/b2", origin: {repository: o/b2, revision: abc1234}}
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "changes.yaml"
    path.write_text(text)
    return str(path)


def test_every_change_lands_in_one_transaction(db_url: str, tmp_path: Path) -> None:
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    result = models.apply_changes(read_changes(write(tmp_path, CHANGES)), by="ops")
    assert result["changes"] == 8
    assert count_events(db_url) == 8
    a, b = models.get_model("a"), models.get_model("b")
    assert a["scaling"] == {"min": 1, "max": 3}
    assert a["profiles"][0]["min_memory_gb"] == 64
    assert a["adapters"] == [{"name": "sql", "source": "s3://adapters/sql"}]
    assert (b["class"], b["owner"], b["source"]) == ("critical", "team:x", "hf://o/b2")
    # One transaction: one timestamp, so an `at` inside it reads the state before it.
    times = {e["time"] for e in models.log_events()}
    assert len(times) == 1
    assert models.list_models(at=4) == []


def test_one_refused_change_refuses_them_all(db_url: str, tmp_path: Path) -> None:
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.apply_changes(read_changes(write(tmp_path, CHANGES)), by="ops")
    rows = count_events(db_url)
    # Removing a while b still falls back to it is refused; the scale before it must not land.
    bad = "- scale: {name: b, max: 5}\n- remove: a\n"
    with pytest.raises(Refused, match=r"change 2 \(remove a\) refused, nothing applied"):
        models.apply_changes(read_changes(write(tmp_path, bad)), by="ops")
    assert count_events(db_url) == rows
    assert models.get_model("b")["scaling"] == {"min": 1, "max": 1}
    # In an order where every step is valid, the same removal goes through.
    good = "- add: {name: b, engine: vllm, source: hf://o/b, profiles: [{name: g, gpus: 1}]}\n"
    good += "- remove: {name: a}\n"  # as every other change names its model, or alone
    models.apply_changes(read_changes(write(tmp_path, good)), by="ops")
    assert [m["name"] for m in models.list_models()] == ["b"]


def test_a_list_of_as_many_changes_as_an_apply_takes_is_read(tmp_path: Path) -> None:
    """The limit is the most changes taken, not the fewest refused (one more
    is, test_fuzz): counted before parsing, and again once parsed."""
    text = json.dumps([{"remove": "m"}] * MAX_CHANGES)
    assert len(read_changes(write(tmp_path, text))) == MAX_CHANGES


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "the list of changes is empty: give at least one change"),
        ("- frobnicate: {name: a}\n", "change 1: expected one of add, remove"),
        ("- scale: {name: a, min: x}\n", "change 1 (scale): min: Input should be a valid integer"),
        ("- scale: {name: a}\n", "change 1 (scale): say what to set"),
        ("- remove: [a]\n", "change 1 (remove): remove: give the model's name, or {name: NAME}"),
        ("- remove: {name: a, max: 2}\n", "change 1 (remove): max: unknown field"),
        ("- owner: {name: 'a b', owner: ''}\n", "change 1 (owner): model 'a b': name"),
        ("- add: {name: a}\n", "change 1 (add): engine: required field is missing"),
    ],
)
def test_a_malformed_changes_file_is_one_clear_error(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(InputError, match="^.*" + re.escape(message)):
        read_changes(write(tmp_path, text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '- add: {name: b, engine: vllm, source: "hf://b\\0", profiles: [{name: g, gpus: 1}]}\n',
            "change 1 (add b) refused, nothing applied: model 'b': source: holds U+0000",
        ),
        (
            '- scale: {name: a, max: 2}\n- source: {name: a, source: "hf://o/\\e[2Jb"}\n',
            "change 2 (source a) refused, nothing applied: model 'a': source: holds U+001B",
        ),
    ],
)
def test_cli_apply_refuses_a_source_with_a_control_character_and_writes_nothing(
    tmp_path: Path, text: str, message: str
) -> None:
    db = f"sqlite:///{tmp_path}/catalog.db"
    runner = CliRunner()
    assert runner.invoke(cli, ["--db", db, "apply", write(tmp_path, CHANGES)]).exit_code == 0
    rows = count_events(db)
    refused = runner.invoke(cli, ["--db", db, "apply", write(tmp_path, text)])
    assert refused.exit_code == 1
    assert refused.stderr.splitlines() == [f"error: {message}, a control or format character"]
    assert count_events(db) == rows


def test_cli_apply_exit_codes_and_nothing_written_on_refusal(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/catalog.db"
    runner = CliRunner()
    done = runner.invoke(cli, ["--db", db, "apply", write(tmp_path, CHANGES), "--json"])
    assert done.exit_code == 0, done.stderr
    assert '"changes": 8' in done.stdout
    rows = count_events(db)
    refused = runner.invoke(cli, ["--db", db, "apply", write(tmp_path, "- remove: a\n")])
    assert refused.exit_code == 1
    assert len(refused.stderr.strip().splitlines()) == 1
    assert refused.stderr.startswith("error: change 1 (remove a) refused")
    assert count_events(db) == rows


def test_cli_apply_says_which_adds_replaced_a_model(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/catalog.db"
    runner = CliRunner()
    assert runner.invoke(cli, ["--db", db, "apply", write(tmp_path, CHANGES)]).exit_code == 0
    again = (
        "- scale: {name: a, max: 2}\n"
        "- add: {name: b, engine: vllm, source: hf://o/b3, profiles: [{name: g, gpus: 1}]}\n"
    )
    both = runner.invoke(cli, ["--db", db, "apply", write(tmp_path, again)])
    assert both.exit_code == 0, both.stderr
    head = count_events(db)
    assert both.stdout.splitlines() == [f"applied 2 changes, now at revision {head}", "replaced b"]
    one = runner.invoke(cli, ["--db", db, "apply", write(tmp_path, "- remove: {name: a}\n")])
    assert one.stdout == f"applied 1 change, now at revision {head + 1}\n"


def test_a_large_apply_lands_whole_and_its_rollback_too(db_url: str) -> None:
    """Thousands of events in one transaction (PostgreSQL's pipeline mode is
    known to stall on a single very large write): all land, in order, and one
    rollback takes them all back in one transaction."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    steps = [commands.add(spec) for spec in (model_spec(f"m-{i:05d}") for i in range(6000))]
    result = models.apply_changes(steps, by="ops")
    assert result["changes"] == 6000
    assert count_events(db_url) == 6000 == len(models.list_models())
    back = models.rollback(0, by="ops")
    assert len(back["events"]) == 6000
    assert count_events(db_url) == 12000
    assert models.list_models() == []
    assert models.verify()["ok"] is True


def test_a_refused_apply_is_kept_apart_naming_the_change_that_could_not_go(
    db_url: str, tmp_path: Path
) -> None:
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.apply_changes(read_changes(write(tmp_path, CHANGES)), by="ops")
    rows = count_events(db_url)
    bad = "- scale: {name: b, max: 5}\n- remove: a\n"
    with pytest.raises(Refused):
        models.apply_changes(read_changes(write(tmp_path, bad)), by="mallory", reason="tidy")
    (refusal,) = models.refusals()
    assert (refusal["by"], refusal["model"], refusal["event"], refusal["reason"]) == (
        "mallory",
        "a",
        "Removed",
        "tidy",
    )
    assert "change 2 (remove a) refused" in refusal["refusal"]
    assert count_events(db_url) == rows


def test_an_add_the_pre_add_check_refuses_is_named_as_the_change_that_could_not_go(
    db_url: str,
) -> None:
    """As a change the rules refuse is: its place in the list and its model
    (the same name may be added twice), in the error and the refusal kept.
    It was the check's bare reason (hostile test)."""
    models = Models(DeclaredConfig(), pre_add_check=RefuseSources(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("a"), by="ops")
    rows = count_events(db_url)
    steps = [
        commands.add(model_spec("a", source="hf://org/a2")),
        commands.scale("a", maximum=3),
        commands.add(model_spec("a", source="hf://broken/a")),
    ]
    said = (
        "change 3 (add a) refused, nothing applied: model 'a': the engine cannot load hf://broken/a"
    )
    with pytest.raises(Refused) as refused:
        models.apply_changes(steps, by="mallory")
    assert str(refused.value) == said
    (refusal,) = models.refusals()
    assert (refusal["model"], refusal["event"], refusal["refusal"]) == ("a", "Added", said)
    assert count_events(db_url) == rows


def test_a_list_refused_as_a_whole_is_kept_as_apply_not_as_its_first_change(
    db_url: str, tmp_path: Path
) -> None:
    """A stale expected revision refuses no one change: it was recorded as the
    first one's (review)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.apply_changes(read_changes(write(tmp_path, CHANGES)), by="ops")
    rows = count_events(db_url)
    steps = [commands.remove("a"), commands.scale("b", maximum=4)]
    with pytest.raises(Refused, match="the log is at revision"):
        models.apply_changes(steps, by="mallory", expected_revision=1)
    (refusal,) = models.refusals()
    assert (refusal["model"], refusal["event"], refusal["fields"]) == (
        None,
        "Apply",
        {"changes": ["remove a", "scale b"]},
    )
    assert [r["id"] for r in models.refusals(event_type="Apply")] == [refusal["id"]]
    assert count_events(db_url) == rows
    runner = CliRunner()
    db = ["--db", db_url]
    listed = runner.invoke(cli, [*db, "refusals", "--type", "apply", "--json"])
    assert listed.exit_code == 0, listed.output
    assert [r["event"] for r in json.loads(listed.stdout)] == ["Apply"]


def test_a_list_with_an_add_refused_as_a_whole_before_the_probe_is_kept_as_apply(
    db_url: str,
) -> None:
    """Where a pre-add check probes the weights, the list is decided before
    it, and a stale expected revision refused there was recorded as the
    list's last change (hostile test)."""
    models = Models(DeclaredConfig(), pre_add_check=RefuseSources(), env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("a"), by="ops")
    stale = models.revision
    models.scale("a", maximum=2, by="ops")
    rows = count_events(db_url)
    steps = [commands.add(model_spec("b")), commands.scale("a", maximum=4)]
    with pytest.raises(Refused, match="the log is at revision"):
        models.apply_changes(steps, by="mallory", expected_revision=stale)
    (refusal,) = models.refusals()
    assert (refusal["model"], refusal["event"], refusal["fields"]) == (
        None,
        "Apply",
        {"changes": ["add b", "scale a"]},
    )
    assert count_events(db_url) == rows


class RefuseSourcesUnprobed(RefuseSources):
    """A check that refuses without a slow probe, so is asked with no list decided first."""

    probes = False


def test_an_apply_refuses_its_names_and_actor_before_the_log_or_the_check(db_url: str) -> None:
    """As a single command does: a name no model can have, with its place in
    the list, before a stale expected revision or the pre-add check; an actor
    no one can be before the check, which would keep a refusal under it."""
    check = RefuseSourcesUnprobed()
    models = Models(DeclaredConfig(), pre_add_check=check, env={"CATALOG_ES_DB": db_url})
    models.add(model_spec("a"), by="ops")
    check.checked.clear()
    rows = count_events(db_url)
    broken = commands.add(model_spec("b", source="hf://broken/b"))
    with pytest.raises(Refused, match=r"^change 2 \(scale a b\) refused, nothing applied: .*name"):
        models.apply_changes(
            [broken, commands.scale("a b", maximum=2)], by="ops", expected_revision=0
        )
    with pytest.raises(InputError, match=r"^actor ''"):
        models.apply_changes([broken], by="")
    assert check.checked == []
    assert [(r["event"], r["model"], r["by"]) for r in models.refusals()] == [
        ("Scaled", "a b", "ops")
    ]
    assert count_events(db_url) == rows


def test_a_list_decided_before_the_probe_decides_each_change_on_the_ones_before_it(
    db_url: str,
) -> None:
    """The decision a probing pre-add check waits for is the write's: a change
    to a model an earlier change adds goes through, probed once."""
    check = RefuseSources()
    models = Models(DeclaredConfig(), pre_add_check=check, env={"CATALOG_ES_DB": db_url})
    steps = [commands.add(model_spec("a")), commands.scale("a", maximum=3)]
    assert models.apply_changes(steps, by="ops")["changes"] == 2
    assert models.get_model("a")["scaling"] == {"min": 1, "max": 3}
    assert check.checked == ["a"]


def test_a_refused_changes_fields_are_kept_only_up_to_a_size(db_url: str, tmp_path: Path) -> None:
    # An apply file may be 64 MiB: its refused change is recorded, not copied whole.
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.apply_changes(read_changes(write(tmp_path, CHANGES)), by="ops")
    huge = f"- owner: {{name: a, owner: team:{'x' * 200_000}}}\n"
    with pytest.raises(Refused):
        models.apply_changes(read_changes(write(tmp_path, huge)), by="mallory")
    (refusal,) = models.refusals()
    assert refusal["fields"] == {"omitted": "200017 bytes of fields; at most 65536 are kept"}


def test_a_batch_continues_each_stream_at_its_own_next_version(db_url: str) -> None:
    """Streams of different lengths, one never written: every stream in the log
    stays numbered 1, 2, 3… with no gap and no repeat."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    for name in ("long", "short"):
        models.add(model_spec(name), by="ops")
    for replicas in range(2, 7):
        models.scale("long", 1, replicas, by="ops")
    models.apply_changes(
        [
            commands.scale("long", 0, 2),
            commands.scale("short", 0, 2),
            commands.add(model_spec("new")),
            commands.scale("long", 1, 3),
        ],
        by="ops",
    )
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT originator_id, originator_version FROM catalog_events ORDER BY revision"
                )
            ).all()
    finally:
        engine.dispose()
    streams: dict[str, list[int]] = {}
    for originator_id, version in rows:
        streams.setdefault(str(originator_id), []).append(version)
    assert sorted(map(len, streams.values())) == [1, 2, 8]
    assert all(versions == list(range(1, len(versions) + 1)) for versions in streams.values())


def _many_adapters(name: str, count: int) -> ModelSpec:
    adapters = [{"name": f"ad{i}", "source": f"s3://adapters/{name}/ad{i}"} for i in range(count)]
    return model_spec(name, adapters=adapters)


@pytest.mark.parametrize(("adapters", "changes"), [(100, 2_000), (5_000, 40)])
def test_a_large_answer_is_built_as_it_is_read(db_url: str, adapters: int, changes: int) -> None:
    """Each change's item gives the model whole: 5,000 changes to one model
    with a hundred adapters answered 58 MB, held whole until written (and,
    by the server, for as long as its client did not read). Read a piece
    at a time, it is never all in memory, nor are many large items at once
    (64 definitions of 10 MB were built and joined together)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(_many_adapters("wide", adapters), by="ops")
    steps = [commands.scale("wide", 0, 1 + i % 7) for i in range(changes)]
    tracemalloc.start()
    try:
        result = models.apply_changes(steps, by="ops")
        head = {"revision": result["revision"], "changes": result["changes"]}
        size = 0
        for piece in json_in_pieces(json_line, ", ", result["models"], head, "models"):
            size += len(piece)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size > 10_000_000
    assert peak < size / 3, (peak, size)


def test_a_list_of_many_models_is_built_as_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list of the models answers each model whole: 100,000 of them took
    133 MB more than the catalog to answer at once, held by a server for as
    long as its client did not read. Read a piece at a time, it is never all
    in memory, and it is the list all the same."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{tmp_path}/c.db"})
    models.apply_changes(
        [commands.add(_many_adapters(f"m{i}", 20)) for i in range(2_000)], by="ops"
    )
    # Pieces smaller than a catalog of this size, as they are than a large one.
    monkeypatch.setattr(errors, "PIECE_LENGTH", 1 << 14)
    whole = "".join(json_in_pieces(json_line, ", ", models.models_as_read()))
    assert whole == json_line(models.list_models())
    tracemalloc.start()
    try:
        size = sum(map(len, json_in_pieces(json_line, ", ", models.models_as_read())))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size > 2_000_000
    # Answered whole, it took 3.5 times its size.
    assert peak < size / 10, (peak, size)


def test_cli_apply_json_is_one_document_whatever_its_length(tmp_path: Path) -> None:
    """Written in pieces, the answer is still one line of JSON: each change's
    item, in the file's order, with the model as that change left it."""
    db = f"sqlite:///{tmp_path}/catalog.db"
    adds = "".join(
        f"- add: {{name: m{i}, engine: vllm, source: hf://o/m, profiles: [{{name: g, gpus: 1}}]}}\n"
        for i in range(300)
    )
    scales = "".join(f"- scale: {{name: m{i % 300}, max: {2 + i % 5}}}\n" for i in range(600))
    done = CliRunner().invoke(
        cli, ["--db", db, "--json", "apply", write(tmp_path, adds + scales + "- remove: m7\n")]
    )
    assert done.exit_code == 0, done.stderr
    assert done.stdout.count("\n") == 1
    answer = json.loads(done.stdout)
    assert (answer["revision"], answer["changes"]) == (901, 901)
    assert [(m["model"], m["event"]) for m in answer["models"]] == (
        [(f"m{i}", "Added") for i in range(300)]
        + [(f"m{i % 300}", "Scaled") for i in range(600)]
        + [("m7", "Removed")]
    )
    assert [m["definition"]["scaling"]["max"] for m in answer["models"][300:900]] == [
        2 + i % 5 for i in range(600)
    ]
    assert answer["models"][-1]["definition"] is None
