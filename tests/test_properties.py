"""Property: whatever commands were run, accepted or refused, the catalog a
fresh service rebuilds from the log is the catalog the live service holds,
and the log's revisions are gapless; a list of them applied at once ends
as they do one at a time; a rollback leaves the catalog at its revision
(or that dimension, or that model, alone), and a diff takes the catalog at
one revision to the catalog at the other."""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from catalog_es import commands as steps
from catalog_es.application import CommandResult, Models
from catalog_es.bootstrap import open_models
from catalog_es.errors import InputError, Refused
from catalog_es.model import model_id, model_key
from catalog_es.spec import Adapter, ModelSpec, Origin, Scaling
from projections.diff import diff_catalogs
from tests.helpers import ACTOR, CPU, CPU_NO_MEMORY, GPU, SHA, config_yaml, spec

# A small pool, so commands collide: fallbacks, replaces, removals of targets,
# and refusals of the declared name.
NAMES = ("a", "b", "c", "declared")
DECLARED = spec("declared", profiles=(CPU_NO_MEMORY,))


class Call(NamedTuple):
    """One command, as data, so a failing example prints readably."""

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __call__(self, models: Models) -> CommandResult:
        result: CommandResult = getattr(models, self.method)(*self.args, **self.kwargs)
        return result


def call(method: str, *args: Any, **kwargs: Any) -> st.SearchStrategy[Call]:
    """A strategy for ``models.method(*args, **kwargs)``, each argument a strategy."""
    keys = list(kwargs)
    return st.tuples(st.tuples(*args), st.tuples(*kwargs.values())).map(
        lambda drawn: Call(method, drawn[0], dict(zip(keys, drawn[1], strict=True)))
    )


names = st.sampled_from(NAMES)
runtime_names = st.sampled_from(NAMES[:-1])
actor = st.just(ACTOR)
bound = st.none() | st.integers(min_value=-1, max_value=3)
# Mostly valid choices, so that most commands are accepted and the catalog
# grows, with enough invalid ones that refusals are exercised too.
definitions = st.builds(
    spec,
    names,
    engine=st.sampled_from(["vllm", "vllm", "sglang", "no-such-engine"]),
    profiles=st.sampled_from([(GPU,), (GPU,), (CPU,), (GPU, CPU), (CPU_NO_MEMORY,), ()]),
    scaling=st.sampled_from(
        [Scaling(), Scaling(min=0, max=2), Scaling(min=1, max=3), Scaling(2, 1)]
    ),
    fallbacks=st.just(()) | st.lists(names, max_size=2, unique=True).map(tuple),
)
adapters = st.lists(
    st.builds(Adapter, name=st.sampled_from(["x", "y"]), source=st.just("s3://adapters/x")),
    max_size=2,
).map(tuple)
origins = st.none() | st.builds(
    Origin, repository=st.just("org/repo"), files=st.sampled_from([{}, {"w": SHA}, {"w": "bad"}])
)

# Commands mostly about names that exist: each script starts by adding some.
prelude = st.lists(
    st.builds(lambda name: Call("add", (spec(name),), {"by": ACTOR}), runtime_names),
    min_size=1,
    max_size=3,
)

commands = st.one_of(
    call("add", definitions, by=actor),
    call("add", definitions, by=actor),  # twice: the catalog needs models to change
    call("remove", names, by=actor),
    call("scale", names, bound, bound, by=actor),
    call(
        "set_resources",
        names,
        profile=st.sampled_from(["", "gpu", "cpu", "tpu"]),
        memory_gb=st.sampled_from([None, 0, 16, -1]),
        cpu_cores=st.sampled_from([None, 4]),
        by=actor,
    ),
    call("set_class", names, st.sampled_from(["", "critical", "opportunistic", "gold"]), by=actor),
    call("set_owner", names, st.sampled_from(["", "team:search", "nobody"]), by=actor),
    call("set_adapters", names, adapters, by=actor),
    call("set_source", names, st.sampled_from(["s3://weights/v2", "has space"]), origins, by=actor),
    call("set_origin", names, origins),
)


def _state(models: Models) -> tuple[Any, ...]:
    """Everything replay builds: the models in force, each stream's position
    and definition, the revision, and what was skipped."""
    catalog = models.catalog
    streams = {name: (a.version, a.spec) for name, a in catalog.aggregates.items()}
    return catalog.models(), streams, catalog.revision, catalog.skipped


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prelude, st.lists(commands, min_size=8, max_size=30))
def test_the_catalog_rebuilt_from_the_log_is_the_one_in_force(
    prelude: list[Call], script: list[Call]
) -> None:
    # One database per example: tmp_path would be shared by all of them.
    with tempfile.TemporaryDirectory() as directory:
        config = Path(directory) / "catalog.yaml"
        config.write_text(config_yaml(DECLARED), encoding="utf-8")
        db = f"sqlite:///{directory}/catalog.db"
        live = open_models(db, str(config))
        written = 0
        try:
            for command in prelude + script:
                try:
                    result = command(live)
                except Refused:
                    continue
                if result.written:
                    # The first write records the declared config before itself.
                    assert result.revision == written + (2 if written == 0 else 1)
                    written = result.revision
            rebuilt = open_models(db, str(config))
            try:
                assert _state(rebuilt) == _state(live)
                assert rebuilt.catalog.skipped == []
            finally:
                rebuilt.close()
            assert [e["revision"] for e in live.log_events()] == list(range(1, written + 1))
        finally:
            live.close()


# The change each command makes, as a list given to ``apply`` holds it
# (``set_origin`` is none an ``apply`` can hold).
STEPS: dict[str, Callable[..., steps.Step]] = {
    "add": steps.add,
    "remove": steps.remove,
    "scale": steps.scale,
    "set_resources": steps.resources,
    "set_class": steps.capacity_class,
    "set_owner": steps.owner,
    "set_adapters": steps.adapters,
    "set_source": steps.source,
}


def as_step(command: Call) -> steps.Step:
    """``command``'s change, as an item of a list of changes."""
    kwargs = {key: value for key, value in command.kwargs.items() if key != "by"}
    return STEPS[command.method](*command.args, **kwargs)


def _readable(command: Call) -> bool:
    # A change that says nothing to set makes a list of changes unreadable,
    # refused whole before any change is decided; not what is compared here.
    try:
        as_step(command)
    except InputError:
        return False
    return True


batchable = commands.filter(lambda command: command.method in STEPS).filter(_readable)


def _events(models: Models) -> list[dict[str, Any]]:
    # One write stamps its events with one time; one command at a time, each its own.
    return [{k: v for k, v in e.items() if k != "time"} for e in models.log_events()]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prelude, st.lists(batchable, min_size=1, max_size=8))
def test_a_list_of_changes_ends_as_they_do_made_one_at_a_time(
    prelude: list[Call], script: list[Call]
) -> None:
    """The same catalog, events and answers (each change's definition, and
    whether an add replaced one); or, where one of those commands is
    refused, the list refused naming that change and its reason, and
    nothing written."""
    with tempfile.TemporaryDirectory() as directory:
        config = Path(directory) / "catalog.yaml"
        config.write_text(config_yaml(DECLARED), encoding="utf-8")
        alone = open_models(f"sqlite:///{directory}/alone.db", str(config))
        batched = open_models(f"sqlite:///{directory}/batched.db", str(config))
        try:
            for command in prelude:
                command(alone)
                command(batched)
            answers: list[CommandResult] = []
            refused: tuple[int, str] | None = None
            for number, command in enumerate(script, start=1):
                try:
                    answers.append(command(alone))
                except Refused as refusal:
                    refused = (number, str(refusal))
                    break
            before = _events(batched)
            try:
                result = batched.apply_changes([as_step(c) for c in script], by=ACTOR)
            except Refused as refusal:
                assert refused is not None, f"refused as a list only: {refusal}"
                number, reason = refused
                assert str(refusal).startswith(f"change {number} (")
                assert str(refusal).endswith(f" refused, nothing applied: {reason}")
                assert _events(batched) == before
                return
            assert refused is None, f"change {refused[0]} alone was refused: {refused[1]}"
            assert [(m["definition"], m["replaced"]) for m in result["models"]] == [
                (answer.model, answer.replaced) for answer in answers
            ]
            assert _events(batched) == _events(alone)
            assert batched.list_models() == alone.list_models()
        finally:
            alone.close()
            batched.close()


# A second config, as a deploy under way has on some nodes: it declares a
# name the first runs at runtime, so each node accepts what the other's
# replay must skip (a removal of a fallback only the hidden definition names).
ROLLING = (DECLARED, spec("a", profiles=(GPU,)))
# A chain through that name: c falls back on a, which falls back on b.
CHAIN = [
    Call("add", (spec(name, fallbacks=fallbacks),), {"by": ACTOR})
    for name, fallbacks in (("b", ()), ("a", ("b",)), ("c", ("a",)))
]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.booleans(), commands), min_size=8, max_size=30))
def test_every_event_load_skips_has_its_audit_row_saying_why(
    script: list[tuple[bool, Call]],
) -> None:
    """Whatever two nodes of two configs wrote, each skip a load reports
    (``verify``, ``model show``) is an audit row of that revision and model
    saying the same, and no other row says it was skipped."""
    with tempfile.TemporaryDirectory() as directory:
        first, rolling = Path(directory) / "first.yaml", Path(directory) / "rolling.yaml"
        first.write_text(config_yaml(DECLARED), encoding="utf-8")
        rolling.write_text(config_yaml(*ROLLING), encoding="utf-8")
        db = f"sqlite:///{directory}/catalog.db"
        nodes = (open_models(db, str(first)), open_models(db, str(rolling)))
        try:
            for command in CHAIN:
                command(nodes[0])
            for on_rolling, command in script:
                try:
                    command(nodes[on_rolling])
                except Refused:
                    continue
            fresh = open_models(db, str(first))
            try:
                skipped = {(s.revision, s.model, s.reason) for s in fresh.catalog.skipped}
                rows = {
                    (r["revision"], r["model"], r["skipped"])
                    for r in fresh.audit()
                    if r["skipped"] is not None
                }
                assert rows == skipped
            finally:
                fresh.close()
        finally:
            for node in nodes:
                node.close()


# A model's stream is found by its name alone, in every log written so far:
# the id must stay the name-based UUID it has always been.
_MODEL_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "catalog-es:model")


@given(st.text(max_size=200))
def test_a_model_s_stream_id_is_the_uuid5_of_its_name(name: str) -> None:
    assert model_id(name) == uuid.uuid5(_MODEL_NAMESPACE, name)
    assert model_key(name) == model_id(name).int


def test_a_model_s_stream_id_is_the_one_earlier_versions_wrote() -> None:
    assert model_id("qwen2.5-7b-instruct") == uuid.UUID("d7f4b730-17d0-5aaf-8022-207f04c79796")


# -- rollback and diff over any history -------------------------------------------------

# What each ``--only`` dimension sets of a definition: the rest must stay.
DIMENSION_FIELDS = {
    "source": ("source", "origin"),
    "scaling": ("scaling",),
    "resources": ("profiles",),
    "class": ("capacity_class",),
    "owner": ("owner",),
    "adapters": ("adapters",),
}
# The fields of a model's view ``--only`` can change: its own, and those
# following from them.
SHOWN = {
    "source": {"source", "origin"},
    "scaling": {"scaling", "effective_class"},
    "resources": {"profiles", "warnings"},
    "class": {"class", "effective_class"},
    "owner": {"owner"},
    "adapters": {"adapters"},
}
# Changes most often accepted, so that the catalog moves in every dimension
# between two revisions; with any command, and rollbacks, whose events land
# as one write.
valid_definitions = st.builds(
    spec,
    runtime_names,
    engine=st.sampled_from(["vllm", "sglang"]),
    profiles=st.sampled_from([(GPU,), (CPU,), (GPU, CPU)]),
    scaling=st.sampled_from([Scaling(), Scaling(min=0, max=2)]),
    owner=st.sampled_from(["", "team:a"]),
    fallbacks=st.just(()) | st.lists(names, max_size=2, unique=True).map(tuple),
)
valid_changes = st.one_of(
    call("add", valid_definitions, by=actor),
    call("add", valid_definitions, by=actor),
    call("remove", runtime_names, by=actor),
    call("scale", runtime_names, st.integers(0, 2), st.integers(2, 3), by=actor),
    call(
        "set_resources",
        runtime_names,
        profile=st.just("gpu"),
        memory_gb=st.sampled_from([16, 64]),
        cpu_cores=st.sampled_from([None, 8]),
        by=actor,
    ),
    call("set_class", runtime_names, st.sampled_from(["", "critical"]), by=actor),
    call("set_owner", runtime_names, st.sampled_from(["", "team:search"]), by=actor),
    call("set_adapters", runtime_names, adapters, by=actor),
    call(
        "set_source",
        runtime_names,
        st.sampled_from(["s3://weights/v2", "s3://weights/v3"]),
        origins,
        by=actor,
    ),
)
change = st.one_of(
    valid_changes, valid_changes, commands, call("rollback", st.integers(0, 20), by=actor)
)
history = st.lists(change, min_size=6, max_size=20)
# Where a revision is drawn, its share of the head (a history's length is unknown till run).
share = st.integers(1, 99).map(lambda percent: percent / 100)


def _at(share: float, models: Models) -> int:
    """The revision a read at that share of the head reads: inside a write,
    the boundary before it."""
    return models.resolve(round(share * models.revision))


def _run(models: Models, script: list[Call]) -> None:
    for command in script:
        try:
            command(models)
        except Refused:
            continue


def _specs(models: Models, at: int | None = None) -> dict[str, ModelSpec]:
    return {m.name: m for m in models.catalog_at(at).models()}


def _unchanged(diff: dict[str, Any]) -> bool:
    return not (diff["added"] or diff["removed"] or diff["changed"])


def _refused_as_recorded(models: Models, log: list[dict[str, Any]], refusals: int) -> None:
    """Nothing written, and the refusal kept as a ``Rollback``."""
    assert _events(models) == log
    kept = models.refusals()
    assert len(kept) == refusals + 1
    assert kept[-1]["event"] == "Rollback"


# Today's config, as the history's (``DECLARED`` alone) or after a deploy:
# one declaring a name the history ran at runtime, one allowing fewer
# engines (what ran on the others no longer loads), one declaring nothing
# (what fell back on the declared model no longer loads).
TODAY = {
    "same": config_yaml(DECLARED),
    "declaring": config_yaml(*ROLLING),
    "narrower": config_yaml(DECLARED, engines=["vllm"]),
    "empty": config_yaml(),
}


def _names(diff: dict[str, Any]) -> set[str]:
    return {m["name"] for m in diff["added"] + diff["removed"]} | {
        c["model"] for c in diff["changed"]
    }


def _read_otherwise_then(models: Models, revision: int) -> set[str]:
    """The models the catalog at ``revision`` has otherwise over the config
    recorded then than over today's."""
    today, then = models.catalog_at(revision), models.catalog_at(revision, declared_then=True)
    return _names(diff_catalogs(today, then))


@pytest.fixture(params=["sqlite", "postgresql"])
def new_database(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], str]:
    """``new_database()``: the URL of a database of its own, on either backend,
    for each example a test draws (the function's fixtures are shared by all)."""
    if request.param == "sqlite":
        return lambda: f"sqlite:///{tmp_path}/{uuid.uuid4().hex}.db"
    make: Callable[[], str] = request.getfixturevalue("pg_schema_url")
    return make


# Fewer examples than the others: each makes a PostgreSQL schema (30 took 6 s).
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(prelude, history, share, st.sampled_from(list(TODAY)))
def test_a_rollback_leaves_the_catalog_at_its_revision_and_a_second_writes_nothing(
    new_database: Callable[[], str],
    prelude: list[Call],
    script: list[Call],
    target_share: float,
    today: str,
) -> None:
    """After ``rollback(R)`` the catalog in force is the catalog at R, both
    over today's config (the models it declares noted and left out), as its
    dry run said; a second writes nothing, and ``diff R`` shows nothing, nor
    ``diff R --declared-then`` beyond what the deploy changed. Or it is
    refused: nothing written, the refusal kept."""
    with tempfile.TemporaryDirectory() as directory:
        first, deployed = Path(directory) / "first.yaml", Path(directory) / "today.yaml"
        first.write_text(TODAY["same"], encoding="utf-8")
        deployed.write_text(TODAY[today], encoding="utf-8")
        db = new_database()
        with closing(open_models(db, str(first))) as writer:
            _run(writer, prelude + script)
        with closing(open_models(db, str(deployed))) as models:
            target = _at(target_share, models)
            head = models.revision
            log, refusals = _events(models), len(models.refusals())
            try:
                dry = models.rollback(target, dry_run=True, by=ACTOR)
            except Refused as refusal:
                # Over the config the history ran on, the catalog at R was valid
                # as it stands, step by step: nothing can stand in its way.
                assert today != "same", refusal
                with pytest.raises(Refused) as real:
                    models.rollback(target, by=ACTOR)
                assert str(real.value) == str(refusal)
                _refused_as_recorded(models, log, refusals)
                return
            assert _events(models) == log
            differently = _read_otherwise_then(models, head) if target else set()
            done = models.rollback(target, by=ACTOR)
            assert (done["events"], done["notes"], done["diff"]) == (
                dry["events"],
                dry["notes"],
                dry["diff"],
            )
            assert models.list_models() == models.list_models(at=target)
            assert _specs(models) == _specs(models, target)
            assert done["diff"] == models.diff(head, target)
            declared = {m["name"] for m in models.list_models() if m["declared"]}
            assert [n for n in done["notes"] if "declared in configuration now" in n] == [
                f"model {name!r} is declared in configuration now; its runtime history is left out"
                for name in sorted(declared)
                if any(e["model"] == name for e in log)
            ]
            after = models.revision
            again = models.rollback(target, by=ACTOR)
            assert (again["written"], again["events"], models.revision) == (False, [], after)
            assert _unchanged(models.diff(target))
            if target == 0:
                return  # No config is recorded at 0: --declared-then refuses it, as documented.
            # Each end over the config recorded then: what the deploy changed, at either.
            differently |= _read_otherwise_then(models, target)
            assert _names(models.diff(target, declared_then=True)) <= differently


def _without(spec: ModelSpec, dimension: str) -> ModelSpec:
    """``spec`` with what ``--only dimension`` may set put aside: for
    resources, the memory and cores of each profile (its GPUs and the
    profiles it has stay)."""
    if dimension == "resources":
        profiles = tuple(
            msgspec.structs.replace(p, min_memory_gb=0, cpu_cores=0) for p in spec.profiles
        )
        return msgspec.structs.replace(spec, profiles=profiles)
    blank = dict.fromkeys(DIMENSION_FIELDS[dimension])
    return msgspec.structs.replace(spec, **blank)


def _dimension(spec: ModelSpec, dimension: str) -> tuple[Any, ...]:
    if dimension == "resources":
        return tuple(sorted((p.name, p.min_memory_gb, p.cpu_cores) for p in spec.profiles))
    return tuple(getattr(spec, field) for field in DIMENSION_FIELDS[dimension])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prelude,
    history,
    share,
    st.none() | st.sampled_from(list(DIMENSION_FIELDS)),
    st.none() | names,
    st.sampled_from(list(TODAY)),
)
def test_a_rollback_of_one_dimension_or_one_model_changes_nothing_else(
    prelude: list[Call],
    script: list[Call],
    target_share: float,
    only: str | None,
    model: str | None,
    today: str,
) -> None:
    """``--only`` changes that dimension alone of each model, to what it was
    at R where the model was in force at both; ``--model`` that model
    alone, to what it was at R; both read over today's config. Or it is
    refused: nothing written, the refusal kept."""
    with tempfile.TemporaryDirectory() as directory:
        first, deployed = Path(directory) / "first.yaml", Path(directory) / "today.yaml"
        first.write_text(TODAY["same"], encoding="utf-8")
        deployed.write_text(TODAY[today], encoding="utf-8")
        db = f"sqlite:///{directory}/catalog.db"
        with closing(open_models(db, str(first))) as writer:
            _run(writer, prelude + script)
        with closing(open_models(db, str(deployed))) as models:
            target = _at(target_share, models)
            before, then = _specs(models), _specs(models, target)
            log, refusals = _events(models), len(models.refusals())
            head = models.revision
            try:
                done = models.rollback(target, only=only, model=model, by=ACTOR)
            except Refused:
                _refused_as_recorded(models, log, refusals)
                return
            if only is None:
                assert done["diff"] == models.diff(head, target, model=model)
            else:
                assert done["diff"]["added"] == done["diff"]["removed"] == []
                for change in done["diff"]["changed"]:
                    assert change["fields"].keys() <= SHOWN[only]
            after = _specs(models)
            for name in before.keys() | after.keys() | then.keys():
                expected = before.get(name)
                if model in (None, name):
                    if only is None:
                        expected = then.get(name)
                    elif name in before and name in then:
                        assert _without(after[name], only) == _without(before[name], only)
                        if only == "resources":
                            # Only the profiles both have are set.
                            kept = {p.name for p in before[name].profiles}
                            set_to = {p.name: p for p in then[name].profiles if p.name in kept}
                            profiles = tuple(set_to.get(p.name, p) for p in after[name].profiles)
                            assert _dimension(after[name], only) == _dimension(
                                msgspec.structs.replace(after[name], profiles=profiles), only
                            )
                        else:
                            assert _dimension(after[name], only) == _dimension(then[name], only)
                        continue
                assert after.get(name) == expected, name


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prelude,
    st.lists(st.tuples(st.sampled_from(list(TODAY)), change), min_size=6, max_size=20),
    st.tuples(share, share).filter(lambda ends: ends[0] != ends[1]),
    st.sampled_from(list(TODAY)),
    st.booleans(),
)
def test_a_diff_takes_the_catalog_at_one_revision_to_the_catalog_at_the_other(
    prelude: list[Call],
    script: list[tuple[str, Call]],
    ends: tuple[float, float],
    today: str,
    declared_then: bool,
) -> None:
    """Whatever nodes of several configs wrote, ``diff(A, B)``'s added,
    removed and changed, applied to the catalog at A, give the catalog at B,
    each read over today's config or (``--declared-then``) the one recorded
    then; ``diff(B, A)`` is its mirror image, ``diff(A, A)`` empty, and
    ``diff --model`` its part."""
    with tempfile.TemporaryDirectory() as directory:
        configs = {name: Path(directory) / f"{name}.yaml" for name in TODAY}
        for name, path in configs.items():
            path.write_text(TODAY[name], encoding="utf-8")
        db = f"sqlite:///{directory}/catalog.db"
        nodes = {name: open_models(db, str(path)) for name, path in configs.items()}
        try:
            _run(nodes["same"], prelude)
            for config, command in script:
                _run(nodes[config], [command])
        finally:
            for node in nodes.values():
                node.close()
        with closing(open_models(db, str(configs[today]))) as models:
            a, b = (_at(end, models) for end in ends)
            # No config is recorded at 0: --declared-then refuses it, as documented.
            then = declared_then and a > 0 and b > 0
            forward, backward = (
                models.diff(a, b, declared_then=then),
                models.diff(b, a, declared_then=then),
            )
            catalog = {m["name"]: m for m in models.list_models(at=a, declared_then=then)}
            for removed in forward["removed"]:
                assert catalog.pop(removed["name"]) == removed
            for added in forward["added"]:
                assert catalog.setdefault(added["name"], added) is added
            for change in forward["changed"]:
                view = catalog[change["model"]]
                for field, values in change["fields"].items():
                    assert view.get(field) == values["before"]
                    view[field] = values["after"]
                    if field == "warnings" and values["after"] is None:
                        del view[field]  # absent when there are none
            assert [catalog[name] for name in sorted(catalog)] == models.list_models(
                at=b, declared_then=then
            )
            assert (backward["from"], backward["to"]) == (b, a)
            assert (backward["added"], backward["removed"]) == (
                forward["removed"],
                forward["added"],
            )
            assert backward["changed"] == [
                {
                    "model": change["model"],
                    "fields": {
                        field: {"before": values["after"], "after": values["before"]}
                        for field, values in change["fields"].items()
                    },
                }
                for change in forward["changed"]
            ]
            assert _unchanged(models.diff(a, a, declared_then=then))
            for name in NAMES:
                one = models.diff(a, b, model=name, declared_then=then)
                assert one["added"] == [m for m in forward["added"] if m["name"] == name]
                assert one["removed"] == [m for m in forward["removed"] if m["name"] == name]
                assert one["changed"] == [c for c in forward["changed"] if c["model"] == name]
