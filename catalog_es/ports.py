"""The small interfaces the service is wired to, with the implementations that run here."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import msgspec

from catalog_es.files import replace_file
from catalog_es.spec import ModelSpec


class Applier(ABC):
    """Receives the catalog in force after every change. The controller implements it."""

    @abstractmethod
    def replace_catalog(self, models: Sequence[ModelSpec], revision: int) -> None:
        """Make ``models`` the set that runs; ``revision`` is the log position it reflects."""

    @abstractmethod
    def replace_replicas(self, model: ModelSpec, revision: int) -> None:
        """Move the running replicas of ``model`` onto this definition (new
        weights), one at a time: each new replica is ready before the next old
        one stops, so the model keeps serving throughout. ``revision`` is the
        log position the definition went into force at."""


class PreAddCheck(ABC):
    """Refuses, before it is added, a model whose weights the engine cannot load
    (which would otherwise be placed and then fail on every node it is tried on).
    Asked only about an add the rules accept, as the log stands: a probe can be
    slow, and a declared name or a stale expected revision needs none."""

    # Whether ``check`` can refuse anything: one that cannot needs no add
    # decided before it is asked (that costs a large apply 15%).
    probes: ClassVar[bool] = True

    @abstractmethod
    def check(self, model: ModelSpec) -> None:
        """Raise :class:`catalog_es.errors.Refused` to refuse ``model``."""


class NoApplier(Applier):
    """For commands run from a shell: the controller follows the log itself."""

    def replace_catalog(self, models: Sequence[ModelSpec], revision: int) -> None:
        return None

    def replace_replicas(self, model: ModelSpec, revision: int) -> None:
        # The controller sees the new source in the log and rolls the replicas itself.
        return None


class AcceptAll(PreAddCheck):
    probes = False

    def check(self, model: ModelSpec) -> None:
        return None


class JsonFileApplier(Applier):
    """Writes the catalog in force to a JSON file, atomically, for a controller
    that watches a file. Readers see the old catalog or the new one, never half.

    Replica replacements are requests the controller works through in order:
    one JSON line each, appended to ``<path>.replicas.jsonl``, because a later
    catalog must not overwrite a request the controller has not read yet."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.replicas_path = path.with_name(f"{path.name}.replicas.jsonl")

    def replace_catalog(self, models: Sequence[ModelSpec], revision: int) -> None:
        body = msgspec.json.encode({"revision": revision, "models": list(models)})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(self.path, body)

    def replace_replicas(self, model: ModelSpec, revision: int) -> None:
        line = msgspec.json.encode(
            {"revision": revision, "model": model, "strategy": "one-at-a-time"}
        )
        self.replicas_path.parent.mkdir(parents=True, exist_ok=True)
        with self.replicas_path.open("ab") as f:
            f.write(line + b"\n")
            f.flush()
            os.fsync(f.fileno())
