"""The catalog projection: the log replayed, in revision order, over the declared config.

One bad record cannot take the cluster down: an event that cannot be decoded,
or whose effect would make the catalog invalid, is skipped and recorded with
its revision and the reason (``Catalog.skipped``), and the replay carries on.
Declared models are in force before the first event is read, so they always
load.
"""

from __future__ import annotations

from collections.abc import Callable
from uuid import UUID

from sqlalchemy.engine import Connection

from catalog_es.catalog import Catalog, Skipped
from catalog_es.collector import collector_paused
from catalog_es.mapper import UndecodableEvent, decode_event, model_of_state
from catalog_es.model import DomainEvent
from catalog_es.persistence import SQLRecorder

Progress = Callable[[int], None]


def catch_up(
    catalog: Catalog,
    recorder: SQLRecorder,
    conn: Connection,
    *,
    upto: int | None = None,
    stream: UUID | None = None,
    progress: Progress | None = None,
) -> list[Skipped]:
    """Apply every event after ``catalog.revision`` (up to ``upto``; of one
    aggregate's ``stream`` only, when given), in order, and return the ones
    skipped. Each event is applied once: the catalog's revision is its
    tracking position."""
    skipped: list[Skipped] = []
    apply = catalog.apply
    last: DomainEvent | None = None
    with collector_paused():
        for page in recorder.scan(conn, after=catalog.revision, upto=upto, stream=stream):
            for revision, topic, state in page:
                try:
                    event = decode_event(topic, state)
                except UndecodableEvent as error:
                    skipped.append(
                        catalog.skip(
                            revision, model_of_state(state), topic.rpartition(".")[2], str(error)
                        )
                    )
                else:
                    last = event
                    outcome = apply(event, revision)
                    if outcome is not None:
                        skipped.append(outcome)
                if progress is not None:
                    progress(revision)
    if last is not None:
        # The log's time never runs backwards, so the last event is the newest.
        catalog.saw(last.timestamp)
    return skipped
