"""Fixtures shared by the suite: the two backends, a clean working folder, the
service on this test's database, and test implementations of the ports."""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa

from catalog_es.application import Models
from catalog_es.configuration import DeclaredConfig
from catalog_es.errors import Refused
from catalog_es.inputs import load_config
from catalog_es.ports import Applier, PreAddCheck
from catalog_es.spec import ModelSpec
from projections.snapshots import DEFAULT_INTERVAL
from tests.helpers import count_events, schema_of

if TYPE_CHECKING:
    from tests.serving import SharedServer

pytest_plugins = ["tests.alone", "tests.locks_held"]

# The CLI reads CATALOG_ES_*, and refuses the event library's cipher settings:
# a developer's shell must not steer the tests.
_REFUSED_SETTINGS = ("CIPHER_TOPIC", "CIPHER_KEY")
_CHECKOUT = str(Path(__file__).resolve().parents[1])
PG_ENV = "CATALOG_ES_TEST_PG"
PG_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PG_HELP = (
    "PostgreSQL is needed for these tests and is not reachable at {url}: start it "
    "(on these machines: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start) "
    f"or point ${PG_ENV} at a server with trust auth"
)


def _admin_url() -> str:
    return os.environ.get(PG_ENV, PG_DEFAULT)


@pytest.fixture(scope="session")
def pg_admin() -> Iterator[sa.Engine]:
    """A connection to the test server; fails (never skips) when it is not there."""
    url = _admin_url()
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.OperationalError:
        pytest.fail(PG_HELP.format(url=url), pytrace=False)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_schema_url(pg_admin: sa.Engine) -> Iterator[Callable[..., str]]:
    """``pg_schema_url(schema=None)``: a URL on a schema of its own (a new
    name unless given: any identifier, quoted), dropped afterwards; its
    sessions are named after it (``application_name``), so that a test
    looking at the server's sessions can tell its own from another test
    worker's."""
    made: list[str] = []

    def make(schema: str | None = None) -> str:
        # A name made here is written bare, as tests use it in their SQL.
        quoted = f"catalog_es_test_{uuid.uuid4().hex[:12]}"
        if schema is not None:
            quoted = '"' + schema.replace('"', '""') + '"'
        with pg_admin.connect() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {quoted}"))
        made.append(quoted)
        url = sa.make_url(_admin_url()).update_query_dict(
            {"options": f"-csearch_path={quoted}", "application_name": schema or quoted}
        )
        return url.render_as_string(hide_password=False)

    yield make
    with pg_admin.connect() as conn:
        for quoted in made:
            conn.execute(sa.text(f"DROP SCHEMA {quoted} CASCADE"))


@pytest.fixture
def pg_url(pg_schema_url: Callable[..., str]) -> str:
    """A URL on a schema of its own (:func:`pg_schema_url`)."""
    return pg_schema_url()


@pytest.fixture
def read_only_url(pg_url: str, pg_admin: sa.Engine) -> Iterator[Callable[[], str]]:
    """``read_only_url()``: a URL on ``pg_url``'s schema as a role that may only
    read the tables there now (as the README says a reading role needs)."""
    url = sa.make_url(pg_url)
    schema = schema_of(pg_url)
    reader = f"reader_{schema}"
    made = False

    def grant() -> str:
        nonlocal made
        with pg_admin.connect() as conn:
            conn.execute(sa.text(f"CREATE ROLE {reader} LOGIN"))
            made = True
            conn.execute(sa.text(f"GRANT USAGE ON SCHEMA {schema} TO {reader}"))
            conn.execute(sa.text(f"GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {reader}"))
        return url.set(username=reader).render_as_string(hide_password=False)

    yield grant
    if made:
        with pg_admin.connect() as conn:
            conn.execute(sa.text(f"DROP OWNED BY {reader}"))
            conn.execute(sa.text(f"DROP ROLE {reader}"))


@pytest.fixture(scope="module")
def shared_server() -> Iterator[SharedServer]:
    """One test server for the module's tests in this process, each serving
    its own app on it in turn (:class:`tests.serving.SharedServer`); ended
    with the module, as a test marked ``alone`` waits for every thread to end."""
    # Imported here: uvicorn and the web app took every test process 0.4 s.
    from tests.serving import shared_server

    with shared_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> str:
    """The same test on the embedded default and on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/catalog.db"
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]) -> None:
    """No test picks up the repo's catalog.yaml or the caller's CATALOG_ES_* settings,
    and the processes a test starts run this checkout's code: the editable
    install names the checkout it was made from, which in another worktree
    of the repository is not this one (a fix there was tested, in the tests'
    subprocesses, against the code without it; review)."""
    for key in list(os.environ):
        if (key.startswith("CATALOG_") and key != PG_ENV) or key in _REFUSED_SETTINGS:
            monkeypatch.delenv(key)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [_CHECKOUT, os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _heap_left_thawed() -> Iterator[None]:
    """No test leaves the heap frozen: ``serve`` freezes what it loaded, and a
    start run in the test process froze a million objects for the rest of the
    run, whose later tests then ran up to 20 times slower (60 s for one)."""
    yield
    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
        pytest.fail(f"the test left {frozen:,} objects frozen (gc.freeze): thaw them")


class RecordingApplier(Applier):
    """The controller's port, recording each catalog pushed and its revision."""

    def __init__(self) -> None:
        self.pushes: list[tuple[int, list[ModelSpec]]] = []
        self.moves: list[tuple[int, ModelSpec]] = []

    def replace_catalog(self, models: Sequence[ModelSpec], revision: int) -> None:
        self.pushes.append((revision, list(models)))

    def replace_replicas(self, model: ModelSpec, revision: int) -> None:
        self.moves.append((revision, model))

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
def service(db_url: str) -> Iterator[Callable[..., Models]]:
    """``service(config=None, snapshot_interval=…, **ports)``: the service on
    this test's database over the declared config at a path (or none), its
    log replayed; every instance is closed at the end."""
    opened: list[Models] = []

    def make(
        config: str | Path | None = None,
        *,
        snapshot_interval: int = DEFAULT_INTERVAL,
        **ports: Any,
    ) -> Models:
        models = Models(
            load_config(str(config)) if config is not None else DeclaredConfig(),
            snapshot_interval=snapshot_interval,
            env={"CATALOG_ES_DB": db_url},
            **ports,
        )
        opened.append(models)
        return models

    yield make
    for models in opened:
        models.close()


@pytest.fixture
def make_models(
    service: Callable[..., Models], write_config: Callable[..., str]
) -> Callable[..., Models]:
    """``make_models(config_yaml=None, **ports)``: ``service`` over a config
    given as YAML text."""

    def make(config_yaml: str | None = None, **ports: Any) -> Models:
        return service(write_config(config_yaml) if config_yaml is not None else None, **ports)

    return make


@pytest.fixture
def rows(db_url: str) -> Callable[[], int]:
    """How many rows ``catalog_events`` holds now, read past the code under test."""
    return lambda: count_events(db_url)
