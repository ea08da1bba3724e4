"""The ``Model`` aggregate: one per model name, and the events that change it.

Events are immutable msgspec structs (the stored form is their JSON, see
:mod:`catalog_es.mapper`). Each knows how it changes a definition
(:meth:`Model.Event.evolve`): the one piece of logic the command side uses to
decide and the projection uses to replay, so the two cannot drift apart.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from hashlib import sha1
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec.structs import replace

from catalog_es.errors import InvalidModel, ModelNotFound, shown
from catalog_es.names import MODEL_EVENTS
from catalog_es.spec import EVERY_FIELD, Adapter, ModelSpec, Origin, Scaling

_MODEL_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "catalog-es:model").bytes
# A name-based (version 5) UUID's version and variant bits, set over the hash.
_UUID5_CLEARED = ~((0xF000 << 64) | (0xC000 << 48))
_UUID5_SET = (0x5000 << 64) | (0x8000 << 48)

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]

# A stored time must say its time zone: the log's times are compared with each
# other and with now, and one naive time among them (a record written by hand,
# say) would make every such comparison after it fail. Decoding refuses it, so
# the record is skipped and reported like any other that cannot be read.
UtcTime = Annotated[datetime, msgspec.Meta(tz=True)]


@lru_cache(maxsize=200_000)
def model_id(name: str) -> uuid.UUID:
    """The aggregate id of a model name: stable, so a name re-added after it
    was removed continues its own history."""
    return uuid.UUID(int=model_key(name))


def model_key(name: str) -> int:
    """:func:`model_id` as its 128-bit int: ``uuid.uuid5``'s value, worked out
    in a quarter of its time (a load does it once a model, and ``UUID``'s
    checks were most of it)."""
    digest = sha1(_MODEL_NAMESPACE + name.encode()).digest()
    return (int.from_bytes(digest[:16]) & _UUID5_CLEARED) | _UUID5_SET


def utc_now() -> datetime:
    return datetime.now(UTC)


def utc_text(moment: datetime) -> str:
    """``2026-11-30T12:00:00Z``: how every time is written out. A time without
    a zone is UTC, as the database keeps them; one in another zone that UTC
    cannot hold (a record's at an end of the calendar) is written in its own."""
    try:
        in_utc = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    except OverflowError:
        return moment.isoformat()
    return in_utc.isoformat().replace("+00:00", "Z")


# How far ahead of a node's clock the log's time may be and still be trusted:
# commands follow it (so the log's time never runs backwards), and reads of
# the past resolve times by it. A time further ahead is a bad clock or record.
MAX_CLOCK_SKEW = timedelta(hours=1)


class DomainEvent(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What every stored event has: who, when, why. ``class_version`` is written
    into each record so a later schema can recognise, and upcast, what an older
    one wrote."""

    originator_id: uuid.UUID
    originator_version: int
    timestamp: UtcTime
    class_version: int = 1
    by: str
    reason: str = ""
    # Set on the compensating events a rollback writes: the revision rolled back to.
    rollback_to: int | None = None

    # Stored dict of class_version N -> stored dict of N + 1. A class that bumps
    # its default class_version defines its own dict here.
    upcasters: ClassVar[dict[int, Upcaster]] = {}

    @classmethod
    def current_version(cls) -> int:
        """The class_version this code writes."""
        for f in msgspec.structs.fields(cls):
            if f.name == "class_version":
                assert isinstance(f.default, int)
                return f.default
        raise AssertionError("every event has a class_version")


class Model(msgspec.Struct, frozen=True, gc=False):
    """A model's aggregate state: its stream position and the definition in force
    (``None`` while it is removed, or while its events are skipped). Its id is
    the name's, worked out rather than stored: snapshots hold many of these."""

    name: str
    version: int
    spec: ModelSpec | None

    @property
    def id(self) -> uuid.UUID:
        return model_id(self.name)

    class Event(DomainEvent, frozen=True, kw_only=True):
        model: str

        # Which change this is, in the words of a refusal for a declared model.
        what: ClassVar[str] = "change it"
        # The fields of the definition it can change: only their rules are checked.
        touches: ClassVar[tuple[str, ...]] = EVERY_FIELD
        # A record of something seen rather than a change: it leaves the
        # definition as it is, so it needs no validation and is accepted for a
        # declared model too (configuration still decides what runs).
        observation: ClassVar[bool] = False

        def evolve(self, current: ModelSpec | None) -> ModelSpec | None:
            """The definition after this event, given the one before it."""
            if current is None:
                raise ModelNotFound(self.model)
            return self.change(current)

        def change(self, current: ModelSpec) -> ModelSpec:
            raise NotImplementedError

    class Added(Event, frozen=True, kw_only=True):
        """The full definition; re-adding a runtime name replaces it."""

        spec: ModelSpec
        what: ClassVar[str] = "edit it"

        def evolve(self, current: ModelSpec | None) -> ModelSpec | None:
            if self.spec.name != self.model:
                raise InvalidModel(
                    self.model, "name", f"the definition is named {self.spec.name!r}"
                )
            return self.spec

    class Removed(Event, frozen=True, kw_only=True):
        """Ends the model's runtime definition. Whether there is one to end is
        the decision's to say (a model whose events were skipped can be
        removed too), so on replay a removal always stands."""

        what: ClassVar[str] = "remove it"
        touches: ClassVar[tuple[str, ...]] = ()

        def evolve(self, current: ModelSpec | None) -> ModelSpec | None:
            return None

    class Scaled(Event, frozen=True, kw_only=True):
        scaling: Scaling
        what: ClassVar[str] = "change its scaling"
        touches: ClassVar[tuple[str, ...]] = ("scaling",)

        def change(self, current: ModelSpec) -> ModelSpec:
            return replace(current, scaling=self.scaling)

    class ResourcesSet(Event, frozen=True, kw_only=True):
        """Host memory and CPU cores of one profile, or of all when ``profile`` is empty.
        A value left ``None`` is kept as it was."""

        profile: str = ""
        memory_gb: int | None = None
        cpu_cores: int | None = None
        what: ClassVar[str] = "change its resources"
        touches: ClassVar[tuple[str, ...]] = ("resources",)

        def change(self, current: ModelSpec) -> ModelSpec:
            # A plain loop: replay runs this for every resources event.
            wanted, memory, cores = self.profile, self.memory_gb, self.cpu_cores
            profiles = []
            found = False
            for p in current.profiles:
                if not wanted or p.name == wanted:
                    found = True
                    p = replace(
                        p,
                        min_memory_gb=p.min_memory_gb if memory is None else memory,
                        cpu_cores=p.cpu_cores if cores is None else cores,
                    )
                profiles.append(p)
            if not found and wanted:
                names = ", ".join(p.name for p in current.profiles)
                raise InvalidModel(
                    self.model, "profiles", f"has no profile {shown(wanted)} (it has: {names})"
                )
            return replace(current, profiles=tuple(profiles))

    class ClassSet(Event, frozen=True, kw_only=True):
        capacity_class: str = msgspec.field(name="class")
        what: ClassVar[str] = "change its class"
        touches: ClassVar[tuple[str, ...]] = ("class",)

        def change(self, current: ModelSpec) -> ModelSpec:
            return replace(current, capacity_class=self.capacity_class)

    class OwnerSet(Event, frozen=True, kw_only=True):
        owner: str
        what: ClassVar[str] = "change its owner"
        touches: ClassVar[tuple[str, ...]] = ("owner",)

        def change(self, current: ModelSpec) -> ModelSpec:
            return replace(current, owner=self.owner)

    class AdaptersSet(Event, frozen=True, kw_only=True):
        adapters: tuple[Adapter, ...]
        what: ClassVar[str] = "change its adapters"
        touches: ClassVar[tuple[str, ...]] = ("adapters",)

        def change(self, current: ModelSpec) -> ModelSpec:
            return replace(current, adapters=self.adapters)

    class SourceSet(Event, frozen=True, kw_only=True):
        """Other weights; running replicas keep what they loaded until replaced."""

        source: str
        origin: Origin | None = None
        what: ClassVar[str] = "change its source"
        touches: ClassVar[tuple[str, ...]] = ("source", "origin")

        def change(self, current: ModelSpec) -> ModelSpec:
            return replace(current, source=self.source, origin=self.origin)

    class OriginSet(Event, frozen=True, kw_only=True):
        """Where the weights came from, recorded without changing them."""

        origin: Origin | None
        what: ClassVar[str] = "record its origin"
        touches: ClassVar[tuple[str, ...]] = ("origin",)

        def change(self, current: ModelSpec) -> ModelSpec:
            return replace(current, origin=self.origin)

    class UpstreamChanged(Event, frozen=True, kw_only=True):
        """Upstream moved away from what the model runs, first seen now: ``ref``
        points to ``upstream`` (a commit, with its files), not to ``revision``
        (the commit it runs) with the checksums it runs; and the paths that differ."""

        ref: str
        revision: str
        upstream: Origin
        added: tuple[str, ...] = ()
        removed: tuple[str, ...] = ()
        changed: tuple[str, ...] = ()
        observation: ClassVar[bool] = True
        touches: ClassVar[tuple[str, ...]] = ()

        def evolve(self, current: ModelSpec | None) -> ModelSpec | None:
            return current

    @classmethod
    def new(cls, name: str) -> Model:
        """A name never seen in the log."""
        return cls(name=name, version=0, spec=None)

    def mutate(self, event: Model.Event, spec: ModelSpec | None) -> Model:
        """This aggregate after ``event``, with the definition now in force."""
        return Model(name=self.name, version=event.originator_version, spec=spec)


# Named apart (the command line reads ``--type`` without loading this module).
EVENT_TYPES: tuple[type[Model.Event], ...] = tuple(getattr(Model, name) for name in MODEL_EVENTS)
