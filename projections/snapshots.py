"""Projection snapshots: the catalog at a revision, so no read replays from the start.

A snapshot is the runtime layer (every model stream, its version and the
definition in force), the skips so far and the log position, built over one
declared config and keyed by its fingerprint: built over another config, the
same log gives another catalog, so such a snapshot is ignored. Snapshots are
a read model — disposable, rebuilt by ``catalog-es replay`` — so they are
compressed and never trusted over the log: one that cannot be decoded is
passed over.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator
from datetime import datetime

import msgspec
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from catalog_es.catalog import Catalog, Skipped
from catalog_es.model import Model
from catalog_es.persistence import BIGINT, metadata

log = logging.getLogger("catalog_es.snapshots")

DEFAULT_INTERVAL = 5_000

snapshots_table = sa.Table(
    "catalog_snapshots",
    metadata,
    sa.Column("fingerprint", sa.String(64), primary_key=True),
    sa.Column("revision", BIGINT, primary_key=True),
    sa.Column("state", sa.LargeBinary(), nullable=False),
)


class SnapshotState(msgspec.Struct, frozen=True):
    revision: int
    last_timestamp: datetime | None
    recorded_declaration: tuple[str, int] | None
    aggregates: list[Model]
    skipped: list[Skipped]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SnapshotState)


def encode(catalog: Catalog) -> bytes:
    state = SnapshotState(
        revision=catalog.revision,
        last_timestamp=catalog.last_timestamp,
        recorded_declaration=catalog.recorded_declaration,
        aggregates=list(catalog.aggregates.values()),
        skipped=catalog.skipped,
    )
    return zlib.compress(_encoder.encode(state), 1)


def save(conn: Connection, fingerprint: str, revision: int, state: bytes) -> None:
    t = snapshots_table.c
    conn.execute(
        sa.delete(snapshots_table).where(t.fingerprint == fingerprint, t.revision == revision)
    )
    conn.execute(
        sa.insert(snapshots_table).values(fingerprint=fingerprint, revision=revision, state=state)
    )


def restore(conn: Connection, catalog: Catalog, fingerprint: str, upto: int | None) -> bool:
    """Bring a fresh ``catalog`` to the newest usable snapshot at or before
    ``upto``; False when there is none."""
    t = snapshots_table.c
    query = sa.select(t.revision, t.state).where(t.fingerprint == fingerprint)
    if upto is not None:
        query = query.where(t.revision <= upto)
    newest_first = query.order_by(t.revision.desc())

    def candidates() -> Iterator[sa.Row[tuple[int, bytes]]]:
        # Usually the newest serves; only a corrupt one costs a second round trip.
        yield from conn.execute(newest_first.limit(1)).all()
        yield from conn.execute(newest_first.offset(1).limit(2)).all()

    for revision, blob in candidates():
        try:
            state = _decoder.decode(zlib.decompress(blob))
        except (zlib.error, msgspec.MsgspecError) as error:
            log.warning("snapshot at revision %d passed over: %s", revision, error)
            continue
        catalog.restore(
            revision=state.revision,
            last_timestamp=state.last_timestamp,
            recorded_declaration=state.recorded_declaration,
            aggregates=state.aggregates,
            skipped=state.skipped,
        )
        return True
    return False


def latest(conn: Connection, fingerprint: str) -> int:
    """The revision of the newest snapshot over this config, 0 for none."""
    t = snapshots_table.c
    value = conn.execute(sa.select(sa.func.max(t.revision)).where(t.fingerprint == fingerprint))
    return int(value.scalar() or 0)


def clear(conn: Connection) -> None:
    conn.execute(sa.delete(snapshots_table))
