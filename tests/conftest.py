"""Fixtures shared by the suite: the two backends, and a clean working folder."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from catalog_es.inputs import model_from_data
from catalog_es.spec import ModelSpec

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
def pg_url(pg_admin: sa.Engine) -> Iterator[str]:
    """A URL on a schema of its own, dropped afterwards."""
    schema = f"catalog_es_test_{uuid.uuid4().hex[:12]}"
    with pg_admin.connect() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    base = sa.make_url(_admin_url())
    url = base.update_query_dict({"options": f"-csearch_path={schema}"})
    yield url.render_as_string(hide_password=False)
    with pg_admin.connect() as conn:
        conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> str:
    """The same test on the embedded default and on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/catalog.db"
    return str(request.getfixturevalue("pg_url"))


def model_data(name: str) -> dict[str, Any]:
    """A runtime model definition that validates: one GPU, everything else default."""
    return {
        "name": name,
        "engine": "vllm",
        "source": f"hf://org/{name}",
        "profiles": [{"name": "gpu", "gpus": 1}],
    }


def model_spec(name: str, **fields: Any) -> ModelSpec:
    """``model_data(name)`` with ``fields`` changed, parsed as input is."""
    return model_from_data(model_data(name) | fields, "test")


def count_events(url: str) -> int:
    """Rows in the log, read straight from the database."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM catalog_events")).scalar_one())
    finally:
        engine.dispose()


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]) -> None:
    """No test picks up the repo's catalog.yaml or the caller's CATALOG_ES_* settings."""
    for key in list(os.environ):
        if key.startswith("CATALOG_ES_") and key != PG_ENV:
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
