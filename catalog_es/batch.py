"""The events one write transaction appends, each decided in turn.

A batch stamps every event with the same envelope (who, why, one timestamp,
the rollback target) and the next version of its stream, and decides each
against the catalog as the events before it leave it, so a series of changes
is valid at every step, not only at the end.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy.engine import Connection

from catalog_es.catalog import Catalog
from catalog_es.configuration import CONFIGURATION_ID, Configuration, DeclaredConfig
from catalog_es.decisions import decide
from catalog_es.errors import DamagedLog, shown
from catalog_es.model import DomainEvent, Model, model_id
from catalog_es.persistence import SQLRecorder
from catalog_es.spec import ModelSpec

Change = tuple[Model.Event, ModelSpec | None]

# What a log that never recorded a declared layer has in force: nothing.
_NOTHING_DECLARED = DeclaredConfig().fingerprint


def declaration_differs(catalog: Catalog, declared: DeclaredConfig) -> bool:
    """Whether ``declared`` is not the layer the log last recorded."""
    recorded = catalog.recorded_declaration
    return (recorded[0] if recorded is not None else _NOTHING_DECLARED) != declared.fingerprint


class KnownVersions:
    """The last version of each stream this service wrote or read, by its id's
    ``int``, and the log's last revision then (``at``). While that is still
    the log's last revision, no other writer has appended since, and they
    spare each write a read of each stream's last version (2-7% of the time
    of a batch of 1,000 changes, as measured)."""

    def __init__(self) -> None:
        self.at: int | None = None
        self.versions: dict[int, int] = {}
        # The revision of the last event of each stream this service wrote:
        # its next event's link to it (``stream_previous``), which the write
        # would otherwise look up, a seek a model (5% of a batch of 1,000).
        self.revisions: dict[int, int] = {}

    def unknown(self, streams: Iterable[UUID]) -> list[UUID]:
        return [s for s in streams if s.int not in self.versions]

    def learn(self, versions: Mapping[int, int], at: int, revisions: Mapping[int, int]) -> None:
        self.versions.update(versions)
        self.revisions.update(revisions)
        self.at = at

    def forget(self) -> None:
        self.at = None
        self.versions.clear()
        self.revisions.clear()


class Batch:
    """Events decided inside one write transaction.

    ``tentative``: the catalog is a scratch copy, changed as each event is
    decided (several events); otherwise it is the live catalog, left untouched
    until the transaction commits (one event, no copy on the hot path).
    """

    def __init__(
        self,
        store: SQLRecorder,
        conn: Connection,
        catalog: Catalog,
        *,
        by: str,
        reason: str,
        timestamp: datetime,
        rollback_to: int | None = None,
        tentative: bool,
        versions: dict[int, int] | None = None,
        known: Mapping[int, int] | None = None,
    ) -> None:
        self.store = store
        self.conn = conn
        self.catalog = catalog
        self.by = by
        self.reason = reason
        self.timestamp = timestamp
        self.rollback_to = rollback_to
        self.tentative = tentative
        self.records: list[DomainEvent] = []
        self.changes: list[Change] = []
        # The last version of each stream, keyed by the id's ``int``: a UUID's
        # own hash is Python code, run several times an event in a large batch.
        # ``versions``: those already read, in this transaction; ``known``:
        # those the service knows still hold, read or written before.
        self.versions: dict[int, int] = dict(versions or {})
        self._known: Mapping[int, int] = known or {}

    def _next_version(self, originator_id: UUID) -> int:
        # From the log, not the catalog: a record replay skipped still holds its place.
        key = originator_id.int
        last = self.versions.get(key)
        if last is None:
            last = self._known.get(key)
            if last is None:
                last = self.store.stream_version(self.conn, originator_id)
            self.versions[key] = last
        return last + 1

    def prefetch(self, names: Iterable[str]) -> None:
        """Read the stream versions of models a batch will change, in one go
        rather than one query per event."""
        wanted = {i.int: i for i in map(model_id, names)}
        missing = {
            key: i
            for key, i in wanted.items()
            if key not in self.versions and key not in self._known
        }
        if missing:
            versions = self.store.stream_versions(self.conn, list(missing.values()))
            self.versions.update(zip(missing, versions, strict=True))

    def _append(self, event: DomainEvent) -> None:
        self.versions[event.originator_id.int] = event.originator_version
        self.records.append(event)

    def _envelope(self, originator_id: UUID, rollback_to: int | None) -> dict[str, Any]:
        return {
            "originator_id": originator_id,
            "originator_version": self._next_version(originator_id),
            "timestamp": self.timestamp,
            "by": self.by,
            "reason": self.reason,
            "rollback_to": rollback_to,
        }

    def event(self, event_class: type[Model.Event], name: str, **fields: Any) -> Model.Event:
        """A candidate event for model ``name``; not yet decided, nothing taken."""
        envelope = self._envelope(model_id(name), self.rollback_to)
        replayed = self.catalog.aggregate(name).version
        if envelope["originator_version"] <= replayed:
            # Replay read the stream further than catalog_streams says it goes.
            raise DamagedLog(
                f"model {shown(name)} has events up to version {replayed}, but catalog_streams"
                f" records it at version {envelope['originator_version'] - 1}: edited by hand;"
                " nothing was written (catalog-es verify)"
            )
        return event_class(**envelope, model=name, **fields)

    def decide(self, event: Model.Event) -> ModelSpec | None:
        """Accept ``event`` (or raise the refusal) and add it to the batch."""
        new = decide(self.catalog, event)
        if self.tentative:
            self.catalog.commit(event, new)
        self._append(event)
        self.changes.append((event, new))
        return new

    def record_declaration(self, declared: DeclaredConfig) -> None:
        """Record the declared layer when it differs from the one the log last recorded."""
        if declaration_differs(self.catalog, declared):
            self._append(
                Configuration.Declared(
                    **self._envelope(CONFIGURATION_ID, None),
                    fingerprint=declared.fingerprint,
                    engines=declared.engines,
                    models=declared.models,
                    path=declared.path,
                )
            )
