"""Property: whatever commands were run, accepted or refused, the catalog a
fresh service rebuilds from the log is the catalog the live service holds,
and the log's revisions are gapless; and a list of them applied at once
ends as they do one at a time."""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from catalog_es import commands as steps
from catalog_es.application import CommandResult, Models
from catalog_es.bootstrap import open_models
from catalog_es.errors import InputError, Refused
from catalog_es.model import model_id, model_key
from catalog_es.spec import Adapter, Origin, Scaling
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
