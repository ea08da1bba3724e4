"""The hash chain over the log: tamper evidence for the stored events.

Each stored event's hash covers the previous event's hash and this event's
stream position and bytes, so altering, removing or reordering any stored
event breaks every link from there on. The revision is deliberately left out:
it is assigned by the database during the insert, and on PostgreSQL a value
burned by an aborted transaction leaves a gap that is not tampering. The last
revision and its hash (the head) are also stored apart, so a deleted last
event is noticed too.

The chain is evidence against editing the database by hand, not a signature:
whoever can write to the database and knows this recipe can rewrite the whole
chain. Recording the head hash elsewhere (``catalog-es verify`` prints it)
closes that gap for everything up to the recorded head.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any
from uuid import UUID

import msgspec

from catalog_es.errors import shown
from catalog_es.spec import SHA256_PATTERN

# The "previous hash" of the first event.
GENESIS = "0" * 64


class ChainHead(msgspec.Struct, frozen=True):
    """The last revision written and its hash."""

    revision: int
    hash: str


class DamagedHead(msgspec.Struct, frozen=True):
    """A head record a hand edit left unreadable: what is wrong with it."""

    problem: str


class UnwritableHead(msgspec.Struct, frozen=True):
    """A head record no write can append after: what is wrong with it, and
    where to look. A write is refused in these words; ``serve`` warns in
    them as it starts, every write to come being refused."""

    problem: str
    advice: str

    @classmethod
    def damaged(cls, head: DamagedHead) -> UnwritableHead:
        return cls(
            f"the log's head record (catalog_head) is damaged: {head.problem}",
            "catalog-es verify tells what else was edited",
        )

    @classmethod
    def missing(cls, last: int) -> UnwritableHead:
        # What the log's last revision was went with it: written on, the
        # chain would start afresh and, on SQLite, a deleted last revision
        # be handed out again, which a reader that saw it skips.
        return cls(
            "the log's head record (catalog_head) is missing, but the log holds events"
            f" up to revision {last}, and maybe held more",
            "catalog-es verify; docs/audit.md says how to put the head back",
        )

    @classmethod
    def of(cls, head: ChainHead | DamagedHead | None, last: int) -> UnwritableHead | None:
        """Why no write may follow ``head`` on a log whose last event is at
        ``last``, if none may."""
        if isinstance(head, DamagedHead):
            return cls.damaged(head)
        if head is None and last:
            return cls.missing(last)
        return None

    def refusal(self) -> str:
        return f"{self.problem}; nothing was written ({self.advice})"

    def warning(self) -> str:
        return f"{self.problem}: every write will be refused until it is put back ({self.advice})"


def stored_head(revision: object, hash_: object) -> ChainHead | DamagedHead | None:
    """The head from its stored columns (``None`` when there is no head row),
    which SQLite keeps of whatever type a hand edit gave them."""
    if revision is None:
        return None
    if type(revision) is not int:
        return DamagedHead(f"its revision is {shown(revision)}, not a whole number")
    if not isinstance(hash_, str) or not SHA256_PATTERN.fullmatch(hash_):
        return DamagedHead(f"its hash is {shown(hash_)}, not a sha256 digest in hex")
    return ChainHead(revision=revision, hash=hash_)


class ChainRow(msgspec.Struct, frozen=True):
    """A stored event as the chain sees it: the values as read, which a hand
    edit may have left of any type (SQLite keeps whatever it is given)."""

    revision: int
    originator_id: Any
    originator_version: Any
    topic: Any
    state: Any
    hash: Any
    stream_previous: Any


class ChainBreak(msgspec.Struct, frozen=True):
    """The first revision the chain cannot vouch for, and what is wrong there."""

    revision: int
    problem: str


class ChainReport(msgspec.Struct, frozen=True):
    events: int
    head: ChainHead | None
    broken: ChainBreak | None


def link(
    previous: str, originator_id: UUID, originator_version: int, topic: str, state: bytes
) -> str:
    """The hash of one event chained onto ``previous`` (sha256, hex).

    Input, in order: the previous hash (64 ASCII hex digits), the originator id
    (16 bytes), the originator version (8 bytes, big-endian), the topic's
    UTF-8 length (4 bytes, big-endian) and bytes, then the stored state. Every
    part but the last has a fixed or stated length, so no two events hash the
    same input.
    """
    encoded_topic = topic.encode("utf-8")
    # One buffer hashed at once: six updates of a few bytes each cost more
    # than the hashing (every event of every write links).
    return hashlib.sha256(
        b"".join(
            (
                previous.encode("ascii"),
                originator_id.int.to_bytes(16, "big"),
                originator_version.to_bytes(8, "big"),
                len(encoded_topic).to_bytes(4, "big"),
                encoded_topic,
                state,
            )
        )
    ).hexdigest()


def check_chain(
    rows: Iterable[ChainRow],
    head: ChainHead | DamagedHead | None,
    streams: Iterable[tuple[Any, Any, Any]] = (),
    *,
    gapless: bool = False,
) -> ChainReport:
    """Walk the stored events in revision order and find the first break.

    A row whose hash does not follow from the previous row's was altered, or
    has lost what came before it. When a gap in the revisions precedes it,
    the gap is named: that is a deleted event. ``gapless`` (SQLite, which
    numbers revisions without gaps): a gap the chain links across is named
    too, as numbers edited by hand (a head raised, which the next write
    followed); on PostgreSQL an aborted transaction may leave one.

    The hash does not cover what is kept beside it for the write path and
    for reading a stream back: each row's link to its stream's event before
    it, and ``streams``, each stream's ``(id, last version, its revision)``
    as stored. Both are checked against the rows.
    """
    events = 0
    last = ChainHead(revision=0, hash=GENESIS)
    readable = head if isinstance(head, ChainHead) else None
    # Each stream's last (revision, version), by its id as stored.
    ends: dict[Any, tuple[int, Any]] = {}
    ids: dict[Any, str] = {}
    for row in rows:
        events += 1
        if row.hash != _rehash(last.hash, row):
            return ChainReport(events=events, head=readable, broken=_broken_link(last, row))
        if gapless and row.revision > last.revision + 1:
            renumbered = ChainBreak(
                revision=last.revision + 1,
                problem=f"{_span(last.revision + 1, row.revision - 1)} missing, but revision "
                f"{row.revision} chains onto revision {last.revision}: nothing was deleted "
                "there; it was numbered past a head or rows edited by hand (this database "
                "leaves no gaps)",
            )
            return ChainReport(events=events, head=readable, broken=renumbered)
        before, version = ends.get(row.originator_id, (0, 0))
        problem = None
        if row.stream_previous != before:
            problem = (
                f"its link to its model's event before it (stream_previous) is "
                f"{row.stream_previous!r}, not {before}: edited by hand, so reading "
                "that model's events back reads others"
            )
        elif row.originator_version != version + 1:
            problem = (
                f"its version is {row.originator_version}, not {version + 1}: its model's "
                "versions skip or repeat one there (written after catalog_streams was "
                "edited by hand)"
            )
        else:
            problem = _filed_elsewhere(row, ids)
        if problem is not None:
            unlinked = ChainBreak(revision=row.revision, problem=problem)
            return ChainReport(events=events, head=readable, broken=unlinked)
        ends[row.originator_id] = (row.revision, row.originator_version)
        last = ChainHead(revision=row.revision, hash=row.hash)
    broken = _broken_tail(last, head) or _broken_streams(ends, streams)
    return ChainReport(events=events, head=readable, broken=broken)


def _broken_streams(
    ends: dict[Any, tuple[int, Any]], streams: Iterable[tuple[Any, Any, Any]]
) -> ChainBreak | None:
    """The first stream whose recorded last version and revision (catalog_streams)
    are not its last event's: the next write would follow the wrong one."""
    recorded = {originator_id: (revision, version) for originator_id, version, revision in streams}

    def told_at(originator_id: Any) -> int:
        # As the break is told: a row for a stream with no events is at its own revision.
        return _at(ends.get(originator_id)) or _at(recorded.get(originator_id))

    for originator_id in sorted(ends.keys() | recorded.keys(), key=told_at):
        end, kept = ends.get(originator_id), recorded.get(originator_id)
        if end != kept:
            return ChainBreak(
                revision=told_at(originator_id),
                problem=f"catalog_streams records stream {originator_id} as at "
                f"{_shown_end(kept)}, but its last event is {_shown_end(end)}: "
                "edited by hand, and the next write to it would follow the wrong version",
            )
    return None


def _at(end: tuple[Any, Any] | None) -> int:
    return end[0] if end is not None and type(end[0]) is int else 0


def _shown_end(end: tuple[Any, Any] | None) -> str:
    return "none" if end is None else f"version {end[1]!r} at revision {end[0]!r}"


def _rehash(previous: str, row: ChainRow) -> str | None:
    """The row's hash recomputed from what is stored; ``None`` when what is
    stored cannot be what was written (not a UUID, a number, text, bytes)."""
    state = row.state.encode("utf-8") if isinstance(row.state, str) else row.state
    if type(row.originator_version) is not int:  # 1.5 is no version the write path wrote
        return None
    try:
        originator_id = UUID(str(row.originator_id))
        return link(previous, originator_id, row.originator_version, row.topic, bytes(state))
    except (ValueError, TypeError, AttributeError, OverflowError):
        return None


class _Envelope(msgspec.Struct):
    """Where a stored event's payload says it belongs (the id as text: what
    the write path wrote is compared as text, which costs a tenth of a UUID)."""

    originator_id: str
    originator_version: int


_envelope = msgspec.json.Decoder(_Envelope)


def _filed_elsewhere(row: ChainRow, ids: dict[Any, str]) -> str | None:
    """Why a row's payload does not belong where it is stored, if it does not:
    replay reads the stream and version from the payload, so such a row
    changes the model its payload names, out of that model's own stream (whose
    next command is then refused as a hand edit). ``ids``: each stored id's
    text as the write path writes it in payloads, worked out once."""
    try:
        said = _envelope.decode(row.state)
        stored = ids.get(row.originator_id)
        if stored is None:
            stored = ids[row.originator_id] = str(UUID(str(row.originator_id)))
        if said.originator_version == row.originator_version and (
            said.originator_id == stored or UUID(said.originator_id) == UUID(stored)
        ):
            return None
    except (msgspec.MsgspecError, TypeError, ValueError):
        return None  # no event at all, which load skips and reports
    return (
        f"its payload is version {said.originator_version} of stream {said.originator_id}, "
        f"but it is stored as version {row.originator_version} of stream {stored}: "
        "edited by hand, and load takes it for what its payload says"
    )


def _broken_link(last: ChainHead, row: ChainRow) -> ChainBreak:
    if row.revision > last.revision + 1:
        missing = _span(last.revision + 1, row.revision - 1)
        return ChainBreak(
            revision=last.revision + 1,
            problem=f"{missing} missing: revision {row.revision} does not chain onto revision "
            f"{last.revision}, so the events between were deleted (or revision "
            f"{row.revision} was altered)",
        )
    return ChainBreak(
        revision=row.revision,
        problem="its stored content does not match its hash: it was altered, "
        "or moved from elsewhere in the log",
    )


def deleted_tail(head: ChainHead, last: int) -> ChainBreak | None:
    """The break of a head past the log's last revision, ``last``: the events
    after it were deleted."""
    if head.revision <= last:
        return None
    return ChainBreak(
        revision=last + 1,
        problem=f"{_span(last + 1, head.revision)} missing: the head is at revision "
        f"{head.revision} but the log ends at {last}, so the last events were deleted",
    )


def _broken_tail(last: ChainHead, head: ChainHead | DamagedHead | None) -> ChainBreak | None:
    if head is None:
        if last.revision == 0:
            return None
        return ChainBreak(
            revision=last.revision + 1,
            problem="the head record (catalog_head) is missing: events after revision "
            f"{last.revision} may have been deleted",
        )
    if isinstance(head, DamagedHead):
        return ChainBreak(
            revision=last.revision + 1,
            problem=f"the head record (catalog_head) is damaged ({head.problem}): events "
            f"after revision {last.revision} may have been deleted",
        )
    deleted = deleted_tail(head, last.revision)
    if deleted is not None:
        return deleted
    if head.revision < last.revision:
        return ChainBreak(
            revision=head.revision + 1,
            problem=f"the head is at revision {head.revision}: the events after it were not "
            "written through the log's write path",
        )
    if head.hash != last.hash:
        return ChainBreak(
            revision=head.revision,
            problem="the head's hash does not match this revision's: the event or the head "
            "record was rewritten, or events after it were deleted and the head moved back",
        )
    return None


def _span(first: int, last: int) -> str:
    return f"revision {first} is" if first == last else f"revisions {first}..{last} are"
