"""The HTTP API (issue 9), through a real server on 127.0.0.1, on SQLite and
PostgreSQL: every endpoint, auth, bad bodies, compare-and-set, the watch stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import gzip
import json
import logging
import os
import queue
import re
import resource
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

import httpx
import msgspec
import psycopg
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from hypothesis import example, given, settings
from hypothesis import strategies as st

from catalog_es import commands
from catalog_es.application import Models
from catalog_es.cli import cli
from catalog_es.cli.serve import AcceptErrorsTold, _listening
from catalog_es.errors import (
    UNSAFE_TEXT,
    InputError,
    LogRewritten,
    StorageBusy,
    json_escaped,
    json_escaped_bytes,
)
from catalog_es.inputs import (
    MAX_CHANGES,
    MAX_INPUT_BYTES,
    DeclaredConfig,
    load_config,
    open_to_read,
)
from catalog_es.model import model_id
from catalog_es.storage.engines import database_unusable
from catalog_es.storage.schema import channel_of, refusals_table
from catalog_es.web import app as web_app
from catalog_es.web import tokens as web_tokens
from catalog_es.web.app import create_app
from catalog_es.web.events import BATCH_MESSAGES, WAKE_UP_SECONDS, _next_batch
from catalog_es.web.tokens import MAX_TOKENS_BYTES, TokenStore
from projections.audit import changes_table_for
from tests.helpers import (
    EVERY_STOP,
    STOPS_BLOCKED_OR_NOT,
    STOPS_TOLD,
    commits_held,
    config_yaml,
    count_events,
    definition,
    following,
    log_rows,
    put_back,
    spec,
    stops_blocked,
)
from tests.serving import (
    Proxy,
    SharedServer,
    bearer,
    http_client,
    serving,
    started,
    tokens_for_roles,
)
from tests.test_concurrency import write_lock_held

DECLARED_YAML = config_yaml(spec("base"))  # one declared model


@dataclass
class Api:
    url: str
    db: str
    models: Models
    tokens: TokenStore
    token: dict[str, str]  # role -> token
    client: httpx.Client

    def as_(self, role: str) -> dict[str, str]:
        return bearer(self.token[role])

    def get(self, path: str, role: str = "read", **kwargs: Any) -> httpx.Response:
        return self.client.get(path, headers=self.as_(role), **kwargs)

    def post(self, path: str, body: Any, role: str = "write", **headers: str) -> httpx.Response:
        return self.client.post(path, json=body, headers={**self.as_(role), **headers})


@pytest.fixture
def config_file(write_config: Callable[..., str]) -> str:
    return write_config(DECLARED_YAML)


@pytest.fixture
def api(
    db_url: str,
    tmp_path: Path,
    make_models: Callable[..., Models],
    shared_server: SharedServer,
) -> Iterator[Api]:
    models = make_models(DECLARED_YAML)
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    # Not httpx's 5 s: an answer took longer once, with the suite beside
    # three other test runs on two cores (ReadTimeout).
    with (
        shared_server.serving(create_app(models, tokens)) as url,
        http_client(base_url=url, timeout=30) as client,
    ):
        yield Api(url, db_url, models, tokens, token, client)


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


def refused(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    message: str = response.json()["error"]
    return message


# -- commands ------------------------------------------------------------------------


def test_every_command_answers_its_revision_and_records_the_tokens_actor(api: Api) -> None:
    added = ok(api.post("/models?reason=trying", definition("qwen")))
    assert added["revision"] == 2  # 1 is the declared config, recorded by the first write
    assert added["model"]["name"] == "qwen" and added["replaced"] is False
    assert api.post("/models", definition("qwen")).json()["replaced"] is True

    steps: list[tuple[str, dict[str, Any], str, Any]] = [
        ("scale", {"min": 0, "max": 3}, "scaling", {"min": 0, "max": 3}),
        ("resources", {"memory_gb": 48, "cpu_cores": 8}, "profiles", None),
        ("class", {"class": "critical"}, "class", "critical"),
        ("owner", {"owner": "team:search"}, "owner", "team:search"),
        ("adapters", {"adapters": [{"name": "sql", "source": "s3://a/sql"}]}, "adapters", None),
        (
            "source",
            {"source": "hf://org/qwen-awq", "origin": {"repository": "org/qwen-awq"}},
            "source",
            "hf://org/qwen-awq",
        ),
    ]
    revision = 3
    for verb, body, field, value in steps:
        response = api.post(f"/models/qwen/{verb}", body)
        result = ok(response)
        revision += 1
        assert result["revision"] == revision, verb
        assert response.headers["ETag"] == f'"{revision}"'
        assert response.headers["X-Catalog-Revision"] == str(revision)
        if value is not None:
            assert result["model"][field] == value, verb
    shown = ok(api.get("/models/qwen"))
    assert shown["profiles"][0]["min_memory_gb"] == 48
    assert shown["adapters"] == [{"name": "sql", "source": "s3://a/sql"}]
    assert shown["origin"]["repository"] == "org/qwen-awq"
    # An origin that says nothing is none, as the CLI's `model source` without
    # its options records: it was kept as one of empty fields (review).
    ok(api.post("/models/qwen/source", {"source": "hf://org/qwen", "origin": {}}))
    assert ok(api.get("/models/qwen"))["origin"] is None
    revision += 1
    ok(api.post("/models", {**definition("bare"), "origin": {}}))
    assert ok(api.get("/models/bare"))["origin"] is None
    ok(api.client.delete("/models/bare", headers=api.as_("write")))
    revision += 2

    applied = ok(
        api.post("/apply", [{"add": definition("tiny")}, {"scale": {"name": "tiny", "max": 2}}])
    )
    assert applied["revision"] == revision + 2 and applied["changes"] == 2

    removed = ok(api.client.delete("/models/tiny", headers=api.as_("write")))
    assert removed == {
        "revision": revision + 3,
        "model": None,
        "replaced": False,
        "removed": "tiny",
        "written": True,
    }
    log = ok(api.get("/log", params={"after": 1}))
    assert {e["by"] for e in log} == {"write-user"}
    assert log[0]["reason"] == "trying"


def test_a_large_apply_is_answered_as_it_is_built(api: Api) -> None:
    """An apply's answer gives each change's model whole (58 MB for 5,000
    changes to a model with a hundred adapters) and was held whole until
    its client read it; it is sent as it is built, one document all the same."""
    changes = [{"add": definition(f"m{i}")} for i in range(150)]
    changes += [{"scale": {"name": f"m{i % 150}", "max": 2 + i % 5}} for i in range(300)]
    with api.client.stream(
        "POST", "/apply", json=[*changes, {"remove": "m7"}], headers=api.as_("write")
    ) as answer:
        assert answer.status_code == 200
        body = json.loads(answer.read())
    assert "content-length" not in answer.headers
    assert answer.headers["x-catalog-revision"] == str(body["revision"]) == str(api.models.revision)
    assert answer.headers["etag"] == f'"{body["revision"]}"'
    assert (answer.headers["cache-control"], answer.headers["x-frame-options"]) == (
        "no-store",
        "DENY",
    )
    assert body["changes"] == 451
    assert [(m["model"], m["event"]) for m in body["models"]] == (
        [(f"m{i}", "Added") for i in range(150)]
        + [(f"m{i % 150}", "Scaled") for i in range(300)]
        + [("m7", "Removed")]
    )
    scaled = [m["definition"]["scaling"]["max"] for m in body["models"][150:450]]
    assert scaled == [2 + i % 5 for i in range(300)]
    assert body["models"][-1]["definition"] is None


def test_the_list_of_models_is_sent_as_it_is_built(api: Api) -> None:
    """100,000 models answered whole took 133 MB more than the catalog, held
    for as long as the client did not read: sent as it is built, it is one
    document all the same, tagged with the revision it was read at."""
    ok(api.post("/apply", [{"add": definition(f"m{i}")} for i in range(300)]))
    with api.client.stream("GET", "/models", headers=api.as_("read")) as answer:
        assert answer.status_code == 200
        body = json.loads(answer.read())
    assert "content-length" not in answer.headers
    assert answer.headers["x-catalog-revision"] == str(api.models.revision)
    assert answer.headers["etag"] == f'"{api.models.revision}"'
    assert body == api.models.list_models()
    assert len(body) == 301  # and the declared base


def test_a_body_or_query_that_names_the_actor_is_refused(api: Api) -> None:
    before = count_events(api.db)
    message = refused(api.post("/models", {**definition("qwen"), "by": "mallory"}), 422)
    assert message == "request body: by: unknown field"
    message = refused(api.post("/models/base/scale", {"max": 2, "by": "mallory"}), 422)
    assert message == "request body: by: unknown field"
    assert count_events(api.db) == before


# -- queries ---------------------------------------------------------------------------


def test_reads_now_and_in_the_past(api: Api) -> None:
    assert ok(api.get("/models")) == api.models.list_models()
    api.post("/models", definition("qwen"))
    api.post("/models/qwen/scale", {"max": 4})
    response = api.get("/models")
    assert [m["name"] for m in response.json()] == ["base", "qwen"]
    assert response.headers["ETag"] == '"3"'

    past = api.get("/models", params={"at": "2"})
    assert past.headers["X-Catalog-Revision"] == "2"
    assert [m["scaling"]["max"] for m in past.json() if m["name"] == "qwen"] == [1]
    assert ok(api.get("/models/qwen", params={"at": 2}))["scaling"]["max"] == 1
    time_now = ok(api.get("/log"))[-1]["time"]
    assert ok(api.get("/models/qwen", params={"at": time_now}))["scaling"]["max"] == 4
    assert ok(api.get("/models", params={"at": 0})) == ok(api.get("/models", params={"at": 1}))

    assert ok(api.get("/revision")) == {"revision": 3}
    assert ok(api.get("/me")) == {"actor": "read-user", "role": "read"}
    diff = ok(api.get("/diff", params={"since": 2}))
    assert diff == api.models.diff(2)
    assert diff["changed"][0]["fields"]["scaling"]["after"] == {"min": 1, "max": 4}
    assert ok(api.get("/diff", params={"since": 1, "until": 2}))["added"][0]["name"] == "qwen"
    assert ok(api.get("/sources"))["hf://org/qwen"] == [{"model": "qwen"}]
    assert [e["event"] for e in ok(api.get("/log", params={"model": "qwen"}))] == [
        "Added",
        "Scaled",
    ]
    assert len(ok(api.get("/log", params={"limit": 1}))) == 1
    assert ok(api.get("/skipped")) == []


def test_log_by_an_actor_is_that_actors_events_alone(api: Api) -> None:
    """`/log` took no actor, where `/audit` does: `by` keeps that actor's
    events, as `log --by` does, with `model`, `after` and `limit` as
    without it; an empty one is refused as `/audit` refuses it. The schema
    says so, and a read writes nothing."""
    # Revision 1 is the declared config, recorded by the first write.
    api.post("/models?reason=admin-user", definition("qwen"))  # a reason naming an actor
    api.post("/models/qwen/scale", {"max": 3}, role="admin")
    api.post("/models/qwen/scale", {"max": 4})
    logged = ok(api.get("/log"))
    written = count_events(api.db)

    def revisions(**params: Any) -> list[int]:
        return [e["revision"] for e in ok(api.get("/log", params=params))]

    assert ok(api.get("/log", params={"by": "admin-user"})) == [logged[2]]
    assert revisions(by="write-user") == [1, 2, 4]
    assert revisions(by="write-user", model="qwen") == [2, 4]
    assert revisions(by="write-user", after=1, limit=1) == [2]
    assert revisions(by="write-user", model="qwen", after=2) == [4]
    assert revisions(by="nobody") == revisions(by="write-user", after=4) == []
    told = refused(api.get("/log", params={"by": ""}), 422)
    assert told == "by: the actor is empty; give an actor, or no actor filter"
    assert count_events(api.db) == written
    (by,) = [
        p
        for p in ok(api.client.get("/openapi.json"))["paths"]["/log"]["get"]["parameters"]
        if p["name"] == "by"
    ]
    assert (by["in"], by["schema"]["type"], by["schema"]["minLength"]) == ("query", "string", 1)


def test_reads_of_the_past_over_the_config_recorded_then(
    api: Api, make_models: Callable[..., Models]
) -> None:
    """Another node, on a config declaring 'qwen' and not 'base', writes;
    read at its revision, the server's own config and the one recorded then
    give different declared layers, as the CLI's reads do."""
    api.post("/models", definition("trial"))  # 1: the server's config, 2: the add
    other = make_models(config_yaml(spec("qwen")))
    other.scale("trial", 0, 2, by="other-node")  # 3: its config, 4: the scale
    other.close()
    today = ok(api.get("/models", params={"at": 4}))
    then = ok(api.get("/models", params={"at": 4, "declared": "then"}))
    assert [(m["name"], m["declared"]) for m in today] == [("base", True), ("trial", False)]
    assert [(m["name"], m["declared"]) for m in then] == [("qwen", True), ("trial", False)]
    assert then == api.models.list_models(4, declared_then=True)
    assert ok(api.get("/models/qwen", params={"at": 4, "declared": "then"}))["declared"]
    assert refused(api.get("/models/qwen", params={"at": 4}), 404) == (
        "model 'qwen' is not in the catalog at revision 4"
    )
    diff = ok(api.get("/diff", params={"since": 2, "until": 4, "declared": "then"}))
    assert [m["name"] for m in diff["added"]] == ["qwen"]
    assert [m["name"] for m in diff["removed"]] == ["base"]
    assert ok(api.get("/models", params={"at": 4, "declared": "today"})) == today
    sources = api.get("/sources", params={"at": 2})
    assert sources.headers["X-Catalog-Revision"] == "2"
    assert sorted(ok(sources)) == ["hf://org/base", "hf://org/trial"]
    assert sorted(ok(api.get("/sources", params={"at": 4, "declared": "then"}))) == [
        "hf://org/qwen",
        "hf://org/trial",
    ]
    assert ok(api.get("/sources", params={"at": 0})) == {"hf://org/base": [{"model": "base"}]}

    written = count_events(api.db)
    assert refused(api.get("/models", params={"declared": "then"}), 422) == (
        "declared=then reads the past: give at too"
    )
    assert "declared" in refused(api.get("/models", params={"at": 4, "declared": "now"}), 422)
    assert refused(api.get("/models", params={"at": 0, "declared": "then"}), 422).startswith(
        "no declared config was recorded at or before revision 0"
    )
    assert count_events(api.db) == written


def test_a_query_key_the_path_does_not_take_is_refused_not_passed_over(api: Api) -> None:
    """`?att=3` read now, and so did an `at` on a path that reads only now
    (`/sources`, until it read the past): a mistyped key answered something
    else than what was asked, in silence (conformance audit)."""
    api.post("/models", definition("qwen"))
    written = count_events(api.db)
    assert refused(api.get("/models", params={"att": 1}), 422) == (
        "unknown query parameter 'att'; this path takes: at, declared"
    )
    assert refused(api.get("/revision", params={"at": 1}), 422) == (
        "unknown query parameter 'at'; this path takes: none"
    )
    scaled = api.client.post(
        "/models/qwen/scale", params={"reson": "x"}, json={"max": 3}, headers=api.as_("write")
    )
    assert refused(scaled, 422) == "unknown query parameter 'reson'; this path takes: reason"
    # A key given twice is refused too, not read as its last value (hostile test).
    for path, query in (("/audit", "model=a&model=b"), ("/models", "at=1&at=2")):
        twice = api.client.get(f"{path}?{query}", headers=api.as_("read"))
        key = query.split("=")[0]
        assert refused(twice, 422) == f"{key} is given more than once in the query: give it once"
    assert count_events(api.db) == written
    # Who is asking is known first: no token, no word on the query.
    assert api.client.get("/models", params={"att": 1}).status_code == 401
    # What a path does take still passes, its dependencies' keys included.
    assert ok(api.get("/log", params={"after": 1, "limit": 1, "model": "qwen"}))
    assert ok(api.get("/diff", params={"since": 2, "model": "qwen", "declared": "then"}))


def test_a_log_asked_of_a_name_no_model_can_have_is_refused(api: Api) -> None:
    """Its id was worked out and kept, whatever text was sent: 5,000 names of
    60 KB each grew the server by 300 MB, never given back (hostile test)."""
    kept = model_id.cache_info().currsize  # the server runs in this process
    for _ in range(3):
        name = os.urandom(30_000).hex()
        assert "is not a valid name" in refused(api.get("/log", params={"model": name}), 422)
    assert model_id.cache_info().currsize == kept
    # A diff of such a name said "no change", as if the name were a model's (review).
    bad = refused(api.get("/diff", params={"since": 0, "model": "bad name!"}), 422)
    assert "'bad name!'" in bad and "is not a valid name" in bad


def test_a_rollback_of_a_dimension_there_is_not_is_refused_in_the_apis_words(api: Api) -> None:
    """It was refused in the CLI's: "--only 'nope'", an option HTTP has not (review)."""
    api.post("/models", definition("qwen"))
    answer = api.post("/rollback", {"to": 1, "only": "nope"}, role="admin")
    assert refused(answer, 422).startswith("only 'nope': choose one of source, scaling, ")


def test_a_large_yaml_body_being_read_holds_up_no_other_request(api: Api) -> None:
    """YAML is read in Python, seconds for a megabyte: read on the server's
    event loop, it held up every other request meanwhile, `/me` included
    (3.8 s; four such bodies at once, 11.5 s; hostile test)."""
    body = "".join(f"k{i}: [a, b]\n" for i in range(70_000))  # just under 1 MiB
    done: dict[str, float] = {}

    def post() -> None:
        answer = api.client.post(
            "/rollback",
            content=body.encode(),
            headers={**api.as_("read"), "Content-Type": "application/yaml"},
            timeout=60,
        )
        done["post"] = time.monotonic()
        assert answer.status_code == 422, answer.text  # no `to`: read, then refused

    reading = threading.Thread(target=post)
    done["start"] = time.monotonic()
    reading.start()
    time.sleep(0.1)
    asked = time.monotonic()
    assert ok(api.get("/me"))["actor"] == "read-user"
    answered = time.monotonic() - asked
    reading.join()
    # Well within the time the body took, whatever this machine's speed (the
    # thread reading it holds the interpreter's lock in turns with the loop:
    # /me took 0.02-0.4 s while a body took 3-4 s; on the loop, all of it).
    assert answered < (done["post"] - done["start"]) / 3, "/me waited for the body"


def test_the_openapi_schema_and_the_console_are_served(api: Api) -> None:
    schema = ok(api.client.get("/openapi.json"))
    for path in ("/models", "/models/{name}/scale", "/apply", "/rollback", "/events", "/diff"):
        assert path in schema["paths"], path
    body = schema["paths"]["/models"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/ModelInput"}
    assert "profiles" in schema["components"]["schemas"]["ModelInput"]["properties"]
    assert api.client.get("/docs").status_code == 200
    console = api.client.get("/", follow_redirects=True)
    assert console.status_code == 200 and "catalog-es console" in console.text
    assert api.client.get("/console/console.js").status_code == 200


def test_the_schema_documents_each_error_as_it_is_answered(api: Api) -> None:
    """Every error answers {"error": one line}; the schema said FastAPI's
    validation shape for 422, and no other status (hostile test)."""
    schema = ok(api.client.get("/openapi.json"))
    assert "HTTPValidationError" not in json.dumps(schema)
    ok(api.post("/models", definition("qwen")))
    answered = {
        ("get", "/models", 401): api.client.get("/models"),
        ("post", "/models/{name}/scale", 403): api.post("/models/qwen/scale", {}, role="read"),
        ("get", "/models/{name}", 404): api.get("/models/nope"),
        ("post", "/models/{name}/scale", 409): api.post(
            "/models/qwen/scale", {"max": 2}, **{"If-Match": "1"}
        ),
        ("post", "/apply", 422): api.post("/apply", [{"frobnicate": 1}]),
        ("get", "/log", 422): api.get("/log", params={"limit": 0}),
    }
    for (method, path, status), answer in answered.items():
        assert list(refused(answer, status)) and list(answer.json()) == ["error"]
        told = schema["paths"][path][method]["responses"][str(status)]
        ref = told["content"]["application/json"]["schema"]["$ref"]
        assert ref == "#/components/schemas/ErrorBody", (method, path, status)
    body = schema["paths"]["/apply"]["post"]["requestBody"]["content"]["application/json"]
    listed, wrapped = body["schema"]["oneOf"]
    assert listed["items"]["additionalProperties"] is False
    assert wrapped["properties"]["changes"] == listed


def test_the_schema_lists_every_query_key_each_path_takes(api: Api) -> None:
    """`/events` takes `lastEventId` in the query (and `Last-Event-ID`), where a
    reconnecting EventSource resumes: the schema listed neither (review)."""
    schema = ok(api.client.get("/openapi.json"))
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            listed = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
            answer = api.client.request(
                method, path.format(name="m"), params={"zz": 1}, headers=api.as_("admin")
            )
            takes = refused(answer, 422).partition("this path takes: ")[2]
            assert set(takes.split(", ")) - {"none"} == listed, (method, path)
    (watch,) = schema["paths"]["/events"].values()
    assert "last-event-id" in {p["name"] for p in watch["parameters"] if p["in"] == "header"}


def test_the_schema_says_which_names_and_if_match_values_are_taken(api: Api) -> None:
    """A client following the schema sent any text as a model's name, and
    `If-Match: null` (FastAPI's optional header may be null): both refused,
    though the schema allowed them (schemathesis). It gives their patterns."""
    schema = ok(api.client.get("/openapi.json"))
    scale = schema["paths"]["/models/{name}/scale"]["post"]
    taken = {p["name"]: p["schema"] for p in scale["parameters"]}
    name = taken["name"]["pattern"]
    bodies = schema["components"]["schemas"]
    assert bodies["ModelInput"]["properties"]["name"]["pattern"] == name
    assert bodies["ScaleChange"]["properties"]["name"]["pattern"] == name
    api.post("/models", definition("qwen-2.5/7b:awq"))
    for sent in ("qwen-2.5/7b:awq", "bad name!", "-x", "x" * 129):
        answer = api.post(f"/models/{sent.replace('/', '%2F')}/scale", {"max": 2})
        assert (answer.status_code == 200) == bool(re.search(name, sent)), sent
    if_match = taken["if-match"]
    assert if_match["type"] == "string" and "anyOf" not in if_match  # never null
    for sent in ("3", '"3"', "*", "null", 'W/"3"', "x"):
        answer = api.post("/models/qwen-2.5%2F7b:awq/scale", {"max": 2}, **{"If-Match": sent})
        assert (answer.status_code != 422) == bool(re.search(if_match["pattern"], sent)), sent
    # History and the audit's model filter read names no command could take,
    # a poison record's (test_poison): the schema gave history's name the
    # model-name pattern, and the filter any text, the empty one refused.
    paths = schema["paths"]
    parameters = paths["/history/{name}"]["get"]["parameters"]
    (recorded,) = (p["schema"] for p in parameters if p["name"] == "name")
    for sent in ("bad name!", "never\0", "a/b", "", "a\n"):
        answer = api.get(f"/history/{quote(sent, safe='')}")
        assert (answer.status_code != 422) == bool(re.fullmatch(recorded["pattern"], sent)), sent
    for path in ("/audit", "/refusals"):
        parameters = paths[path]["get"]["parameters"]
        (model,) = (p["schema"] for p in parameters if p["name"] == "model")
        assert model["type"] == "string" and "anyOf" not in model and "pattern" not in model
        for sent in ("bad name!", "a\n", ""):
            answer = api.get(path, params={"model": sent})
            assert (answer.status_code == 200) == (len(sent) >= model["minLength"]), sent
    # The actor filter is never empty, and a reason has a limit: the schema
    # let a client send both, then refused (review).
    for path in ("/audit", "/refusals", "/history/{name}"):
        parameters = paths[path]["get"]["parameters"]
        (by,) = (p["schema"] for p in parameters if p["name"] == "by")
        assert by["type"] == "string" and "anyOf" not in by
        for sent in ("alice", ""):
            answer = api.get(path.format(name="qwen-2.5%2F7b:awq"), params={"by": sent})
            assert (answer.status_code == 200) == (len(sent) >= by["minLength"]), sent
    (reason,) = (p["schema"] for p in scale["parameters"] if p["name"] == "reason")
    for sent in ("r" * reason["maxLength"], "r" * (reason["maxLength"] + 1)):
        answer = api.post(f"/models/qwen-2.5%2F7b:awq/scale?reason={sent}", {"max": 2})
        assert (answer.status_code == 200) == (len(sent) <= reason["maxLength"]), len(sent)


def test_no_answer_can_be_framed_and_the_apis_are_never_cached(api: Api) -> None:
    """A page of another site could frame the console and have its buttons
    clicked; a browser kept the catalog in its cache after signing out
    (hostile test). The console's own files may be cached."""
    answers = {
        "console": api.client.get("/console/", follow_redirects=True),
        "models": api.get("/models"),
        "refused": api.get("/models/nope"),
        "unauthenticated": api.client.get("/models"),
    }
    for name, answer in answers.items():
        assert answer.headers["x-frame-options"] == "DENY", name
        assert answer.headers["content-security-policy"] == "frame-ancestors 'none'", name
        assert answer.headers["x-content-type-options"] == "nosniff", name
    assert "no-store" not in answers["console"].headers.get("cache-control", "")
    for name in ("models", "refused", "unauthenticated"):
        assert answers[name].headers["cache-control"] == "no-store", name
    with api.client.stream("GET", "/events", headers=api.as_("read")) as stream:
        assert stream.headers["cache-control"] == "no-cache"


def test_the_consoles_files_are_checked_with_the_server_before_each_use(api: Api) -> None:
    """The console's files said nothing of caching: a browser kept them for
    a tenth of their age without asking (a page loaded twice fetched them
    once), so a server upgraded under it had its old page run against the
    new API for days (hostile test). They say no-cache: kept, and asked
    again before each use, a 304 when they are unchanged."""
    for path in ("/console/", "/console/console.js", "/console/console.css"):
        answer = api.client.get(path)
        assert answer.status_code == 200, path
        assert answer.headers["cache-control"] == "no-cache", path
        again = api.client.get(path, headers={"If-None-Match": answer.headers["etag"]})
        assert again.status_code == 304, path


def test_what_would_act_on_a_terminal_is_sent_escaped_as_the_cli_prints_it(
    tmp_path: Path, make_models: Callable[..., Models], shared_server: SharedServer
) -> None:
    """A declared source with an escape sequence and a bidi override went
    out raw to `curl` (hostile test); the CLI's JSON escapes both, and the
    docs say these are its lines. Read back, it is the same text."""
    source = "hf://org/\x1b[2J\u202egpj.live\x9b"
    models = make_models(config_yaml(spec("declared", source=source)))
    models.add(spec("runtime", source="hf://org/quoted’"), by="setup")
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    with (
        shared_server.serving(create_app(models, tokens)) as url,
        http_client(base_url=url, headers=bearer(token["read"])) as client,
    ):
        answers = [client.get(path) for path in ("/models", "/models/declared", "/log", "/sources")]
        with client.stream("GET", "/events", params={"from": 0}) as stream:
            sent = []
            for line in stream.iter_lines():
                sent.append(line)
                if line.startswith("data: "):
                    break
    for text in [answer.text for answer in answers] + sent:
        assert not set(text) & {"\x1b", "\u202e", "\x9b"}, text
    assert answers[1].json()["source"] == source
    assert "\\u001b[2J\\u202egpj.live\\u009b" in answers[0].text
    # Text that is only text goes out as it is.
    assert "quoted’" in answers[0].text
    data = json.loads(sent[-1].removeprefix("data: "))
    # The config as recorded, the declared source in it as given.
    assert json.dumps(source)[1:-1] in json.dumps(data)


@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
@example("\x7f")
@example("\u061c")
@example("a\u0085b")
@example("\u2069")
@settings(max_examples=500)
def test_answers_are_escaped_exactly_where_the_clis_json_escapes(text: str) -> None:
    """Looked for in the bytes (fast), what is escaped is what the CLI's
    --json escapes, and reads back as the same text."""
    body = msgspec.json.encode({"text": text})
    answer = json_escaped_bytes(body)
    assert answer.decode("utf-8") == json_escaped(body.decode("utf-8"))
    assert msgspec.json.decode(answer) == {"text": text}
    # The C0 controls the encoder escaped itself.
    assert (answer != body) == (UNSAFE_TEXT.search(body.decode("utf-8")) is not None)


def test_head_is_answered_as_get_is_without_the_body(api: Api) -> None:
    """Monitors and ``curl -I`` ask with HEAD; it was refused with 405."""
    api.post("/models", definition("qwen"))
    for path in ("/models", "/models/qwen", "/sources", "/log"):
        got, head = api.get(path), api.client.head(path, headers=api.as_("read"))
        assert head.status_code == got.status_code == 200, path
        assert head.content == b"", path
        for name in ("content-type", "content-length", "etag", "x-frame-options"):
            assert head.headers.get(name) == got.headers.get(name), (path, name)
    assert api.client.head("/models").status_code == 401
    assert api.client.head("/models/nope", headers=api.as_("read")).status_code == 404
    stream = api.client.head("/events", headers=api.as_("read"), timeout=5)
    assert stream.status_code == 200 and stream.content == b""
    assert stream.headers["content-type"].startswith("text/event-stream")
    # What does not answer GET does not answer HEAD, and a 405 says what a
    # path answers, of every route it matches (the first one's only, before).
    before = count_events(api.db)
    head_rollback = api.client.head("/rollback", headers=api.as_("admin"))
    assert head_rollback.status_code == 405 and head_rollback.headers["allow"] == "POST"
    assert count_events(api.db) == before
    for method, path, allowed in [
        ("POST", "/sources", "GET, HEAD"),
        ("PUT", "/models", "GET, HEAD, POST"),
        ("PUT", "/models/qwen", "DELETE, GET, HEAD"),
        ("POST", "/console/models", "GET, HEAD"),  # it named the API's methods
        ("POST", "/console/console.js", "GET, HEAD"),
    ]:
        answer = api.client.request(method, path, headers=api.as_("admin"))
        assert refused(answer, 405) and answer.headers["allow"] == allowed, (method, path)


def test_head_of_the_stream_ends_with_its_headers_on_any_server(api: Api) -> None:
    """A HEAD of /events ran a watch until the client left, which a server of
    ASGI spec 2.4 does not tell (review). Called as such a server calls it,
    with a client that never leaves, the answer ends by itself."""
    app = create_app(api.models, api.tokens)
    sent: list[MutableMapping[str, Any]] = []

    async def never_leaves() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    token = api.token["read"]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "HEAD",
        "scheme": "http",
        "path": "/events",
        "raw_path": b"/events",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"authorization", f"Bearer {token}".encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(asyncio.wait_for(app(scope, never_leaves, send), timeout=5))
    start, body = sent[0], sent[-1]
    assert start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert b"content-length" not in dict(start["headers"])  # as the stream, which has none
    assert (body["body"], body.get("more_body", False)) == (b"", False)


# -- refusals ----------------------------------------------------------------------


def test_no_token_or_a_bad_one_is_401_and_writes_nothing(api: Api) -> None:
    before = count_events(api.db)
    other_prefix = bearer(api.token["admin"].replace("ces_", "xyz_", 1))  # its id and secret good
    no_token = "no token: send Authorization: Bearer <token>"
    not_valid = "the token is not valid (unknown or revoked)"
    for headers, told in (
        ({}, no_token),
        ({"Authorization": "Basic x"}, no_token),
        (bearer("ces_0000_nope"), not_valid),
        (bearer("garbage"), not_valid),
        (other_prefix, not_valid),
    ):
        response = api.client.post("/models", json=definition("qwen"), headers=headers)
        assert refused(response, 401) == told
        assert response.headers["WWW-Authenticate"] == "Bearer"
        assert api.client.get("/models", headers=headers).status_code == 401
    # A bad body is not even read without a token.
    assert api.client.post("/models", content=b"{", headers={}).status_code == 401
    assert count_events(api.db) == before


def test_a_role_too_low_is_403_and_writes_nothing(api: Api) -> None:
    api.post("/models", definition("qwen"))
    before = count_events(api.db)
    for path, body in [
        ("/models", definition("other")),
        ("/models/qwen/scale", {"max": 2}),
        ("/models/qwen/owner", {"owner": "team:x"}),
        ("/apply", [{"remove": "qwen"}]),
    ]:
        assert "needs write" in refused(api.post(path, body, role="read"), 403)
    assert refused(api.client.delete("/models/qwen", headers=api.as_("read")), 403)
    for role in ("read", "write"):
        message = refused(api.post("/rollback", {"to": 1}, role=role), 403)
        assert message == f"'{role}-user' has the {role} role; a rollback needs admin"
    assert count_events(api.db) == before


def test_a_name_with_a_dot_segment_is_warned_of_and_reached_with_its_dots_encoded(
    api: Api,
) -> None:
    """DESIGN allows ``x/../qwen``, but HTTP clients resolve ``..`` away (httpx
    here, curl and browsers too): a DELETE meant for it removed ``qwen``
    (hostile test). Its answers warn how to reach it: its slashes as ``%2F``."""
    ok(api.post("/models", definition("qwen")))
    added = ok(api.post("/models", definition("x/../qwen")))["model"]
    assert added["warnings"] == [
        "its name has a '..' segment, which HTTP clients resolve away before they send"
        " a path (RFC 3986): over HTTP, send the name with its slashes as %2F"
    ]
    assert api.client.get("/models/x/../qwen").url.path == "/models/qwen"  # the client's doing
    assert ok(api.get("/models/x%2F..%2Fqwen")) == added
    # Shown, given back: the warning is worked out, and accepted as such.
    assert ok(api.post("/models", added))["replaced"] is True
    assert ok(api.get("/models/qwen")).get("warnings") is None


def test_a_command_s_verb_sent_inside_the_name_is_refused_not_taken_for_another_model(
    api: Api,
) -> None:
    """A slash sent as %2F is the name's: a POST to ``/models/qwen%2Fscale``,
    the model ``qwen/scale`` with no command, scaled ``qwen`` (hostile test)."""
    ok(api.post("/models", definition("qwen")))
    ok(api.post("/models", definition("qwen/scale")))
    before = count_events(api.db)
    for path in ("/models/qwen%2Fscale", "/models/qwen%2fscale", "/models/qwen/scale%2Fowner"):
        told = refused(api.post(path, {"max": 3}), 422)
        assert told.startswith("path: its /"), told
    assert count_events(api.db) == before
    assert ok(api.get("/models/qwen"))["scaling"]["max"] == 1
    # Its own command, and a verb's letters escaped, still reach the model named.
    assert ok(api.post("/models/qwen%2Fscale/scale", {"max": 3}))["model"]["name"] == "qwen/scale"
    assert ok(api.post("/models/qwen/sc%61le", {"max": 2}))["model"]["scaling"]["max"] == 2


def test_two_authorization_headers_are_refused_whichever_comes_first(api: Api) -> None:
    before = count_events(api.db)
    for first, second in [("admin", "bogus"), ("bogus", "admin")]:
        tokens = [api.token.get(role, role) for role in (first, second)]
        headers = [("Authorization", f"Bearer {token}") for token in tokens]
        response = api.client.post("/models/base/scale", json={"max": 2}, headers=headers)
        assert refused(response, 401) == "more than one Authorization header: send one"
    assert count_events(api.db) == before


def test_a_removed_token_is_refused_from_the_next_request(api: Api) -> None:
    assert ok(api.get("/me"))["actor"] == "read-user"
    (entry,) = [e for e in api.tokens.entries() if e.actor == "read-user"]
    api.tokens.remove(entry.id)
    assert refused(api.get("/me"), 401) == "the token is not valid (unknown or revoked)"


@pytest.mark.parametrize("spoiled", [b"{", b"", b"[1, 2]"])
def test_a_tokens_file_spoiled_while_serving_refuses_every_token_and_says_nothing_of_it(
    api: Api, spoiled: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    kept = api.tokens.path.read_bytes()
    api.tokens.path.write_bytes(spoiled)
    os.utime(api.tokens.path, (1, 1))  # changed, even within the file system's clock tick
    for role in ("read", "admin"):
        message = refused(api.get("/me", role=role), 401)
        assert message == "the token is not valid (unknown or revoked)"
    told = "empty: remove it" if not spoiled else "not a tokens file"
    assert f"{api.tokens.path}: {told}" in caplog.text
    api.tokens.path.write_bytes(kept)
    assert ok(api.get("/me"))["actor"] == "read-user"


@pytest.mark.parametrize("how", ["moved away", "emptied"])
def test_a_tokens_file_gone_or_emptied_while_serving_is_told_once_on_the_servers_side(
    api: Api, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every token is then refused, rightly, and a spoiled file was logged, but
    these two were not: the operator had no clue why (hostile test)."""
    kept = api.tokens.path.read_bytes()
    if how == "moved away":
        api.tokens.path.unlink()
    else:
        api.tokens.path.write_bytes(b"{}")
        os.utime(api.tokens.path, (1, 1))  # changed, even within the file system's clock tick
    for role in ("read", "admin", "read"):
        message = refused(api.get("/me", role=role), 401)
        assert message == "the token is not valid (unknown or revoked)"
    why = "is gone" if how == "moved away" else "holds no tokens"
    told = [r.getMessage() for r in caplog.records if "every token is refused" in r.getMessage()]
    assert told == [f"{api.tokens.path} {why}; every token is refused (catalog-es token add)"]
    api.tokens.path.write_bytes(kept)
    assert ok(api.get("/me"))["actor"] == "read-user"


def test_a_tokens_file_that_could_not_be_read_once_is_read_again_on_the_next_request(
    api: Api, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of descriptors as the file changed (a flood of connections, and a
    token revoked meanwhile): that request is refused, and the next reads
    the file again. Kept as read, the failure locked every token out until
    the file changed again (hostile test)."""
    api.tokens.add("dave", "read")  # changed: read again on the next request
    real_open = open_to_read
    failures: list[OSError] = []

    def failing(path: str) -> BinaryIO:
        if path == str(api.tokens.path) and failures:
            raise failures.pop()
        return real_open(path)

    def refused_while_unread(times: int) -> None:
        failures.extend(OSError(errno.EMFILE, "Too many open files") for _ in range(times))
        for _ in range(times):
            assert refused(api.get("/me"), 401) == "the token is not valid (unknown or revoked)"

    monkeypatch.setattr(web_tokens, "open_to_read", failing)
    refused_while_unread(2)
    assert ok(api.get("/me"))["actor"] == "read-user"
    assert ok(api.get("/me", role="admin"))["actor"] == "admin-user"
    # Told once a streak: not at each request refused, and again at the next.
    api.tokens.add("erin", "read")
    refused_while_unread(1)
    told = [r.getMessage() for r in caplog.records if "tokens are refused" in r.getMessage()]
    unread = f"{api.tokens.path}: Too many open files; tokens are refused until it can be read"
    assert told == [unread, unread]


def test_a_body_in_a_content_coding_is_refused_and_writes_nothing(api: Api) -> None:
    """A body sent as gzip (``Content-Encoding``) was read as it came: refused
    as "not UTF-8 text", and one said to be gzip that was not was taken and
    written (hostile test). Both are 415 now, saying to send it as is."""
    ok(api.post("/models", definition("qwen")))
    written = api.models.revision
    scale = json.dumps({"max": 3}).encode()
    headers = {**api.as_("write"), "Content-Type": "application/json"}
    for body, coding in ((gzip.compress(scale), "gzip"), (scale, "gzip"), (scale, "Br")):
        response = api.client.post(
            "/models/qwen/scale", content=body, headers={**headers, "Content-Encoding": coding}
        )
        assert refused(response, 415) == (
            f"request body: sent as {coding.lower()!r} (Content-Encoding); send it as is"
        )
    assert count_events(api.db) == written
    identity = {**headers, "Content-Encoding": "identity"}
    assert ok(api.client.post("/models/qwen/scale", content=scale, headers=identity))


def test_bad_bodies_are_422_with_the_clis_message_and_write_nothing(
    api: Api, tmp_path: Path, config_file: str
) -> None:
    before = count_events(api.db)
    bad_definitions: list[Any] = [
        {"name": "qwen", "engine": "vllm", "source": "hf://x"},  # no profiles
        definition("qwen", scaling={"min": "1"}),  # strict types
        definition("qwen", engine="nope"),
        definition("qwen", fallbacks=["missing"]),
        definition("bad name!"),
        definition("base"),  # declared in config
        definition("cpu", profiles=[{"name": "cpu"}]),  # the memory rule
    ]
    for number, bad in enumerate(bad_definitions):
        message = refused(api.post("/models", bad), 422)
        path = tmp_path / f"bad{number}.json"
        path.write_text(json.dumps(bad))
        command = ["--db", api.db, "--config", config_file, "model", "add", str(path)]
        run = CliRunner().invoke(cli, command)
        assert run.exit_code == 1
        cli_message = run.stderr.strip().removeprefix("error: ")
        assert message == cli_message.replace(str(path), "request body"), number
    for raw, expected in [
        (b"", "request body: empty: send a JSON (or YAML) document"),
        (b"{", "request body: not valid JSON"),
        (b'{"a": 1, "a": 2}', "request body: duplicate key 'a'"),
        (b"\xff", "request body: not UTF-8 text"),
    ]:
        response = api.client.post("/models", content=raw, headers=api.as_("write"))
        assert refused(response, 422).startswith(expected)
    assert refused(api.post("/models/base/scale", {"max": 2}), 422).startswith(
        "model 'base' is declared in configuration"
    )
    assert refused(api.post("/models/base/scale", {}), 422) == (
        "say what to set: the minimum, the maximum, or both"
    )
    assert refused(api.post("/models/base/scale", [1]), 422) == (
        "request body: expected a mapping of fields (got list)"
    )
    # A body with nothing in it, or of another kind than the route takes, is
    # said as every input says it (a comment alone was "got null").
    send = "send a JSON (or YAML) document"
    for route, kind in (
        ("/models", "a mapping of fields"),
        ("/models/base/scale", "a mapping of fields"),
        ("/rollback", "a mapping of fields"),
        ("/apply", "a list of changes"),
    ):
        for raw, said in (
            (b" \n\t\n", f"empty but for whitespace: {send}"),
            (b"# later\n", f"empty but for comments: {send}"),
            (b"null", f"expected {kind} (got null)"),
            (b'"text"', f"expected {kind} (got 'text')"),
        ):
            response = api.client.post(route, content=raw, headers=api.as_("admin"))
            assert refused(response, 422) == f"request body: {said}", (route, raw)
    # Said empty, a profile would be every profile (review: only the CLI refused it).
    empty_profile = "the profile is empty: name one, or leave it out for every profile"
    assert refused(api.post("/models/qwen/resources", {"profile": "", "memory_gb": 8}), 422) == (
        empty_profile
    )
    resources = [{"resources": {"name": "qwen", "profile": "", "memory_gb": 8}}]
    assert refused(api.post("/apply", resources), 422) == (
        f"request body: change 1 (resources): {empty_profile}"
    )
    assert refused(api.post("/apply", []), 422) == (
        "request body: the list of changes is empty: give at least one change"
    )
    assert refused(api.post("/apply", {"changes": [{"remove": "qwen"}], "dry_run": True}), 422) == (
        "request body: 'dry_run' beside 'changes': the list of changes comes alone"
    )
    too_many = {"changes": [{"remove": "qwen"}] * (MAX_CHANGES + 1)}
    assert refused(api.post("/apply", too_many), 422) == (
        f"request body: more than {MAX_CHANGES} changes in one apply"
    )
    assert refused(api.post("/rollback", {"to": "yesterday"}, role="admin"), 422) == (
        "'yesterday' is neither a revision nor an ISO 8601 time"
    )
    assert refused(api.get("/models", params={"at": "99"}), 422) == (
        f"revision 99 is beyond the head of the log ({api.models.revision})"
    )
    assert refused(api.get("/log", params={"limit": "x"}), 422).startswith("query.limit: ")
    assert refused(api.get("/models", params={"at": "²"}), 422) == (
        "'²' is neither a revision nor an ISO 8601 time"
    )
    # Past 4,300 digits Python will not read a number at all.
    assert refused(api.get("/models", params={"at": "9" * 5000}), 422).endswith(
        "… is past any revision a log can hold (2^63 - 1)"
    )
    assert refused(api.get("/log", params={"after": str(2**63)}), 422).startswith("query.after: ")
    assert refused(api.get("/models", params={"at": "0001-01-01T00:00:00+01:00"}), 422) == (
        "'0001-01-01T00:00:00+01:00': outside the times UTC can hold (years 1 to 9999)"
    )
    assert refused(api.post("/models/qwen/scale", {"max": 2}, **{"If-Match": "9" * 5000}), 422) == (
        f"If-Match {'9' * 40!r}: not a revision (e.g. If-Match: 12)"
    )
    assert count_events(api.db) == before


def test_a_revision_written_with_thousands_of_leading_zeros_is_that_revision(api: Api) -> None:
    # Python reads no number of more than 4,300 digits, leading zeros counted.
    head = ok(api.post("/models", definition("qwen")))["revision"]
    zeros = "0" * 5000
    assert ok(api.get("/models", params={"at": f"{zeros}{head}"})) == ok(
        api.get("/models", params={"at": str(head)})
    )
    scaled = ok(api.post("/models/qwen/scale", {"max": 2}, **{"If-Match": f'"{zeros}{head}"'}))
    assert scaled["revision"] == head + 1


def test_an_origin_field_given_empty_is_refused_over_http_as_by_the_cli(
    api: Api, tmp_path: Path, config_file: str
) -> None:
    """``origin: {repository: "", revision: ""}`` (a template's variables
    unset) wrote the model with no origin, without a word, where ``model
    source --repository ''`` is refused for that (review); one field given
    empty beside another recorded an origin in part (review). Each is
    refused, naming the field. ``origin: {}`` is still none, and a field
    null (as ``model show`` prints one left out) is left out."""
    ok(api.post("/models", definition("qwen")))
    before = count_events(api.db)
    empty = {"repository": "", "revision": ""}
    no_repository = (
        "origin: repository is empty: give a registry repository (org/name), or leave it out"
    )
    no_revision = "origin: revision is empty: give a commit, or leave it out"
    source = {"name": "qwen", "source": "hf://org/x"}
    for path, body, command, told in [
        ("/models", definition("new", origin=empty), "model add", no_repository),
        (
            "/apply",
            [{"add": definition("new", origin=empty)}],
            "apply",
            f"change 1 (add): {no_repository}",
        ),
        (
            "/apply",
            [{"source": {**source, "origin": {"revision": ""}}}],
            "apply",
            f"change 1 (source): {no_revision}",
        ),
    ]:
        assert refused(api.post(path, body), 422) == f"request body: {told}", body
        written = tmp_path / "given.json"
        written.write_text(json.dumps(body))
        run = CliRunner().invoke(
            cli, ["--db", api.db, "--config", config_file, *command.split(), str(written)]
        )
        assert (run.exit_code, run.stderr) == (1, f"error: {written}: {told}\n"), body
    for origin, told in [
        (empty, no_repository),
        ({"repository": "org/x", "revision": ""}, no_revision),
    ]:
        answer = api.post("/models/qwen/source", {"source": "hf://org/x", "origin": origin})
        assert refused(answer, 422) == f"request body: {told}", origin
    assert count_events(api.db) == before
    in_part: dict[str, Any] = {"repository": "org/x", "revision": None, "files": {}}
    ok(api.post("/models/qwen/source", {"source": "hf://org/x", "origin": in_part}))
    assert ok(api.get("/models/qwen"))["origin"] == in_part
    schema = ok(api.client.get("/openapi.json"))["components"]["schemas"]["OriginInput"]
    assert [schema["properties"][field]["minLength"] for field in ("repository", "revision")] == [
        1,
        1,
    ]


def test_a_revision_with_white_space_around_it_is_refused(api: Api, config_file: str) -> None:
    """``?at=+1`` (a space once read), ``1%0A`` and ``1%20`` read as revision 1,
    where ``If-Match: +3`` is refused (hostile test)."""
    ok(api.post("/models", definition("qwen")))
    before = count_events(api.db)
    not_a_revision = "is not a revision: write it in digits alone, with no white space around it"
    for query, read in [("+1", " 1"), ("1%0A", "1\n"), ("1%20", "1 "), ("%091", "\t1")]:
        message = f"{read!r} {not_a_revision}"
        assert refused(api.get(f"/models?at={query}"), 422) == message
        assert refused(api.get(f"/diff?since={query}"), 422) == message
        assert refused(api.get(f"/diff?since=1&until={query}"), 422) == message
        rollback = api.post("/rollback", {"to": read}, role="admin")
        assert refused(rollback, 422) == message
    assert refused(api.get("/models?at=%2B1"), 422) == (
        "'+1' is neither a revision nor an ISO 8601 time"
    )
    assert count_events(api.db) == before
    assert ok(api.get("/models?at=1")) == ok(api.get("/models?at=0001"))
    # The CLI reads --at as the server reads ?at=: a usage error.
    command = ["--db", api.db, "--config", config_file, "model", "list", "--at", "1 "]
    run = CliRunner().invoke(cli, command)
    assert run.exit_code == 2
    assert f"'1 ' {not_a_revision}" in run.stderr


def test_a_time_s_offset_whose_plus_the_query_read_as_a_space_is_told_so(api: Api) -> None:
    """``?at=2026-12-07T12:00:00+01:00``, as the docs write a time, reaches the
    server as ``… 01:00``: refused quoting a space no one typed (hostile test)."""
    ok(api.post("/models", definition("qwen")))
    before = count_events(api.db)
    hint = " (a + in a query is read as a space: send it as %2B)"
    sent = "2026-12-07T12:00:00+01:00"
    for path in ("/models?at=", "/sources?at=", "/diff?since=", "/diff?since=0&until="):
        assert refused(api.get(f"{path}{sent}"), 422) == (
            f"'2026-12-07T12:00:00 01:00' is neither a revision nor an ISO 8601 time{hint}"
        )
    for bound in ("since", "until"):
        assert refused(api.get(f"/audit?{bound}={sent}"), 422).endswith(hint)
        assert refused(api.get(f"/history/qwen?{bound}={sent}"), 422).endswith(hint)
    # Sent as %2B it is the time, and a refusal with no offset has no hint.
    assert isinstance(ok(api.get(f"/audit?since={sent.replace('+', '%2B')}")), list)
    assert not refused(api.get("/models?at=yesterday"), 422).endswith(hint)
    assert count_events(api.db) == before


def test_a_time_window_closed_before_it_opens_is_refused(api: Api) -> None:
    """since at or after until matched nothing, answered as an empty list, as
    if nothing had changed in it (hostile test)."""
    ok(api.post("/models", definition("qwen")))
    before = count_events(api.db)
    window = "since=2026-12-08&until=2026-12-07"
    told = "since 2026-12-08T00:00:00Z is not before until 2026-12-07T00:00:00Z"
    for path in ("/audit", "/history/qwen", "/refusals"):
        assert refused(api.get(f"{path}?{window}"), 422).startswith(told)
    assert count_events(api.db) == before


def test_a_whole_number_in_a_query_is_digits_alone(api: Api) -> None:
    """pydantic read ``limit=5_0`` as 50, and ``after= 5``, ``+5`` (a space, in
    a query) and ``5%0A`` as 5, where ``?at=`` and If-Match refuse them (hostile
    test)."""
    ok(api.post("/models", definition("qwen")))
    sent = {"5_0": "5_0", "%205": " 5", "+5": " 5", "5%0A": "5\n", "%EF%BC%95": "５"}
    in_digits = "expected a whole number in digits alone"
    for query, read in sent.items():
        for name, path in [("limit", "/log"), ("after", "/log"), ("limit", "/audit")]:
            message = refused(api.get(f"{path}?{name}={query}"), 422)
            assert message == f"query.{name}: {in_digits} (got {read!r})"
        with api.client.stream("GET", f"/events?from={query}", headers=api.as_("read")) as events:
            assert events.status_code == 422
    assert len(ok(api.get("/log?limit=01"))) == 1  # leading zeros are the number's, as for ?at=
    # A minus sign is read, for the bounds to say what the number must be.
    assert refused(api.get("/log?after=-1"), 422).startswith("query.after: Input should be greater")


def test_an_if_match_on_a_revision_deleted_since_is_409_saying_so(
    api: Api, make_models: Callable[..., Models]
) -> None:
    """The last events deleted by hand (docs/audit.md): an If-Match a read
    gave before was told "never written" by a server loaded since."""
    for name in ("qwen", "llama"):
        ok(api.post("/models", definition(name)))
    with api.models.store.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM catalog_events WHERE revision = 3"))
    before = count_events(api.db)
    with (
        serving(create_app(make_models(DECLARED_YAML), api.tokens)) as url,
        http_client(base_url=url) as client,
    ):
        stale = client.post(
            "/models/qwen/scale", json={"max": 3}, headers={**api.as_("write"), "If-Match": "3"}
        )
        assert refused(stale, 409) == (
            "the log is at revision 2, not 3: revision 3 was written, but the log no longer"
            " holds it: the events after revision 2 were deleted (catalog-es verify); read it"
            " again and retry"
        )
    assert count_events(api.db) == before


def test_revision_with_the_logs_last_events_deleted_is_refused_naming_both(api: Api) -> None:
    """The last events deleted by hand (docs/audit.md): `GET /revision`
    answered the revision before them, 200, where `catalog-es revision` is
    refused and verify names the break: a monitor polling it took it for the
    head of a log whole. It is refused as the command line is, 500 as a log
    edited by hand is; reads go on, and once a write goes on past the gap it
    answers the head again."""
    for name in ("qwen", "llama"):
        ok(api.post("/models", definition(name)))
    with api.models.store.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM catalog_events WHERE revision = 3"))
    before = count_events(api.db)
    refusal = api.get("/revision")
    assert refused(refusal, 500) == (
        "revision 3 is missing: the head is at revision 3 but the log ends at 2, so the last"
        " events were deleted; revision 2 is not the head (catalog-es verify)"
    )
    assert "ETag" not in refusal.headers
    read = api.get("/models")  # reads go on, tagged with the revision they read
    assert read.headers["ETag"] == '"2"'
    assert count_events(api.db) == before
    # Sent back, it is taken: the write is numbered after the head, past the gap.
    ok(api.post("/models/qwen/scale", {"max": 3}, **{"If-Match": read.headers["ETag"]}))
    answer = api.get("/revision")
    assert (ok(answer), answer.headers["ETag"]) == ({"revision": 4}, '"4"')


def test_an_if_match_of_a_revision_the_log_skipped_is_409_saying_so(
    pg_url: str, tmp_path: Path, shared_server: SharedServer
) -> None:
    """PostgreSQL skips the number a write that failed took, and no read
    gives it (one of it reads the revision before): an If-Match of it was
    told "someone changed the catalog since you read it"."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    models.add(spec("m"), by="setup")
    with models.store.engine.begin() as conn:
        conn.exec_driver_sql("SELECT nextval(pg_get_serial_sequence('catalog_events', 'revision'))")
    assert models.scale("m", 0, 2, by="setup").revision == 3
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    with shared_server.serving(create_app(models, tokens)) as url:

        def scale(if_match: str) -> httpx.Response:
            headers = {**bearer(token["write"]), "If-Match": if_match}
            return httpx.post(f"{url}/models/m/scale", json={"max": 3}, headers=headers)

        assert refused(scale("2"), 409) == (
            "the log is at revision 3, not 2: revision 2 was never written (the log's"
            " revisions skip it); read it again and retry"
        )
        # One the log holds, moved past since, is still someone else's change.
        assert refused(scale("1"), 409) == (
            "the log is at revision 3, not 1: someone changed the catalog since you read it;"
            " read it again and retry"
        )
    assert count_events(pg_url) == 2
    models.close()


def test_not_found_is_404(api: Api) -> None:
    assert refused(api.get("/models/nope"), 404) == "model 'nope' is not in the catalog"
    assert refused(api.post("/models/nope/scale", {"max": 2}), 404).startswith("model 'nope'")
    assert refused(api.client.delete("/models/nope", headers=api.as_("write")), 404)


def test_a_stale_if_match_is_409_and_writes_nothing(api: Api) -> None:
    read = api.get("/models")
    etag = read.headers["ETag"]  # revision 0: nothing written yet
    first = api.post("/models", definition("qwen"), **{"If-Match": etag})
    assert ok(first)["revision"] == 2
    before = count_events(api.db)
    message = refused(api.post("/models/qwen/scale", {"max": 3}, **{"If-Match": etag}), 409)
    assert message.startswith("the log is at revision 2, not 0")
    # The CLI's words for a revision past the head: never written, no retry.
    ahead = refused(api.post("/models/qwen/scale", {"max": 3}, **{"If-Match": "100"}), 409)
    assert ahead == "the log is at revision 2, not 100: revision 100 was never written"
    assert count_events(api.db) == before
    assert ok(api.post("/models/qwen/scale", {"max": 3}, **{"If-Match": "2"}))["revision"] == 3
    assert ok(api.post("/models/qwen/scale", {"max": 4}, **{"If-Match": "*"}))["revision"] == 4
    for unread in ("x", '"4', '4"', '"'):
        assert refused(api.post("/models/qwen/scale", {"max": 5}, **{"If-Match": unread}), 422)
    # A weak tag never matches; of two headers, which counts would be a guess.
    weak = api.post("/models/qwen/scale", {"max": 5}, **{"If-Match": 'W/"4"'})
    assert refused(weak, 422).startswith("If-Match 'W/\"4\"': a weak tag never matches")
    two = [*api.as_("write").items(), ("If-Match", "*"), ("If-Match", "1")]
    stale = api.client.post("/models/qwen/scale", json={"max": 5}, headers=two)
    assert refused(stale, 422) == "more than one If-Match header: send one"
    twice = api.client.post(
        "/models/qwen/scale?reason=a&reason=b", json={"max": 5}, headers=api.as_("write")
    )
    assert refused(twice, 422) == "reason is given more than once in the query: give it once"
    # %-escapes that are not UTF-8 were read as U+FFFD, and recorded (hostile test).
    for query in ("reason=%FF", "reason=%ED%A0%80", "%FF=x"):
        odd = api.client.post(
            f"/models/qwen/scale?{query}", json={"max": 5}, headers=api.as_("write")
        )
        assert refused(odd, 422) == "query: not UTF-8 text once its %-escapes are read", query
    blank = api.client.post(
        "/models/qwen/scale?reason=%20%0A%20", json={"max": 5}, headers=api.as_("write")
    )
    assert refused(blank, 422) == "reason: nothing visible in it: say why, or give no reason"
    odd = api.client.post("/models/qw%FFen/scale", json={"max": 5}, headers=api.as_("write"))
    assert refused(odd, 422) == "path: not UTF-8 text once its %-escapes are read"
    assert count_events(api.db) == before + 2


def test_a_name_with_a_line_break_after_it_is_refused_not_read_without_it(api: Api) -> None:
    """A route's pattern matched before a last line break: DELETE of
    `qwen%0A` removed qwen (hostile test)."""
    ok(api.post("/models", definition("qwen")))
    before = log_rows(api.db)
    writer = api.as_("write")
    for method, path in (
        ("DELETE", "/models/qwen%0A"),
        ("POST", "/models/qwen/scale%0A"),
        ("GET", "/models/qwen%0A"),
        ("GET", "/history/qwen%0A"),
    ):
        answer = api.client.request(method, path, json={"max": 5}, headers=writer)
        assert refused(answer, 422) == "path: holds a line break, which no name or path has"
    # Within the path, no route's pattern matches it.
    inside = api.client.post("/models/qwen%0A/scale", json={"max": 5}, headers=writer)
    assert refused(inside, 404) == "Not Found"
    assert log_rows(api.db) == before


def test_a_list_sent_while_a_change_lands_never_lets_if_match_overwrite_it(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests are served on several threads: a change may land between
    reading the head and reading the list. The list's tag must then be the
    older revision, so an If-Match sent back with it fails rather than
    overwriting a change its sender never saw."""
    ok(api.post("/models", definition("qwen")))
    listing = api.models.models_as_read

    def a_change_lands_meanwhile(at: Any = None, **options: Any) -> Iterator[dict[str, Any]]:
        listed = listing(at, **options)
        api.models.scale("qwen", maximum=5, by="bob")
        return listed

    monkeypatch.setattr(api.models, "models_as_read", a_change_lands_meanwhile)
    read = api.get("/models")
    monkeypatch.undo()
    seen = next(m for m in ok(read) if m["name"] == "qwen")
    assert seen["scaling"]["max"] == 1
    before = count_events(api.db)
    refused(api.post("/models/qwen/scale", {"max": 2}, **{"If-Match": read.headers["ETag"]}), 409)
    assert count_events(api.db) == before
    assert ok(api.get("/models/qwen"))["scaling"]["max"] == 5


def test_a_read_is_tagged_with_the_head_other_nodes_moved(
    api: Api, make_models: Callable[..., Models]
) -> None:
    """Another node's write is in the tag of the next read here, so an
    If-Match sent back with it goes through rather than failing for nothing."""
    other = make_models(DECLARED_YAML)
    written = other.add(spec("qwen"), by="bob").revision
    for path in ("/models", "/models/qwen"):
        assert api.get(path).headers["ETag"] == f'"{written}"'
    etag = api.get("/models").headers["ETag"]
    assert ok(api.post("/models/qwen/scale", {"max": 2}, **{"If-Match": etag}))["revision"]


def test_storage_busy_is_503(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    def busy(*args: Any, **kwargs: Any) -> None:
        raise StorageBusy("the database stayed locked by another writer")

    monkeypatch.setattr(api.models, "scale", busy)
    response = api.post("/models/base/scale", {"max": 2})
    assert refused(response, 503) == "the database stayed locked by another writer"
    assert response.headers["Retry-After"] == "1"


def test_a_log_edited_by_hand_past_appending_is_500_and_writes_nothing(api: Api) -> None:
    if not api.db.startswith("sqlite"):
        pytest.skip("only SQLite keeps a text revision in an integer column")
    ok(api.post("/models", definition("qwen")))
    with api.models.store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE catalog_head SET revision = 'two'"))
    before = count_events(api.db)
    message = refused(api.post("/models/qwen/scale", {"max": 3}), 500)
    assert message.startswith("the log's head record (catalog_head) is damaged")
    assert count_events(api.db) == before


# -- rollback ----------------------------------------------------------------------------


def test_rollback_dry_run_then_for_real(api: Api) -> None:
    api.post("/models", definition("qwen"))
    api.post("/models/qwen/scale", {"max": 4})
    api.post("/models", definition("tiny"))
    before = count_events(api.db)
    plan = ok(api.post("/rollback", {"to": 2, "dry_run": True}, role="read"))
    assert plan["dry_run"] is True and plan["written"] is False
    assert {(e["model"], e["event"]) for e in plan["events"]} == {
        ("qwen", "Scaled"),
        ("tiny", "Removed"),
    }
    assert count_events(api.db) == before
    only = ok(api.post("/rollback", {"to": 2, "model": "qwen", "dry_run": True}))
    assert [e["model"] for e in only["events"]] == ["qwen"]

    done = ok(api.post("/rollback?reason=bad", {"to": 2}, role="admin", **{"If-Match": "4"}))
    assert done["written"] is True and done["revision"] == 6
    assert [m["name"] for m in ok(api.get("/models"))] == ["base", "qwen"]
    last = ok(api.get("/log", params={"after": 4}))
    assert {(e["by"], e["rollback_to"], e["reason"]) for e in last} == {("admin-user", 2, "bad")}


def test_a_rollback_to_no_revision_or_time_or_of_no_model_name_says_so(api: Api) -> None:
    """``"to": true`` told pydantic's first try, ``to.int``, and hid the
    other; a name no model can have was "no runtime history" (hostile test)."""
    api.post("/models", definition("qwen"))
    api.post("/models/qwen/scale", {"max": 4})
    before = count_events(api.db)
    takes = "request body: to: expected a revision (a whole number ≥ 0) or a UTC time"
    shapes: list[tuple[Any, str]] = [(True, "true"), (2.0, "2.0"), (None, "null"), ([2], "list")]
    for to, got in shapes:
        for dry_run in (True, False):
            body = {"to": to, "dry_run": dry_run}
            assert refused(api.post("/rollback", body, role="admin"), 422) == f"{takes} (got {got})"
    for dry_run in (True, False):
        body = {"to": 2, "model": "<x>", "dry_run": dry_run}
        assert refused(api.post("/rollback", body, role="admin"), 422) == (
            "model '<x>': name: '<x>' is not a valid name: 1-128 characters of "
            "A-Z a-z 0-9 . _ : / -, starting with a letter or digit"
        )
    assert count_events(api.db) == before


# -- watch -------------------------------------------------------------------------------


def _sse_events(lines: Iterator[str], count: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    ids: list[str] = []
    for line in lines:
        if line.startswith("id: "):
            ids.append(line[4:])
        elif line.startswith("data: "):
            events.append(json.loads(line[6:]))
            if len(events) == count:
                break
    assert ids == [str(e["revision"]) for e in events]
    return events


def _watch_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("catalog-es-watch"))


def test_log_after_a_revision_past_the_head_is_refused_as_events_from_it_is(api: Api) -> None:
    """``GET /log?after=99`` answered ``[]`` where ``/events?from=99`` is
    refused: a follower on a log restored from an older backup read that
    as nothing new. Both are refused now, in the same words."""
    api.post("/models", definition("qwen"))
    told = f"revision 99 is beyond the head of the log ({api.models.revision})"
    assert refused(api.get("/log", params={"after": 99}), 422) == told
    assert refused(api.get("/events", params={"from": 99}), 422) == told
    assert ok(api.get("/log", params={"after": api.models.revision})) == []


def test_watch_streams_changes_after_a_revision_then_live(api: Api) -> None:
    api.post("/models", definition("qwen"))
    api.post("/models/qwen/scale", {"max": 4})
    headers = api.as_("read")
    with api.client.stream("GET", "/events", params={"from": 2}, headers=headers) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.iter_lines()
        (backlog,) = _sse_events(lines, 1)
        assert (backlog["revision"], backlog["event"], backlog["by"]) == (3, "Scaled", "write-user")
        api.post("/models/qwen/owner", {"owner": "team:x"})
        (live,) = _sse_events(lines, 1)
        assert (live["revision"], live["event"]) == (4, "OwnerSet")
        assert _watch_threads() == 1
    # The client went away: the server stops the watch and its thread ends.
    deadline = time.monotonic() + 5
    while _watch_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _watch_threads() == 0
    # A reconnecting EventSource resumes after its Last-Event-ID.
    with api.client.stream("GET", "/events", headers={**headers, "Last-Event-ID": "3"}) as stream:
        (resumed,) = _sse_events(stream.iter_lines(), 1)
        assert resumed["revision"] == 4
    # So does a polyfill that sends a token, which puts it in the query.
    with api.client.stream("GET", "/events?lastEventId=3", headers=headers) as stream:
        (resumed,) = _sse_events(stream.iter_lines(), 1)
        assert resumed["revision"] == 4
    assert refused(api.get("/events", params={"from": 99}), 422).startswith("revision 99")
    long_id = {**headers, "Last-Event-ID": "9" * 25}
    assert refused(api.client.get("/events", headers=long_id), 422) == (
        f"Last-Event-ID {'9' * 25!r}: past any revision a log can hold"
    )
    assert refused(api.client.get("/events"), 401)


def test_watch_by_an_actor_streams_that_actors_changes_alone(api: Api) -> None:
    """`/events` took no actor, where `/log` and `watch --by` do: `by` keeps
    that actor's changes, those before it and the live ones, and a resume
    passes over the others' too; an empty one is refused as `/log`'s is. A
    change of theirs read with others' after it is sent at once: it was
    held, the stream waiting for their next change to fill its batch."""
    api.post("/models", definition("qwen"))  # 1, the declared config; 2
    api.post("/models/qwen/scale", {"max": 3}, role="admin")  # 3
    api.post("/models/qwen/scale", {"max": 4})  # 4
    watch = api.models.watch(0, by="admin-user")
    changes = iter(watch)
    assert next(changes)["revision"] == 3
    assert not watch.ready()  # revision 4, read with it, is another's
    watch.stop()
    headers = api.as_("read")
    with api.client.stream("GET", "/events?from=0&by=admin-user", headers=headers) as stream:
        lines = stream.iter_lines()
        (backlog,) = _sse_events(lines, 1)
        assert (backlog["revision"], backlog["by"]) == (3, "admin-user")
        api.post("/models/qwen/owner", {"owner": "team:x"})  # 5
        api.post("/models/qwen/scale", {"max": 5}, role="admin")  # 6
        (live,) = _sse_events(lines, 1)
        assert (live["revision"], live["event"], live["by"]) == (6, "Scaled", "admin-user")
    resume = {**headers, "Last-Event-ID": "2"}
    with api.client.stream("GET", "/events?by=write-user", headers=resume) as stream:
        assert [e["revision"] for e in _sse_events(stream.iter_lines(), 2)] == [4, 5]
    told = refused(api.get("/events", params={"by": ""}), 422)
    assert told == "by: the actor is empty; give an actor, or no actor filter"
    (by,) = [
        p
        for p in ok(api.client.get("/openapi.json"))["paths"]["/events"]["get"]["parameters"]
        if p["name"] == "by"
    ]
    assert (by["in"], by["schema"]["type"], by["schema"]["minLength"]) == ("query", "string", 1)


def test_a_resume_point_that_is_no_revision_or_sent_twice_is_refused(api: Api) -> None:
    """Text that named no revision was ignored: the stream replayed from the
    start, or from ``from``, and a bad header hid a good ``lastEventId``
    (hostile test)."""
    api.post("/models", definition("qwen"))
    api.post("/models/qwen/scale", {"max": 4})
    api.post("/models/qwen/owner", {"owner": "team:x"})
    headers = api.as_("read")
    for sent in ("abc", "-5", "+5", "5x", "1_0", ""):
        resume = {**headers, "Last-Event-ID": sent}
        # With a good lastEventId too: it would have been read instead.
        answer = api.client.get("/events?from=1&lastEventId=3", headers=resume)
        assert refused(answer, 422) == (
            f"Last-Event-ID {sent!r}: not a revision (e.g. Last-Event-ID: 12)"
        )
    # Any script's digits, sent as UTF-8 and read as Latin-1 (as headers are).
    arabic_three = [(k.encode(), v.encode()) for k, v in {**headers, "Last-Event-ID": "٣"}.items()]
    assert refused(api.client.get("/events", headers=arabic_three), 422).endswith(
        ": not a revision (e.g. Last-Event-ID: 12)"
    )
    for sent in ("x", "٣", "+3", " 3", "3\n", ""):
        answer = api.client.get("/events", params={"lastEventId": sent}, headers=headers)
        assert refused(answer, 422) == (
            f"lastEventId {sent!r}: not a revision (e.g. lastEventId=12)"
        )
    too_far = api.client.get("/events", params={"lastEventId": "9" * 25}, headers=headers)
    assert refused(too_far, 422) == f"lastEventId {'9' * 25!r}: past any revision a log can hold"
    two = [*headers.items(), ("Last-Event-ID", "3"), ("Last-Event-ID", "1")]
    assert refused(api.client.get("/events", headers=two), 422) == (
        "more than one Last-Event-ID header: send one"
    )
    # Both good: the header, which an EventSource sends on reconnecting, wins.
    resume = {**headers, "Last-Event-ID": "3"}
    with api.client.stream("GET", "/events?from=1&lastEventId=2", headers=resume) as stream:
        (resumed,) = _sse_events(stream.iter_lines(), 1)
        assert resumed["revision"] == 4


def test_watches_past_the_servers_limit_are_refused_until_one_ends(
    db_url: str, tmp_path: Path, make_models: Callable[..., Models], shared_server: SharedServer
) -> None:
    """Each watch holds a thread: a thousand, opened and never read, held a
    server's CPU; five thousand stopped it answering (hostile test)."""
    models = make_models(DECLARED_YAML)
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    with (
        shared_server.serving(create_app(models, tokens, max_watches=2)) as url,
        http_client(base_url=url, headers=bearer(token["read"])) as client,
        contextlib.ExitStack() as open_streams,
    ):
        # A watch refused (past the head) gives its place back: three such
        # requests took every place until a restart (review).
        for _ in range(3):
            refusal = client.get("/events", params={"from": 99})
            assert refused(refusal, 422).startswith("revision 99 is beyond the head")
        held = []  # a stream's lines, read on: let go of, they end it
        for _ in range(2):
            lines = open_streams.enter_context(client.stream("GET", "/events")).iter_lines()
            assert next(lines) == ": watching"
            held.append(lines)
        third = client.get("/events")
        assert refused(third, 503) == (
            "2 watches are open here, as many as this server serves (serve --max-watches); "
            "try again later"
        )
        assert third.headers["Retry-After"] == "1"
        assert client.head("/events").status_code == 200  # no watch: not counted
        assert ok(client.get("/models"))  # the rest is served as ever
        # The clients leave; their places are free again, without waiting for
        # the cyclic collector (which a serving process seldom runs).
        gc.disable()
        try:
            open_streams.close()
            deadline = time.monotonic() + 5
            while True:
                with client.stream("GET", "/events") as fourth:
                    if fourth.status_code == 200:
                        break
                assert time.monotonic() < deadline, "the places of streams that ended were kept"
                time.sleep(0.05)
        finally:
            gc.enable()
    models.close()


def test_a_watch_refused_as_asked_is_told_so_while_every_place_is_taken(
    db_url: str, tmp_path: Path, make_models: Callable[..., Models], shared_server: SharedServer
) -> None:
    """`/events?by=` with every watch place taken answered 503 "try again
    later", and a client that did was told the 422 only once a place was
    free (review): what the request asks is judged before a place is taken."""
    models = make_models(DECLARED_YAML)
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    with (
        shared_server.serving(create_app(models, tokens, max_watches=1)) as url,
        http_client(base_url=url, headers=bearer(token["read"])) as client,
        client.stream("GET", "/events") as held,
    ):
        lines = held.iter_lines()  # read on: let go of, it ends the stream
        assert next(lines) == ": watching"
        assert refused(client.get("/events", params={"by": ""}), 422) == (
            "by: the actor is empty; give an actor, or no actor filter"
        )
        assert refused(client.get("/events", params={"from": 99}), 422).startswith(
            "revision 99 is beyond the head"
        )
        assert refused(client.get("/events"), 503).endswith("try again later")
    models.close()


def test_writes_past_the_ones_that_may_wait_are_refused_and_reads_go_on(
    db_url: str,
    tmp_path: Path,
    make_models: Callable[..., Models],
    monkeypatch: pytest.MonkeyPatch,
    shared_server: SharedServer,
) -> None:
    """Sixty writes waiting behind another process's write took every thread
    requests are served on: reads of the catalog answered once in ten seconds
    (hostile test). Past the writes that may wait, one is refused at once."""
    # Long enough that a read which waited for the writes (4.5 s at least) is
    # told apart from one slowed by sixty threads starting at once on two
    # cores (up to 1.1 s seen on a slow host, where a bound of 1 s in a 2 s
    # wait failed a run in three; a bound of 2 s in a 3 s wait failed beside
    # another test worker and a tester), and that all sixty come while the
    # first sixteen still wait.
    monkeypatch.setenv("CATALOG_ES_LOCK_WAIT", "5")
    models = make_models(DECLARED_YAML)
    models.add(spec("qwen"), by="setup")
    written = count_events(db_url)
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    answers: list[httpx.Response] = []
    with shared_server.serving(create_app(models, tokens)) as url, write_lock_held(db_url):

        def scale() -> None:
            body = {"max": 3}
            answers.append(
                httpx.post(
                    f"{url}/models/qwen/scale",
                    json=body,
                    headers=bearer(token["write"]),
                    timeout=30,
                )
            )

        writes = [threading.Thread(target=scale) for _ in range(60)]
        for thread in writes:
            thread.start()
        time.sleep(0.5)
        asked = time.monotonic()
        listed = httpx.get(f"{url}/models", headers=bearer(token["read"]), timeout=10)
        assert listed.status_code == 200
        assert time.monotonic() - asked < 3.0, "the read waited for the writes"
        for thread in writes:
            thread.join()
    statuses = sorted(answer.status_code for answer in answers)
    assert statuses == [503] * 60  # the lock was held throughout: none written
    busy = [a.json()["error"] for a in answers if "already waiting" in a.json()["error"]]
    assert len(busy) == 60 - 16
    assert busy[0] == "16 writes are already waiting to be written here; try again"
    assert count_events(db_url) == written
    models.close()


def test_a_body_still_arriving_holds_no_place_among_the_writes(api: Api) -> None:
    """Sixteen clients trickling bodies took every place while their bodies
    arrived, and every other write was refused (review)."""
    api.post("/models", definition("qwen"))
    host, port = api.url.removeprefix("http://").split(":")
    trickling = []
    for _ in range(20):
        sock = socket.create_connection((host, int(port)))
        sock.sendall(
            b"POST /models HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {api.token['write']}\r\n".encode()
            + b"Content-Length: 100000\r\n\r\n{"
        )
        trickling.append(sock)
    try:
        time.sleep(0.3)
        assert ok(api.post("/models/qwen/scale", {"max": 3}))["model"]["scaling"]["max"] == 3
    finally:
        for sock in trickling:
            sock.close()


def test_a_rollback_takes_a_place_among_the_writes_a_dry_run_does_not(
    db_url: str, tmp_path: Path, make_models: Callable[..., Models], shared_server: SharedServer
) -> None:
    models = make_models(DECLARED_YAML)
    models.add(spec("qwen"), by="setup")
    written = count_events(db_url)
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    app = create_app(models, tokens)
    with (
        shared_server.serving(app) as url,
        http_client(base_url=url, headers=bearer(token["admin"])) as client,
    ):
        places = app.state.write_places
        taken = 0
        while places.acquire(blocking=False):  # every place held, as by waiting writes
            taken += 1
        try:
            back = client.post("/rollback", json={"to": 1})
            assert refused(back, 503) == (
                "16 writes are already waiting to be written here; try again"
            )
            assert ok(client.post("/rollback", json={"to": 1, "dry_run": True}))["events"]
        finally:
            for _ in range(taken):
                places.release()
        assert count_events(db_url) == written
        assert ok(client.post("/rollback", json={"to": 1}))["written"]
    models.close()


def test_large_bodies_read_at_once_are_bounded(
    db_url: str, tmp_path: Path, make_models: Callable[..., Models], shared_server: SharedServer
) -> None:
    """A list of changes of 59 MB of YAML took 420 MB while it was parsed,
    six at once 2.5 GB, with no bound on how many (hostile test). Past two
    over a definition's size, a client is told to try again."""
    models = make_models(DECLARED_YAML)
    models.add(spec("qwen"), by="setup")
    written = count_events(db_url)
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    app = create_app(models, tokens)
    # Two megabytes of YAML: a scale, and a comment that pads it.
    large = "- scale: {name: qwen, max: 3}\n" + "#" * (2 << 20) + "\n"
    headers = {**bearer(token["write"]), "Content-Type": "application/yaml"}
    with shared_server.serving(app) as url, http_client(base_url=url, headers=headers) as client:
        places = app.state.large_body_places
        assert places.acquire(blocking=False) and places.acquire(blocking=False)
        try:
            refusal = client.post("/apply", content=large)
            assert refused(refusal, 503) == (
                "2 bodies over 1024 KiB are already being read or written here; try again"
            )
            small = client.post("/apply", content="- scale: {name: qwen, max: 2}\n")
            assert ok(small)["changes"] == 1
            # A definition's size is no large body; a byte more is one.
            change = "- scale: {name: qwen, max: 4}\n"
            at_the_size = change + "#" * (MAX_INPUT_BYTES - len(change) - 1) + "\n"
            assert refused(client.post("/apply", content=at_the_size + "#"), 503) == (
                "2 bodies over 1024 KiB are already being read or written here; try again"
            )
            assert ok(client.post("/apply", content=at_the_size))["changes"] == 1
        finally:
            places.release()
            places.release()
        assert count_events(db_url) == written + 2
        assert ok(client.post("/apply", content=large))["changes"] == 1
    models.close()


def test_a_body_of_a_definitions_size_is_taken_and_a_byte_more_refused(api: Api) -> None:
    """The server takes what `model add` takes from a file: up to 1 MiB."""
    headers = {**api.as_("write"), "Content-Type": "application/json"}
    document = json.dumps(definition("qwen")).encode()
    at_the_size = document + b" " * (MAX_INPUT_BYTES - len(document))
    before = log_rows(api.db)
    over = api.client.post("/models", content=at_the_size + b" ", headers=headers)
    assert refused(over, 422) == "request body: larger than 1024 KiB"
    assert log_rows(api.db) == before
    assert ok(api.client.post("/models", content=at_the_size, headers=headers))["revision"]


def _sent_in_part(url: str, headers: dict[str, str], length: int, part: bytes) -> socket.socket:
    """A POST /apply saying its body is ``length`` bytes, of which ``part`` is sent."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    sock.sendall(
        f"POST /apply HTTP/1.1\r\nHost: {host}\r\n{head}Content-Length: {length}\r\n\r\n".encode()
        + part
    )
    return sock


def test_a_large_body_past_the_places_is_refused_as_it_grows_not_once_it_has_come(
    db_url: str, tmp_path: Path, make_models: Callable[..., Models], shared_server: SharedServer
) -> None:
    """Places were taken once a body had all come: sixteen clients each
    sending 60 MB were held in memory together, a gigabyte, before any was
    refused (hostile test)."""
    models = make_models(DECLARED_YAML)
    before = log_rows(db_url)
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    app = create_app(models, tokens)
    headers = {**bearer(token["write"]), "Content-Type": "application/yaml"}
    two_megabytes = b"#" * (2 << 20)
    with shared_server.serving(app) as url:
        holders = [_sent_in_part(url, headers, 60 << 20, two_megabytes) for _ in range(2)]
        try:
            # The two places are taken once each body passes a megabyte.
            _until(lambda: app.state.large_body_places._value == 0)
            deadline = time.monotonic() + 10
            third = _sent_in_part(url, headers, 60 << 20, two_megabytes)
            third.settimeout(max(deadline - time.monotonic(), 0.1))
            answer = ""
            while "}" not in answer and (received := third.recv(1 << 16)):
                answer += received.decode()
            third.close()
        finally:
            for holder in holders:
                holder.close()
    assert answer.startswith("HTTP/1.1 503"), answer[:200]
    assert "2 bodies over 1024 KiB are already being read or written here; try again" in answer
    assert log_rows(db_url) == before


def test_a_large_body_holds_its_place_until_its_change_is_written(
    db_url: str, tmp_path: Path, make_models: Callable[..., Models], shared_server: SharedServer
) -> None:
    """Let go once parsed, lists of changes waiting for the write lock kept
    their memory past the two places: eight of 3.7 MB took a server to a
    gigabyte (hostile test)."""
    models = make_models(DECLARED_YAML)
    models.add(spec("qwen"), by="setup")
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    app = create_app(models, tokens)
    large = "- scale: {name: qwen, max: 3}\n" + "#" * (2 << 20) + "\n"
    headers = {**bearer(token["write"]), "Content-Type": "application/yaml"}
    with (
        shared_server.serving(app) as url,
        http_client(base_url=url, headers=headers, timeout=60) as client,
    ):
        places = app.state.large_body_places
        answers: list[httpx.Response] = []
        with write_lock_held(db_url):
            waiting = [
                threading.Thread(
                    target=lambda: answers.append(client.post("/apply", content=large))
                )
                for _ in range(2)
            ]
            for thread in waiting:
                thread.start()
            _until(lambda: places._value == 0)  # both parsed, both waiting for the lock
            third = client.post("/apply", content=large)
            assert refused(third, 503) == (
                "2 bodies over 1024 KiB are already being read or written here; try again"
            )
        for thread in waiting:
            thread.join(timeout=60)
        assert [ok(answer)["changes"] for answer in answers] == [1, 1]
        _until(lambda: places._value == 2)  # given back once each is answered
    models.close()


def test_places_are_given_back_once_written_though_the_answer_is_not_read(api: Api) -> None:
    """An apply's answer is sent as it is built, and waits on its client:
    held until it was sent, two clients that did not read theirs kept both
    places for large bodies, and every other was refused (review)."""
    adapters = [{"name": f"ad{i}", "source": f"s3://adapters/wide/ad{i}"} for i in range(100)]
    ok(api.post("/models", definition("wide", adapters=adapters)))
    changes = [{"scale": {"name": "wide", "max": 1 + i % 7}} for i in range(2_000)]
    # Twenty megabytes of answer each, more than the connection buffers.
    large = json.dumps(changes).encode() + b" " * (1 << 20)
    headers = {**api.as_("write"), "Content-Type": "application/json"}
    head = count_events(api.db)
    unread = [_sent_in_part(api.url, headers, len(large), large) for _ in range(2)]
    try:
        _until(lambda: count_events(api.db) == head + 4_000, seconds=30)
        assert ok(api.client.post("/apply", content=large, headers=headers))["changes"] == 2_000
    finally:
        for sock in unread:
            sock.close()


def test_a_large_body_that_does_not_come_in_time_gives_its_place_back(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two clients sending a byte a second once past a megabyte held both
    places for as long as they liked: every other large body was refused
    (review of the session's diff)."""
    monkeypatch.setattr(web_app, "LARGE_BODY_SECONDS", 1.0)
    before = log_rows(api.db)
    headers = {**api.as_("write"), "Content-Type": "application/yaml"}
    two_megabytes = b"#" * (2 << 20)
    slow = [_sent_in_part(api.url, headers, 3 << 20, two_megabytes) for _ in range(2)]
    try:
        for sock in slow:
            sock.settimeout(30)
            answer = b""
            while b"}" not in answer and (received := sock.recv(1 << 16)):
                answer += received
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"request body: over 1024 KiB, it did not all come within 1 s" in answer
    finally:
        for sock in slow:
            sock.close()
    large = "- scale: {name: base, max: 3}\n" + "#" * (2 << 20) + "\n"
    taken = api.client.post("/apply", content=large, headers=headers)
    assert "declared in configuration" in refused(taken, 422)  # read, then refused
    assert log_rows(api.db) == before


def test_a_client_hanging_up_mid_body_is_not_an_error_of_the_server(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    """Each one logged a traceback as an unexpected error (hostile test)."""
    server_log = logging.getLogger("uvicorn.error")  # it does not propagate
    server_log.addHandler(caplog.handler)
    caplog.set_level(logging.INFO)
    try:
        for _ in range(3):
            _sent_in_part(api.url, api.as_("write"), 100, b"- scale").close()
        deadline = time.monotonic() + 10
        while caplog.text.count("went away") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server_log.removeHandler(caplog.handler)
    assert caplog.text.count("POST /apply: the client went away before its body came") == 3
    assert "Exception in ASGI application" not in caplog.text
    ok(api.get("/revision"))


def test_log_and_audit_answers_past_a_page_are_refused_not_built(api: Api) -> None:
    """One read of a long log was built whole in memory: 70 MB of JSON for
    80,000 rows, 3.3 GB for forty at once (hostile test). Past a page, the
    client is told how to page."""
    api.post("/models", definition("qwen"))
    steps = [commands.scale("qwen", 0, 1 + i % 3) for i in range(1000)]
    for _ in range(10):
        api.models.apply_changes(steps, by="bench")
    head = api.models.revision
    assert head > 10_000
    assert refused(api.get("/log"), 422) == (
        "more than 10,000 events after revision 0: page with after and limit (at most 10,000)"
    )
    page = ok(api.get("/log", params={"limit": 10_000}))
    assert [e["revision"] for e in page] == list(range(1, 10_001))
    rest = ok(api.get("/log", params={"after": 10_000}))
    assert [e["revision"] for e in rest] == list(range(10_001, head + 1))
    assert "less than or equal to 10000" in refused(api.get("/log", params={"limit": 10_001}), 422)
    assert refused(api.get("/audit"), 422) == (
        "more than 10,000 rows match: give limit (the most recent N, at most 10,000), "
        "or narrow them with model, by, type, since or until"
    )
    recent = ok(api.get("/audit", params={"limit": 5}))
    assert [r["revision"] for r in recent] == list(range(head - 4, head + 1))
    assert ok(api.get("/audit", params={"by": "write-user"}))  # one row: well within
    # Nor one model's history: a model scaled every minute has half a million rows.
    assert refused(api.get("/history/qwen"), 422) == (
        "more than 10,000 rows match: give limit (the most recent N, at most 10,000), "
        "or narrow them with by, type, since or until"
    )
    recent = ok(api.get("/history/qwen", params={"limit": 3}))
    assert [r["revision"] for r in recent] == list(range(head - 2, head + 1))
    (added,) = ok(api.get("/history/qwen", params={"type": "added"}))
    assert added["revision"] == 2
    assert ok(api.get("/history/qwen", params={"until": "2000-01-01"})) == []
    assert refused(api.get("/history/never", params={"limit": 3}), 404).startswith(
        "model 'never' has no history"
    )
    # The refusals too (written straight to their table: ten thousand
    # refused commands would take a while).
    row = {"actor": "x", "model": "qwen", "event": "Scaled", "refusal": "no", "reason": ""}
    with api.models.store.write() as conn:
        conn.execute(
            sa.insert(refusals_table),
            [{**row, "time": datetime(2026, 1, 1), "fields": {}} for _ in range(10_001)],
        )
    assert refused(api.get("/refusals"), 422).startswith("more than 10,000 rows match")
    assert len(ok(api.get("/refusals", params={"limit": 3}))) == 3


def test_log_audit_and_history_answers_past_a_size_are_refused_not_read(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounded in rows, answers were not in bytes: forty events of large
    definitions made one of 183 MB, and a page of ten thousand would take the
    server's memory (hostile test). Past the bound, the client is told how to
    page, before any row is read; a page of one always answers. Bytes, not
    characters: four-byte ones let answers of four times the bound through."""
    emoji = "\N{GRINNING FACE}" * 100  # four bytes each
    adapters = [{"name": f"a{i}", "source": f"s3://a/{emoji}"} for i in range(40)]
    for _ in range(5):  # 17 KB stored each (5,000 characters); a row holds two or three
        api.post("/models", definition("qwen", adapters=adapters))
    monkeypatch.setattr("catalog_es.web.app.MAX_ANSWER_BYTES", 40_000)
    assert refused(api.get("/log"), 422) == (
        "the events after revision 0 hold more than 40,000 bytes: page with after and a "
        "smaller limit"
    )
    assert len(ok(api.get("/log", params={"limit": 2}))) == 2  # the config's record, the first
    # So are an actor's, read a page at a time: told once read past the bound.
    assert refused(api.get("/log", params={"by": "write-user"}), 422) == (
        "the events after revision 0 hold more than 40,000 bytes: page with after and a "
        "smaller limit"
    )
    assert len(ok(api.get("/log", params={"by": "write-user", "limit": 2}))) == 2
    rows_too_large = "the rows that match hold more than 40,000 bytes: give a smaller limit, "
    assert refused(api.get("/audit"), 422) == (
        rows_too_large + "or narrow them with model, by, type, since or until"
    )
    assert refused(api.get("/history/qwen", params={"limit": 2}), 422) == (
        rows_too_large + "or narrow them with by, type, since or until"
    )
    # One row past the bound alone: a page of one reads anything the log holds.
    (last,) = ok(api.get("/history/qwen", params={"limit": 1}))
    assert last["revision"] == 6 and len(json.dumps(last).encode()) > 40_000
    assert ok(api.get("/audit", params={"type": "ConfigDeclared"}))  # small: well within


def test_a_stream_ends_once_its_token_is_revoked(api: Api) -> None:
    """Revoked, a token is refused from its next request on; its open stream
    stopped getting changes only when the client left (hostile test)."""
    api.post("/models", definition("qwen"))
    with api.client.stream("GET", "/events", params={"from": 1}, headers=api.as_("read")) as stream:
        lines = stream.iter_lines()
        (seen,) = _sse_events(lines, 1)
        (reader,) = [e for e in api.tokens.describe() if e["actor"] == "read-user"]
        api.tokens.remove(reader["id"])
        time.sleep(2 * WAKE_UP_SECONDS)  # the token is asked again once a wake-up
        ok(api.post("/models/qwen/scale", {"max": 4}))
        assert [line for line in lines if line.startswith("data: ")] == []  # ended, unsent
    assert seen["revision"] == 2
    assert refused(api.get("/events", params={"from": 2}), 401)


# -- concurrency ----------------------------------------------------------------------


def test_concurrent_reads_and_writes_all_succeed(api: Api) -> None:
    api.post("/models", definition("qwen"))
    failures: list[str] = []

    def writer() -> None:
        for maximum in range(2, 12):
            response = api.post("/models/qwen/scale", {"max": maximum})
            if response.status_code != 200:
                failures.append(response.text)

    def reader() -> None:
        for _ in range(15):
            for path in ("/models", "/sources", "/models/qwen"):
                response = api.get(path)
                if response.status_code != 200:
                    failures.append(response.text)

    threads = [threading.Thread(target=writer)] + [
        threading.Thread(target=reader) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert ok(api.get("/models/qwen"))["scaling"]["max"] == 11


# -- the commands around it ---------------------------------------------------------------


def test_token_commands(tmp_path: Path) -> None:
    tokens = tmp_path / "t.json"
    runner = CliRunner()
    made = runner.invoke(cli, ["token", "add", "alice", "--role", "admin", "--tokens", str(tokens)])
    assert made.exit_code == 0, made.output
    secret = made.stdout.strip()
    assert secret.startswith("ces_") and secret not in tokens.read_text()
    assert tokens.stat().st_mode & 0o777 == 0o600
    assert TokenStore(tokens).verify(secret) is not None
    listed = runner.invoke(cli, ["token", "list", "--json", "--tokens", str(tokens)])
    (entry,) = json.loads(listed.stdout)
    assert (entry["actor"], entry["role"]) == ("alice", "admin")
    wrong = runner.invoke(cli, ["token", "add", "bob", "--role", "root", "--tokens", str(tokens)])
    assert wrong.exit_code == 2
    # Refused by the store too: written, a role there is not spoils the file for every token.
    kept = tokens.read_bytes()
    with pytest.raises(InputError, match=r"^role 'root': not a role"):
        TokenStore(tokens).add("bob", "root")
    assert tokens.read_bytes() == kept
    # Its writes would be recorded as ' bob', which `audit --by bob` misses.
    before = tokens.read_bytes()
    padded = runner.invoke(cli, ["token", "add", " bob", "--tokens", str(tokens)])
    assert (padded.exit_code, padded.stdout) == (1, "")
    assert padded.stderr.startswith("error: actor ' bob': begins or ends with a space")
    assert padded.stderr.count("\n") == 1 and tokens.read_bytes() == before
    gone = runner.invoke(cli, ["token", "remove", entry["id"], "--tokens", str(tokens)])
    assert gone.exit_code == 0 and TokenStore(tokens).verify(secret) is None
    # A tokens file where none can be: one line (a traceback, before; review).
    inside_a_file = str(tokens / "t.json")
    nowhere = runner.invoke(cli, ["token", "add", "bob", "--tokens", inside_a_file])
    assert (nowhere.exit_code, nowhere.stderr) == (1, f"error: {tokens}: not a directory\n")


def test_a_mistyped_tokens_path_is_refused_not_taken_for_an_empty_file(tmp_path: Path) -> None:
    """`token list --tokens typo.json` listed none, and `token add` into a
    mistyped folder made it, with a tokens file no server reads (hostile test)."""
    runner = CliRunner()
    tokens = tmp_path / "t.json"
    ok = runner.invoke(cli, ["token", "add", "alice", "--role", "admin", "--tokens", str(tokens)])
    assert ok.exit_code == 0, ok.stderr
    typo = str(tmp_path / "typo.json")
    for args in (["token", "list"], ["token", "list", "--json"], ["token", "remove", "abc"]):
        refused = runner.invoke(cli, [*args, "--tokens", typo])
        assert (refused.exit_code, refused.stdout) == (1, ""), args
        assert refused.stderr == (
            f"error: no tokens file at {typo} (catalog-es token add makes one)\n"
        )
    folder = tmp_path / "typo" / "sub"
    refused = runner.invoke(cli, ["token", "add", "bob", "--tokens", str(folder / "t.json")])
    assert (refused.exit_code, refused.stdout) == (1, "")
    assert refused.stderr == f"error: {folder}: no such directory; make it first\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".t.json.lock", "t.json"]


@pytest.mark.parametrize(
    ("edit", "unknown"),
    [
        (lambda kept: {"Tokens": kept["tokens"]}, "Object contains unknown field `Tokens`"),
        (
            lambda kept: {"tokens": [{**kept["tokens"][0], "expires": "2020-01-01T00:00:00Z"}]},
            "Object contains unknown field `expires` - at `$.tokens[0]`",
        ),
        # Listed as Admin, its token refused as unknown or revoked (hostile test).
        (
            lambda kept: {"tokens": [{**kept["tokens"][0], "id": "abc", "role": "Admin"}]},
            "token 'abc': role 'Admin': not a role (known: read, write, admin)",
        ),
    ],
    ids=["misspelt-key", "hand-added-field", "unknown-role"],
)
def test_a_tokens_file_with_a_key_it_does_not_have_is_refused_not_written_back_without_it(
    tmp_path: Path, edit: Callable[[dict[str, Any]], dict[str, Any]], unknown: str
) -> None:
    """A hand-edited file with a misspelt key listed no tokens, or a token
    with an expiry no release reads as it was; the next `token add` wrote it
    back without what it did not know (the tokens under `Tokens`, lost). Now
    every token command refuses it, as it does any other malformed file."""
    runner = CliRunner()
    tokens = tmp_path / "t.json"
    made = runner.invoke(cli, ["token", "add", "alice", "--role", "admin", "--tokens", str(tokens)])
    assert made.exit_code == 0, made.stderr
    tokens.write_text(json.dumps(edit(json.loads(tokens.read_text()))))
    edited = tokens.read_bytes()
    for args in (["token", "list"], ["token", "add", "bob"], ["token", "remove", "abc"]):
        refused = runner.invoke(cli, [*args, "--tokens", str(tokens)])
        assert (refused.exit_code, refused.stdout, refused.stderr) == (
            1,
            "",
            f"error: {tokens}: not a tokens file: {unknown}\n",
        ), args
    assert tokens.read_bytes() == edited


def test_a_tokens_file_holding_an_entry_twice_is_refused_not_half_revoked(tmp_path: Path) -> None:
    """An entry copied by hand: `token remove` revoked the first and said so,
    and the server went on letting the token in by the copy (hostile test)."""
    runner = CliRunner()
    tokens = tmp_path / "t.json"
    made = runner.invoke(cli, ["token", "add", "alice", "--role", "admin", "--tokens", str(tokens)])
    assert made.exit_code == 0, made.stderr
    kept = json.loads(tokens.read_text())
    tokens.write_text(json.dumps({"tokens": kept["tokens"] * 2}))
    edited = tokens.read_bytes()
    token_id = kept["tokens"][0]["id"]
    told = f"error: {tokens}: not a tokens file: token id {token_id!r} appears more than once\n"
    for args in (["token", "list"], ["token", "add", "bob"], ["token", "remove", token_id]):
        refused = runner.invoke(cli, [*args, "--tokens", str(tokens)])
        assert (refused.exit_code, refused.stdout, refused.stderr) == (1, "", told), args
    assert tokens.read_bytes() == edited
    assert TokenStore(tokens).verify(made.stdout.strip()) is None


def test_a_token_revoked_through_a_link_to_the_tokens_file_is_revoked_in_it(
    tmp_path: Path,
) -> None:
    """`token remove --tokens LINK` replaced the link with a file of its own:
    the file it named, which a server read, kept the token, still let in
    (hostile test). The file is changed, the link kept."""
    runner = CliRunner()
    (tmp_path / "real").mkdir()
    tokens, link = tmp_path / "real" / "t.json", tmp_path / "t.json"
    made = runner.invoke(cli, ["token", "add", "alice", "--tokens", str(tokens)])
    assert made.exit_code == 0, made.stderr
    link.symlink_to(tokens)
    (entry,) = TokenStore(tokens).entries()
    gone = runner.invoke(cli, ["token", "remove", entry.id, "--tokens", str(link)])
    assert gone.exit_code == 0, gone.stderr
    assert TokenStore(tokens).verify(made.stdout.strip()) is None
    assert link.is_symlink() and link.resolve() == tokens


def test_a_tokens_file_that_is_a_pipe_nothing_writes_to_is_refused_not_waited_on(
    tmp_path: Path,
) -> None:
    """Opening a pipe to read waits for a writer: every token command, and
    serve, on a tokens file that was one hung for good (hostile test)."""
    pipe = tmp_path / "t.json"
    os.mkfifo(pipe)
    for args in (["list"], ["add", "alice"], ["remove", "abc"]):
        done = subprocess.run(
            [sys.executable, "-m", "catalog_es", "token", *args, "--tokens", str(pipe)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            cwd=Path(__file__).parents[1],  # this checkout's code, for `-m catalog_es`
        )
        assert (done.returncode, done.stdout) == (1, ""), args
        assert done.stderr == (f"error: {pipe}: empty: remove it, and token add makes one\n"), args
    assert pipe.is_fifo()


def test_an_empty_tokens_file_is_said_to_be_empty_and_kept(tmp_path: Path) -> None:
    """A tokens file left empty (`touch`, a copy that failed) was refused in
    msgspec's words, "Input data was truncated" (hostile test's notes)."""
    tokens = tmp_path / "t.json"
    tokens.touch()
    runner = CliRunner()
    for args in (["token", "list"], ["token", "add", "alice"], ["token", "remove", "abc"]):
        refused = runner.invoke(cli, [*args, "--tokens", str(tokens)])
        assert (refused.exit_code, refused.stdout, refused.stderr) == (
            1,
            "",
            f"error: {tokens}: empty: remove it, and token add makes one\n",
        ), args
    assert tokens.stat().st_size == 0


def test_a_tokens_file_past_its_bound_is_refused_unread(tmp_path: Path) -> None:
    """Read whole, a path to a device (/dev/zero) or a large file took the
    command, or the server, to the end of memory (hostile test). Past the
    bound, even a well-formed file (spaces after its tokens) is refused."""
    tokens = tmp_path / "t.json"
    with tokens.open("wb") as file:
        file.write(b'{"tokens": []}')
        file.write(b" " * (MAX_TOKENS_BYTES + 1 - file.tell()))
    runner = CliRunner()
    for args in (["token", "list"], ["token", "add", "alice"]):
        refused = runner.invoke(cli, [*args, "--tokens", str(tokens)])
        assert (refused.exit_code, refused.stdout, refused.stderr) == (
            1,
            "",
            # The bound docs/console.md gives.
            f"error: {tokens}: not a tokens file: larger than 64 MiB\n",
        ), args
    assert tokens.stat().st_size == MAX_TOKENS_BYTES + 1


@pytest.mark.parametrize(
    ("fails", "told"),
    [
        # A full disk as `token add` wrote the file was told as "unexpected
        # OSError" (hostile test).
        (
            ["-e", "inject=fsync:error=ENOSPC"],
            "{tokens}: cannot be written: No space left on device",
        ),
        # A file system without locks (some NFS), and a lock file that cannot be made.
        (["-e", "inject=flock:error=ENOLCK"], "{lock}: cannot be locked: No locks available"),
        (["-P", "{lock}", "-e", "inject=openat:error=EACCES"], "{lock}: Permission denied"),
    ],
    ids=["disk-full", "no-locks", "lock-not-opened"],
)
def test_a_tokens_file_that_cannot_be_locked_or_written_is_said_so_and_kept(
    tmp_path: Path, fails: list[str], told: str
) -> None:
    if shutil.which("strace") is None:
        pytest.fail("this test makes the disk fail with strace: `apt-get install -y strace`")
    tokens = tmp_path / "t.json"
    made = CliRunner().invoke(cli, ["token", "add", "alice", "--tokens", str(tokens)])
    assert made.exit_code == 0, made.stderr
    kept = tokens.read_bytes()
    where = {"tokens": tokens, "lock": tmp_path / ".t.json.lock"}
    failing = ["strace", "-f", "-q", "-o", "/dev/null", *(arg.format(**where) for arg in fails)]
    failed = subprocess.run(
        [
            *failing,
            sys.executable,
            "-m",
            "catalog_es",
            "token",
            "add",
            "bob",
            "--tokens",
            str(tokens),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=Path(__file__).parents[1],  # this checkout's code, for `-m catalog_es`
    )
    assert (failed.returncode, failed.stdout) == (1, "")
    assert failed.stderr == f"error: {told.format(**where)}\n"
    assert tokens.read_bytes() == kept


def test_a_revoked_token_s_actor_is_told_as_token_list_shows_it(tmp_path: Path) -> None:
    """An actor edited by hand to hold a bidi override went out raw to the
    terminal in `token remove`'s line, shown escaped by `token list` (hostile
    test)."""
    tokens = tmp_path / "t.json"
    made = CliRunner().invoke(cli, ["token", "add", "alice", "--tokens", str(tokens)])
    assert made.exit_code == 0, made.stderr
    kept = json.loads(tokens.read_text())
    tokens.write_text(json.dumps({"tokens": [{**kept["tokens"][0], "actor": "ali\u202ece"}]}))
    token_id = kept["tokens"][0]["id"]
    listed = CliRunner().invoke(cli, ["token", "list", "--tokens", str(tokens)])
    assert "ali\\u202ece" in listed.stdout
    gone = CliRunner().invoke(cli, ["token", "remove", token_id, "--tokens", str(tokens)])
    assert (gone.exit_code, gone.stdout) == (0, f"revoked token {token_id} of ali\\u202ece\n")


def test_tokens_added_at_once_are_all_kept(tmp_path: Path) -> None:
    """Each add read the file and wrote it back: of 80 added by four threads,
    19 were kept, the others shown and never accepted (review)."""
    tokens = tmp_path / "t.json"
    made: list[str] = []

    def add_twenty(actor: str) -> None:
        store = TokenStore(tokens)
        made.extend(store.add(actor, "read")[1] for _ in range(20))

    threads = [threading.Thread(target=add_twenty, args=(f"ops-{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store = TokenStore(tokens)
    assert len(store.entries()) == len(made) == 80
    assert all(store.verify(secret) is not None for secret in made)


def test_a_tokens_file_is_on_disk_before_it_replaces_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new file took the old one's place unsynced: a crash just after a
    `token add` could leave it empty, and every token refused (review). And
    the folder, whose entry the rename changes, is synced after it: a crash
    after a `token remove` said it was done could leave the old file, the
    revoked token good again (review)."""
    tokens = tmp_path / "t.json"
    synced: list[int] = []
    fsync = os.fsync

    def noted(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", noted)
    store = TokenStore(tokens)
    store.add("ops", "admin")
    assert synced[-2:] == [tokens.stat().st_ino, tmp_path.stat().st_ino]
    store.remove(store.entries()[0].id)
    assert synced[-2:] == [tokens.stat().st_ino, tmp_path.stat().st_ino]


def test_a_tokens_file_replaced_within_its_clocks_tick_is_read_again(tmp_path: Path) -> None:
    """A replacement of the same size, on a file system whose clock shows the
    same mtime, was taken for the file already read: a revoked token stayed
    good (review)."""
    tokens = tmp_path / "t.json"
    store = TokenStore(tokens)
    secret = store.add("ops", "admin")[1]
    assert store.verify(secret) is not None
    before = tokens.stat()
    text = tokens.read_text()
    digest = json.loads(text)["tokens"][0]["sha256"]
    replacement = tmp_path / "new.json"
    replacement.write_text(text.replace(digest, "0" * len(digest)))
    replacement.replace(tokens)
    os.utime(tokens, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert tokens.stat().st_size == before.st_size
    assert store.verify(secret) is None


def test_serve_records_the_declared_config_at_start(tmp_path: Path, config_file: str) -> None:
    db = f"sqlite:///{tmp_path}/serve.db"
    tokens = tmp_path / "tokens.json"
    runner = CliRunner()
    no_tokens = runner.invoke(cli, ["--db", db, "serve", "--tokens", str(tokens)])
    assert no_tokens.exit_code == 1 and "catalog-es token add" in no_tokens.stderr
    secret = TokenStore(tokens).add("ops", "read")[1]
    tokens.chmod(0o666)  # told, not refused: it is the operator's file
    command = [sys.executable, "-m", "catalog_es", "--db", db, "--config", config_file]
    command += ["--by", "deployer", "--reason", "deploy 42", "serve", "--port", "0"]
    command += ["--tokens", str(tokens)]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        url, said = started(server)
        warned, new, serving = said.splitlines()
        assert f"warning: {tokens} can be written by others (mode 666)" in warned
        assert "warning: no log at " in new  # a new database
        assert "serving the catalog at revision 1" in serving
        response = httpx.get(f"{url}/log", headers=bearer(secret))
        (record,) = response.json()
        assert (record["event"], record["by"], record["reason"]) == (
            "ConfigDeclared",
            "deployer",
            "deploy 42",
        )
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert count_events(db) == 1


def test_serve_logs_each_request_on_stderr_when_asked(tmp_path: Path, config_file: str) -> None:
    """Operators had no access log, so no sight of refused tokens either
    (operator walkthrough). Asked for, it is on stderr, stdout left for data."""
    db = f"sqlite:///{tmp_path}/serve.db"
    tokens = tmp_path / "tokens.json"
    secret = TokenStore(tokens).add("ops", "read")[1]
    command = [sys.executable, "-m", "catalog_es", "--db", db, "--config", config_file]
    command += ["serve", "--port", "0", "--tokens", str(tokens), "--access-log"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url, _ = started(server)
        models = f"{url}/models"
        assert httpx.get(models, headers=bearer(secret)).status_code == 200
        assert httpx.get(models, headers=bearer("nope")).status_code == 401
    finally:
        server.terminate()
        out, err = server.communicate(timeout=10)
    assert out == ""
    assert '"GET /models HTTP/1.1" 200' in err and '"GET /models HTTP/1.1" 401' in err


@EVERY_STOP
@STOPS_BLOCKED_OR_NOT
def test_serve_stopped_as_asked_says_stopped_and_exits_0(
    tmp_path: Path, config_file: str, stop: signal.Signals, blocked: bool
) -> None:
    """A stop asked for is how a server ends: Ctrl-C told "Aborted!" and exit 1,
    which says a command was refused, and SIGTERM killed it (hostile test), as
    SIGHUP did, cutting off what it was answering (an operator's reload).
    Started with them blocked (a signal mask is inherited: a supervisor's
    thread that blocks them), it stopped on none of them, only on SIGKILL."""
    db = f"sqlite:///{tmp_path}/serve.db"
    tokens = tmp_path / "tokens.json"
    secret = TokenStore(tokens).add("ops", "read")[1]
    command = [sys.executable, "-m", "catalog_es", "--db", db, "--config", config_file]
    command += ["serve", "--port", "0", "--tokens", str(tokens)]
    server = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=stops_blocked if blocked else None,
    )
    try:
        url, said = started(server)
        assert httpx.get(f"{url}/revision", headers=bearer(secret)).status_code == 200
        server.send_signal(stop)
        out, err = server.communicate(timeout=20)
    finally:
        server.kill()
    assert (server.returncode, out) == (0, "")
    told = said + err
    assert told.endswith(f"\n{STOPS_TOLD[stop]}") and "Aborted" not in told, told


# ``catalog-es serve`` with a stop raised as uvicorn's run begins: after it
# has made the coroutine it serves with, before its signal handlers are in.
STOPPED_AS_UVICORN_RUNS = """
import asyncio, signal
from catalog_es.__main__ import main
run = asyncio.Runner.run
def stopped_first(self, coro, **kwargs):
    asyncio.Runner.run = run
    signal.raise_signal(signal.{stop})
    return run(self, coro, **kwargs)
asyncio.Runner.run = stopped_first
main()
"""


@EVERY_STOP
def test_serve_stopped_as_uvicorn_starts_says_stopped_and_nothing_else(
    tmp_path: Path, config_file: str, stop: signal.Signals
) -> None:
    """A supervisor's stop sent as soon as ``serving ...`` is out (a rolling
    deploy) came, 2 times in 30, as uvicorn made its coroutine and event
    loop: ``stopped`` and 0, then a "never awaited" warning and an
    "Exception ignored" traceback on stderr. Raised there, it is held until
    uvicorn's handlers are in, and shut down on as any stop."""
    db = f"sqlite:///{tmp_path}/serve.db"
    tokens = tmp_path / "tokens.json"
    TokenStore(tokens).add("ops", "read")
    command = [sys.executable, "-c", STOPPED_AS_UVICORN_RUNS.format(stop=stop.name)]
    command += ["--db", db, "--config", config_file]
    command += ["serve", "--port", "0", "--tokens", str(tokens)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, said = started(server)
        out, err = server.communicate(timeout=20)
    finally:
        server.kill()
    assert (server.returncode, out, err) == (0, "", STOPS_TOLD[stop]), said + err


def test_serve_started_with_ctrl_c_ignored_keeps_ignoring_it(
    tmp_path: Path, config_file: str
) -> None:
    """A script's background job (``serve &``) starts with SIGINT ignored, and
    a program keeps it so: uvicorn stopped on it anyway, with no ``stopped``
    said (hostile test). As ``nohup`` ignores SIGHUP. SIGTERM still stops it."""
    db = f"sqlite:///{tmp_path}/serve.db"
    tokens = tmp_path / "tokens.json"
    secret = TokenStore(tokens).add("ops", "read")[1]
    command = [sys.executable, "-m", "catalog_es", "--db", db, "--config", config_file]
    command += ["serve", "--port", "0", "--tokens", str(tokens)]
    server = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: [
            signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGHUP)
        ],
    )
    try:
        url, said = started(server)
        revision = f"{url}/revision"
        # Answering: uvicorn has its signal handlers by now.
        assert httpx.get(revision, headers=bearer(secret)).status_code == 200
        server.send_signal(signal.SIGINT)
        server.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert httpx.get(revision, headers=bearer(secret)).status_code == 200
        server.send_signal(signal.SIGTERM)
        out, err = server.communicate(timeout=20)
    finally:
        server.kill()
    assert (server.returncode, out) == (0, "")
    assert (said + err).endswith("\nstopped\n"), said + err


# Descriptors the server below may hold: enough to start and answer, far
# fewer than the clients that then connect and wait.
SMALL_DESCRIPTOR_LIMIT = 20


def test_serve_out_of_descriptors_says_so_in_a_line_and_answers_once_clients_leave(
    tmp_path: Path, config_file: str
) -> None:
    """Under ``ulimit -n 20``, 30 idle clients made asyncio tell each failed
    accept(), each a traceback, up to 2048 a tick: 5.8 MB of stderr a second
    at 97% CPU, enough to fill the database's disk (hostile test). Told once
    in a line now, with how many since every few seconds."""
    db = f"sqlite:///{tmp_path}/serve.db"
    tokens = tmp_path / "tokens.json"
    secret = TokenStore(tokens).add("ops", "read")[1]
    command = [sys.executable, "-m", "catalog_es", "--db", db, "--config", config_file]
    command += ["serve", "--port", "0", "--tokens", str(tokens)]
    stderr = tmp_path / "stderr.txt"

    def limited() -> None:
        limit = SMALL_DESCRIPTOR_LIMIT
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    with stderr.open("w") as stderr_file:
        server = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=stderr_file, preexec_fn=limited
        )
    clients: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        while not (
            serving := re.search(r"serving the catalog .* on (http://\S+?)/", stderr.read_text())
        ):
            assert server.poll() is None and time.monotonic() < deadline, stderr.read_text()
            time.sleep(0.05)
        url = serving[1]
        port = int(url.rsplit(":", 1)[1])
        started_size = stderr.stat().st_size
        # Connected, never a request: the kernel queues them, asyncio cannot accept them.
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        time.sleep(3)
        said = stderr.read_text()[started_size:]
        assert len(said) < 2_000, said[:3_000]
        told = [line for line in said.splitlines() if "accept" in line]
        assert len(told) == 1, said
        assert told[0].startswith("warning: ") and "limit 20" in told[0] and "ulimit -n" in told[0]
        for client in clients:
            client.close()
        # The failed accepts are tried again once a second.
        deadline = time.monotonic() + 10
        while True:
            try:
                answer = httpx.get(f"{url}/revision", headers=bearer(secret), timeout=2)
                if answer.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "no answer once the clients left"
            time.sleep(0.2)
        # Stopped while out of descriptors again: asyncio's retry of the
        # accept, due a second on, found the listening socket closed, and
        # serve printed a traceback on its way out (a CI run under load).
        # A watch kept open keeps it stopping for a while, past that second, as
        # a slow machine's stop took.
        with httpx.stream("GET", f"{url}/events", headers=bearer(secret), timeout=10):
            clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
            time.sleep(0.5)
            server.terminate()
            time.sleep(2)
        assert server.wait(timeout=10) == 0
    finally:
        for client in clients:
            client.close()
        server.terminate()
        server.wait(timeout=10)
    said = stderr.read_text()
    assert "Logging error" not in said and "Traceback" not in said, said[:3_000]
    (low,) = [line for line in said.splitlines() if "file descriptor limit" in line]
    assert low.startswith("warning: the file descriptor limit is 20 (ulimit -n), below the 384 ")


RETRY_AFTER_CLOSE = (
    "Exception in callback BaseSelectorEventLoop._start_serving(<function Ser...x7f18d624ce00>,"
    " <socket.socke...pe=1, proto=6>, None, <Server sockets=()>, 2048, None, None)"
)


def test_failed_accepts_are_told_at_once_then_counted_and_other_errors_as_asyncio_tells_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    told = AcceptErrorsTold(every=0.05)
    out_of_descriptors = {
        "message": "socket.accept() out of system resource",
        "exception": OSError(errno.EMFILE, "Too many open files"),
    }

    async def fail_accepts() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(5):
            told(loop, out_of_descriptors)
        await asyncio.sleep(0.08)  # after the count is told (the timers run in order)
        await asyncio.sleep(0.08)  # after a count of none, which ends it
        told(loop, out_of_descriptors)
        # asyncio's retry of the accepts, a second on, after the server closed
        # its socket (a stop): nothing to tell, where it told a traceback.
        told(
            loop,
            {"message": RETRY_AFTER_CLOSE, "exception": ValueError("Invalid file descriptor: -1")},
        )
        told(loop, {"message": "something else", "exception": ValueError("other")})

    with caplog.at_level(logging.WARNING):
        asyncio.run(fail_accepts())
    first, count, again, other = caplog.records
    assert first.getMessage().startswith("out of file descriptors (limit ")
    assert "a connection could not be accepted" in first.getMessage()
    assert ": accept() failed 4 times in the last 0.05 s " in count.getMessage()
    assert again.getMessage() == first.getMessage()
    assert (other.name, other.getMessage()) == ("asyncio", "something else")


def _served_log(
    tmp_path: Path, config_file: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, Path]:
    """A log of one model over ``config_file``, and a tokens file, for a
    ``serve`` whose start returns at once rather than serving on."""
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda *_args, **_kwargs: None)
    # A start that goes through freezes the heap for the server's life: here,
    # the test process's, whose later tests ran up to 20 times slower.
    monkeypatch.setattr(gc, "freeze", lambda: None)
    db = f"sqlite:///{tmp_path}/serve.db"
    tokens = tmp_path / "tokens.json"
    TokenStore(tokens).add("ops", "read")
    setup = Models(load_config(config_file), env={"CATALOG_ES_DB": db})
    setup.add(spec("m"), by="setup")
    setup.close()
    return db, tokens


@pytest.mark.parametrize("config", ["changed", "recorded"])
def test_serve_given_a_stale_expected_revision_is_refused_before_it_records_anything(
    tmp_path: Path,
    config_file: str,
    write_config: Callable[..., str],
    config: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It recorded a changed config at start whatever the revision given
    (hostile test): it is a compare-and-set like every write, and a start
    with nothing to record is refused all the same."""
    db, tokens = _served_log(tmp_path, config_file, monkeypatch)
    path = write_config("models: []\n") if config == "changed" else config_file
    rows = count_events(db)
    command = ["--db", db, "--config", path, "serve", "--port", "0", "--tokens", str(tokens)]
    served = CliRunner().invoke(cli, [*command, "--expected-revision", "1"])
    assert (served.exit_code, served.stdout) == (1, "")
    assert served.stderr.splitlines() == [
        f"error: the log is at revision {rows}, not 1: someone changed the catalog since "
        "you read it; read it again and retry"
    ]
    assert count_events(db) == rows
    models = Models(load_config(path), env={"CATALOG_ES_DB": db})
    assert [(r["event"], r["model"]) for r in models.refusals()] == [("ConfigDeclared", None)]
    # At the log's revision, it starts (and records a changed config).
    assert models.record_declaration(by="deployer", expected_revision=rows) == (
        rows + 1 if config == "changed" else rows
    )
    models.close()


def test_serve_given_no_config_on_a_log_whose_nodes_recorded_one_refuses_to_start(
    tmp_path: Path,
    config_file: str,
    write_config: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Started from a folder without the deploy's catalog.yaml, serve recorded
    no config at start over the one the nodes recorded, undeclaring every
    declared model for every node. It refuses to start, one line, nothing
    written; given the config, or one of `models: []`, it starts."""
    db, tokens = _served_log(tmp_path, config_file, monkeypatch)
    rows = count_events(db)
    serve = ["serve", "--port", "0", "--tokens", str(tokens)]
    served = CliRunner().invoke(cli, ["--db", db, *serve])
    assert (served.exit_code, served.stdout) == (1, "")
    assert served.stderr.splitlines() == [
        "error: no declared config given (--config, $CATALOG_ES_CONFIG or ./catalog.yaml): "
        "the log's nodes recorded one at revision 1, and this write would record none over "
        "it (no models, the default engines); give that config, or one declaring what "
        "every node should run (`models: []`: no models)"
    ]
    assert count_events(db) == rows
    for config in (config_file, write_config("models: []\n")):
        started = CliRunner().invoke(cli, ["--db", db, "--config", config, *serve])
        assert started.exit_code == 0, started.output
    assert count_events(db) == rows + 1  # `models: []`, recorded


@pytest.mark.parametrize("where", ["taken", "unknown host", "empty host"])
def test_serve_that_cannot_listen_is_refused_before_it_records_anything(
    tmp_path: Path, config_file: str, where: str
) -> None:
    db = f"sqlite:///{tmp_path}/serve.db"
    tokens = tmp_path / "tokens.json"
    TokenStore(tokens).add("ops", "read")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        host = {"taken": "127.0.0.1", "unknown host": "no-such-host.invalid"}.get(where, "")
        command = ["--db", db, "--config", config_file, "serve", "--host", host]
        command += ["--port", port, "--tokens", str(tokens)]
        served = CliRunner().invoke(cli, command)
    assert served.exit_code == 1, served.output
    (line,) = served.stderr.splitlines()
    assert line.startswith(
        {
            "taken": "error: cannot listen on '127.0.0.1' port",
            "unknown host": "error: --host 'no-such-host.invalid': ",
            # Not every interface, as the system takes no host to mean.
            "empty host": "error: --host '': give the address to listen on",
        }[where]
    )
    assert count_events(db) == 0


def test_a_server_given_no_config_answers_500_once_another_node_records_one(
    db_url: str, tmp_path: Path, config_file: str, shared_server: SharedServer
) -> None:
    """A server started with no config on a log that recorded none writes on;
    once another node records a config, its writes are refused (they would
    record none over it): the server's setup is at fault, not the request,
    which answered 422 as if it were, and which no retry can help."""
    bare = Models(env={"CATALOG_ES_DB": db_url})
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    with (
        shared_server.serving(create_app(bare, tokens)) as url,
        http_client(base_url=url, timeout=30, headers=bearer(token["write"])) as client,
    ):
        ok(client.post("/models", json=definition("a")))
        deployed = Models(load_config(config_file), env={"CATALOG_ES_DB": db_url})
        deployed.scale("a", 0, 2, by="ops")
        rows = count_events(db_url)
        told = refused(client.post("/models", json=definition("b")), 500)
        assert told.startswith("no declared config given (--config, $CATALOG_ES_CONFIG or ")
        assert count_events(db_url) == rows
    deployed.close()
    bare.close()


def test_a_database_that_went_away_is_a_503_to_retry_and_nothing_is_written(
    pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, shared_server: SharedServer
) -> None:
    """PostgreSQL restarting or failing over under a running server: each
    request answers JSON that says to try again, as a busy log does, not a
    bare 500 with a traceback in the log (hostile test)."""
    direct = sa.make_url(pg_url)
    proxy = Proxy((direct.host or "127.0.0.1", direct.port or 5432))
    through = direct.set(port=proxy.port).render_as_string(hide_password=False)
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": through})
    models.add(spec("m"), by="setup")
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    server_log = logging.getLogger("uvicorn.error")  # it does not propagate
    server_log.addHandler(caplog.handler)
    try:
        with (
            shared_server.serving(create_app(models, tokens)) as url,
            http_client(base_url=url) as client,
        ):
            assert client.get("/revision", headers=bearer(token["read"])).status_code == 200
            proxy.cut()
            rows = count_events(pg_url)
            read = client.get("/revision", headers=bearer(token["read"]))
            write = bearer(token["write"])
            scaled = client.post("/models/m/scale", json={"max": 2}, headers=write)
    finally:
        server_log.removeHandler(caplog.handler)
    for response in (read, scaled):
        assert refused(response, 503) == "the database could not be used; try again"
        assert response.headers["retry-after"] == "1"
        assert response.headers["x-frame-options"] == "DENY"
    assert count_events(pg_url) == rows
    told = [r.getMessage() for r in caplog.records if "could not be used" in r.getMessage()]
    assert told[0].startswith("GET /revision: the database could not be used: ")
    assert "Exception in ASGI application" not in caplog.text  # one line, no traceback
    models.close()


def test_a_role_without_the_logs_privileges_is_a_500_not_a_retry(
    pg_url: str,
    read_only_url: Callable[[], str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    shared_server: SharedServer,
) -> None:
    """A server whose role may only read, asked to write: 503 and Retry-After
    told clients to try again, forever (review). It is the operator's to mend."""
    Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url}).add(spec("m"), by="setup")
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": read_only_url()})
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    rows = count_events(pg_url)
    with (
        shared_server.serving(create_app(models, tokens)) as url,
        http_client(base_url=url) as client,
    ):
        assert client.get("/models", headers=bearer(token["read"])).status_code == 200
        scaled = client.post("/models/m/scale", json={"max": 2}, headers=bearer(token["write"]))
    models.close()
    assert refused(scaled, 500) == "the database could not be used; the server's log says why"
    assert "retry-after" not in scaled.headers
    assert count_events(pg_url) == rows
    told = [r.getMessage() for r in caplog.records if "could not be used" in r.getMessage()]
    assert told == [
        "POST /models/m/scale: the database could not be used: permission denied for table "
        "catalog_events"
    ]


# -- the SQLite file replaced under a running server -----------------------------------


def _sqlite_catalog(path: Path, *names: str) -> None:
    """A log at ``path`` holding ``names``, closed: no -wal or -shm left beside it."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{path}"})
    for name in names:
        models.add(spec(name), by="setup")
    models.close()


@pytest.fixture
def file_api(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, shared_server: SharedServer
) -> Iterator[Api]:
    """A server on a SQLite file holding m1, its held writer and a pooled
    reader already open on that file, and the server's log in ``caplog``."""
    db = f"sqlite:///{tmp_path}/catalog.db"
    _sqlite_catalog(tmp_path / "catalog.db", "m1")
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db})
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    server_log = logging.getLogger("uvicorn.error")  # it does not propagate
    server_log.addHandler(caplog.handler)
    try:
        with (
            shared_server.serving(create_app(models, tokens)) as url,
            http_client(base_url=url) as client,
        ):
            api = Api(url, db, models, tokens, token, client)
            ok(api.post("/models/m1/scale", {"max": 2}))
            ok(api.get("/models"))
            yield api
    finally:
        server_log.removeHandler(caplog.handler)
        models.close()


def _told_unusable(
    responses: tuple[httpx.Response, ...], caplog: pytest.LogCaptureFixture
) -> list[str]:
    """What the server's log told of ``responses``, each refused with a 500
    that points there, in one line each, with no traceback."""
    for response in responses:
        assert refused(response, 500) == "the database could not be used; the server's log says why"
    assert "Exception in ASGI application" not in caplog.text
    return [r.getMessage() for r in caplog.records if "could not be used" in r.getMessage()]


def _beside(path: Path) -> list[Path]:
    return [path, path.with_name(f"{path.name}-wal"), path.with_name(f"{path.name}-shm")]


def test_a_catalog_renamed_over_the_file_under_a_server_is_refused_not_written(
    file_api: Api, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its open connections kept the file renamed away: a write answered 200
    and a revision, went into that file, and was lost (hostile test). Read
    afresh, the new file was read with the old one's -wal and -shm, which
    the rename leaves beside it, and corrupted (review). Refused instead,
    until the server is started again."""
    path = tmp_path / "catalog.db"
    ok(file_api.post("/models/m1/scale", {"max": 3}))  # the old file's -wal holds it
    _sqlite_catalog(tmp_path / "other.db", "x1")
    (tmp_path / "other.db").replace(path)
    told = _told_unusable(
        (file_api.post("/models/x1/scale", {"max": 3}), file_api.get("/models")), caplog
    )
    assert told[0] == (
        f"POST /models/x1/scale: the database could not be used: the database file {path} "
        "was replaced while this process ran (renamed over): the -wal and -shm files beside "
        "it are the old file's, and reading on would mix the two; stop every process using "
        "it, and remove those two before starting them again"
    )
    file_api.models.close()
    for old in _beside(path)[1:]:
        old.unlink(missing_ok=True)
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("SELECT count(*) FROM catalog_events").fetchone() == (1,)


def test_a_database_file_removed_under_a_server_is_refused_in_one_line_and_not_made_again(
    file_api: Api, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Writes went on answering 200 into the removed file, and a read made a
    new empty catalog at the path (hostile test)."""
    path = tmp_path / "catalog.db"
    for old in _beside(path):
        old.unlink()
    scaled = file_api.post("/models/m1/scale", {"max": 3})
    read = file_api.get("/models")
    told = _told_unusable((scaled, read), caplog)
    assert told[0] == (
        f"POST /models/m1/scale: the database could not be used: the database file {path} "
        "is gone (removed, or renamed away, while this process ran): nothing was read or "
        "written; put it back"
    )
    file_api.models.close()
    assert not path.exists()


@pytest.mark.parametrize("query", ["?uri=true", "?uri=true&timeout=5"])
def test_a_plain_path_given_as_a_uri_is_the_same_file_to_every_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, query: str
) -> None:
    """Opened only if there once made, a path with ``?uri=true`` had
    ``?mode=rw`` taken as part of its name: every connection after the
    first opened a new empty database beside it (review)."""
    monkeypatch.chdir(tmp_path)
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///plain.db{query}"})
    models.add(spec("m1"), by="ops")
    with models.store.read() as first, models.store.read() as second:
        assert models.store.head(first) == models.store.head(second) == 1
    models.close()
    assert sorted(p.name for p in tmp_path.iterdir() if "plain" in p.name) == ["plain.db"]


def test_a_database_file_emptied_under_a_server_is_refused_in_one_line(
    file_api: Api, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Truncated to 0 bytes: reads said the database stayed locked (nothing
    held it), a write answered 200 (hostile test). Refused, the write let go
    of its connection, whose close wrote the WAL into the emptied file: it
    grew again, unreadable (retest)."""
    path = tmp_path / "catalog.db"
    ok(file_api.post("/models/m1/scale", {"max": 2}))  # the WAL holds it
    os.truncate(path, 0)
    read = file_api.get("/revision")
    scaled = file_api.post("/models/m1/scale", {"max": 3})
    assert path.stat().st_size == 0
    told = _told_unusable((read, scaled), caplog)
    assert told[0] == (
        f"GET /revision: the database could not be used: the database file {path} is empty "
        "(truncated while this process ran?): it holds no log, nothing was read or written; "
        "restore it"
    )


def test_verify_of_a_malformed_log_is_one_line_as_the_logs_read_is(
    file_api: Api, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A page of the log's table damaged: /log said so in one line, /verify
    answered "internal error" with a traceback (hostile test)."""
    path = tmp_path / "catalog.db"
    with contextlib.closing(sqlite3.connect(path)) as side:
        side.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (page_size,) = side.execute("PRAGMA page_size").fetchone()
        (root,) = side.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'catalog_events'"
        ).fetchone()
        with path.open("r+b") as file:
            file.seek((root - 1) * page_size)
            file.write(b"\xff" * page_size)
        # A commit the server's connections see: they drop the pages they hold.
        side.execute("PRAGMA user_version = 1")
    told = _told_unusable((file_api.get("/verify"), file_api.get("/log")), caplog)
    assert told == [
        f"GET /verify: the database at {path} could not be used: database disk image is malformed",
        f"GET /log: the database at {path} could not be used: database disk image is malformed",
    ]


@pytest.mark.parametrize("moved", ["renamed over", "renamed away"])
def test_a_write_the_file_was_replaced_under_is_not_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moved: str
) -> None:
    """Renamed over, or away, between the writer's check and its commit, the
    write goes into the file no longer at the path: refused in one line, not
    answered with a revision the log at the path does not have. Renamed
    away, the check's own error escaped unwrapped, an internal error saying
    nothing was written (review)."""
    path = tmp_path / "catalog.db"
    _sqlite_catalog(path, "m1")
    _sqlite_catalog(tmp_path / "other.db", "x1")
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{path}"})
    append = models.store.append

    def renamed_over_first(*args: Any, **kwargs: Any) -> Any:
        if moved == "renamed away":
            path.rename(tmp_path / "moved.db")
        else:
            (tmp_path / "other.db").replace(path)
        return append(*args, **kwargs)

    monkeypatch.setattr(models.store, "append", renamed_over_first)
    with pytest.raises(sa.exc.OperationalError) as raised:
        models.scale("m1", 1, 3, by="ops")
    unusable = database_unusable(raised.value)
    assert unusable == (
        f"the database file {path} was replaced, removed or emptied during this write, which "
        "went into the file that was there: the log at the path does not hold it; stop every "
        "process using it, then start them again",
        True,
        "",  # its words name the file
    )
    monkeypatch.undo()
    models.close()


def test_a_session_ended_by_the_server_mid_query_is_a_503(
    pg_url: str, tmp_path: Path, shared_server: SharedServer
) -> None:
    """A restart or a failover ends the sessions in a query with SQLSTATE
    57P01 (psycopg's AdminShutdown, a subclass of OperationalError): it was
    taken for an unexpected error, a 500 (review)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    models.add(spec("m"), by="setup")
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    engine = sa.create_engine(pg_url)
    with (
        shared_server.serving(create_app(models, tokens)) as url,
        engine.connect() as holder,
        holder.begin(),
    ):
        holder.exec_driver_sql("LOCK TABLE catalog_events IN ACCESS EXCLUSIVE MODE")
        answers: list[httpx.Response] = []
        read = bearer(token["read"])
        reading = threading.Thread(
            target=lambda: answers.append(httpx.get(f"{url}/log", headers=read, timeout=30))
        )
        reading.start()

        def waiting() -> list[int]:
            # The statistics are read once a transaction unless cleared.
            holder.exec_driver_sql("SELECT pg_stat_clear_snapshot()")
            return list(
                holder.exec_driver_sql(
                    "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND datname = current_database() AND pid <> pg_backend_pid()"
                    " AND application_name = current_setting('application_name')"
                ).scalars()
            )

        _until(lambda: bool(waiting()))
        for pid in waiting():
            holder.exec_driver_sql(f"SELECT pg_terminate_backend({pid})")
        reading.join(timeout=10)
    engine.dispose()
    models.close()
    (answer,) = answers
    assert refused(answer, 503) == "the database could not be used; try again"


def test_a_watch_whose_log_was_rewritten_while_it_was_away_ends_saying_so(pg_url: str) -> None:
    """A failover to a standby that missed the last commits, then other
    writes numbered the same: a watch following on after the last revision it
    gave missed those, in silence (hostile test). It ends, told why."""
    direct = sa.make_url(pg_url)
    proxy = Proxy((direct.host or "127.0.0.1", direct.port or 5432))
    through = direct.set(port=proxy.port).render_as_string(hide_password=False)
    writer = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    writer.add(spec("m"), by="setup")
    saved = log_rows(pg_url)
    follower = Models(DeclaredConfig(), env={"CATALOG_ES_DB": through})
    watch = follower.watch(0)
    watch.retry_seconds = 0.1
    thread, seen, ended = following(watch)
    writer.scale("m", 0, 2, by="ops")
    _until(lambda: seen == [1, 2])
    proxy.cut()
    put_back(pg_url, saved)  # the standby had revision 1 only
    other = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    other.add(spec("n"), by="elsewhere")  # revision 2 again, another event
    proxy.resume()
    thread.join(10)
    assert not thread.is_alive()
    assert seen == [1, 2]
    assert [type(e) for e in ended] == [LogRewritten]
    assert str(ended[0]) == (
        "the log no longer holds revision 2 as this watch gave it: it lost events and took"
        " others (a failover, or a restored backup?); catalog-es verify says whether the log"
        " was edited; watch again from a revision before the loss"
    )
    for models in (follower, writer, other):
        models.close()
    proxy.cut()  # and its threads end: a later test forks, alone


@pytest.mark.parametrize("driver", ["postgresql+psycopg", "postgresql"])
def test_a_watch_starting_while_the_database_is_away_waits_for_it(pg_url: str, driver: str) -> None:
    """A replica starting as its database failed over exited 1 (multi-node
    test), where one already following waits. It waits too now, told once,
    and gives everything once the database is back; given a bare
    postgresql:// (psycopg, as everywhere), it exited 1 for want of psycopg2
    (doc audit)."""
    direct = sa.make_url(pg_url)
    writer = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    writer.add(spec("m"), by="setup")
    proxy = Proxy((direct.host or "127.0.0.1", direct.port or 5432))
    through = direct.set(port=proxy.port, drivername=driver).render_as_string(hide_password=False)
    proxy.cut()
    command = [sys.executable, "-m", "catalog_es", "--db", through, "watch", "--json"]
    watching = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: dict[str, queue.Queue[str]] = {"out": queue.Queue(), "err": queue.Queue()}
    for name, stream in (("out", watching.stdout), ("err", watching.stderr)):
        threading.Thread(target=lambda q=lines[name], s=stream: [q.put(x) for x in s]).start()
    try:
        told = lines["err"].get(timeout=30)
        # Named as the log's URL lines name it (the password hidden): the
        # line named no database, the driver's words no more than a port.
        named = sa.make_url(through).set(drivername="postgresql+psycopg")
        shown = repr(named.render_as_string(hide_password=True))
        assert told.startswith(f"warning: watch: the database at {shown} could not be used (")
        assert told.rstrip().endswith("trying again every 1 s")
        writer.scale("m", 0, 2, by="ops")  # while it cannot reach the database
        proxy.resume()
        given = [json.loads(lines["out"].get(timeout=30))["revision"] for _ in range(2)]
        assert given == [1, 2]
    finally:
        watching.send_signal(signal.SIGTERM)
        watching.wait(timeout=30)
        writer.close()
        proxy.cut()
    assert watching.returncode == 0
    assert lines["err"].get(timeout=10).strip() == "stopped"


def _a_log_behind_a_cut_proxy(pg_url: str) -> tuple[Models, Proxy, str]:
    """A log holding model ``m`` at revision 1, its writer, and a proxy to its
    database, cut (it refuses connections until it resumes), with its URL."""
    direct = sa.make_url(pg_url)
    writer = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    writer.add(spec("m"), by="setup")
    proxy = Proxy((direct.host or "127.0.0.1", direct.port or 5432))
    through = direct.set(port=proxy.port).render_as_string(hide_password=False)
    proxy.cut()
    return writer, proxy, through


def test_a_watch_waiting_for_the_database_reads_a_piped_config_once(pg_url: str) -> None:
    """A start that waits for its database (a replica as PostgreSQL fails
    over) tried again reading the declared config again: one given as a
    pipe (`--config <(…)`, read once) was empty the second time, and the
    start refused as of an empty config once the database was back."""
    writer, proxy, through = _a_log_behind_a_cut_proxy(pg_url)
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as piped:
        piped.write(config_yaml(spec("d")))
    command = [sys.executable, "-m", "catalog_es", "--db", through]
    command += ["--config", f"/dev/fd/{read_end}", "watch", "--json"]
    watching = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        pass_fds=[read_end],
        cwd=Path(__file__).parents[1],  # this checkout's code, for `-m catalog_es`
    )
    os.close(read_end)
    try:
        assert watching.stderr is not None and watching.stdout is not None
        told = watching.stderr.readline()
        assert told.rstrip().endswith("trying again every 1 s"), told
        writer.scale("m", 0, 2, by="ops")  # while it cannot reach the database
        proxy.resume()
        given = [watching.stdout.readline() for _ in range(2)]
        assert [json.loads(line)["revision"] for line in given if line] == [1, 2]
    finally:
        watching.send_signal(signal.SIGTERM)
        out, err = watching.communicate(timeout=30)
        writer.close()
        proxy.cut()
    assert (watching.returncode, err) == (0, "stopped\n"), out


@dataclass
class _Waiting:
    """A ``catalog-es serve`` started while its database is away (a proxy to
    it cut): the process, the port it was given, a read token, the proxy
    and a service writing straight to the database."""

    server: subprocess.Popen[str]
    port: int
    secret: str
    proxy: Proxy
    writer: Models


@contextlib.contextmanager
def _serve_started_while_the_database_is_away(
    pg_url: str, tmp_path: Path, *root: str
) -> Iterator[_Waiting]:
    """Yields once the server has said, in its first line, that it waits
    for the database; the log holds model ``m`` at revision 1."""
    writer, proxy, through = _a_log_behind_a_cut_proxy(pg_url)
    tokens = tmp_path / "tokens.json"
    secret = TokenStore(tokens).add("ops", "read")[1]
    with socket.socket() as free:  # a port to knock on while it waits
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    command = [sys.executable, "-m", "catalog_es", "--db", through, *root]
    command += ["serve", "--port", str(port), "--tokens", str(tokens)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        told = server.stderr.readline()
        shown = repr(sa.make_url(through).render_as_string(hide_password=True))
        assert told.startswith(f"warning: serve: the database at {shown} could not be used ("), told
        assert told.rstrip().endswith("trying again every 1 s")
        yield _Waiting(server, port, secret, proxy, writer)
    finally:
        server.kill()
        writer.close()
        proxy.cut()


def test_a_server_starting_while_the_database_is_away_waits_for_it(
    pg_url: str, tmp_path: Path
) -> None:
    """``serve`` starting as its database failed over exited 1, where a
    running server answers 503 until it is back and a watch starting then
    waits for it: a supervisor restarting a unit that fails fast gives up on
    it. It waits too now, told once, and serves the catalog as the database
    has it once back. Meanwhile it does not listen: a connection sat in the
    queue unanswered, and a check of the port took the node for one that
    serves (review)."""
    with _serve_started_while_the_database_is_away(pg_url, tmp_path) as waiting:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", waiting.port), timeout=5).close()
        waiting.writer.scale("m", 0, 2, by="ops")  # while it cannot reach the database
        waiting.proxy.resume()
        url, said = started(waiting.server)
        assert said.startswith("serving the catalog at revision 2 on "), said
        assert url == f"http://127.0.0.1:{waiting.port}"
        answer = httpx.get(f"{url}/models/m", headers=bearer(waiting.secret))
        assert answer.json()["scaling"]["max"] == 2
        waiting.server.send_signal(signal.SIGTERM)
        out, err = waiting.server.communicate(timeout=20)
    assert (waiting.server.returncode, out, err) == (0, "", "stopped\n")


def test_a_server_whose_port_was_taken_while_it_waited_records_nothing(
    pg_url: str, tmp_path: Path, config_file: str
) -> None:
    """A server waiting for its database closes its port; taken meanwhile,
    the port was found so only after the declared config was recorded, by a
    start refused (review): a start refused writes nothing."""
    with _serve_started_while_the_database_is_away(
        pg_url, tmp_path, "--config", config_file
    ) as waiting:
        with socket.socket() as taker:
            taker.bind(("127.0.0.1", waiting.port))
            taker.listen()
            waiting.proxy.resume()
            out, err = waiting.server.communicate(timeout=30)
        assert out == ""
        assert waiting.writer.catalog_at().revision == 1
    assert waiting.server.returncode == 1, err
    assert f"error: cannot listen on '127.0.0.1' port {waiting.port}: Address already in use" in err


def test_a_watch_on_a_database_set_up_wrong_is_an_error_at_once(
    pg_url: str, tmp_path: Path
) -> None:
    """Waiting is for outages: a name, a role that is not there, a SQLite
    file that cannot be opened (a folder), waited for good (review); by a
    server starting too."""
    direct = sa.make_url(pg_url)
    wrong = [
        direct.set(database="no_such_database_here").render_as_string(hide_password=False),
        direct.set(username="no_such_role_here").render_as_string(hide_password=False),
        f"sqlite:///{tmp_path}",
    ]
    tokens = tmp_path / "tokens.json"
    TokenStore(tokens).add("ops", "read")
    for url in wrong:
        serving = CliRunner().invoke(
            cli, ["--db", url, "serve", "--port", "0", "--tokens", str(tokens)]
        )
        assert serving.exit_code == 1, (url, serving.output)
        # SQLite's line names the file, which its driver's words do not.
        told = f"at {tmp_path} could not be used: " if url.startswith("sqlite") else "could not"
        assert serving.output.startswith(f"error: the database {told}"), url
        assert "trying again" not in serving.output
        command = [sys.executable, "-m", "catalog_es", "--db", url, "watch"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 1, (url, done.stderr)
        assert done.stderr.startswith(f"error: the database {told}"), done.stderr
        assert "trying again" not in done.stderr


def test_a_watch_follows_on_after_the_database_came_back(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL restarted under a follower (a gateway replica): it ended with
    the driver's error, and every replica needed a supervisor (hostile test).
    It now waits, subscribes again after the last revision it gave, and misses
    nothing written meanwhile. The process tells each outage once, not once a
    watch, and its end even when nothing is written after it (review)."""
    direct = sa.make_url(pg_url)
    proxy = Proxy((direct.host or "127.0.0.1", direct.port or 5432))
    through = direct.set(port=proxy.port).render_as_string(hide_password=False)
    writer = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    writer.add(spec("m"), by="setup")
    follower = Models(DeclaredConfig(), env={"CATALOG_ES_DB": through})
    watches = [follower.watch(0) for _ in range(3)]
    seen: list[list[int]] = [[] for _ in watches]
    following = [
        threading.Thread(target=lambda w=w, s=s: s.extend(e["revision"] for e in w))
        for w, s in zip(watches, seen, strict=True)
    ]
    for watch, thread in zip(watches, following, strict=True):
        watch.retry_seconds = 0.1
        thread.start()
    _until(lambda: all(s == [1] for s in seen))

    def told() -> list[str]:
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("watch: ")]
        kinds = {"is back": "back", "could not be used": "gone"}
        return [next((k for s, k in kinds.items() if s in m), m) for m in said]

    proxy.cut()
    time.sleep(0.5)
    proxy.resume()
    _until(lambda: told() == ["gone", "back"])  # nothing written: a quiet log
    proxy.cut()
    writer.scale("m", 0, 2, by="ops")  # while the followers cannot reach the database
    time.sleep(0.5)
    proxy.resume()
    writer.scale("m", 0, 3, by="ops")
    _until(lambda: all(len(s) == 3 for s in seen))
    for watch, thread in zip(watches, following, strict=True):
        watch.stop()
        thread.join(timeout=10)
        assert not thread.is_alive()
    assert seen == [[1, 2, 3]] * 3
    assert told() == ["gone", "back", "gone", "back"]
    shown = repr(sa.make_url(through).render_as_string(hide_password=True))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("watch: ")]
    assert said[0].startswith(f"watch: the database at {shown} could not be used (")
    assert said[1] == f"watch: the database at {shown} is back; following on"
    follower.close()
    writer.close()
    proxy.cut()  # and its threads end: a later test forks, alone


def test_a_stream_sends_the_changes_read_already_together_and_waits_for_no_more(
    make_models: Callable[..., Models],
) -> None:
    """A change at a time, a catch-up went at 2,400 changes a second: a
    batch is the next change and those after it the watch has read already
    (a page of them), up to its bound, in order; caught up, the next change
    is sent as it comes, not held for more."""
    models = make_models()
    models.add(spec("m"), by="ops")
    models.apply_changes([commands.scale("m", 0, 1 + i % 3) for i in range(299)], by="ops")
    watch = models.watch(0)
    changes = iter(watch)
    batches: list[str] = []
    while sum(batch.count("id: ") for batch in batches) < models.revision:
        batches.append(_next_batch(changes, watch) or "")
    ids = [int(line[4:]) for batch in batches for line in batch.splitlines() if line[:4] == "id: "]
    assert ids == list(range(1, models.revision + 1))
    assert max(batch.count("id: ") for batch in batches) == BATCH_MESSAGES
    assert len(batches) < models.revision / 10
    came: list[str | None] = []
    waiting = threading.Thread(target=lambda: came.append(_next_batch(changes, watch)))
    waiting.start()
    models.scale("m", 0, 3, by="ops")
    waiting.join(10)
    watch.stop()
    assert [batch.count("id: ") for batch in came if batch] == [1]


def _listen_statement(models: Models) -> str:
    """What the LISTEN connection of ``models`` runs, as the server's sessions show it."""
    return f"LISTEN {channel_of(models.store.log_schema())}"


def test_followers_in_one_process_share_one_listen_connection(pg_url: str) -> None:
    """A LISTEN connection each, twenty open streams took twenty-five of the
    server's connections, which every node shares (hostile test)."""
    writer = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    writer.add(spec("m"), by="setup")
    follower = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})

    def listening() -> int:
        with writer.store.read() as conn:
            return int(
                conn.exec_driver_sql(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE query = %(listen)s AND datname = current_database()"
                    " AND application_name = current_setting('application_name')",
                    {"listen": _listen_statement(writer)},
                ).scalar_one()
            )

    before = listening()
    watches = [follower.watch(0) for _ in range(8)]
    seen: list[list[int]] = [[] for _ in watches]
    threads = [
        threading.Thread(target=lambda w=w, s=s: s.extend(e["revision"] for e in w))
        for w, s in zip(watches, seen, strict=True)
    ]
    for thread in threads:
        thread.start()
    writer.scale("m", 0, 2, by="ops")
    _until(lambda: all(s == [1, 2] for s in seen))
    assert listening() == before + 1
    for watch in watches:
        watch.stop()
    for thread in threads:
        thread.join(timeout=10)
    _until(lambda: listening() == before)  # let go once no one follows
    follower.close()
    writer.close()


@pytest.mark.parametrize(
    ("in_url", "probes"), [("", (30, 10, 3)), ("keepalives_idle=45", (45, 10, 3))]
)
def test_the_listen_connection_is_kept_alive_and_given_up_when_its_peer_goes(
    pg_url: str, in_url: str, probes: tuple[int, int, int]
) -> None:
    """The LISTEN connection is idle while nothing is written. A NAT or a
    firewall that drops idle flows would cut it silently, and no watch would
    hear of a commit again; a peer gone without a word was noticed after the
    system's two hours. It probes every 30 s, and gives up after three
    unanswered probes, 10 s apart; what the database URL says wins (review)."""
    url = f"{pg_url}&{in_url}" if in_url else pg_url
    writer = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    writer.add(spec("m"), by="setup")
    watch = writer.watch(1)
    follower = threading.Thread(target=lambda: list(watch))
    follower.start()

    def listen_port() -> int | None:
        with writer.store.read() as conn:
            # The newest: an earlier test's may not have closed yet (seen once).
            return conn.exec_driver_sql(
                "SELECT client_port FROM pg_stat_activity"
                " WHERE query = %(listen)s AND datname = current_database()"
                " AND application_name = current_setting('application_name')"
                " ORDER BY backend_start DESC LIMIT 1",
                {"listen": _listen_statement(writer)},
            ).scalar()

    _until(lambda: listen_port() is not None)
    port = listen_port()
    options = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            probe = socket.socket(fileno=os.dup(int(fd.name)))
            with probe:
                # TCP only: an event loop's wake-up pair (a test server's) is a
                # Unix socket, whose name is no (host, port).
                tcp = probe.family in (socket.AF_INET, socket.AF_INET6)
                if tcp and probe.type == socket.SOCK_STREAM and probe.getsockname()[1] == port:
                    options.append(
                        (
                            probe.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                            probe.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                            probe.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                            probe.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                        )
                    )
    watch.stop()
    follower.join(timeout=10)
    writer.close()
    assert options == [(1, *probes)]


def _until(done: Callable[[], bool], seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, "not within the time given"
        time.sleep(0.02)


def test_what_no_handler_expected_is_a_json_500_and_a_traceback_in_the_log(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(api.models, "refresh", broken)
    answer = api.get("/revision")
    assert refused(answer, 500).startswith("internal error")
    # Made outside every middleware, it carries their headers itself.
    assert answer.headers["x-frame-options"] == "DENY"
    assert answer.headers["cache-control"] == "no-store"


def test_serve_listens_on_one_port_for_every_address_and_before_another_can() -> None:
    """Bound but not yet listening, two servers starting at once could both
    take the port (SO_REUSEADDR) and both record the declared config; and
    each address of a host (IPv4, IPv6) must not get a port of its own."""
    first = _listening("", 0)
    try:
        # Named TCP, as asyncio needs to turn Nagle off on what they accept:
        # a test server's socket of protocol 0 made each answer on a kept
        # connection wait 40 ms for the client's delayed ACK.
        assert {sock.proto for sock in first} == {socket.IPPROTO_TCP}
        (port,) = {sock.getsockname()[1] for sock in first}
        with pytest.raises(InputError, match=f"cannot listen on '' port {port}: "):
            _listening("", port)
    finally:
        for sock in first:
            sock.close()


# -- the audit trail -------------------------------------------------------------------


def test_history_audit_refusals_and_verify(api: Api) -> None:
    api.post("/models?reason=trying", definition("qwen"))
    api.post("/models/qwen/scale", {"min": 0, "max": 3}, role="admin")
    refused(api.post("/models/qwen/scale", {"min": 5, "max": 1}), 422)

    history = ok(api.get("/history/qwen"))
    assert [(r["revision"], r["event"], r["by"]) for r in history] == [
        (2, "Added", "write-user"),
        (3, "Scaled", "admin-user"),
    ]
    assert history[0]["reason"] == "trying"
    assert {(c["field"], c["before"], c["after"]) for c in history[1]["changes"]} == {
        ("scaling.min", 1, 0),
        ("scaling.max", 1, 3),
    }
    assert [r["revision"] for r in ok(api.get("/history/qwen", params={"by": "admin-user"}))] == [3]
    assert refused(api.get("/history/never"), 404).startswith("model 'never' has no history")

    everything = ok(api.get("/audit"))
    # The config record, its row of the model it declares (base), then qwen's.
    assert [r["event"] for r in everything] == ["ConfigDeclared", "Declared", "Added", "Scaled"]
    assert ok(api.get("/audit", params={"by": "admin-user", "type": "scaled"})) == history[1:]
    assert [r["revision"] for r in ok(api.get("/audit", params={"limit": 1}))] == [3]
    assert ok(api.get("/audit", params={"since": "2999-01-01"})) == []
    assert refused(api.get("/audit", params={"type": "Exploded"}), 422).startswith(
        "type 'Exploded': not an event type"
    )
    # Refusals' alone: they answered nothing, as if nothing had been done.
    assert refused(api.get("/audit", params={"type": "Rollback"}), 422).startswith(
        "type 'Rollback': the audit has none; it takes Added, "
    )
    assert refused(api.get("/history/qwen", params={"type": "Apply"}), 422).startswith(
        "type 'Apply': a model's history has none; it takes Added, "
    )
    assert refused(api.get("/audit", params={"until": "noon"}), 422).startswith(
        "until 'noon': not a UTC time"
    )
    # Not the declared-config records, which have no model (hostile test).
    for path in ("/audit", "/refusals"):
        assert refused(api.get(path, params={"model": ""}), 422).startswith(
            "model: the name is empty"
        )
        assert refused(api.get(path, params={"by": ""}), 422).startswith("by: the actor is empty")

    (refusal,) = ok(api.get("/refusals"))
    assert (refusal["by"], refusal["model"], refusal["event"]) == ("write-user", "qwen", "Scaled")
    assert refusal["refusal"].startswith("model 'qwen': scaling")
    assert ok(api.get("/refusals", params={"by": "admin-user"})) == []

    report = ok(api.get("/verify"))
    assert report["ok"] is True and report["events"] == 3 and report["skipped"] == []


@pytest.mark.parametrize(
    ("view", "problem"),
    [
        ('{"revision": 3,', "Input data was truncated"),
        ('"gone"', "Expected `object`, got `str`"),
        # Two rows' worth: joined into the answer, an array of one row too many.
        ("{row},{row}", "JSON is malformed: trailing characters (byte {length})"),
        # Sound JSON, but no row: the console and the CLI's table read its keys.
        ("{}", "Object missing required field `revision`"),
        ('{"fields": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deep"),
        # What the CLI's table and the console read of a row, of another type.
        (
            '{"revision": 3, "time": null, "by": null, "reason": null, "model": "qwen",'
            ' "event": "Scaled", "class_version": 1, "fields": {}, "rollback_to": null,'
            ' "skipped": null, "changes": 5, "before": null, "after": null}',
            "Expected `array`, got `int` - at `$.changes`",
        ),
    ],
    ids=["cut short", "not an object", "two objects", "no row's keys", "nested deep", "a number"],
)
def test_a_damaged_audit_row_is_a_500_naming_replay_not_a_broken_answer(
    api: Api, view: str, problem: str
) -> None:
    """The rows' views are sent as they are stored, undecoded: one edited by
    hand went out inside a 200, and the client could read none of it."""
    ok(api.post("/models", definition("qwen")))
    ok(api.post("/models/qwen/scale", {"max": 3}))
    ok(api.post("/models/qwen/scale", {"max": 4}))
    assert len(ok(api.get("/audit"))) == 5  # the rows are made
    table = changes_table_for(api.models.name, api.models.declared.fingerprint)
    with api.models.store.engine.begin() as conn:
        row = conn.execute(sa.select(table.c.view).where(table.c.revision == 3)).scalar_one()
        view = view.replace("{row}", row)
        problem = problem.replace("{length}", str(len(row.encode()) + 1))
        conn.execute(sa.update(table).where(table.c.revision == 3).values(view=view))
    for path in ("/audit", "/history/qwen"):
        response = api.get(path)
        assert response.status_code == 500, path
        assert response.headers["content-type"] == "application/json"
        assert response.json() == {
            "error": f"an audit row cannot be read ({problem}): the audit's rows were damaged; "
            "run catalog-es replay to make them again from the log"
        }
    # The rows of another model's history are answered.
    assert [r["event"] for r in ok(api.get("/history/base"))] == ["Declared"]


@pytest.mark.parametrize(
    ("said", "lasting"),
    [
        ('FATAL:  database "nope" does not exist', True),
        ('FATAL:  role "nope" does not exist', True),
        ('FATAL:  password authentication failed for user "x"', True),
        ("FATAL:  the database system is starting up", False),
        ("FATAL:  sorry, too many clients already", False),
        ('FATAL:  too many connections for role "x"', False),
        ("FATAL:  remaining connection slots are reserved for roles with SUPERUSER", False),
        ("Connection refused", False),
    ],
)
def test_a_connection_refused_as_it_is_made_is_setup_or_an_outage_by_what_it_says(
    said: str, lasting: bool
) -> None:
    """libpq gives no SQLSTATE as a connection is made: a full server was
    told apart from a missing database by its words (review)."""
    error = psycopg.OperationalError(f"connection failed: connection to server failed: {said}")
    unusable = database_unusable(error)
    assert unusable is not None and unusable.lasting is lasting


def test_a_write_whose_session_ends_at_its_commit_answers_500_without_retry_after(
    pg_url: str,
    pg_admin: sa.Engine,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    shared_server: SharedServer,
) -> None:
    """Its outcome is unknown (the server may have committed): not 503 and
    Retry-After, which a client's retry takes as leave to send it again, and
    which a write without If-Match would make twice."""
    models = Models(load_config(None), env={"CATALOG_ES_DB": pg_url})
    models.add(spec("qwen"), by="setup")  # revision 1
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    answers: list[httpx.Response] = []
    try:
        with (
            shared_server.serving(create_app(models, tokens)) as url,
            commits_held(pg_admin, pg_url) as ended_at_its_commit,
        ):

            def scale() -> None:
                answers.append(
                    httpx.post(
                        f"{url}/models/qwen/scale",
                        json={"max": 3},
                        headers=bearer(token["write"]),
                        timeout=30,
                    )
                )

            ended_at_its_commit(scale)
            [answer] = answers
            assert answer.status_code == 500
            assert "retry-after" not in answer.headers
            assert answer.json() == {
                "error": "the write's outcome is unknown: its commit failed;"
                " if it was written, the log holds it as revision 2"
            }
            # What the database said is the server log's.
            assert "terminating connection due to administrator command" in caplog.text
        # The session's end rolled it back: the log, and the service, say so.
        assert models.get_model("qwen")["scaling"]["max"] == 1
        assert models.refusals() == []
    finally:
        models.close()
