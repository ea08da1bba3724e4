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
import time
import zlib
from collections.abc import Callable, Container, Iterator
from datetime import datetime
from typing import Protocol, TypeVar

import msgspec
import sqlalchemy as sa
import zstandard
from sqlalchemy.engine import Connection

from catalog_es.catalog import Catalog, Skipped
from catalog_es.chain import ChainHead
from catalog_es.configuration import CONFIGS_KEPT, CONFIGURATION_ID, Configuration
from catalog_es.errors import lost_events
from catalog_es.mapper import UNREADABLE, declared_fingerprint, readable_declaration
from catalog_es.model import Model
from catalog_es.spec import ModelSpec
from catalog_es.storage.schema import BIGINT, check_walk, events_table, metadata, stream_walk

log = logging.getLogger("catalog_es.snapshots")


class _Built(Protocol):
    """A decoded snapshot: what ``_newest`` reads of each."""

    @property
    def rules(self) -> int: ...

    @property
    def chain_hash(self) -> str | None: ...


T = TypeVar("T", bound=_Built)

DEFAULT_INTERVAL = 5_000

# The replay rules a snapshot is built under. Built under older ones, it may
# hold another catalog than the log now replays to, and is passed over (the
# first start after an upgrade replays the log; `catalog-es replay` makes them
# all again): 1, every snapshot written before the rules were recorded; 2,
# the unhealed models kept, and a removal always standing on replay; 3, what
# upstream did to a model out of force keeps it out (under 2 it healed the
# skip: the model could then neither be removed nor its absence explained),
# and a record filed in another model's stream moves neither (0.2.0 wrote 2).
RULES = 3

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
    # Which skipped models no later event has healed: a removal heals one and
    # leaves no definition, so the aggregates cannot tell.
    unhealed: list[str] = []
    rules: int = 1
    # The log's hash at the revision (None in those written before it was
    # kept): a log rewritten since has another there, and the snapshot
    # would hold events it no longer has.
    chain_hash: str | None = None


_encoder = msgspec.msgpack.Encoder()
# How every zstd frame starts (zlib's streams start otherwise: 0x78).
_ZSTD_FRAME = bytes.fromhex("28b52ffd")
_decoder = msgspec.msgpack.Decoder(SnapshotState)


def state_of(catalog: Catalog) -> SnapshotState:
    """What a snapshot of ``catalog`` keeps, as it stands now, in lists of
    its own (the aggregates and skips in them are immutable): encoded once
    the catalog is let go, as it moves on. Encoding 10,000 models takes
    about 5 ms, which every read waited for under the catalog's lock, where
    this takes a tenth of a millisecond."""
    return SnapshotState(
        revision=catalog.revision,
        last_timestamp=catalog.last_timestamp,
        recorded_declaration=catalog.recorded_declaration,
        aggregates=list(catalog.aggregates.values()),
        skipped=list(catalog.skipped),
        unhealed=catalog.unhealed(),
        rules=RULES,
        chain_hash=catalog.chain_hash,
    )


def encode(state: SnapshotState) -> bytes:
    # zstd: a 10,000-model catalog's 2.2 MB in 0.7 ms and to 31 KB, where
    # zlib took 3.4 ms to 91 KB and a batch writing a snapshot paid for it
    # (and a read of the past 4 ms to decompress, against 0.3). A compressor
    # each time: one is not to be shared between threads, and it costs 9 µs.
    # It lets go of the GIL as it compresses.
    return zstandard.ZstdCompressor(level=1).compress(_msgpack(state))


# How many models are encoded in one call: msgspec holds the GIL through a
# call, and 100,000 models in one (65-90 ms) kept every other thread of the
# process (a server's handlers) waiting for it. Two thousand take about 2 ms;
# a thousand halved a writer's wait again, but cost the encoding 16% more CPU
# on a busy machine, where these cost it 9%.
MODELS_AT_A_TIME = 2000


def _msgpack(state: SnapshotState) -> bytearray:
    """The bytes msgspec encodes of ``state`` in one call, so every reader
    reads them, encoded a slice of its models at a time, the GIL let go
    between slices for a thread waiting for it to take."""
    aggregates = state.aggregates
    whole = _encoder.encode(msgspec.structs.replace(state, aggregates=[]))
    # The empty list of aggregates in it comes after the fields before them
    # and its key, which a map of those alone, ending in it, encodes the same
    # (the map's header one byte as the state's: fewer than 16 fields).
    before: dict[str, object] = {}
    for field in msgspec.structs.fields(SnapshotState):
        if field.name == "aggregates":
            before[field.encode_name] = []
            break
        before[field.encode_name] = getattr(state, field.name)
    at = len(_encoder.encode(before)) - 1
    encoded = bytearray(whole[:at])
    encoded += _array_header(len(aggregates))
    for start in range(0, len(aggregates), MODELS_AT_A_TIME):
        models = aggregates[start : start + MODELS_AT_A_TIME]
        # Encoded as a list over the last bytes written, its header landing
        # on them, which are then put back: its models follow on, uncopied.
        end = len(encoded)
        covered = end - len(_array_header(len(models)))
        kept = encoded[covered:end]
        _encoder.encode_into(models, encoded, covered)
        encoded[covered:end] = kept
        # A sleep, however short, is a wait a thread waiting for the GIL
        # takes it in. Let go and taken again at once (os.sched_yield with
        # the CPU otherwise idle, a select of nothing), it can be taken again
        # before a thread woken for it runs; not let go, another thread gets
        # it after CPython's switch interval (5 ms each time it wants it),
        # and a write on PostgreSQL still waited 100-160 ms.
        time.sleep(0)
    encoded += whole[at + 1 :]
    return encoded


_EMPTY_ARRAY = 0x90


def _array_header(length: int) -> bytes:
    """How msgpack starts an array of ``length`` items."""
    if length < 16:
        return bytes([_EMPTY_ARRAY | length])
    if length < 2**16:
        return b"\xdc" + length.to_bytes(2, "big")
    return b"\xdd" + length.to_bytes(4, "big")


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
    for state in _newest(conn, fingerprint, upto, _decoder.decode):
        if upto is None and state.last_timestamp is None and state.revision > 0:
            # Written by a rebuild before it kept the log's time: a start on it
            # would not know the time its next command must follow (a read of
            # the past has no use for it).
            log.info("snapshot at %d passed over: it holds no time", state.revision)
            continue
        catalog.restore(
            revision=state.revision,
            last_timestamp=state.last_timestamp,
            recorded_declaration=state.recorded_declaration,
            aggregates=state.aggregates,
            skipped=state.skipped,
            unhealed=state.unhealed,
        )
        if state.chain_hash is not None:
            catalog.chain = ChainHead(revision=state.revision, hash=state.chain_hash)
        return True
    return False


class _Entry(msgspec.Struct, frozen=True, gc=False):
    """An aggregate of a snapshot with its definition left undecoded."""

    name: str
    version: int
    spec: msgspec.Raw


class _Entries(msgspec.Struct, frozen=True, gc=False):
    """:class:`SnapshotState` with each definition left undecoded: a snapshot
    the full decode would pass over for anything else is passed over here too."""

    revision: int
    last_timestamp: datetime | None
    recorded_declaration: tuple[str, int] | None
    aggregates: list[_Entry]
    skipped: list[Skipped]
    rules: int = 1
    chain_hash: str | None = None


_entries_decoder = msgspec.msgpack.Decoder(_Entries)
_spec_decoder = msgspec.msgpack.Decoder(ModelSpec | None)


def restore_model(
    conn: Connection, catalog: Catalog, fingerprint: str, upto: int | None, name: str
) -> bool:
    """:func:`restore` of one model's aggregate alone (the catalog's revision is
    the snapshot's): a read of one model decodes one definition, not ten
    thousand. The other definitions are not checked: a snapshot written by
    hand with one of them of the wrong shape serves this read, where the
    whole catalog's passes it over (and a wrong answer for this model would
    then differ from the whole catalog's)."""

    for state in _newest(conn, fingerprint, upto, _entries_decoder.decode):
        try:
            found = [
                Model(entry.name, entry.version, _spec_decoder.decode(entry.spec))
                for entry in state.aggregates
                if entry.name == name
            ]
        except msgspec.MsgspecError as error:
            # Passed over as the whole catalog's read passes it over: a
            # read of this model must not fail where a list answers.
            _passed_over(state.revision, error)
            continue
        catalog.restore(
            revision=state.revision,
            last_timestamp=None,
            recorded_declaration=None,
            aggregates=found,
            skipped=(),
            unhealed=(),
        )
        return True
    return False


def _newest(
    conn: Connection, fingerprint: str, upto: int | None, decode: Callable[[bytes], T]
) -> Iterator[T]:
    """The newest snapshots at or before ``upto``, newest first, decoded; one
    that cannot be, was built under older replay rules, or on events the log
    no longer holds, is passed over."""
    t = snapshots_table.c
    query = sa.select(t.revision, t.state).where(t.fingerprint == fingerprint)
    if upto is not None:
        query = query.where(t.revision <= upto)
    newest_first = query.order_by(t.revision.desc())

    def candidates() -> Iterator[sa.Row[tuple[int, bytes]]]:
        # Usually the newest serves; only a corrupt one costs a second round
        # trip. None at all (a log younger than the first snapshot) means no
        # older ones either: asked anyway, every such start paid a round trip.
        newest = conn.execute(newest_first.limit(1)).all()
        yield from newest
        if newest:
            yield from conn.execute(newest_first.offset(1).limit(2)).all()

    # Each row's revision is told with %s: the column is no rowid, and SQLite
    # keeps whatever a hand edit puts there (text too), which %d told as a
    # logging traceback.
    for revision, blob in candidates():
        try:
            state = decode(_decompressed(blob))
        except (zlib.error, zstandard.ZstdError, *UNREADABLE) as error:
            # TypeError among them: SQLite keeps whatever a hand edit puts in
            # the column (text, a number), which no decompressor takes.
            _passed_over(revision, error)
            continue
        if state.rules < RULES:
            log.info("snapshot at %s passed over: built under older replay rules", revision)
            continue
        if state.chain_hash is not None and state.chain_hash != _hash_at(conn, revision):
            log.warning(
                "snapshot at %s passed over: %s",
                revision,
                lost_events("the log holds other events there now"),
            )
            continue
        yield state


def _passed_over(revision: object, error: Exception) -> None:
    log.warning("snapshot at revision %s passed over: %s", revision, error)


def _hash_at(conn: Connection, revision: int) -> object:
    """The stored hash of the event at ``revision``, ``None`` if there is none."""
    e = events_table.c
    return conn.execute(sa.select(e.hash).where(e.revision == revision)).scalar()


def _decompressed(blob: bytes) -> bytes:
    """A snapshot's msgpack: zstd, or zlib as 0.2.0 wrote them (read, to be
    passed over as built under older replay rules, not as corrupt)."""
    if blob[:4] == _ZSTD_FRAME:
        # The frame says how large it decompresses, and that much is taken
        # at once: a size edited by hand asked for terabytes (review).
        # Snapshots shrink 20 to 70 times; one said to shrink a thousand is passed over.
        size = zstandard.frame_content_size(blob)
        if size < 0 or size > 1000 * len(blob) + 2**20:
            raise zstandard.ZstdError(f"its frame says it holds {size:,} bytes, from {len(blob):,}")
        return zstandard.ZstdDecompressor().decompress(blob)
    return zlib.decompress(blob)


def taken_since(conn: Connection, fingerprint: str, revision: int) -> list[int]:
    """The revisions of this config's snapshots taken at ``revision`` or after it."""
    t = snapshots_table.c
    query = (
        sa.select(t.revision)
        .where(t.fingerprint == fingerprint, t.revision >= revision)
        .order_by(t.revision)
    )
    return list(conn.execute(query).scalars())


def clear(conn: Connection, fingerprint: str) -> None:
    """Delete this config's snapshots (a rebuild makes them again), and those of
    the configs the log did not record among the last others (with this one,
    :data:`CONFIGS_KEPT`): a node records its config as it starts serving or
    first writes, so nodes still on those (a rolling deploy) read theirs on,
    while a one-off run's over an edited config, which records nothing, goes."""
    t = snapshots_table.c
    kept = recorded_configs(conn, CONFIGS_KEPT - 1, besides=fingerprint)
    conn.execute(sa.delete(snapshots_table).where(t.fingerprint.not_in(kept)))


# Who a walk of the declared config's records cut short names (check_walk).
CONFIG_RECORDS = "the declared config's records"


def config_records(upto: int | None = None, after: int = 0) -> sa.Select[tuple[int, str, bytes]]:
    """The declared config's records at or before ``upto`` (all of them,
    without it) and after ``after``, newest first: revision, topic and
    stored state, as read for which config was in force at a revision, and
    what to do with one that cannot be read left to the reader.

    Newest first because the recursive walk yields them so (stream_walk),
    and on purpose with no ORDER BY: one would read the whole walk, every
    record back to the first, before the first row, where a LIMIT (1, to
    take the last record at or before ``upto``) stops the walk there. The
    state is read for each row the walk yields, not joined, so that no plan
    can yield the rows in another order."""
    stream = stream_walk(CONFIGURATION_ID, after)
    e = events_table.c
    state = sa.select(e.state).where(e.revision == stream.c.revision).scalar_subquery()
    records = sa.select(stream.c.revision, stream.c.topic, state)
    return records if upto is None else records.where(stream.c.revision <= upto)


def readable_configs(
    conn: Connection, upto: int | None = None, *, looked_at: int | None = None
) -> Iterator[Configuration.Declared]:
    """The records of :func:`config_records` that can be read, newest first;
    of the first ``looked_at`` records only, when given."""
    for _, topic, state in _config_rows(conn, upto, looked_at):
        record = readable_declaration(topic, state)
        if record is not None:
            yield record
    if looked_at is None:
        # Read to its end: an end short of the first record is a hand edit.
        check_walk(conn, CONFIGURATION_ID, CONFIG_RECORDS)


# How far back the log's records of declared configs are looked through for
# those of other configs: nodes of two configs writing in turn record theirs
# in turn, each write.
RECORDS_LOOKED_AT = 1000


def last_replaced(conn: Connection, fingerprint: str, *, upto: int) -> tuple[int, int] | None:
    """The revision that last recorded the config of ``fingerprint`` and
    that of the record after it, which replaced it, among the last
    :data:`RECORDS_LOOKED_AT` records at or before ``upto``; ``None`` if none
    of them recorded it, or if the last of them did (not replaced)."""
    newer: int | None = None
    for revision, topic, state in _config_rows(conn, upto, RECORDS_LOOKED_AT):
        if declared_fingerprint(topic, state) == fingerprint:
            return None if newer is None else (int(revision), newer)
        newer = int(revision)
    return None


def _config_rows(
    conn: Connection, upto: int | None, looked_at: int | None
) -> Iterator[sa.Row[tuple[int, str, bytes]]]:
    """The rows of :func:`config_records` (of the first ``looked_at`` only,
    when given), read in growing pages, the first of two: psycopg reads every
    row asked for at once, each a record of every declared definition, where
    readers mostly want the first or the second (two configs taking turns).
    1,000 records of 100 models each took 160 ms on PostgreSQL to find the
    second; the record an audit view follows on from, the newest, took 160 ms
    among 30 of 2,000 models, each history or audit read that caught up."""
    read, page = 0, 2
    while looked_at is None or read < looked_at:
        asked = page if looked_at is None else min(page, looked_at - read)
        rows = conn.execute(config_records(upto).offset(read).limit(asked)).all()
        yield from rows
        if len(rows) < asked:
            return
        read, page = read + asked, page * 8


def configs_recorded_between(
    conn: Connection, after: int, upto: int, *, besides: Container[str]
) -> list[tuple[int, Configuration.Declared]]:
    """The configs other than those ``besides`` names that the log recorded
    after revision ``after`` and up to ``upto``, each once, with the revision
    of its first record there, oldest first (a record that cannot be read is
    passed over). Each fingerprint alone is decoded, then the record of a
    config not met before."""
    found: dict[str, tuple[int, Configuration.Declared]] = {}
    for revision, topic, state in reversed(conn.execute(config_records(upto, after)).all()):
        fingerprint = declared_fingerprint(topic, state)
        if fingerprint is None or fingerprint in besides or fingerprint in found:
            continue
        record = readable_declaration(topic, state)
        if record is not None:
            found[fingerprint] = (int(revision), record)
    return list(found.values())


def recorded_configs(conn: Connection, count: int, *, besides: str) -> list[str]:
    """The fingerprints of the last ``count`` configs, other than ``besides``,
    that the log recorded in force, newest first (a record that cannot be
    read is passed over)."""
    found: list[str] = []
    for record in readable_configs(conn, looked_at=RECORDS_LOOKED_AT):
        if record.fingerprint != besides and record.fingerprint not in found:
            found.append(record.fingerprint)
            if len(found) == count:
                break
    return found
