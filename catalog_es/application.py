"""``Models``: the application service that changes the catalog without a restart.

Every command reads the log up to its head, decides against the catalog in
force, and appends its event, all inside one write transaction, so a decision
is never made on stale grounds even with other writers on the same database.
Commands are also serialised in-process and push the catalog to the applier
before the next one starts, so catalogs are applied in log order.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar
from uuid import UUID

import msgspec
import sqlalchemy as sa
from eventsourcing.application import Application
from eventsourcing.utils import EnvType, get_topic
from sqlalchemy.engine import Connection

from catalog_es.audit import AuditTrail
from catalog_es.catalog import Catalog, Skipped
from catalog_es.decisions import decide
from catalog_es.errors import InputError, ModelNotFound, Refused, RevisionConflict
from catalog_es.inputs import DeclaredConfig
from catalog_es.mapper import EventMapper, UndecodableEvent, decode_event, model_of_state
from catalog_es.model import Model, model_id, utc_now
from catalog_es.persistence import SQLRecorder, events_table
from catalog_es.ports import AcceptAll, Applier, NoApplier, PreAddCheck
from catalog_es.spec import Adapter, ModelSpec, Origin, Scaling, check_name
from catalog_es.views import event_view, model_view, undecodable_view
from projections.catalog import catch_up

log = logging.getLogger("catalog_es")

# Who records what the system works out by itself (an origin, say).
SYSTEM_ACTOR = "catalog-es"
MAX_ACTOR_LENGTH = 128
MAX_REASON_LENGTH = 1000


class CommandResult(msgspec.Struct, frozen=True):
    """What a command answers: the revision it wrote and the model as it will run."""

    revision: int
    model: dict[str, Any] | None
    replaced: bool = False
    removed: str | None = None
    written: bool = True


def _check_meta(by: str, reason: str) -> None:
    if not by or not by.strip() or len(by) > MAX_ACTOR_LENGTH or not by.isprintable():
        raise InputError(f"actor {by[:40]!r}: must be 1-{MAX_ACTOR_LENGTH} printable characters")
    if len(reason) > MAX_REASON_LENGTH or not reason.replace("\n", " ").isprintable():
        raise InputError(f"reason: must be at most {MAX_REASON_LENGTH} printable characters")


class Models(AuditTrail, Application[UUID]):
    """The catalog's application service: commands, and queries returning plain data
    (the audit queries come from :class:`catalog_es.audit.AuditTrail`)."""

    name = "catalog"
    env: ClassVar[dict[str, str]] = {
        "PERSISTENCE_MODULE": "catalog_es.persistence:Factory",
        "MAPPER_TOPIC": get_topic(EventMapper),
    }

    def __init__(
        self,
        declared: DeclaredConfig | None = None,
        *,
        applier: Applier | None = None,
        pre_add_check: PreAddCheck | None = None,
        env: EnvType | None = None,
    ) -> None:
        self.declared = declared or DeclaredConfig()
        self.applier = applier or NoApplier()
        self.pre_add_check = pre_add_check or AcceptAll()
        # Serialises commands in this process; the write transaction serialises
        # them across processes.
        self._lock = threading.RLock()
        super().__init__(env)
        assert isinstance(self.recorder, SQLRecorder)
        self.store: SQLRecorder = self.recorder
        self.catalog = self._new_catalog()
        with self.store.read() as conn:
            catch_up(self.catalog, self.store, conn)

    def _new_catalog(self) -> Catalog:
        return Catalog(self.declared.models, self.declared.engines)

    # -- commands ----------------------------------------------------------------

    def add(
        self, spec: ModelSpec, *, by: str, reason: str = "", expected_revision: int | None = None
    ) -> CommandResult:
        """Add a model, or replace the definition of a runtime one."""
        try:
            check_name(spec.name)
            _check_meta(by, reason)
            self.pre_add_check.check(spec)
        except Refused as refusal:
            self._record_refusal(Model.Added, spec.name, by, reason, {"spec": spec}, refusal)
            raise
        return self._command(Model.Added, spec.name, by, reason, expected_revision, spec=spec)

    def remove(
        self, name: str, *, by: str, reason: str = "", expected_revision: int | None = None
    ) -> CommandResult:
        return self._command(Model.Removed, name, by, reason, expected_revision)

    def scale(
        self,
        name: str,
        minimum: int | None = None,
        maximum: int | None = None,
        *,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> CommandResult:
        """Replica bounds; a bound left ``None`` keeps its current value."""
        if minimum is None and maximum is None:
            raise InputError("say what to set: the minimum, the maximum, or both")

        def scaling(current: ModelSpec | None) -> dict[str, Any]:
            now = current.scaling if current is not None else Scaling()
            return {
                "scaling": Scaling(
                    min=now.min if minimum is None else minimum,
                    max=now.max if maximum is None else maximum,
                )
            }

        return self._command(Model.Scaled, name, by, reason, expected_revision, derive=scaling)

    def set_resources(
        self,
        name: str,
        *,
        profile: str = "",
        memory_gb: int | None = None,
        cpu_cores: int | None = None,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> CommandResult:
        """Host memory and CPU cores of one profile, or of every profile."""
        if memory_gb is None and cpu_cores is None:
            raise InputError("say what to set: memory (GB), CPU cores, or both")
        return self._command(
            Model.ResourcesSet,
            name,
            by,
            reason,
            expected_revision,
            profile=profile,
            memory_gb=memory_gb,
            cpu_cores=cpu_cores,
        )

    def set_class(
        self,
        name: str,
        capacity_class: str,
        *,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> CommandResult:
        """critical, standard or opportunistic; empty goes back to what scaling implies."""
        return self._command(
            Model.ClassSet, name, by, reason, expected_revision, capacity_class=capacity_class
        )

    def set_owner(
        self,
        name: str,
        owner: str,
        *,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> CommandResult:
        """org:ID, team:ID or project:ID; empty makes the model shared."""
        return self._command(Model.OwnerSet, name, by, reason, expected_revision, owner=owner)

    def set_adapters(
        self,
        name: str,
        adapters: tuple[Adapter, ...],
        *,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> CommandResult:
        """Replace the LoRA adapters; replicas load the new set when they next start."""
        return self._command(
            Model.AdaptersSet, name, by, reason, expected_revision, adapters=tuple(adapters)
        )

    def set_source(
        self,
        name: str,
        source: str,
        origin: Origin | None = None,
        *,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> CommandResult:
        """Other weights; running replicas keep what they loaded until replaced."""
        return self._command(
            Model.SourceSet, name, by, reason, expected_revision, source=source, origin=origin
        )

    def set_origin(
        self,
        name: str,
        origin: Origin | None,
        *,
        by: str = SYSTEM_ACTOR,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> CommandResult:
        """Record where a model's weights came from without changing them. For a
        declared model this is a no-op: its origin is worked out again when needed."""
        with self._lock:
            self.refresh()
            if self.catalog.is_declared(name):
                spec = self.catalog.declared[name]
                return CommandResult(
                    revision=self.catalog.revision,
                    model=model_view(spec, declared=True),
                    written=False,
                )
            return self._command(
                Model.OriginSet, name, by, reason, expected_revision, origin=origin
            )

    def _command(
        self,
        event_class: type[Model.Event],
        name: str,
        by: str,
        reason: str,
        expected_revision: int | None,
        derive: Callable[[ModelSpec | None], dict[str, Any]] | None = None,
        **fields: Any,
    ) -> CommandResult:
        """Decide and append one event. ``derive`` computes fields that depend
        on the definition in force, read inside the write transaction."""
        try:
            check_name(name)
            _check_meta(by, reason)
            with self._lock:
                with self.store.write() as conn:
                    self._catch_up(conn)
                    head = self.catalog.revision
                    if expected_revision is not None and expected_revision != head:
                        raise RevisionConflict(expected_revision, head)
                    current = self.catalog.get(name)
                    if derive is not None:
                        fields.update(derive(current))
                    event = event_class(
                        originator_id=model_id(name),
                        originator_version=self.store.stream_version(conn, model_id(name)) + 1,
                        timestamp=utc_now(),
                        model=name,
                        by=by,
                        reason=reason,
                        **fields,
                    )
                    new = decide(self.catalog, event)
                    (recording,) = self.events.put([event], conn=conn)
                # Committed: only now is the change in force.
                revision = recording.notification.id
                self.catalog.commit(event, new)
                self.catalog.revision = revision
                log.info("%s %s at revision %d by %s", type(event).__name__, name, revision, by)
                self.applier.replace_catalog(self.catalog.models(), revision)
            return CommandResult(
                revision=revision,
                model=model_view(new, declared=False) if new is not None else None,
                replaced=isinstance(event, Model.Added) and current is not None,
                removed=name if new is None else None,
            )
        except Refused as refusal:
            self._record_refusal(event_class, name, by, reason, fields, refusal)
            raise

    # -- reading ---------------------------------------------------------------

    def _catch_up(self, conn: Connection) -> None:
        catch_up(self.catalog, self.store, conn)

    def refresh(self) -> None:
        """Apply what other writers appended since this service last looked."""
        with self._lock, self.store.read() as conn:
            self._catch_up(conn)

    @property
    def revision(self) -> int:
        return self.catalog.revision

    def list_models(self) -> list[dict[str, Any]]:
        self.refresh()
        return [
            model_view(m, declared=self.catalog.is_declared(m.name)) for m in self.catalog.models()
        ]

    def get_model(self, name: str) -> dict[str, Any]:
        self.refresh()
        spec = self.catalog.get(name)
        if spec is None:
            raise ModelNotFound(name)
        return model_view(spec, declared=self.catalog.is_declared(name))

    def skipped(self) -> list[Skipped]:
        """Stored events the catalog in force leaves out, and why."""
        self.refresh()
        return list(self.catalog.skipped)

    def sources(self) -> dict[str, list[dict[str, str]]]:
        """Each weights source in the catalog, and the models (or adapters of
        models) that use it."""
        self.refresh()
        out: dict[str, list[dict[str, str]]] = {}
        for m in self.catalog.models():
            out.setdefault(m.source, []).append({"model": m.name})
            for a in m.adapters:
                out.setdefault(a.source, []).append({"model": m.name, "adapter": a.name})
        return dict(sorted(out.items()))

    def log_events(
        self, *, after: int = 0, limit: int | None = None, model: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """The stored events with their revisions, oldest first, undecodable ones
        included (with the error)."""
        t = events_table.c
        query = sa.select(t.revision, t.topic, t.state).where(t.revision > after)
        if model is not None:
            query = query.where(t.originator_id == model_id(model))
        query = query.order_by(t.revision)
        if limit is not None:
            query = query.limit(limit)
        with self.store.read() as conn:
            rows = conn.execute(query).all()
        for revision, topic, state in rows:
            try:
                yield event_view(revision, decode_event(topic, state))
            except UndecodableEvent as error:
                yield undecodable_view(revision, topic, model_of_state(state), str(error))
