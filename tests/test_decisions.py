"""Deciding a command: given events, when a candidate event, then the definition
it puts in force or the refusal (its type and what it tells the operator)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from catalog_es.catalog import Catalog
from catalog_es.decisions import decide
from catalog_es.errors import (
    ConfigError,
    DeclaredInConfig,
    InvalidModel,
    ModelNotFound,
    shown,
)
from catalog_es.model import EVENT_TYPES, Model, model_id
from catalog_es.spec import Adapter, Origin, Profile, Scaling
from tests.helpers import (
    CPU,
    CPU_NO_MEMORY,
    GPU,
    SHA,
    added,
    candidate,
    event,
    given,
    removed,
    spec,
)


def when(catalog: Catalog, e: Model.Event) -> Any:
    """Decide ``e`` as the next event of its stream; the catalog must not change."""
    before = (catalog.models(), {n: a.version for n, a in catalog.aggregates.items()})
    try:
        return decide(catalog, candidate(catalog, e))
    finally:
        # Deciding is pure: only a committed event changes the catalog.
        assert before == (catalog.models(), {n: a.version for n, a in catalog.aggregates.items()})


# -- every command's effect ------------------------------------------------------

BASE = spec("base", profiles=(GPU, CPU), adapters=(Adapter(name="tone", source="s3://a/tone"),))
ORIGIN = Origin(repository="org/base", revision="c0ffee0", files={"model.safetensors": SHA})


def _profiles(**changes: Any) -> tuple[Profile, ...]:
    return tuple(msgspec.structs.replace(p, **changes) for p in BASE.profiles)


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        pytest.param(
            event(Model.Scaled, "base", scaling=Scaling(min=0, max=4)),
            {"scaling": Scaling(min=0, max=4)},
            id="scaled",
        ),
        pytest.param(
            event(Model.ResourcesSet, "base", profile="cpu", memory_gb=16),
            {"profiles": (GPU, msgspec.structs.replace(CPU, min_memory_gb=16))},
            id="resources-one-profile",
        ),
        pytest.param(
            event(Model.ResourcesSet, "base", memory_gb=64, cpu_cores=12),
            {"profiles": _profiles(min_memory_gb=64, cpu_cores=12)},
            id="resources-all-profiles",
        ),
        pytest.param(
            event(Model.ResourcesSet, "base", cpu_cores=12),
            {"profiles": _profiles(cpu_cores=12)},
            id="resources-cores-only-keeps-memory",
        ),
        pytest.param(
            event(Model.ClassSet, "base", capacity_class="critical"),
            {"capacity_class": "critical"},
            id="class",
        ),
        pytest.param(
            event(Model.OwnerSet, "base", owner="team:search"), {"owner": "team:search"}, id="owner"
        ),
        pytest.param(
            event(Model.AdaptersSet, "base", adapters=(Adapter(name="sql", source="s3://a/sql"),)),
            {"adapters": (Adapter(name="sql", source="s3://a/sql"),)},
            id="adapters",
        ),
        pytest.param(
            event(Model.SourceSet, "base", source="s3://weights/base-v2", origin=ORIGIN),
            {"source": "s3://weights/base-v2", "origin": ORIGIN},
            id="source-with-origin",
        ),
        pytest.param(
            event(Model.OriginSet, "base", origin=ORIGIN), {"origin": ORIGIN}, id="origin"
        ),
        pytest.param(removed("base"), None, id="removed"),
    ],
)
def test_each_command_puts_its_change_in_force(
    command: Model.Event, expected: dict[str, Any] | None
) -> None:
    catalog = given(added(BASE))
    result = when(catalog, command)
    assert result == (None if expected is None else msgspec.structs.replace(BASE, **expected))


def test_events_and_definitions_cannot_be_changed_in_place() -> None:
    # The catalog shares them between revisions, snapshots and readers: one
    # changed in place would change history.
    events = [e for e, _ in DECLARED_ADVICE] + [upstream_moved("x")]
    assert {type(e) for e in events} == set(EVENT_TYPES)
    values = [*events, Model.new("x"), BASE, GPU, BASE.scaling, BASE.adapters[0], ORIGIN]
    for value in values:
        field = msgspec.structs.fields(value)[0].name
        with pytest.raises(AttributeError):
            setattr(value, field, getattr(value, field))


def test_re_adding_a_runtime_name_replaces_its_definition() -> None:
    catalog = given(added(spec("a", owner="team:x")))
    replacement = spec("a", source="s3://other/a")
    assert when(catalog, added(replacement)) == replacement


def test_remove_then_re_add_continues_the_same_stream() -> None:
    catalog = given(added(spec("a")), removed("a"))
    assert catalog.get("a") is None
    stream = catalog.aggregate("a")
    assert (stream.id, stream.version) == (model_id("a"), 2)
    next_add = candidate(catalog, added(spec("a")))
    assert (next_add.originator_id, next_add.originator_version) == (model_id("a"), 3)
    assert decide(catalog, next_add) == spec("a")


def test_a_skipped_event_still_advances_its_stream() -> None:
    # Its record holds the version: the next command must follow it, not reuse it.
    catalog = given(added(spec("x", engine="gone")), event(Model.Scaled, "x", scaling=Scaling()))
    assert [s.revision for s in catalog.skipped] == [1, 2]
    assert catalog.aggregate("x").version == 2
    assert candidate(catalog, added(spec("x"))).originator_version == 3


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(removed("a"), id="removed-twice"),
        pytest.param(event(Model.Scaled, "a", scaling=Scaling()), id="scaled"),
        pytest.param(event(Model.OwnerSet, "a", owner="team:x"), id="owner"),
    ],
)
def test_a_removed_model_cannot_be_changed(command: Model.Event) -> None:
    with pytest.raises(ModelNotFound, match="'a' is not in the catalog"):
        when(given(added(spec("a")), removed("a")), command)


def test_a_name_never_added_cannot_be_changed() -> None:
    with pytest.raises(ModelNotFound, match="'ghost'"):
        when(given(), event(Model.Scaled, "ghost", scaling=Scaling()))


def test_an_added_definition_must_bear_the_name_it_is_added_under() -> None:
    # A record written by hand, or by a bug: the stream is the name's, and
    # would hold a definition that answers to another.
    mismatched = msgspec.structs.replace(added(spec("b")), model="a", originator_id=model_id("a"))
    with pytest.raises(InvalidModel) as refusal:
        when(given(), mismatched)
    assert str(refusal.value) == "model 'a': name: the definition is named 'b'"


# -- configuration wins -------------------------------------------------------------

DECLARED = spec("declared")


DECLARED_ADVICE = [
    (added(spec("declared")), "edit that rather than adding a second definition"),
    (removed("declared"), "remove it there, or it comes back on the next restart"),
    (
        event(Model.Scaled, "declared", scaling=Scaling(min=2, max=2)),
        "change its scaling there, or it reverts on the next restart",
    ),
    (
        event(Model.ResourcesSet, "declared", memory_gb=8),
        "change its resources there, or it reverts",
    ),
    (
        event(Model.ClassSet, "declared", capacity_class="critical"),
        "change its class there, or it reverts",
    ),
    (event(Model.OwnerSet, "declared", owner="team:x"), "change its owner there, or it reverts"),
    (
        event(Model.AdaptersSet, "declared", adapters=()),
        "change its adapters there, or it reverts",
    ),
    (
        event(Model.SourceSet, "declared", source="s3://x"),
        "change its source there, or it reverts",
    ),
    (
        event(Model.OriginSet, "declared", origin=ORIGIN),
        "record its origin there, or it reverts",
    ),
]


@pytest.mark.parametrize(
    ("command", "advice"),
    [pytest.param(e, advice, id=type(e).__name__) for e, advice in DECLARED_ADVICE],
)
def test_a_declared_model_is_refused_with_advice_for_the_change(
    command: Model.Event, advice: str
) -> None:
    catalog = given(declared=[DECLARED])
    with pytest.raises(DeclaredInConfig) as refusal:
        when(catalog, command)
    message = str(refusal.value)
    assert "model 'declared' is declared in configuration" in message
    assert advice in message


def test_a_declared_name_is_refused_even_when_the_runtime_definition_is_valid() -> None:
    # Not a collision the catalog could resolve by replacing: config wins.
    catalog = given(declared=[spec("declared", engine="tgi")])
    with pytest.raises(DeclaredInConfig):
        when(catalog, added(spec("declared", engine="vllm")))
    assert catalog.get("declared") == spec("declared", engine="tgi")


# -- observations ----------------------------------------------------------------------


def upstream_moved(name: str) -> Model.Event:
    """What ``check-updates`` records of ``name``: upstream moved off its commit."""
    upstream = Origin(repository=f"org/{name}", revision="b" * 40, files={"m.gguf": SHA})
    return event(Model.UpstreamChanged, name, ref="main", revision="a" * 40, upstream=upstream)


def test_an_observation_leaves_the_definition_in_force_declared_or_not() -> None:
    # A record of what was seen, not a change: configuration does not refuse it.
    catalog = given(added(BASE), declared=[DECLARED])
    assert when(catalog, upstream_moved("base")) == BASE
    assert when(catalog, upstream_moved("declared")) == DECLARED


@pytest.mark.parametrize(
    "history",
    [
        pytest.param([], id="never-added"),
        pytest.param([added(spec("x")), removed("x")], id="removed"),
        pytest.param([added(spec("x", engine="gone"))], id="skipped"),
    ],
)
def test_an_observation_of_a_model_out_of_force_is_refused(history: list[Model.Event]) -> None:
    with pytest.raises(ModelNotFound, match="'x' is not in the catalog"):
        when(given(*history), upstream_moved("x"))


# -- fallbacks ---------------------------------------------------------------------


def test_a_fallback_may_name_a_runtime_or_a_declared_model() -> None:
    catalog = given(added(spec("runtime")), declared=[DECLARED])
    model = spec("a", fallbacks=("runtime", "declared"))
    assert when(catalog, added(model)) == model


@pytest.mark.parametrize(
    ("history", "model", "problem"),
    [
        pytest.param(
            [],
            spec("a", fallbacks=("ghost",)),
            "fallbacks: names 'ghost', which is not in the catalog",
            id="names-nothing",
        ),
        pytest.param(
            [added(spec("gone")), removed("gone")],
            spec("a", fallbacks=("gone",)),
            "fallbacks: names 'gone', which is not in the catalog",
            id="names-a-removed-model",
        ),
        pytest.param(
            [],
            spec("a", fallbacks=("a",)),
            "fallbacks: a model cannot be its own fallback",
            id="names-itself",
        ),
        pytest.param(
            [added(spec("b")), added(spec("a", fallbacks=("b",)))],
            spec("b", fallbacks=("a",)),
            "fallbacks: form a cycle: b -> a -> b",
            id="two-cycle",
        ),
        pytest.param(
            [
                added(spec("c")),
                added(spec("b", fallbacks=("c",))),
                added(spec("a", fallbacks=("b",))),
            ],
            spec("c", fallbacks=("a",)),
            "fallbacks: form a cycle: c -> a -> b -> c",
            id="three-cycle",
        ),
        pytest.param(
            [added(spec("b"))],
            spec("a", fallbacks=("b", "b")),
            "fallbacks: 'b' appears more than once",
            id="duplicate",
        ),
    ],
)
def test_fallbacks_must_name_other_models_without_a_cycle(
    history: list[Model.Event], model: Any, problem: str
) -> None:
    with pytest.raises(InvalidModel) as refusal:
        when(given(*history), added(model))
    assert (refusal.value.model, refusal.value.field) == (model.name, "fallbacks")
    assert problem in str(refusal.value)


@pytest.mark.parametrize(
    ("length", "told"),
    [
        # One model left out would be said by its name: told whole.
        (6, "m6 -> m1 -> m2 -> m3 -> m4 -> m5 -> m6"),
        (7, "m7 -> m1 -> m2 -> m3 -> m4 -> … (2 more) -> m7"),
    ],
)
def test_a_cycle_is_told_whole_up_to_six_models_then_by_its_first_five(
    length: int, told: str
) -> None:
    # Given a chain m1 -> m2 -> ... -> m<length>
    last = f"m{length}"
    chain = [added(spec(last))] + [
        added(spec(f"m{i}", fallbacks=(f"m{i + 1}",))) for i in range(length - 1, 0, -1)
    ]
    # When its last model names the first, then the cycle is told so.
    with pytest.raises(InvalidModel) as refusal:
        when(given(*chain), added(spec(last, fallbacks=("m1",))))
    assert str(refusal.value) == f"model {last!r}: fallbacks: form a cycle: {told}"


def test_removing_a_fallback_target_is_refused_until_no_model_names_it() -> None:
    catalog = given(
        added(spec("small")),
        added(spec("big", fallbacks=("small",))),
        added(spec("huge", fallbacks=("small",))),
    )
    with pytest.raises(InvalidModel) as refusal:
        when(catalog, removed("small"))
    assert refusal.value.field == "fallbacks"
    assert str(refusal.value) == (
        "model 'small': fallbacks: is a fallback of 'big', 'huge'; add those models again "
        "without 'small' in their fallbacks first (model show NAME --json > FILE, edit it, "
        "model add FILE)"
    )

    catalog.apply(candidate(catalog, added(spec("big"))), 4)
    with pytest.raises(InvalidModel, match="is a fallback of 'huge'; add that model again"):
        when(catalog, removed("small"))
    catalog.apply(candidate(catalog, removed("huge")), 5)
    assert catalog.skipped == []
    assert when(catalog, removed("small")) is None


# -- the memory rule -----------------------------------------------------------------

LEGACY = spec("legacy", profiles=(GPU, CPU_NO_MEMORY))


def test_the_memory_rule_is_not_applied_on_replay_or_to_declared_models() -> None:
    # Stored before the rule, and declared: both still load.
    catalog = given(added(LEGACY), declared=[spec("kubeai-cpu", profiles=(CPU_NO_MEMORY,))])
    assert catalog.skipped == []
    assert catalog.get("legacy") == LEGACY
    assert catalog.get("kubeai-cpu") is not None
    # A runtime model may still lean on the declared one.
    assert when(catalog, added(spec("a", fallbacks=("kubeai-cpu",)))) is not None


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(added(spec("a", profiles=(CPU_NO_MEMORY,))), id="add"),
        pytest.param(added(spec("base", profiles=(GPU, CPU_NO_MEMORY))), id="replace"),
        pytest.param(
            event(Model.ResourcesSet, "base", profile="cpu", memory_gb=0), id="resources-to-zero"
        ),
        pytest.param(
            event(Model.ResourcesSet, "legacy", cpu_cores=8), id="resources-all-leaving-zero"
        ),
        pytest.param(
            event(Model.ResourcesSet, "legacy", profile="cpu", cpu_cores=8),
            id="resources-one-leaving-zero",
        ),
    ],
)
def test_a_cpu_only_profile_without_memory_is_refused(command: Model.Event) -> None:
    catalog = given(added(BASE), added(LEGACY))
    with pytest.raises(InvalidModel) as refusal:
        when(catalog, command)
    assert refusal.value.field == "profile 'cpu'"
    assert "runs without a GPU and declares no memory (min_memory_gb)" in str(refusal.value)


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(
            event(Model.ResourcesSet, "legacy", profile="cpu", memory_gb=1),
            id="resources-fixes-it-with-the-least",
        ),
        pytest.param(
            event(Model.ResourcesSet, "legacy", profile="gpu", cpu_cores=8),
            id="resources-on-another-profile",
        ),
        pytest.param(event(Model.Scaled, "legacy", scaling=Scaling(max=3)), id="scaled"),
        pytest.param(event(Model.OwnerSet, "legacy", owner="team:x"), id="owner"),
        pytest.param(added(spec("gpu-no-memory", profiles=(Profile(name="g", gpus=1),))), id="gpu"),
    ],
)
def test_the_memory_rule_leaves_other_changes_alone(command: Model.Event) -> None:
    assert when(given(added(LEGACY)), command) is not None


# -- printable sources ---------------------------------------------------------------

ODD = spec("odd", source="hf://org/a\x00b", adapters=(Adapter("x", "s3://x\u202e"),))


@pytest.mark.parametrize(
    ("command", "field", "code"),
    [
        pytest.param(added(spec("a", source="hf://o/\x00")), "source", "U+0000", id="add-nul"),
        pytest.param(
            event(Model.SourceSet, "base", source="hf://o/\x1b[2J"), "source", "U+001B", id="esc"
        ),
        pytest.param(
            event(Model.AdaptersSet, "base", adapters=(Adapter("x", "s3://x\u202egpj"),)),
            "adapters[0].source",
            "U+202E",
            id="adapter-bidi",
        ),
    ],
)
def test_a_source_with_a_control_or_format_character_is_refused(
    command: Model.Event, field: str, code: str
) -> None:
    with pytest.raises(InvalidModel) as refusal:
        when(given(added(BASE)), command)
    assert refusal.value.field == field
    assert f"holds {code}, a control or format character" in str(refusal.value)


def test_printable_sources_are_not_required_on_replay_rollback_or_other_changes() -> None:
    # Stored before the rule: it loads, takes other changes, and a rollback
    # may put it back as it was.
    catalog = given(added(ODD))
    assert catalog.skipped == [] and catalog.get("odd") == ODD
    assert when(catalog, event(Model.OwnerSet, "odd", owner="team:x")) is not None
    back = msgspec.structs.replace(event(Model.SourceSet, "odd", source=ODD.source), rollback_to=1)
    assert when(catalog, back) is not None
    assert when(catalog, added(spec("fine", source="file:///data/été/😀"))) is not None


# -- origins -------------------------------------------------------------------------

DIGEST = "a" * 64
GOOD_ORIGIN = Origin(repository="Qwen/Qwen2.5-7B", revision="1f3c9a0", files={"sub/m.gguf": DIGEST})
NOT_A_PATH = "is not a plain path inside a revision"


@pytest.mark.parametrize(
    ("origin", "field", "problem"),
    [
        pytest.param(Origin(repository="../etc"), "origin.repository", "is not org/name", id="up"),
        pytest.param(Origin(repository="a/b/c"), "origin.repository", "is not org/name", id="deep"),
        pytest.param(Origin(revision="main"), "origin.revision", "is not a commit id", id="branch"),
        pytest.param(Origin(revision="x\ny"), "origin.revision", "is not a commit", id="newline"),
        pytest.param(
            Origin(files={"../../etc/passwd": DIGEST}),
            "origin.files['../../etc/passwd']",
            NOT_A_PATH,
            id="file-up",
        ),
        pytest.param(Origin(files={"": DIGEST}), "origin.files['']", NOT_A_PATH, id="empty"),
        pytest.param(Origin(files={"/abs": DIGEST}), "origin.files['/abs']", NOT_A_PATH, id="abs"),
        pytest.param(Origin(files={"./m": DIGEST}), "origin.files['./m']", NOT_A_PATH, id="dot"),
        pytest.param(
            Origin(files={"a\0b": DIGEST}),
            "origin.files['a\\x00b']",
            "holds a NUL, which no file name can",
            id="nul",
        ),
        *(
            pytest.param(
                Origin(files={name: DIGEST}),
                f"origin.files[{shown(name)}]",
                f"holds U+{ord(held):04X}, which a terminal acts on",
                id=case,
            )
            for name, held, case in [
                ("evil\u202egpj.exe", "\u202e", "file-bidi"),
                ("a\x1b[2Jb", "\x1b", "file-escape"),
                ("a\nb", "\n", "file-newline"),
            ]
        ),
        pytest.param(
            Origin(files={"x" * 256: DIGEST}),
            f"origin.files[{shown('x' * 256)}]",
            "longer than a weights folder holds",
            id="long-name",
        ),
        pytest.param(
            Origin(files={"d/" * 2048 + "f": DIGEST}),
            f"origin.files[{shown('d/' * 2048 + 'f')}]",
            "longer than a weights folder holds",
            id="long-path",
        ),
        # No revision holds x as a file and as a folder: no update or
        # rollback could fetch them (hostile test).
        pytest.param(
            Origin(files={"x/y/z": DIGEST, "x-1": DIGEST, "x": DIGEST}),
            "origin.files['x']",
            "is a file, and a folder of 'x/y/z': no revision holds both",
            id="file-and-folder",
        ),
    ],
)
@pytest.mark.parametrize("how", ["add", "source"])
def test_an_origin_no_registry_could_name_is_refused(
    origin: Origin, field: str, problem: str, how: str
) -> None:
    command = (
        added(spec("a", origin=origin))
        if how == "add"
        else event(Model.SourceSet, "base", source="hf://o/b2", origin=origin)
    )
    with pytest.raises(InvalidModel) as refusal:
        when(given(added(BASE)), command)
    assert refusal.value.field == field
    assert problem in refusal.value.problem


@pytest.mark.parametrize(
    "path",
    # A joiner, a soft hyphen, a no-break space: text, as a registry may name a file.
    ["model\xa0v2.bin", "read\u200dme.md", "soft\xadhyphen.bin", "模型/权重.bin", "x" * 255],
)
def test_an_origin_file_name_a_file_system_holds_is_taken(path: str) -> None:
    # Beside a folder whose name begins as the file's does, not a folder of it.
    beside = f"{path[:200]}-/y"
    origin = Origin(repository="o/m", revision="1f3c9a0", files={path: DIGEST, beside: DIGEST})
    assert when(given(), added(spec("a", origin=origin))) is not None


def test_origins_are_checked_only_as_new_input() -> None:
    stored = spec("odd", origin=Origin(repository="../x", revision="a b", files={"": DIGEST}))
    catalog = given(added(stored))
    assert catalog.skipped == [] and catalog.get("odd") == stored
    assert when(catalog, event(Model.OwnerSet, "odd", owner="team:x")) is not None
    back = msgspec.structs.replace(
        event(Model.SourceSet, "odd", source=stored.source, origin=stored.origin), rollback_to=1
    )
    assert when(catalog, back) is not None
    assert when(catalog, added(spec("fine", origin=GOOD_ORIGIN))) is not None


# -- malformed fields ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field", "problem"),
    [
        pytest.param({"engine": "triton"}, "engine", "'triton' is not a known engine", id="engine"),
        pytest.param({"owner": "bob"}, "owner", "is not org:ID, team:ID", id="owner-no-kind"),
        pytest.param({"owner": "user:bob"}, "owner", "is not org:ID", id="owner-bad-kind"),
        pytest.param({"owner": "team:"}, "owner", "is not org:ID", id="owner-no-id"),
        pytest.param({"capacity_class": "gold"}, "class", "'gold' is not one of", id="class"),
        pytest.param({"capacity_class": "Critical"}, "class", "is not one of", id="class-case"),
        pytest.param(
            {"profiles": (GPU, msgspec.structs.replace(CPU, name="gpu"))},
            "profiles",
            "'gpu' appears more than once",
            id="duplicate-profile",
        ),
        pytest.param(
            {"adapters": (Adapter(name="x", source="s3://a"), Adapter(name="x", source="s3://b"))},
            "adapters",
            "'x' appears more than once",
            id="duplicate-adapter",
        ),
        pytest.param({"profiles": ()}, "profiles", "at least one profile", id="no-profiles"),
        pytest.param(
            {"profiles": (Profile(name="g", gpus=-1),)},
            "profiles[0].gpus",
            "cannot be negative",
            id="negative-gpus",
        ),
        pytest.param(
            {"profiles": (Profile(name="c", min_memory_gb=-8),)},
            "profiles[0].min_memory_gb",
            "cannot be negative",
            id="negative-memory",
        ),
        pytest.param(
            {"profiles": (Profile(name="bad name", gpus=1),)},
            "profiles[0].name",
            "is not a valid name",
            id="profile-name",
        ),
        pytest.param(
            {"scaling": Scaling(min=-1, max=1)}, "scaling", "need 0 <= min", id="negative-min"
        ),
        pytest.param({"scaling": Scaling(min=3, max=2)}, "scaling", "min 3, max 2", id="min>max"),
        pytest.param({"scaling": Scaling(min=0, max=0)}, "scaling", "max >= 1", id="max-zero"),
        pytest.param({"source": ""}, "source", "must not be empty", id="empty-source"),
        pytest.param({"source": "hf://a b"}, "source", "white space", id="source-space"),
        pytest.param(
            {"source": "s3://" + "x" * 2044}, "source", "longer than 2048", id="source-2049-long"
        ),
        pytest.param(
            {"profiles": (Profile(name="g", gpus=2**63),)},
            "profiles[0].gpus",
            "is larger than 2^63 - 1 (9223372036854775807)",
            id="gpus-past-64-bits",
        ),
        pytest.param(
            {"scaling": Scaling(min=2**63, max=2**63)},
            "scaling.min",
            "is larger than 2^63 - 1",
            id="scaling-min-past-64-bits",
        ),
        pytest.param(
            {"scaling": Scaling(min=1, max=2**63)},
            "scaling.max",
            "is larger than 2^63 - 1",
            id="scaling-max-past-64-bits",
        ),
        pytest.param(
            {"adapters": (Adapter(name="-x", source="s3://a"),)},
            "adapters[0].name",
            "is not a valid name",
            id="adapter-name",
        ),
        pytest.param(
            {"origin": Origin(files={"w.bin": "ABC"})},
            "origin.files['w.bin']",
            "sha256",
            id="origin-digest",
        ),
    ],
)
def test_a_malformed_field_is_refused_naming_the_model_and_field(
    fields: dict[str, Any], field: str, problem: str
) -> None:
    with pytest.raises(InvalidModel) as refusal:
        when(given(), added(spec("m", **fields)))
    assert (refusal.value.model, refusal.value.field) == ("m", field)
    assert problem in str(refusal.value)


@pytest.mark.parametrize(
    "name",
    ["has space", "-leading-dash", ".leading-dot", "x" * 129, "ünïcode", "tab\there", "new\nline"],
)
def test_a_bad_name_is_refused(name: str) -> None:
    with pytest.raises(InvalidModel) as refusal:
        when(given(), added(spec(name)))
    assert refusal.value.field == "name"
    assert "is not a valid name" in str(refusal.value)
    assert "\n" not in str(refusal.value)  # one line, whatever the name holds


@pytest.mark.parametrize(
    ("name", "as_shown"),
    [
        pytest.param("-" + "x" * 39, "-" + "x" * 39, id="40-whole"),
        pytest.param("-" + "x" * 40, "-" + "x" * 39 + "…", id="41-cut"),
    ],
)
def test_a_bad_name_is_named_whole_up_to_40_characters(name: str, as_shown: str) -> None:
    with pytest.raises(InvalidModel) as refusal:
        when(given(), added(spec(name)))
    assert refusal.value.model == as_shown
    assert str(refusal.value).startswith(f"model {as_shown!r}: name: ")


@pytest.mark.parametrize("name", ["a", "Qwen/Qwen2.5-0.5B:q4_k_m", "x" * 128, "7b"])
def test_a_good_name_is_accepted(name: str) -> None:
    assert when(given(), added(spec(name))) == spec(name)


def test_the_largest_counts_and_the_longest_source_are_accepted() -> None:
    # The bounds are inclusive: 2^63 - 1 is a 64-bit integer's, 2048 characters a source's.
    most = 2**63 - 1
    largest = Profile(name="g", gpus=most, gpu_memory_gb=most, min_memory_gb=most, cpu_cores=most)
    model = spec(
        "m", source="s3://" + "x" * 2043, profiles=(largest,), scaling=Scaling(min=most, max=most)
    )
    assert len(model.source) == 2048
    assert when(given(), added(model)) == model


def test_resources_for_an_unknown_profile_are_refused() -> None:
    with pytest.raises(InvalidModel, match="has no profile 'nope' \\(it has: gpu, cpu\\)"):
        when(given(added(BASE)), event(Model.ResourcesSet, "base", profile="nope", memory_gb=4))


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        pytest.param(
            {"memory_gb": -1}, "profiles[0].min_memory_gb", "cannot be negative", id="mem"
        ),
        pytest.param({"cpu_cores": -1}, "profiles[0].cpu_cores", "cannot be negative", id="cores"),
        pytest.param(
            {"cpu_cores": 2**63}, "profiles[0].cpu_cores", "is larger than 2^63 - 1", id="huge"
        ),
    ],
)
def test_resources_out_of_range_are_refused(
    change: dict[str, int], field: str, problem: str
) -> None:
    # On a GPU profile, which the memory rule leaves alone.
    with pytest.raises(InvalidModel) as refusal:
        when(given(added(BASE)), event(Model.ResourcesSet, "base", profile="gpu", **change))
    assert refusal.value.field == field
    assert problem in refusal.value.problem


# -- engines -------------------------------------------------------------------------


def test_configured_engines_replace_the_default_list() -> None:
    catalog = given(engines=["vllm", "ollama"])
    assert when(catalog, added(spec("a", engine="ollama"))) is not None
    with pytest.raises(InvalidModel, match="'tgi' is not a known engine \\(known: ollama, vllm\\)"):
        when(catalog, added(spec("a", engine="tgi")))


# -- the declared layer ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("declared", "problem"),
    [
        pytest.param(
            [spec("a", fallbacks=("b",))], "fallbacks: names 'b', which is not declared", id="ghost"
        ),
        pytest.param(
            [spec("a", fallbacks=("b",)), spec("b", fallbacks=("a",))],
            "form a cycle",
            id="cycle",
        ),
        pytest.param(
            [spec("a", fallbacks=("b",)), spec("b", fallbacks=("c",)), spec("c", fallbacks=("a",))],
            "^model 'a': fallbacks: form a cycle: a -> b -> c -> a$",
            id="cycle-told-from-its-first-model",
        ),
        pytest.param(
            # The search passes 'c' before it reaches the cycle through 'b'.
            [spec("c"), spec("a", fallbacks=("b",)), spec("b", fallbacks=("c", "a"))],
            "^model 'a': fallbacks: form a cycle: a -> b -> a$",
            id="cycle-naming-a-model-off-it",
        ),
        pytest.param([spec("a"), spec("a")], "'a' is declared more than once", id="duplicate"),
        pytest.param([spec("a", engine="triton")], "not a known engine", id="engine"),
    ],
)
def test_an_invalid_declared_config_does_not_load(declared: list[Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        Catalog(declared)


# -- cost -------------------------------------------------------------------------------


def counted_lookups(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """How many catalog look-ups have been made, from here on: work is
    counted so (wall time would be flaky)."""
    lookups = 0
    real_get = Catalog.get

    def counting_get(self: Catalog, name: str) -> Any:
        nonlocal lookups
        lookups += 1
        return real_get(self, name)

    monkeypatch.setattr(Catalog, "get", counting_get)
    return lambda: lookups


def test_replaying_a_long_fallback_chain_is_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    # A replay must cost the same per event however deep the fallback chains already are.
    lookups = counted_lookups(monkeypatch)
    depth = 400
    chain = [added(spec("m0"))] + [
        added(spec(f"m{i}", fallbacks=(f"m{i - 1}",))) for i in range(1, depth)
    ]
    catalog = given(*chain)
    assert (len(catalog), catalog.skipped) == (depth, [])
    assert lookups() < 5 * depth
    # And a change that could close the chain into a cycle is still caught.
    with pytest.raises(InvalidModel, match=f"form a cycle: m0 -> m{depth - 1} -> "):
        when(catalog, added(spec("m0", fallbacks=(f"m{depth - 1}",))))


def test_checking_a_long_declared_fallback_chain_is_linear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every start checks the declared layer, and searched from each model in
    turn for a cycle, a chain N deep took N²/2 look-ups (half a second at
    2,000 models). A cycle at its end is still told from the first model on it."""
    lookups = counted_lookups(monkeypatch)
    depth = 400

    def chain(last_falls_back_to: tuple[str, ...]) -> list[Any]:
        return [spec(f"m{i}", fallbacks=(f"m{i + 1}",)) for i in range(depth - 1)] + [
            spec(f"m{depth - 1}", fallbacks=last_falls_back_to)
        ]

    assert len(Catalog(chain(()))) == depth
    assert lookups() < 5 * depth
    with pytest.raises(ConfigError) as refused:
        Catalog(chain((f"m{depth - 2}",)))
    assert str(refused.value) == "model 'm398': fallbacks: form a cycle: m398 -> m399 -> m398"
    assert lookups() < 10 * depth


def test_a_model_out_of_force_is_told_by_its_own_skip_that_took_it_out() -> None:
    """Not by a later change to it, skipped only as "not in the catalog"; nor
    by a record naming it filed in another model's stream, which never moved
    it (and was told twice; review)."""
    foreign = msgspec.structs.replace(
        event(Model.Scaled, "x", scaling=Scaling(0, 2)),
        originator_id=model_id("other"),
        originator_version=1,
    )
    catalog = given(
        added(spec("x", engine="gone")),
        event(Model.Scaled, "x", scaling=Scaling(0, 3)),
        engines=["vllm"],
    )
    catalog.apply(foreign, 3)
    assert [s.revision for s in catalog.skipped] == [1, 2, 3]
    assert catalog.taken_out_by("x").revision == 1
    assert [s.revision for s in catalog.standing_skips()] == [1, 3]


def test_skips_at_one_revision_are_told_by_name() -> None:
    """Models a removal takes out together share its revision: told in the
    order of a set, they came out differently from one start to the next."""
    names = [f"m{i}" for i in range(12, 0, -1)]
    catalog = given(
        added(spec("f")),
        *(added(spec(name, fallbacks=("f",))) for name in names),
        removed("f"),
    )
    standing = catalog.standing_skips()
    assert [(s.revision, s.model) for s in standing] == [(14, name) for name in sorted(names)]


def test_a_removal_of_a_name_the_config_now_declares_hides_nothing() -> None:
    """A runtime model added, removed, then declared: every load warned of the
    removal's skip, though without the declaration nothing of the runtime
    model would be in force after it either (operator's report). It is still
    a skip (verify and the audit list it); an add or a scale of a declared
    name, which the declaration does hide, is still told."""
    declared = [spec("x", engine="tgi")]
    gone = given(added(spec("x")), removed("x"), declared=declared)
    assert [(s.revision, s.event) for s in gone.skipped] == [(1, "Added"), (2, "Removed")]
    assert gone.standing_skips() == []
    hidden = given(
        added(spec("x")),
        removed("x"),
        added(spec("x")),
        event(Model.Scaled, "x", scaling=Scaling(0, 2)),
        declared=declared,
    )
    assert [(s.revision, s.event) for s in hidden.standing_skips()] == [(4, "Scaled")]


def test_changes_to_a_name_never_added_are_told_by_the_latest() -> None:
    """Records of a model the log never added (written by hand): each is
    skipped as "not in the catalog", none took it out, and the one told is
    its latest change."""
    catalog = given(
        event(Model.Scaled, "ghost", scaling=Scaling(0, 2)),
        event(Model.Scaled, "ghost", scaling=Scaling(0, 3)),
    )
    assert [(s.revision, s.reason) for s in catalog.skipped] == [
        (1, "model 'ghost' is not in the catalog"),
        (2, "model 'ghost' is not in the catalog"),
    ]
    assert catalog.taken_out_by("ghost") == catalog.skipped[1]
    assert catalog.standing_skips() == [catalog.skipped[1]]


def test_a_model_a_removal_takes_out_by_two_paths_is_told_once() -> None:
    """'z' names the removed 'f' and 'a', which the removal takes out first:
    'z' goes out once, told by the removed fallback, with one audit row."""
    catalog = given(
        added(spec("f")),
        added(spec("a", fallbacks=("f",))),
        added(spec("z", fallbacks=("a", "f"))),
    )
    told: list[tuple[str, str]] = []
    catalog.taken_out = lambda skip, definition: told.append((skip.model, definition.name))
    catalog.apply(candidate(catalog, removed("f")), 4)
    out = "which this revision removed; out of force until added again"
    assert [(s.revision, s.model, s.reason) for s in catalog.skipped] == [
        (4, "a", f"model 'a': fallbacks: names 'f', {out}"),
        (4, "z", f"model 'z': fallbacks: names 'f', {out}"),
    ]
    assert told == [("a", "a"), ("z", "z")]
    assert (catalog.get("a"), catalog.get("z")) == (None, None)
