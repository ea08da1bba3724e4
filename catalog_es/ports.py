"""The small interfaces the service is wired to, with the implementations that run here."""

from __future__ import annotations

import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import msgspec

from catalog_es.spec import ModelSpec


class Applier(ABC):
    """Receives the catalog in force after every change. The controller implements it."""

    @abstractmethod
    def replace_catalog(self, models: Sequence[ModelSpec], revision: int) -> None:
        """Make ``models`` the set that runs; ``revision`` is the log position it reflects."""


class PreAddCheck(ABC):
    """Refuses, before it is added, a model whose weights the engine cannot load
    (which would otherwise be placed and then fail on every node it is tried on)."""

    @abstractmethod
    def check(self, model: ModelSpec) -> None:
        """Raise :class:`catalog_es.errors.Refused` to refuse ``model``."""


class NoApplier(Applier):
    """For commands run from a shell: the controller follows the log itself."""

    def replace_catalog(self, models: Sequence[ModelSpec], revision: int) -> None:
        return None


class AcceptAll(PreAddCheck):
    def check(self, model: ModelSpec) -> None:
        return None


class JsonFileApplier(Applier):
    """Writes the catalog in force to a JSON file, atomically, for a controller
    that watches a file. Readers see the old catalog or the new one, never half."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def replace_catalog(self, models: Sequence[ModelSpec], revision: int) -> None:
        body = msgspec.json.encode({"revision": revision, "models": list(models)})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            Path(tmp).replace(self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
