"""The stored form of events: msgspec JSON, decoded straight into the event struct.

All serialisation lives here, wired into the application through
``construct_mapper`` (``MAPPER_TOPIC``). Domain code never encodes anything.

Decoding never trusts the database: the topic is looked up among the event
classes this code knows (a topic is not an import path to follow), and what
cannot be decoded raises :class:`UndecodableEvent` with a reason a replay can
report while it carries on.
"""

from __future__ import annotations

from contextlib import suppress
from typing import Any
from uuid import UUID

import msgspec
from eventsourcing.persistence import Compressor, Mapper, StoredEvent, Transcoder
from eventsourcing.utils import get_topic

from catalog_es.configuration import Configuration
from catalog_es.errors import InputError, shown
from catalog_es.model import EVENT_TYPES, DomainEvent
from catalog_es.names import CONFIG_DECLARED

_STORED: tuple[type[DomainEvent], ...] = (*EVENT_TYPES, Configuration.Declared)
EVENT_CLASSES: dict[str, type[DomainEvent]] = {get_topic(cls): cls for cls in _STORED}
_encoder = msgspec.json.Encoder()
_decoders: dict[str, msgspec.json.Decoder[Any]] = {
    topic: msgspec.json.Decoder(cls) for topic, cls in EVENT_CLASSES.items()
}
_raw = msgspec.json.Decoder(dict[str, Any])

# The topic declared-config records are stored under.
DECLARED_TOPIC = get_topic(Configuration.Declared)


class UndecodableEvent(Exception):
    """A stored record this code cannot turn into an event."""


def topic_of(cls: type[DomainEvent]) -> str:
    return get_topic(cls)


def encode_event(event: DomainEvent) -> bytes:
    try:
        return _encoder.encode(event)
    except UnicodeEncodeError as error:
        # A lone surrogate: what Python makes of bytes that are not UTF-8 (an
        # argument, a file name). No UTF-8 holds it, so it cannot be stored:
        # refused like any bad input, and nothing is written.
        text = error.object if isinstance(error.object, str) else ""
        raise InputError(
            f"{shown(text)} is not Unicode text (it holds a lone surrogate, as bytes "
            "that are not UTF-8 become); it cannot be stored"
        ) from None


# What a JSON string spelled otherwise than this code writes it holds: JSON
# lets any character be a \u escape (in either case), and "/" be "\/";
# this code writes neither but for a control character with no short escape.
_ESCAPE = b"\\u"
_ESCAPED_SLASH = b"\\/"


def spelling_marks(text: str) -> list[bytes]:
    """Bytes of which a stored event holding ``text`` as a JSON string holds
    one, however it was spelled: as this code writes it (as json.dumps
    without ensure_ascii, jq or PostgreSQL write it too), or with an escape
    no such form has, which every other spelling has (json.dumps's
    ``\\u00e9``, another writer's ``\\u00E9`` or ``\\/``: a record made
    by hand). A row holding one is a candidate, which decoding it tells."""
    marks = [_ESCAPE, _ESCAPED_SLASH] if "/" in text else [_ESCAPE]
    with suppress(UnicodeEncodeError):
        marks.append(_encoder.encode(text))
    return marks


_VERSIONS: dict[type[DomainEvent], int] = {cls: cls.current_version() for cls in _STORED}

# What decoding a stored payload raises when it cannot be read: msgspec's
# errors, and TypeError for one that is not bytes at all (SQLite lets a row
# hold any type, a number for the payload say).
UNREADABLE = (msgspec.MsgspecError, TypeError)


def decode_event(topic: str, state: bytes) -> DomainEvent:
    """The event stored as ``state`` under ``topic``, upcast to this code's version."""
    decoder = _decoders.get(topic)
    if decoder is None:
        raise UndecodableEvent(f"unknown event type {topic!r}")
    try:
        event: DomainEvent = decoder.decode(state)
    except UNREADABLE:
        pass  # an older shape, perhaps, or not bytes at all: try the upcasting path
    else:
        if event.class_version == _VERSIONS[type(event)]:
            return event
    return _upcast(EVENT_CLASSES[topic], state)


def readable_declaration(topic: str, state: bytes) -> Configuration.Declared | None:
    """The declared-config record stored as ``state``; ``None`` for one that
    cannot be read (a newer release's, say) or is no such record (filed in
    the config's stream by hand): read for what it declares, such a record
    is passed over."""
    try:
        record = decode_event(topic, state)
    except UndecodableEvent:
        return None
    return record if isinstance(record, Configuration.Declared) else None


class _Fingerprinted(msgspec.Struct):
    fingerprint: str = ""
    class_version: int = 1


_fingerprinted = msgspec.json.Decoder(_Fingerprinted)


def declared_fingerprint(topic: str, state: bytes) -> str | None:
    """The fingerprint of the declared config recorded as ``state``, read from
    that field alone where this code's version of the record has it (a
    record holds every declared definition); ``None`` as for
    :func:`readable_declaration`."""
    if topic == DECLARED_TOPIC:
        try:
            found = _fingerprinted.decode(state)
        except UNREADABLE:
            return None
        if found.class_version == _VERSIONS[Configuration.Declared]:
            return found.fingerprint
    record = readable_declaration(topic, state)
    return record.fingerprint if record is not None else None


class _About(msgspec.Struct):
    model: str | None = None
    class_version: int = 1


_about = msgspec.json.Decoder(_About)


def is_about_another(topic: str, state: bytes, model: str) -> bool:
    """Whether replaying this stored event surely leaves ``model`` as it is,
    told by reading two fields rather than decoding it all: it names another
    model (or none) in this code's version of its class, which no upcaster
    will change, or its type is not one this code knows. False when only a
    full decode can tell."""
    cls = EVENT_CLASSES.get(topic)
    if cls is None:
        return True  # replay skips it
    try:
        about = _about.decode(state)
    except UNREADABLE:
        return False
    return about.class_version == _VERSIONS[cls] and about.model != model


def topic_name(topic: str) -> str:
    """The event's class name from its topic, as the log shows an undecodable
    record; a topic that is not text (SQLite lets a row hold any type) as
    ``repr`` writes it. A declared-config record is ``ConfigDeclared``, as
    the log shows one it can read."""
    if topic == DECLARED_TOPIC:
        return CONFIG_DECLARED
    if not isinstance(topic, str):
        return repr(topic)
    name = topic.rpartition(".")[2]
    # Only the config's own topic is named so (or by its class's name, as
    # snapshots of older releases name it): another ending so is a model's
    # record, which a snapshot or the audit took for the config's where a
    # full replay did not (review). It is named whole, as repr writes it.
    return repr(topic) if name in _CONFIG_NAMES else name


_CONFIG_NAMES = (CONFIG_DECLARED, DECLARED_TOPIC.rpartition(".")[2])


def model_of_state(state: bytes) -> str:
    """The model an undecodable record was about, when that much can be read."""
    try:
        data = _raw.decode(state)
    except UNREADABLE:
        return ""
    value = data.get("model", "")
    return value if isinstance(value, str) else ""


def _upcast(cls: type[DomainEvent], state: bytes) -> DomainEvent:
    current = _VERSIONS[cls]
    try:
        data = _raw.decode(state)
    except UNREADABLE as error:
        raise UndecodableEvent(f"corrupt payload: {error}") from None
    version = data.get("class_version", 1)
    if not isinstance(version, int) or version < 1:
        raise UndecodableEvent(f"class_version {version!r} is not a version")
    if version > current:
        raise UndecodableEvent(
            f"written by a newer version of catalog-es ({cls.__qualname__} class_version "
            f"{version}; this one reads up to {current})"
        )
    while version < current:
        upcaster = cls.upcasters.get(version)
        if upcaster is None:
            raise UndecodableEvent(
                f"no upcaster for {cls.__qualname__} from class_version {version}"
            )
        try:
            data = upcaster(data)
            if not isinstance(data, dict):
                raise TypeError(f"it returned a {type(data).__name__}, not a dict")
        except Exception as error:
            # An old record the upcaster was not written for: that record is
            # skipped and reported, the load goes on.
            raise UndecodableEvent(
                f"upcasting {cls.__qualname__} from class_version {version} failed: "
                f"{type(error).__name__}: {error}"
            ) from None
        version += 1
    data["class_version"] = current
    try:
        return msgspec.convert(data, cls)
    except msgspec.MsgspecError as error:
        raise UndecodableEvent(f"invalid payload: {error}") from None


class MsgspecTranscoder(Transcoder):
    """Plain msgspec JSON, for anything the mapper is asked to transcode."""

    def encode(self, obj: Any) -> bytes:
        return _encoder.encode(obj)

    def decode(self, data: bytes) -> Any:
        return msgspec.json.decode(data)


class StoredRecord(msgspec.Struct, frozen=True, gc=False):
    """An event as the recorder appends it: ``StoredEvent``'s fields, in a
    struct made in a twentieth of the time of that frozen dataclass (9,000
    instructions each, for every event of every write)."""

    originator_id: UUID
    originator_version: int
    topic: str
    state: bytes


class EventMapper(Mapper[UUID]):
    """Events to stored events and back, through msgspec, never pickle."""

    def __init__(
        self,
        transcoder: Transcoder | None = None,
        compressor: Compressor | None = None,
        cipher: Any = None,
    ) -> None:
        if compressor is not None or cipher is not None:
            # Every reader (log, replay, audit, snapshots) decodes the stored
            # bytes as encode_event writes them.
            raise ValueError("catalog-es stores events as msgspec JSON: no compressor or cipher")
        super().__init__(transcoder or MsgspecTranscoder())

    def to_record(self, event: DomainEvent) -> StoredRecord:
        """``event`` as the recorder appends it (what the service writes)."""
        return StoredRecord(
            event.originator_id,
            event.originator_version,
            topic_of(type(event)),
            encode_event(event),
        )

    def to_stored_event(self, domain_event: Any) -> StoredEvent:
        assert isinstance(domain_event, DomainEvent), type(domain_event)
        record = self.to_record(domain_event)
        return StoredEvent(
            originator_id=record.originator_id,
            originator_version=record.originator_version,
            topic=record.topic,
            state=record.state,
        )

    def to_domain_event(self, stored_event: StoredEvent) -> DomainEvent:
        return decode_event(stored_event.topic, stored_event.state)
