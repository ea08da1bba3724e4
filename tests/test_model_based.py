"""Model-based test: the service driven by commands, redeploys of the declared
config, reads of the past and rollbacks, and after every step compared with
a reference: the rules of DESIGN.md written out plainly, small enough to
check against the text line by line, sharing no code with the catalog's.

The reference keeps the log as the design describes it (transactions of
events, each with its revision, and the declared-config records) and
answers everything by replaying it over today's config: the catalog in
force, the catalog at a past revision, what a command is refused with.
What a rollback writes is the library's to choose; the reference checks
that each of its events is valid in turn and that, replayed, they leave the
catalog at the revision rolled back to.

``--hypothesis-show-statistics`` tells what was accepted and refused.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import event as tell
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from msgspec.structs import replace

from catalog_es.application import CommandResult, Models
from catalog_es.bootstrap import open_models
from catalog_es.errors import (
    DeclaredInConfig,
    InputError,
    InvalidModel,
    ModelNotFound,
    Refused,
    RevisionConflict,
)
from catalog_es.spec import DEFAULT_ENGINES, Adapter, ModelSpec, Origin, Profile, Scaling
from catalog_es.views import model_view
from tests.conftest import RecordingApplier
from tests.helpers import ACTOR, CPU, CPU_NO_MEMORY, GPU, SHA, config_yaml, spec

# -- the reference: DESIGN.md's rules ------------------------------------------------

CLASSES = ("", "critical", "standard", "opportunistic")
OWNER = re.compile(r"(org|team|project):[A-Za-z0-9][A-Za-z0-9._-]*")
SHA256 = re.compile(r"[0-9a-f]{64}")


class Config(NamedTuple):
    """A declared config: its models (always in force) and the known engines."""

    models: tuple[ModelSpec, ...] = ()
    engines: tuple[str, ...] = DEFAULT_ENGINES

    @property
    def declared(self) -> dict[str, ModelSpec]:
        return {m.name: m for m in self.models}

    def same_as(self, other: Config) -> bool:
        """The same declared layer: same models, same engines, in any order."""
        by_name = sorted(self.models, key=lambda m: m.name)
        return (by_name, sorted(self.engines)) == (
            sorted(other.models, key=lambda m: m.name),
            sorted(other.engines),
        )


class Event(NamedTuple):
    """A runtime change of one model, as the log holds it. ``value``: for add
    the definition; scale a ``Scaling``; resources ``(profile or "" for
    all, memory or None, cores or None)``; source ``(source, origin)``; class,
    owner, adapters and origin the value set; remove nothing."""

    kind: str
    name: str
    value: Any = None


class Transaction(NamedTuple):
    """One write: the config record when one was written first, then its events;
    ``last`` is the revision of its last record."""

    last: int
    config: Config | None
    events: tuple[Event, ...]


class Refusal(Exception):
    """The reference refuses a command with the domain error ``error``."""

    def __init__(self, error: type[Refused]) -> None:
        super().__init__(error.__name__)
        self.error = error


def good_source(source: str) -> bool:
    return bool(source.strip()) and not re.search(r"\s", source)


def unique(names: Iterable[str]) -> bool:
    listed = list(names)
    return len(listed) == len(set(listed))


def well_formed(model: ModelSpec, engines: tuple[str, ...]) -> bool:
    """The Domain table's rules for one model, fallbacks aside."""
    counts = [
        n for p in model.profiles for n in (p.gpus, p.gpu_memory_gb, p.min_memory_gb, p.cpu_cores)
    ]
    return (
        model.engine in engines
        and good_source(model.source)
        and len(model.profiles) >= 1
        and unique(p.name for p in model.profiles)
        and all(n >= 0 for n in counts)
        and 0 <= model.scaling.min <= model.scaling.max
        and model.scaling.max >= 1
        and model.capacity_class in CLASSES
        and (model.owner == "" or OWNER.fullmatch(model.owner) is not None)
        and unique(a.name for a in model.adapters)
        and all(good_source(a.source) for a in model.adapters)
        and (model.origin is None or all(SHA256.fullmatch(d) for d in model.origin.files.values()))
    )


def leads_back(catalog: dict[str, ModelSpec], start: str) -> bool:
    """Whether following fallbacks from ``start`` comes back to it."""
    seen: set[str] = set()
    todo = list(catalog[start].fallbacks)
    while todo:
        name = todo.pop()
        if name == start:
            return True
        if name in seen or name not in catalog:
            continue
        seen.add(name)
        todo.extend(catalog[name].fallbacks)
    return False


def valid(catalog: dict[str, ModelSpec], engines: tuple[str, ...]) -> bool:
    """Rule 2: every model well formed, its fallbacks other models of the
    catalog, named once, and no cycle."""
    for name, model in catalog.items():
        if not well_formed(model, engines) or not unique(model.fallbacks):
            return False
        if any(f == name or f not in catalog for f in model.fallbacks):
            return False
        if leads_back(catalog, name):
            return False
    return True


def lacks_memory(profile: Profile) -> bool:
    """Rule 3: runs without a GPU and declares no host memory."""
    return profile.gpus == 0 and profile.min_memory_gb <= 0


def changed(event: Event, current: ModelSpec | None) -> ModelSpec | None:
    """The definition ``event`` leaves, from ``current`` (``None``: none in force)."""
    if event.kind == "add":
        definition: ModelSpec = event.value
        return definition
    if event.kind == "remove":
        return None
    if current is None:
        raise Refusal(ModelNotFound)
    if event.kind == "scale":
        return replace(current, scaling=event.value)
    if event.kind == "resources":
        profile, memory, cores = event.value
        if profile and profile not in [p.name for p in current.profiles]:
            raise Refusal(InvalidModel)
        profiles = tuple(
            replace(
                p,
                min_memory_gb=p.min_memory_gb if memory is None else memory,
                cpu_cores=p.cpu_cores if cores is None else cores,
            )
            if profile in ("", p.name)
            else p
            for p in current.profiles
        )
        return replace(current, profiles=profiles)
    if event.kind == "source":
        source, origin = event.value
        return replace(current, source=source, origin=origin)
    field = {"class": "capacity_class", "owner": "owner", "adapters": "adapters"}
    return replace(current, **{field.get(event.kind, event.kind): event.value})


class Loaded(NamedTuple):
    """The runtime models in force, and the names whose latest record did not load."""

    runtime: dict[str, ModelSpec]
    skipped: set[str]


class Reference:
    """The log, and the rules that read it."""

    def __init__(self, config: Config) -> None:
        self.config = config  # today's
        self.log: list[Transaction] = []

    @property
    def head(self) -> int:
        return self.log[-1].last if self.log else 0

    def boundary(self, revision: int) -> int:
        """Where a read ``at`` ``revision`` reads: the end of the last write
        ending there or before (0: the declared config alone)."""
        return max((t.last for t in self.log if t.last <= revision), default=0)

    def write_end(self, revision: int) -> int:
        """The last revision of the write ``revision`` is in."""
        return min(t.last for t in self.log if t.last >= revision)

    def load(self, upto: int | None = None, pending: Iterable[Event] = ()) -> Loaded:
        """Rule 5: the log up to ``upto`` (then ``pending``) replayed over
        today's config; a record that cannot take effect, or would make the
        catalog invalid, is skipped and the rest loads."""
        declared = self.config.declared
        loaded = Loaded({}, set())
        events = [e for t in self.log if upto is None or t.last <= upto for e in t.events]
        for event in [*events, *pending]:
            name = event.name
            if name in declared:
                loaded.skipped.add(name)  # rule 1: configuration wins
                continue
            if event.kind == "remove":
                # A removal always stands (a command decided it); what named
                # the removed model as a fallback cannot load: its fallback is
                # gone. (Rule 5 could be read as skipping the removal instead:
                # the library's reading, and the original's, kept here.)
                loaded.runtime.pop(name, None)
                loaded.skipped.discard(name)
                self._take_out_dangling(loaded)
                continue
            try:
                new = changed(event, loaded.runtime.get(name))
            except Refusal:
                loaded.skipped.add(name)
                continue
            assert new is not None
            if valid({**declared, **loaded.runtime, name: new}, self.config.engines):
                loaded.runtime[name] = new
                loaded.skipped.discard(name)
            else:
                loaded.skipped.add(name)
        return loaded

    def _take_out_dangling(self, loaded: Loaded) -> None:
        catalog = {**self.config.declared, **loaded.runtime}
        dangling = [
            name
            for name, model in loaded.runtime.items()
            if any(f not in catalog for f in model.fallbacks)
        ]
        for name in dangling:
            del loaded.runtime[name]
            loaded.skipped.add(name)
        if dangling:
            self._take_out_dangling(loaded)

    def catalog(self, upto: int | None = None) -> dict[str, ModelSpec]:
        """The catalog in force (declared and runtime), now or at a revision."""
        return {**self.config.declared, **self.load(upto).runtime}

    def decide(self, event: Event, *, command: bool = True, pending: Iterable[Event] = ()) -> bool:
        """Whether ``event`` goes on the catalog in force (after ``pending``),
        or the refusal. ``command``: a command's (rule 3 applies), not a
        rollback's, which puts back what was in force. Answers whether an
        add replaces a runtime definition (one that did not load included)."""
        name = event.name
        if name in self.config.declared:
            raise Refusal(DeclaredInConfig)
        loaded = self.load(pending=pending)
        catalog = {**self.config.declared, **loaded.runtime}
        held = name in loaded.runtime or name in loaded.skipped
        if event.kind == "remove":
            if not held:
                raise Refusal(ModelNotFound)
            if any(name in m.fallbacks for m in catalog.values()):
                raise Refusal(InvalidModel)
            return False
        new = changed(event, loaded.runtime.get(name))
        assert new is not None
        if not valid({**catalog, name: new}, self.config.engines):
            raise Refusal(InvalidModel)
        if command and event.kind in ("add", "resources"):
            profile = event.value[0] if event.kind == "resources" else ""
            if any(lacks_memory(p) for p in new.profiles if profile in ("", p.name)):
                raise Refusal(InvalidModel)
        return event.kind == "add" and held

    def records_config(self) -> bool:
        """Whether a write now records today's config first: it differs from
        the one recorded last (before any, nothing declared)."""
        recorded = next((t.config for t in reversed(self.log) if t.config), Config())
        return not self.config.same_as(recorded)

    def write(self, events: tuple[Event, ...]) -> int:
        """Append one write; its last revision."""
        config = self.config if self.records_config() else None
        last = self.head + (config is not None) + len(events)
        self.log.append(Transaction(last, config, events))
        return last


# -- the log as the service shows it, in the reference's words ---------------------


def origin_of(shown: dict[str, Any] | None) -> Origin | None:
    if shown is None:
        return None
    return Origin(shown["repository"] or "", shown["revision"] or "", shown["files"])


def event_of(row: dict[str, Any]) -> Event:
    """A ``log_events`` row as a reference event."""
    fields, name = row["fields"], row["model"]
    match row["event"]:
        case "Added":
            definition = {**fields["spec"], "origin": origin_of(fields["spec"]["origin"])}
            return Event("add", name, msgspec.convert(definition, ModelSpec))
        case "Removed":
            return Event("remove", name)
        case "Scaled":
            return Event("scale", name, msgspec.convert(fields["scaling"], Scaling))
        case "ResourcesSet":
            resources = (fields["profile"], fields["memory_gb"], fields["cpu_cores"])
            return Event("resources", name, resources)
        case "ClassSet":
            return Event("class", name, fields["class"])
        case "OwnerSet":
            return Event("owner", name, fields["owner"])
        case "AdaptersSet":
            return Event("adapters", name, msgspec.convert(fields["adapters"], tuple[Adapter, ...]))
        case "SourceSet":
            return Event("source", name, (fields["source"], origin_of(fields["origin"])))
    raise AssertionError(f"a rollback wrote {row['event']}")


# -- what the machine draws ----------------------------------------------------------

# Runtime names, and names a config may declare ("a" too), so that conflicts happen.
NAMES = ("a", "b", "c", "d1", "d2")
DECLARABLE = ("a", "d1", "d2")
FIRST_CONFIG = ("d1",)
CHAIN = (("b", ()), ("a", ("b",)), ("c", ("a",)))


def config_of(declared: Iterable[str], narrow: bool) -> Config:
    """A valid config declaring ``declared`` (d2 falling back on d1 when both
    are), with fewer engines when ``narrow``: what ran on the others no longer loads."""
    models = tuple(
        spec(
            name,
            profiles=(CPU_NO_MEMORY,),  # declared models load without memory (rule 3)
            fallbacks=("d1",) if name == "d2" and "d1" in declared else (),
        )
        for name in sorted(declared)
    )
    return Config(models, ("vllm",) if narrow else DEFAULT_ENGINES)


names = st.sampled_from(NAMES)
runtime_names = st.sampled_from(("a", "b", "c"))
origins = st.sampled_from(
    [None, Origin(repository="org/repo", files={"w": SHA}), Origin(files={"w": "bad"})]
)
# Mostly definitions that hold, so that the catalog grows and its models
# name each other, with enough that break a rule for refusals.
valid_definitions = st.builds(
    spec,
    runtime_names,
    engine=st.sampled_from(["vllm", "sglang"]),
    profiles=st.sampled_from([(GPU,), (CPU,), (GPU, CPU)]),
    scaling=st.sampled_from([Scaling(), Scaling(min=0, max=2)]),
    # Often a declared one, which a redeploy may take away.
    fallbacks=st.sampled_from([(), (), ("d1",), ("d2",), ("b",), ("a", "d1"), ("c",)]),
    origin=st.sampled_from([None, Origin(repository="org/repo", files={"w": SHA})]),
)
any_definitions = st.builds(
    spec,
    names,
    engine=st.sampled_from(["vllm", "no-such-engine"]),
    source=st.sampled_from(["hf://org/x", "has space"]),
    profiles=st.sampled_from([(GPU,), (CPU_NO_MEMORY,), ()]),
    scaling=st.sampled_from([Scaling(), Scaling(2, 1)]),
    fallbacks=st.lists(names, max_size=2).map(tuple),
    origin=origins,
)
definitions = st.one_of(valid_definitions, valid_definitions, valid_definitions, any_definitions)
# The models commands are about: mostly runtime names.
targets = st.one_of(runtime_names, runtime_names, names)
bounds = st.none() | st.integers(min_value=-1, max_value=3)
adapter_lists = st.lists(
    st.builds(Adapter, name=st.sampled_from(["x", "y"]), source=st.just("s3://adapters/x")),
    max_size=2,
).map(tuple)
# Where a read or a rollback goes: a share of the head (its length is not known when drawn).
shares = st.integers(0, 100).map(lambda percent: percent / 100)


def _named(models: Iterable[ModelSpec]) -> list[ModelSpec]:
    return sorted(models, key=lambda m: m.name)


class CatalogMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = tempfile.TemporaryDirectory()
        self.db = f"sqlite:///{self.folder.name}/catalog.db"
        self.configs = 0
        self.applier = RecordingApplier()
        self.reference = Reference(config_of(FIRST_CONFIG, narrow=False))
        self.service = self._open()
        # The revisions whose reads were compared since the config last changed:
        # the log is append-only, so what a revision reads changes only with it.
        self.read: set[int] = set()

    def _open(self) -> Models:
        self.configs += 1
        path = Path(self.folder.name) / f"config-{self.configs}.yaml"
        config = self.reference.config
        engines = None if config.engines == DEFAULT_ENGINES else config.engines
        path.write_text(config_yaml(*config.models, engines=engines), encoding="utf-8")
        return open_models(self.db, str(path), applier=self.applier)

    def teardown(self) -> None:
        self.service.close()
        self.folder.cleanup()

    def _command(
        self, call: Callable[[Models], CommandResult], event: Event | Callable[[], Event]
    ) -> None:
        """Run ``call`` on the service and ``event`` (or what it is worked out
        to be) on the reference: both refuse it with the same domain error,
        nothing written, or both write it at the same revision."""
        head, pushes = self.reference.head, len(self.applier.pushes)
        try:
            planned = event() if callable(event) else event
            replaces = self.reference.decide(planned)
        except Refusal as refused:
            tell(f"refused: {refused}")  # --hypothesis-show-statistics
            try:
                call(self.service)
            except Refused as error:
                assert type(error) is refused.error, f"{error!r}; the rules say {refused}"
                assert (self.service.head(), len(self.applier.pushes)) == (head, pushes)
                return
            raise AssertionError(f"accepted; the rules refuse it: {refused}") from None
        tell(f"accepted: {planned.kind}")
        result = call(self.service)
        assert result.revision == self.reference.write((planned,))
        assert (result.written, result.replaced) == (True, replaces)
        # Rule 7: what comes back is what will run.
        new = self.reference.catalog().get(planned.name)
        assert result.model == (model_view(new, declared=False) if new is not None else None)
        self._pushed(pushes)

    def _pushed(self, before: int) -> None:
        """Rule 6: the write pushed the catalog in force, once, at its revision."""
        catalog = _named(self.reference.catalog().values())
        assert self.applier.pushes[before:] == [(self.reference.head, catalog)]

    @initialize(chain=st.integers(1, 3))
    def add_some(self, chain: int) -> None:
        """Models to act on, most commands being about a model there is: b,
        a falling back on it, c on a (the first ``chain`` of them)."""
        for name, fallbacks in CHAIN[:chain]:
            self.add(spec(name, fallbacks=fallbacks))

    @rule(definition=definitions)
    def add(self, definition: ModelSpec) -> None:
        self._command(
            lambda s: s.add(definition, by=ACTOR), Event("add", definition.name, definition)
        )

    @rule(definition=definitions)
    def add_another(self, definition: ModelSpec) -> None:
        """Twice the chances: the catalog needs models to change."""
        self.add(definition)

    @rule(name=targets)
    def remove(self, name: str) -> None:
        self._command(lambda s: s.remove(name, by=ACTOR), Event("remove", name))

    @rule(name=targets, minimum=bounds, maximum=bounds)
    def scale(self, name: str, minimum: int | None, maximum: int | None) -> None:
        def scaling() -> Event:
            if minimum is None and maximum is None:
                raise Refusal(InputError)  # nothing to set
            # A bound not given keeps its value (with no model, the event is refused).
            current = self.reference.load().runtime.get(name)
            now = current.scaling if current is not None else Scaling()
            low = now.min if minimum is None else minimum
            high = now.max if maximum is None else maximum
            return Event("scale", name, Scaling(low, high))

        self._command(lambda s: s.scale(name, minimum, maximum, by=ACTOR), scaling)

    @rule(
        name=targets,
        profile=st.sampled_from([None, "", "gpu", "cpu", "tpu"]),
        memory=st.sampled_from([None, 0, 16, -1]),
        cores=st.sampled_from([None, 4]),
    )
    def set_resources(
        self, name: str, profile: str | None, memory: int | None, cores: int | None
    ) -> None:
        def resources() -> Event:
            # Nothing to set, or a profile named empty, is unreadable input.
            if (memory is None and cores is None) or profile == "":
                raise Refusal(InputError)
            return Event("resources", name, (profile or "", memory, cores))

        self._command(
            lambda s: s.set_resources(
                name, profile=profile, memory_gb=memory, cpu_cores=cores, by=ACTOR
            ),
            resources,
        )

    @rule(name=targets, value=st.sampled_from(["", "critical", "opportunistic", "gold"]))
    def set_class(self, name: str, value: str) -> None:
        self._command(lambda s: s.set_class(name, value, by=ACTOR), Event("class", name, value))

    @rule(name=targets, stale=st.booleans())
    def set_class_expecting(self, name: str, stale: bool) -> None:
        """Compare-and-set: refused once the log has moved past the revision expected."""
        expected = self.reference.head - 1 if stale and self.reference.head else self.reference.head

        def if_not_stale() -> Event:
            if expected != self.reference.head:
                raise Refusal(RevisionConflict)
            return Event("class", name, "critical")

        self._command(
            lambda s: s.set_class(name, "critical", by=ACTOR, expected_revision=expected),
            if_not_stale,
        )

    @rule(data=st.data(), definition=valid_definitions)
    def heal(self, data: st.DataObject, definition: ModelSpec) -> None:
        """A model whose latest record did not load, not declared: removed, or
        added again (which replaces it). Any model when there is none."""
        loaded = self.reference.load()
        skipped = sorted(loaded.skipped - self.reference.config.declared.keys())
        name = data.draw(st.sampled_from(skipped or list(NAMES)))
        if data.draw(st.booleans()):
            self.remove(name)
        else:
            self.add(replace(definition, name=name))

    @rule(name=targets, value=st.sampled_from(["", "team:search", "nobody"]))
    def set_owner(self, name: str, value: str) -> None:
        self._command(lambda s: s.set_owner(name, value, by=ACTOR), Event("owner", name, value))

    @rule(name=targets, value=adapter_lists)
    def set_adapters(self, name: str, value: tuple[Adapter, ...]) -> None:
        self._command(
            lambda s: s.set_adapters(name, value, by=ACTOR), Event("adapters", name, value)
        )

    @rule(name=targets, source=st.sampled_from(["s3://weights/v2", "has space"]), origin=origins)
    def set_source(self, name: str, source: str, origin: Origin | None) -> None:
        self._command(
            lambda s: s.set_source(name, source, origin, by=ACTOR),
            Event("source", name, (source, origin)),
        )

    @rule(name=targets, origin=origins)
    def set_origin(self, name: str, origin: Origin | None) -> None:
        if name in self.reference.config.declared:
            # Rule 1's exception: a silent no-op, nothing written.
            head = self.reference.head
            result = self.service.set_origin(name, origin, by=ACTOR)
            assert (result.written, result.revision, self.service.head()) == (False, head, head)
            return
        self._command(lambda s: s.set_origin(name, origin, by=ACTOR), Event("origin", name, origin))

    @rule(declared=st.sets(st.sampled_from(DECLARABLE)), narrow=st.booleans())
    def redeploy(self, declared: set[str], narrow: bool) -> None:
        """A new config and a restart: it is in force whatever the log says."""
        self.service.close()
        self.reference.config = config_of(declared, narrow)
        self.service = self._open()
        self.read.clear()

    @rule(declared=st.sets(st.sampled_from(DECLARABLE)), narrow=st.booleans())
    def redeploy_again(self, declared: set[str], narrow: bool) -> None:
        """Twice the chances: what a redeploy leaves out is what load skips."""
        self.redeploy(declared, narrow)

    @rule(share=shares, name=names, by_time=st.booleans())
    def read_at(self, share: float, name: str, by_time: bool) -> None:
        """A read of the list and of one model at a past revision, or at the
        time a past revision was written (all its write's), and past the head."""
        revision = round(share * self.reference.head)
        at: int | datetime = revision
        then = self.reference.catalog(revision)
        if by_time and revision:
            row = next(self.service.log_events(after=revision - 1, limit=1))
            at = datetime.fromisoformat(row["time"])
            then = self.reference.catalog(self.reference.write_end(revision))
        declared = self.reference.config.declared
        listed = [(m["name"], m["declared"]) for m in self.service.list_models(at=at)]
        assert listed == [(n, n in declared) for n in sorted(then)]
        if name in then:
            view = model_view(then[name], declared=name in declared)
            assert self.service.get_model(name, at=at) == view
        else:
            with pytest.raises(ModelNotFound):
                self.service.get_model(name, at=at)
        with pytest.raises(Refused, match="beyond the head"):
            self.service.list_models(at=self.reference.head + 1)

    @rule(share=shares, beyond=st.booleans())
    def rollback(self, share: float, beyond: bool) -> None:
        """Compensating events, in one write, each valid in turn and marked
        with the revision rolled back to, that leave the catalog at it; or,
        beyond the head, a refusal."""
        reference = self.reference
        head = reference.head
        if beyond:
            with pytest.raises(Refused, match="beyond the head"):
                self.service.rollback(head + 1, by=ACTOR)
            assert self.service.head() == head
            return
        target = reference.boundary(round(share * head))
        pushes = len(self.applier.pushes)
        result = self.service.rollback(round(share * head), by=ACTOR)
        rows = list(self.service.log_events(after=head))
        assert result["to"] == target
        tell(f"rollback: {len(rows)} records")
        if not result["written"]:
            assert (rows, result["revision"]) == ([], head)
            assert _named(reference.catalog().values()) == _named(
                reference.catalog(target).values()
            )
            return
        assert [r["revision"] for r in rows] == list(range(head + 1, result["revision"] + 1))
        recorded = rows[0]["event"] == "ConfigDeclared"
        assert recorded == reference.records_config()
        assert {r["rollback_to"] for r in rows[recorded:]} == {target}
        events = tuple(event_of(r) for r in rows[recorded:])
        for number, event in enumerate(events):
            try:
                reference.decide(event, command=False, pending=events[:number])
            except Refusal as refusal:
                raise AssertionError(f"{event} leaves an invalid catalog ({refusal})") from None
        assert reference.write(events) == result["revision"]
        assert _named(reference.catalog().values()) == _named(reference.catalog(target).values())
        self._pushed(pushes)

    @invariant()
    def the_catalog_in_force_is_the_rules(self) -> None:
        in_force = self.service.catalog_at()
        assert in_force.models() == _named(self.reference.catalog().values())
        assert sorted(in_force.declared) == sorted(self.reference.config.declared)
        assert self.service.revision == self.reference.head

    @invariant()
    def each_past_revision_reads_as_the_rules_say(self) -> None:
        for revision in range(self.reference.head + 1):
            if revision not in self.read:
                then = self.reference.catalog(revision)
                assert self.service.catalog_at(revision).models() == _named(then.values()), revision
                self.read.add(revision)


CatalogMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_the_service_follows_the_design = CatalogMachine.TestCase
