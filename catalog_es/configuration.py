"""The declared layer, as recorded in the log: one aggregate, one event kind.

Configuration is read from its file on every start and always wins, so the
log never decides what is declared. It records which declared layer was in
force from which revision on, so a point-in-time read or a diff can say so,
and an audit can show when a newly declared model started shadowing a
runtime one. Recorded by commands that write (and by ``serve`` at start),
never by a read.
"""

from __future__ import annotations

import uuid

from catalog_es.model import DomainEvent
from catalog_es.spec import ModelSpec

CONFIGURATION_ID = uuid.uuid5(uuid.NAMESPACE_URL, "catalog-es:configuration")


class Configuration:
    """The aggregate of declared-config records."""

    class Declared(DomainEvent, frozen=True, kw_only=True):
        """The full normalised declared definitions, and their fingerprint."""

        fingerprint: str
        engines: tuple[str, ...]
        models: tuple[ModelSpec, ...]
        path: str = ""
