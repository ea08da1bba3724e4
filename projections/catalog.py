"""The catalog projection: the log replayed, in revision order, over the declared config.

One bad record cannot take the cluster down: an event that cannot be decoded,
or whose effect would make the catalog invalid, is skipped and recorded with
its revision and the reason (``Catalog.skipped``), and the replay carries on.
Declared models are in force before the first event is read, so they always
load.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy.engine import Connection

from catalog_es.catalog import Catalog, Skipped
from catalog_es.collector import collector_paused
from catalog_es.mapper import (
    UndecodableEvent,
    decode_event,
    is_about_another,
    model_of_state,
    topic_name,
)
from catalog_es.model import DomainEvent
from catalog_es.persistence import SQLRecorder

Progress = Callable[[int], None]


def catch_up(
    catalog: Catalog,
    recorder: SQLRecorder,
    conn: Connection,
    *,
    upto: int | None = None,
    model: str | None = None,
    progress: Progress | None = None,
) -> list[Skipped]:
    """Apply every event after ``catalog.revision`` (up to ``upto``), in order,
    and return the ones skipped. Each event is applied once: the catalog's
    revision is its tracking position. ``model``: only the events that can
    change that model are decoded and applied, for a read of it alone; the
    catalog's revision, skips and time then say nothing of the others."""
    skipped: list[Skipped] = []
    apply = catalog.apply
    last: DomainEvent | None = None
    with collector_paused():
        pages = recorder.scan(conn, after=catalog.revision, upto=upto)
        if model is not None:
            pages = (_about(page, model) for page in pages)
        for page in pages:
            for revision, topic, state in page:
                try:
                    event = decode_event(topic, state)
                except UndecodableEvent as error:
                    skipped.append(
                        catalog.skip(revision, model_of_state(state), topic_name(topic), str(error))
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


def _about(page: list[tuple[int, str, bytes]], model: str) -> list[tuple[int, str, bytes]]:
    """The rows of ``page`` that may change ``model``, the rest left undecoded."""
    return [row for row in page if not is_about_another(row[1], row[2], model)]
