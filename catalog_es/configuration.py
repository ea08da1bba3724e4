"""The declared layer, as recorded in the log: one aggregate, one event kind.

Configuration is read from its file on every start and always wins, so the
log never decides what is declared. It records which declared layer was in
force from which revision on, so a point-in-time read or a diff can say so,
and an audit can show when a newly declared model started shadowing a
runtime one. Recorded by commands that write (and by ``serve`` at start),
never by a read.
"""

from __future__ import annotations

import hashlib
import uuid
from functools import cached_property
from typing import TYPE_CHECKING

import msgspec

from catalog_es.errors import shown
from catalog_es.model import DomainEvent
from catalog_es.names import FINGERPRINT_SHOWN
from catalog_es.spec import DEFAULT_ENGINES, ModelSpec

if TYPE_CHECKING:
    from catalog_es.catalog import Catalog

CONFIGURATION_ID = uuid.uuid5(uuid.NAMESPACE_URL, "catalog-es:configuration")

# Declared configs whose read models (audit tables, snapshots) a database
# keeps: those of the configs used last. Nodes of two configs at once (a
# rolling deploy, a canary beside them) each keep theirs, and each edit of the
# config does not leave a copy of them behind for good.
CONFIGS_KEPT = 3


class DeclaredConfig(msgspec.Struct, frozen=True, dict=True):
    """What configuration declares: in force on every start, whatever the log says.
    (``dict``: room for the fingerprint and the checked layer, worked out
    once, not on every command.) ``given``: false when no config was given
    at all, which a write must not record over one the log recorded
    (:class:`~catalog_es.errors.NoConfigGiven`); not part of the layer."""

    models: tuple[ModelSpec, ...] = ()
    engines: tuple[str, ...] = DEFAULT_ENGINES
    path: str = ""
    given: bool = True

    @cached_property
    def fingerprint(self) -> str:
        """Identifies the declared layer: same models and engines, same fingerprint."""
        canonical = msgspec.json.encode(
            {"engines": sorted(self.engines), "models": sorted(self.models, key=lambda m: m.name)}
        )
        return hashlib.sha256(canonical).hexdigest()

    def check(self) -> None:
        """Check the declared layer against the catalog rules (a
        ``DeclaredModelError`` says where it breaks them). Once a config:
        ``load_config`` asks, to tell where a refusal is in the file, and
        every catalog over it starts from the layer it checked."""
        self._checked_layer  # noqa: B018  (worked out on first use, and kept)

    def new_catalog(self) -> Catalog:
        """A catalog of the declared layer alone, to replay the log over."""
        return self._checked_layer.replay_copy()

    @cached_property
    def _checked_layer(self) -> Catalog:
        # Never changed: each catalog over this config is a copy of it.
        from catalog_es.catalog import Catalog  # which imports this module

        return Catalog(self.models, self.engines)


def named_config(fingerprint: str, path: str) -> str:
    """A declared config as a line names it: its fingerprint, cut short, and
    the file it was read from, as the node that read it was given it (a path
    a record holds written by hand quoted where it would break the line)."""
    where = (path if path.isprintable() else shown(path)) or "no file"
    return f"fingerprint {fingerprint[:FINGERPRINT_SHOWN]} ({where})"


def gone_without(recorded: DeclaredConfig | None) -> str:
    """What a run given no config goes without of the config the log
    recorded: its models, its engines (a config may declare engines alone,
    for runtime models), or both; "it" where the record cannot be read."""
    missed = []
    if recorded is not None and recorded.models:
        missed.append("models")
    if recorded is not None and sorted(recorded.engines) != sorted(DEFAULT_ENGINES):
        missed.append("engines")
    return f"its {' and '.join(missed)}" if missed else "it"


class Configuration:
    """The aggregate of declared-config records."""

    class Declared(DomainEvent, frozen=True, kw_only=True):
        """The full normalised declared definitions, and their fingerprint."""

        fingerprint: str
        engines: tuple[str, ...]
        models: tuple[ModelSpec, ...]
        path: str = ""
