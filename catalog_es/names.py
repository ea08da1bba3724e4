"""The names the command line reads and offers as it parses its options: the
event types of ``--type`` and the dimensions of ``rollback --only``.

Apart from the events and planners they name, which need msgspec and the
catalog: ``--help`` and a usage error load none of the service.
"""

from __future__ import annotations

from catalog_es.errors import InputError, shown

# The Model aggregate's events, as their classes are named
# (:data:`catalog_es.model.EVENT_TYPES` is the classes these name).
MODEL_EVENTS = (
    "Added",
    "Removed",
    "Scaled",
    "ResourcesSet",
    "ClassSet",
    "OwnerSet",
    "AdaptersSet",
    "SourceSet",
    "OriginSet",
    "UpstreamChanged",
)

# What a declared-config record is called where events are listed by name.
CONFIG_DECLARED = "ConfigDeclared"
# The hex digits of a declared config's fingerprint shown where one is named
# (the log's summary of a record, a warning): enough to tell configs apart.
FINGERPRINT_SHOWN = 12
# What a declared-config record did to one model's declared definition, as
# the audit's row of that model says (a model's history shows them among its
# runtime events): declared it anew, declared it otherwise, no longer declares it.
DECLARED = "Declared"
REDECLARED = "Redeclared"
UNDECLARED = "Undeclared"
DECLARATION_TYPES = (DECLARED, REDECLARED, UNDECLARED)

# What a refused rollback is recorded as: it has no event of its own (one
# that goes through writes the events it plans, each marked ``rollback_to``).
ROLLBACK = "Rollback"
# What a list of changes refused as a whole is recorded as (a stale expected
# revision): no one change of it was refused. One refused change is recorded
# as itself.
APPLY = "Apply"
# What a ``model check-updates`` refused as a whole is recorded as (a stale
# expected revision): it writes origins and findings, no one kind of event.
CHECK_UPDATES = "CheckUpdates"

# The event types each query's rows carry: a model's history, its events and
# what config records did to its declared definition; the audit, a
# declared-config record's besides (no model's); the refusals, a model's
# events, a declared-config record's (a refused start) and a refused
# rollback's, list of changes' or check for updates' (no event of their own).
HISTORY_TYPES = (*MODEL_EVENTS, *DECLARATION_TYPES)
AUDIT_TYPES = (*HISTORY_TYPES, CONFIG_DECLARED)
REFUSAL_TYPES = (*MODEL_EVENTS, CONFIG_DECLARED, ROLLBACK, APPLY, CHECK_UPDATES)
_EVENT_NAMES = {name.lower(): name for types in (AUDIT_TYPES, REFUSAL_TYPES) for name in types}
# Each query, as its command is named: what an answer calls it, and its types.
QUERY_TYPES = {
    "history": ("a model's history", HISTORY_TYPES),
    "audit": ("the audit", AUDIT_TYPES),
    "refusals": ("the record of refusals", REFUSAL_TYPES),
}

# What a rollback can be limited to (its planners are
# :data:`catalog_es.rollback.DIMENSIONS`, in this order).
ROLLBACK_DIMENSIONS = ("source", "scaling", "resources", "class", "owner", "adapters")


def carried(name: str, query: str, said: str) -> str:
    """``name``, an event type, where the rows of ``query`` (a key of
    :data:`QUERY_TYPES`) can carry it. One they never do matched nothing,
    said as nothing done (``audit --type Rollback``: a refused rollback is
    in the refusals alone)."""
    what, types = QUERY_TYPES[query]
    if name not in types:
        raise InputError(f"{said} {name!r}: {what} has none; it takes {', '.join(types)}")
    return name


def event_type(text: str, option: str) -> str:
    """An event type's name (``Scaled``), in any case: a value the audit's or
    the refusals' rows carry."""
    name = _EVENT_NAMES.get(text.lower())
    if name is None:
        known = ", ".join(_EVENT_NAMES.values())
        raise InputError(f"{option} {shown(text)}: not an event type (known: {known})")
    return name
