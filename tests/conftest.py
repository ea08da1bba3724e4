"""Fixtures: the service on a real SQLite file in ``tmp_path``, and test ports."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from catalog_es.application import Models
from catalog_es.bootstrap import open_models
from catalog_es.errors import Refused
from catalog_es.ports import Applier, PreAddCheck
from catalog_es.spec import ModelSpec
from tests.helpers import count_events

# eventsourcing lets the environment override an application's settings, and
# the CLI reads CATALOG_ES_*: a developer's shell must not steer the tests.
_LIBRARY_SETTINGS = ("PERSISTENCE_MODULE", "MAPPER_TOPIC", "COMPRESSOR_TOPIC", "CIPHER_TOPIC")


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The repository's own ./catalog.yaml would be picked up as declared config.
    monkeypatch.chdir(tmp_path)
    for var in list(os.environ):
        if var.startswith("CATALOG_") or var in _LIBRARY_SETTINGS:
            monkeypatch.delenv(var)


class RecordingApplier(Applier):
    """The controller's port, recording each catalog pushed and its revision."""

    def __init__(self) -> None:
        self.pushes: list[tuple[int, list[ModelSpec]]] = []

    def replace_catalog(self, models: Sequence[ModelSpec], revision: int) -> None:
        self.pushes.append((revision, list(models)))

    @property
    def revisions(self) -> list[int]:
        return [revision for revision, _ in self.pushes]


class RefuseSources(PreAddCheck):
    """Refuses weights under a prefix, as an engine probe refuses what it cannot load."""

    def __init__(self, prefix: str = "hf://broken/") -> None:
        self.prefix = prefix
        self.checked: list[str] = []

    def check(self, model: ModelSpec) -> None:
        self.checked.append(model.name)
        if model.source.startswith(self.prefix):
            raise Refused(f"model {model.name!r}: the engine cannot load {model.source}")


@pytest.fixture
def db_file(tmp_path: Path) -> Path:
    return tmp_path / "catalog.db"


@pytest.fixture
def db_url(db_file: Path) -> str:
    return f"sqlite:///{db_file}"


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[..., str]:
    """Writes a declared config file and returns its path; each call a new file,
    so a test can reopen the same log over a config that has changed."""
    written = 0

    def write(text: str) -> str:
        nonlocal written
        written += 1
        path = tmp_path / f"config-{written}.yaml"
        path.write_text(text, encoding="utf-8")
        return str(path)

    return write


@pytest.fixture
def make_models(db_url: str, write_config: Callable[..., str]) -> Iterator[Callable[..., Models]]:
    """``make_models(config_yaml=None, **ports)``: the service on this test's
    database, its log replayed; every instance is closed at the end."""
    opened: list[Models] = []

    def make(config_yaml: str | None = None, **ports: Any) -> Models:
        config = write_config(config_yaml) if config_yaml is not None else None
        models = open_models(db_url, config, **ports)
        opened.append(models)
        return models

    yield make
    for models in opened:
        models.close()


@pytest.fixture
def rows(db_file: Path) -> Callable[[], int]:
    """How many rows ``catalog_events`` holds now."""
    return lambda: count_events(db_file)
