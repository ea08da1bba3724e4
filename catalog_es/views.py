"""Plain data for what queries return: the shapes ``--json`` prints and HTTP serves.

These are the stable output formats, documented in docs/cli.md; change them
only by adding keys (docs/cli.md says where a value changed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, get_args, get_origin

import msgspec

from catalog_es.collector import collector_paused
from catalog_es.configuration import Configuration
from catalog_es.decisions import origin_warnings
from catalog_es.mapper import topic_name
from catalog_es.model import EVENT_TYPES, DomainEvent, Model, utc_text
from catalog_es.names import CONFIG_DECLARED
from catalog_es.spec import ModelSpec, Origin, memory_warnings, name_warnings


def model_view(spec: ModelSpec, *, declared: bool) -> dict[str, Any]:
    """A model as it will run: every default filled in, the effective class, and
    where the definition comes from."""
    return _complete(msgspec.to_builtins(spec), spec, declared)


def model_views(specs: list[ModelSpec], is_declared: Callable[[str], bool]) -> list[dict[str, Any]]:
    """``model_view`` of many, converted in one pass (a catalog can be large)."""
    with collector_paused(lasting=True, cycles=False):
        plain: list[dict[str, Any]] = msgspec.to_builtins(specs)
        return [_complete(v, s, is_declared(s.name)) for v, s in zip(plain, specs, strict=True)]


# The definition's tuples, lists in the documented shape (as JSON has them).
# Converted straight from the structs, not through JSON and back: 10,000
# views in 16 ms rather than 23.
_TUPLES = tuple(
    f.encode_name for f in msgspec.structs.fields(ModelSpec) if get_origin(f.type) is tuple
)


# An origin's text fields, stored as empty text when left out.
_ORIGIN_TEXT = ("repository", "revision")


def show_origin(origin: dict[str, Any] | None) -> None:
    """An origin as every output shows it, changed in place: a field left out
    is null, not the empty text it is stored as, so that what is shown can be
    given back (`model add`, `apply`), where a field given empty is refused (a
    template's variable unset)."""
    if origin is not None:
        for key in _ORIGIN_TEXT:
            if origin[key] == "":
                origin[key] = None


def definition_view(spec: ModelSpec) -> dict[str, Any]:
    """A definition as stored, its origin as shown (:func:`show_origin`): what
    the audit's ``before`` and ``after`` hold."""
    view: dict[str, Any] = msgspec.to_builtins(spec)
    show_origin(view["origin"])
    return view


def _complete(view: dict[str, Any], spec: ModelSpec, declared: bool) -> dict[str, Any]:
    for key in _TUPLES:
        view[key] = list(view[key])
    show_origin(view["origin"])
    view["effective_class"] = spec.effective_class
    view["declared"] = declared
    missing = spec.missing_memory()
    # A declared origin alone was never held to the rules on its way in (a
    # runtime one is as it is written, an older release's is told by the
    # weights commands): each origin checked cost a list 30 us a model.
    declared_origin = spec.origin if declared else None
    # Most models warn of nothing: 10,000 views 15% faster.
    if missing or declared_origin is not None or "/." in spec.name:
        warnings = definition_warnings(missing, spec.name, declared_origin)
        if warnings:
            view["warnings"] = warnings
    return view


def definition_warnings(missing: list[str], name: str, origin: Origin | None) -> list[str]:
    """What a model's view warns of: its CPU-only profiles ``missing`` host
    memory, its name, and ``origin`` (a declared model's)."""
    return memory_warnings(missing) + name_warnings(name) + origin_warnings(origin)


def event_fields(event: DomainEvent) -> dict[str, Any]:
    """An event's own payload, without the envelope every event has, each
    origin in it as every output shows one (:func:`show_origin`): an origin
    given in part is copied from here into `model add` and `apply`."""
    data: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(event))
    fields = {k: v for k, v in data.items() if k not in _ENVELOPE}
    _show_origins(fields, type(event))
    return fields


def refused_fields(event: str, fields: Any) -> Any:
    """A refusal's stored ``fields`` (those of a command refused as ``event``)
    with each origin in them as every output shows one (:func:`show_origin`).
    Shown so rather than stored so: older rows hold the empty text too. A
    refusal keeps what a command was asked, its fields in part or
    ``omitted``: an origin is shown where one is held."""
    event_class = _REFUSED_CLASSES.get(event)
    if event_class is not None and isinstance(fields, dict):
        _show_origins(fields, event_class)
    return fields


_REFUSED_CLASSES = {event_class.__name__: event_class for event_class in EVENT_TYPES}


def _show_origins(fields: dict[str, Any], event_class: type[DomainEvent]) -> None:
    """:func:`show_origin` of each origin that ``fields``, an
    ``event_class``'s, hold, changed in place."""
    for name, holds in _origin_fields(event_class):
        value = fields.get(name)
        if value is None:
            continue
        if holds is Origin:
            show_origin(value)
        elif holds is ModelSpec:
            show_origin(value.get("origin"))
        else:
            for definition in value:
                show_origin(definition.get("origin"))


@functools.cache
def _origin_fields(event_class: type[DomainEvent]) -> tuple[tuple[str, object], ...]:
    """The fields of an event that hold an origin, by their types, not their
    names: an origin (SourceSet, UpstreamChanged's upstream), a definition
    (Added), or definitions (a config record, as ``tuple``). Worked out once
    a class: most events hold none, and ``log --json`` runs this for each."""
    found: list[tuple[str, object]] = []
    for f in msgspec.structs.fields(event_class):
        held = set(get_args(f.type)) | {f.type}
        if Origin in held:
            found.append((f.encode_name, Origin))
        elif ModelSpec in held:
            found.append((f.encode_name, tuple if get_origin(f.type) is tuple else ModelSpec))
    return tuple(found)


_ENVELOPE = frozenset(Model.Event.__struct_fields__)


def event_name(event: DomainEvent) -> str:
    """``Added``, ``Scaled``…; ``ConfigDeclared`` for a declared-config record."""
    if isinstance(event, Configuration.Declared):
        return CONFIG_DECLARED
    return type(event).__name__


def event_view(revision: int, event: DomainEvent) -> dict[str, Any]:
    """One stored event, as ``log --json`` and ``watch --json`` print it."""
    return {
        "revision": revision,
        "time": utc_text(event.timestamp),
        "by": event.by,
        "reason": event.reason,
        "model": event.model if isinstance(event, Model.Event) else None,
        "event": event_name(event),
        "class_version": event.class_version,
        "fields": event_fields(event),
        "rollback_to": event.rollback_to,
    }


def undecodable_view(revision: int, topic: str, model: str, error: str) -> dict[str, Any]:
    """A stored record that could not be decoded, shown rather than hidden: a
    declared-config record as one that can be read is, ``model`` null."""
    event = topic_name(topic)
    return {
        "revision": revision,
        "time": None,
        "by": None,
        "reason": None,
        "model": None if event == CONFIG_DECLARED else model,
        "event": event,
        "class_version": None,
        "fields": {},
        "rollback_to": None,
        "error": error,
    }
