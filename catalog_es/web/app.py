"""The HTTP API: the catalog's commands and queries, over the CLI's service.
What it leaves to the CLI: the weights commands (`model updates`,
`check-updates`, `model update`, `model rollback`), `replay` and `token`.

This layer only parses, calls :class:`catalog_es.application.Models` and maps
domain errors to statuses; the rules live in the service. Bodies are parsed
by the same functions as the CLI's files (:mod:`catalog_es.inputs`), so a bad
one gets the CLI's one-line message, as ``{"error": "..."}``. Who did a
change is the token's actor, never a field the client sends.

Endpoints are plain ``def``: FastAPI runs them on its thread pool, because
the service blocks on the database.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import datetime
from importlib.metadata import version
from typing import Annotated, Any, Literal, Protocol, TypeVar
from urllib.parse import unquote_to_bytes

import anyio
import msgspec
import sqlalchemy as sa
from fastapi import APIRouter, Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match, Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from catalog_es.application import CommandResult, Models
from catalog_es.errors import (
    DamagedLog,
    DamagedReadModel,
    InputError,
    ModelNotFound,
    NoConfigGiven,
    OutcomeUnknown,
    Refused,
    RevisionConflict,
    StorageBusy,
    json_escaped_bytes,
    json_in_pieces,
    shown,
)
from catalog_es.inputs import (
    MAX_CHANGES,
    MAX_CHANGES_BYTES,
    MAX_INPUT_BYTES,
    MAX_REASON_LENGTH,
    NAME_REGEX,
    NAME_SCHEMA,
    AdaptersChange,
    AdaptersFields,
    ClassChange,
    ClassFields,
    ModelInput,
    OwnerChange,
    OwnerFields,
    ResourcesChange,
    ResourcesFields,
    ScaleChange,
    ScaleFields,
    SourceChange,
    SourceFields,
    changes_from_data,
    describe,
    describe_problems,
    model_from_data,
    one_of,
    parse_changes,
    parse_document,
)
from catalog_es.names import event_type
from catalog_es.persistence import AnswerTooLarge
from catalog_es.storage.engines import database_unusable
from catalog_es.values import MAX_REVISION, in_digits, revision_or_time, utc_time, whole_number
from catalog_es.web import MAX_WATCHES, Role
from catalog_es.web.events import StreamPlaces, event_stream
from catalog_es.web.tokens import Caller, TokenStore
from projections.audit import ChangeFilters, Filters

log = logging.getLogger("catalog_es")

REVISION_HEADER = "X-Catalog-Revision"
BODY = "request body"
# What to send in place of an empty body.
SEND_A_DOCUMENT = "send a JSON (or YAML) document"

# Writes waiting at once, at most: each waits in one of the threads every
# request is served on, for the write lock, up to its bounded wait; sixty
# behind another process's write took them all, and reads stalled with them.
MAX_WRITES_WAITING = 16
# Bodies over a single definition's size (a list of changes) parsed at once,
# at most: one of 59 MB of YAML took 420 MB while it was read, and six at
# once 2.5 GB (hostile test); past them, a client is told to try again.
MAX_LARGE_BODIES = 2
# Seconds a body that holds one of those places has to come in full (64 MiB
# at a megabyte a second): two clients sending a byte a second held both
# places for as long as they liked, and every other large body was refused.
LARGE_BODY_SECONDS = 60.0
# Rows one answer of /log or /audit holds at most; asked for more, a client
# is told to page. Unbounded, one answer of a long log was built whole in
# memory: 70 MB of JSON for 80,000 rows, 3.3 GB for forty at once.
MAX_ANSWER_ROWS = 10_000
# And bytes: forty events of large definitions made an answer of 183 MB, and
# a page of them would take the server's memory. As large as the largest
# body it takes (an `apply` file).
MAX_ANSWER_BYTES = MAX_CHANGES_BYTES


class TooBusy(Refused):
    """As many requests of a kind are open as this server takes: try again."""


class TooSlow(Refused):
    """A request's body did not come in the time given to it."""


class EncodedBody(Refused):
    """A request's body in a content coding (``Content-Encoding``) this
    server does not undo."""


# The first of these a refusal is an instance of gives its status; every
# other refusal is 422. 409 means exactly "read again and retry": a model
# declared in config is refused with 422, since retrying cannot help. A log
# edited by hand is the server's fault, not the request's, as is a server
# started with no config once another node records one.
_STATUS_OF_REFUSAL: tuple[tuple[type[Refused], int], ...] = (
    (RevisionConflict, 409),
    (ModelNotFound, 404),
    (StorageBusy, 503),
    (TooBusy, 503),
    (TooSlow, 408),
    (EncodedBody, 415),
    (DamagedLog, 500),
    (DamagedReadModel, 500),
    (NoConfigGiven, 500),
)


def _status(refusal: Refused) -> int:
    for kind, status in _STATUS_OF_REFUSAL:
        if isinstance(refusal, kind):
            return status
    return 422


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return Response(
        escaped_json({"error": message}),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def respond(data: Any, revision: int | None = None) -> Response:
    """JSON through msgspec (a catalog can be large), with the revision read
    or written as a header and as the ETag an ``If-Match`` can send back."""
    return respond_json(msgspec.json.encode(data), revision)


def respond_json(body: bytes, revision: int | None = None) -> Response:
    """:func:`respond` for data that is JSON already. What a terminal would
    act on is escaped, as the CLI's ``--json`` escapes it: ``curl`` prints
    an answer to one (a source with a bidi override or an escape sequence
    in it went out raw)."""
    return Response(
        json_escaped_bytes(body), media_type="application/json", headers=revision_headers(revision)
    )


def revision_headers(revision: int | None) -> dict[str, str] | None:
    if revision is None:
        return None
    return {REVISION_HEADER: str(revision), "ETag": f'"{revision}"'}


def escaped_json(data: Any) -> bytes:
    """``data`` as JSON through msgspec, what a terminal would act on escaped."""
    return json_escaped_bytes(msgspec.json.encode(data))


def command_response(result: CommandResult) -> Response:
    return respond(msgspec.to_builtins(result), result.revision)


# -- the service and who is calling ------------------------------------------------


def service(request: Request) -> Models:
    models: Models = request.app.state.models
    return models


Service = Annotated[Models, Depends(service)]
_bearer = HTTPBearer(auto_error=False, description="A token from `catalog-es token add`.")


def forbidden(caller: Caller, needs: str) -> HTTPException:
    return HTTPException(403, f"{caller.actor!r} has the {caller.role.name} role; {needs}")


def caller_with(role: Role) -> Callable[..., Caller]:
    """A dependency: the caller, refused unless its token has ``role`` or more."""

    def caller(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> Caller:
        challenge = {"WWW-Authenticate": "Bearer"}
        if len(request.headers.getlist("authorization")) > 1:
            # Which would count is a guess a proxy and this server may make apart.
            raise HTTPException(401, "more than one Authorization header: send one", challenge)
        if credentials is None:
            raise HTTPException(401, "no token: send Authorization: Bearer <token>", challenge)
        tokens: TokenStore = request.app.state.tokens
        found = tokens.verify(credentials.credentials)
        if found is None:
            raise HTTPException(401, "the token is not valid (unknown or revoked)", challenge)
        if found.role < role:
            raise forbidden(found, f"this needs {role.name}")
        _check_path_and_query(request)
        return found

    return caller


def _check_path_and_query(request: Request) -> None:
    """A query key the path does not take is refused, not passed over: a read
    asked `?att=3`, or `at` where the path reads only now, answered now, in
    silence (conformance audit). So is a key given twice, rather than the
    last one read (`?model=a&model=b` answered for b alone, as if filtered
    by both); and a path or query whose %-escapes are not UTF-8, which were
    read with U+FFFD in their place (a `reason=%FF` recorded as what no one
    sent), as a request body that is not is; and a path with a line break in
    it. Checked once the caller is known."""
    scope = request.scope
    for part, raw in (("path", scope.get("raw_path")), ("query", scope.get("query_string"))):
        try:
            unquote_to_bytes(raw or b"").decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{part}: not UTF-8 text once its %-escapes are read") from None
    if "\n" in scope["path"]:
        # A route's pattern ends in `$`, which matches before a last line
        # break: DELETE /models/a%0A removed `a` (hostile test).
        raise InputError("path: holds a line break, which no name or path has")
    route = scope.get("route")
    if not isinstance(route, APIRoute):
        return
    _check_route_end(scope.get("raw_path") or b"", route.path_format)
    taken = _query_names(route)
    for key in request.query_params:
        if key not in taken:
            takes = ", ".join(sorted(taken)) or "none"
            raise InputError(f"unknown query parameter {shown(key, 40)}; this path takes: {takes}")
        if len(request.query_params.getlist(key)) > 1:
            raise InputError(f"{key} is given more than once in the query: give it once")


def _check_route_end(raw_path: bytes, path_format: str) -> None:
    """Refuse a path whose route's end after the name (the ``/scale`` of
    ``/models/{name}/scale``) came inside the name, its slash sent as %2F:
    routed on the path as read, a POST to ``/models/x%2Fscale``, a model no
    command takes that way, scaled the model ``x`` (hostile test)."""
    end = path_format.rpartition("}")[2]
    if "{" not in path_format or not end:
        return
    wanted = end.split("/")[1:]
    given = raw_path.split(b"/")[-len(wanted) :]
    if [unquote_to_bytes(part).decode("utf-8") for part in given] != wanted:
        raise InputError(
            f"path: its {end} is inside the name, its slash sent as %2F; a command on a "
            f"model is sent to /models/NAME{end}"
        )


def _query_names(route: APIRoute) -> frozenset[str]:
    """The query keys ``route`` reads, its dependencies' included; worked out
    once for each path and its methods (a route is not hashable, and which of
    its copies a request names differs between FastAPI releases)."""
    key = (route.path_format, frozenset(route.methods or ()))
    names = _QUERY_NAMES.get(key)
    if names is None:
        found: set[str] = set()
        pending = [route.dependant]
        while pending:
            dependant = pending.pop()
            found.update(field.alias for field in dependant.query_params)
            pending.extend(dependant.dependencies)
        names = _QUERY_NAMES[key] = frozenset(found)
    return names


_QUERY_NAMES: dict[tuple[str, frozenset[str]], frozenset[str]] = {}


@contextmanager
def write_place(request: Request) -> Iterator[None]:
    """One of the server's places for a write, held for the block; refused
    (503) when all are taken."""
    places: threading.BoundedSemaphore = request.app.state.write_places
    if not places.acquire(blocking=False):
        raise TooBusy(
            f"{MAX_WRITES_WAITING} writes are already waiting to be written here; try again"
        )
    try:
        yield
    finally:
        places.release()


def held_write_place(request: Request) -> Iterator[None]:
    """A dependency: a place for a write, held until the command returns. The
    last a command asks for, so a body still arriving, or being read, holds
    none (sixteen clients trickling bodies took them all)."""
    with write_place(request):
        yield


Reader = Annotated[Caller, Depends(caller_with(Role.read))]
Writer = Annotated[Caller, Depends(caller_with(Role.write))]
WritePlace = Annotated[None, Depends(held_write_place, scope="function")]


def text(**constraints: Any) -> Callable[[dict[str, Any]], None]:
    """A header's or query value's schema: text, within ``constraints`` (its
    ``pattern``, ``minLength``). Given, it is never null, which FastAPI's
    schema of an optional one lets it be (a client sent `If-Match: null`,
    told it followed the schema)."""

    def schema(found: dict[str, Any]) -> None:
        found.pop("anyOf", None)
        found.update(type="string", **constraints)

    return schema


NAME_TEXT = text(pattern=NAME_REGEX)


def expected_revision(
    request: Request,
    if_match: Annotated[
        str | None,
        Header(
            description="The revision the change is based on: refused (409) if the log "
            'has moved past it. `12`, `"12"` (an ETag) or `*`.',
            json_schema_extra=text(pattern=r'^\s*(\*|[0-9]+|"[0-9]+")\s*$'),
        ),
    ] = None,
) -> int | None:
    if len(request.headers.getlist("if-match")) > 1:
        # Which one counts is a guess a proxy and this server may make apart,
        # and `*` first would let a stale change through.
        raise InputError("more than one If-Match header: send one")
    if if_match is None or if_match.strip() == "*":
        return None
    given = if_match.strip()
    if given.startswith("W/"):
        raise InputError(
            f"If-Match {shown(given, 40)}: a weak tag never matches (If-Match compares "
            'strong tags): send "12" or 12'
        )
    quoted = len(given) >= 2 and given[0] == given[-1] == '"'
    revision = whole_number(given[1:-1] if quoted else given)
    if revision is None:
        raise InputError(f"If-Match {if_match[:40]!r}: not a revision (e.g. If-Match: 12)")
    return revision


ExpectedRevision = Annotated[int | None, Depends(expected_revision)]


def reason_value(
    reason: Annotated[
        str,
        Query(
            description="Why, recorded with the change: no control or bidi characters but "
            "line breaks.",
            json_schema_extra=text(maxLength=MAX_REASON_LENGTH),
        ),
    ] = "",
) -> str:
    # A dependency, so that the parameter has its default wherever it stands.
    return reason


Reason = Annotated[str, Depends(reason_value)]


def command_meta(caller: Caller, reason: str, expected: int | None) -> dict[str, Any]:
    """``by``, ``reason``, ``expected_revision`` as every command takes them."""
    return {"by": caller.actor, "reason": reason, "expected_revision": expected}


# A time's offset whose `+` a query read as a space: `…T12:00:00 01:00`.
_PLUS_READ_AS_SPACE = re.compile(r"\d \d\d(:?\d\d)?\s*$")
_Read = TypeVar("_Read")


def query_time(text: str, read: Callable[[str], _Read]) -> _Read:
    """``text`` from the query, read by ``read``; refused saying why where it
    holds an offset whose ``+`` the query read as a space: `?at=…+01:00`, as
    the docs write a time, was refused quoting `… 01:00` (hostile test)."""
    try:
        return read(text)
    except InputError as error:
        if _PLUS_READ_AS_SPACE.search(text) is None:
            raise
        raise InputError(f"{error} (a + in a query is read as a space: send it as %2B)") from None


def at_value(
    at: Annotated[
        str | None, Query(description="A revision (`120`) or a UTC time (`2026-11-30T12:00:00Z`).")
    ] = None,
) -> int | datetime | None:
    return None if at is None else query_time(at, revision_or_time)


At = Annotated[int | datetime | None, Depends(at_value)]


def declared_then_value(
    declared: Annotated[
        Literal["today", "then"],
        Query(
            description="The declared config a read of the past is replayed over: today's, "
            "or the one the log had recorded then (what the nodes ran)."
        ),
    ] = "today",
) -> bool:
    return declared == "then"


DeclaredThen = Annotated[bool, Depends(declared_then_value)]


# -- bodies ------------------------------------------------------------------------


class _Parser(Protocol):
    def __call__(self, text: str, where: str, *, instead: str, limit: int) -> Any: ...


def document(limit: int, parse: _Parser) -> Callable[..., Any]:
    """A dependency: the request body, JSON or YAML, parsed as the CLI parses
    a file. One over a definition's size holds one of the places for large
    bodies until its command returns: let go once parsed, a list waiting
    for the write lock kept its memory past the two (eight of 3.7 MB took a
    server to a gigabyte; hostile test)."""

    async def parsed(request: Request) -> AsyncIterator[Any]:
        coding = request.headers.get("content-encoding", "").strip().lower()
        if coding not in ("", "identity"):
            # Read as it came: a gzip body was refused as "not UTF-8 text",
            # and one said to be gzip that was not was taken (hostile test).
            raise EncodedBody(f"{BODY}: sent as {shown(coding)} (Content-Encoding); send it as is")
        places: threading.BoundedSemaphore = request.app.state.large_body_places
        large = False
        try:
            raw = bytearray()
            with anyio.CancelScope() as receiving:
                async for chunk in request.stream():
                    raw += chunk
                    if len(raw) > limit:
                        raise InputError(f"{BODY}: larger than {limit // 1024} KiB")
                    # A place is taken as the body grows past a definition's
                    # size, not once it has all come: sixteen clients each
                    # sending 60 MB were held in memory together before any
                    # was refused. From then on the body has a deadline.
                    if not large and len(raw) > MAX_INPUT_BYTES:
                        if not places.acquire(blocking=False):
                            raise TooBusy(
                                f"{MAX_LARGE_BODIES} bodies over {MAX_INPUT_BYTES // 1024} KiB "
                                "are already being read or written here; try again"
                            )
                        large = True
                        receiving.deadline = anyio.current_time() + LARGE_BODY_SECONDS
            if receiving.cancelled_caught:
                raise TooSlow(
                    f"{BODY}: over {MAX_INPUT_BYTES // 1024} KiB, it did not all come within "
                    f"{LARGE_BODY_SECONDS:g} s"
                )
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"{BODY}: not UTF-8 text") from None
            # In a thread: YAML is read in Python, seconds for a megabyte, and on
            # the event loop that held up every other request (hostile test).
            yield await run_in_threadpool(parse, text, BODY, instead=SEND_A_DOCUMENT, limit=limit)
        finally:
            if large:
                places.release()

    return parsed


# Held until the command returns, not until its answer is sent: an answer sent
# as it is built (an apply's) waits on its client, who may not read it.
Document = Annotated[Any, Depends(document(MAX_INPUT_BYTES, parse_document), scope="function")]
Changes = Annotated[Any, Depends(document(MAX_CHANGES_BYTES, parse_changes), scope="function")]


Fields = TypeVar("Fields", bound=BaseModel)


def fields(kind: type[Fields], data: Any) -> Fields:
    """A body validated as ``kind``; a problem is one line, as the CLI words it."""
    try:
        return kind.model_validate(data)
    except ValidationError as error:
        raise InputError(f"{BODY}: {describe(error)}") from None


class RollbackBody(BaseModel):
    """What ``catalog-es rollback`` takes as options."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    to: Annotated[int | str, one_of("a revision (a whole number ≥ 0) or a UTC time")]
    model: str | None = None
    only: str | None = None
    dry_run: bool = False


# Request bodies are documented in the schema by hand, since they are parsed
# from the raw body (see ``document``); these are the models they follow.
_BODY_MODELS: dict[str, type[BaseModel]] = {}


def body_schema(schema: dict[str, Any], description: str) -> dict[str, Any]:
    content = {media: {"schema": schema} for media in ("application/json", "application/yaml")}
    return {"requestBody": {"required": True, "description": description, "content": content}}


def body_of(model: type[BaseModel], description: str) -> dict[str, Any]:
    _BODY_MODELS[model.__name__] = model
    return body_schema({"$ref": f"#/components/schemas/{model.__name__}"}, description)


_CHANGE_MODELS: dict[str, type[BaseModel]] = {
    "add": ModelInput,
    "scale": ScaleChange,
    "resources": ResourcesChange,
    "class": ClassChange,
    "owner": OwnerChange,
    "adapters": AdaptersChange,
    "source": SourceChange,
}


def _changes_schema() -> dict[str, Any]:
    named = {
        "type": "object",
        "properties": {"name": NAME_SCHEMA},
        "required": ["name"],
        "additionalProperties": False,
    }
    properties: dict[str, Any] = {
        "remove": {"oneOf": [NAME_SCHEMA, named], "description": "a model's name"}
    }
    for kind, model in _CHANGE_MODELS.items():
        _BODY_MODELS[model.__name__] = model
        properties[kind] = {"$ref": f"#/components/schemas/{model.__name__}"}
    item = {
        "type": "object",
        "minProperties": 1,
        "maxProperties": 1,
        "properties": properties,
        "additionalProperties": False,
    }
    changes = {"type": "array", "minItems": 1, "maxItems": MAX_CHANGES, "items": item}
    wrapped = {
        "type": "object",
        "properties": {"changes": changes},
        "required": ["changes"],
        "additionalProperties": False,
    }
    return {"oneOf": [changes, wrapped]}


class ErrorBody(BaseModel):
    """What every refusal and failure answers: one line saying why."""

    error: str


# What each error status means here, for the schema. Every one answers an
# ErrorBody: FastAPI's own shape for a request it cannot read is never sent.
_ERROR_MEANINGS = {
    401: "No token, or one that is not valid (unknown or revoked).",
    403: "The token's role does not allow this.",
    404: "No such model (now, or at the revision or time asked).",
    408: "A body over a megabyte did not all come within a minute.",
    409: "If-Match: the log is not at that revision (it has moved past it, never "
    "reached it, skipped it, or its last events were deleted by hand since); read again "
    "and retry.",
    415: "The body was sent in a content coding (Content-Encoding): send it as is.",
    422: "Refused: the request, or the change it asks for. Nothing was written.",
    500: "The server's fault, or a log edited by hand; the server's log says more. Or a "
    "write's outcome is unknown (its commit failed once begun): read the log before "
    "sending it again, or send it with If-Match.",
    503: "Busy, or the database out of reach: try again (Retry-After).",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The schema's word for the error answers ``statuses``."""
    return {s: {"model": ErrorBody, "description": _ERROR_MEANINGS[s]} for s in statuses}


# Writes: the role, and If-Match; and those with a body, its deadline.
WRITE_ERRORS = errors(403, 409)
BODY_ERRORS = {**WRITE_ERRORS, **errors(408, 415)}


# -- the routes --------------------------------------------------------------------

route = APIRouter(responses=errors(401, 422, 500, 503))
MODEL = "/models/{name:path}"
# The name in a path: a `/` in it sent as `%2F` (docs/console.md).
ModelName = Annotated[str, Path(json_schema_extra=NAME_SCHEMA)]
# The name history reads: any a path holds but a line break
# (_check_path_and_query), for a poison record, written by hand, may name a
# model no command could, and history tells of it (tests/test_poison.py).
RecordedName = Annotated[str, Path(json_schema_extra={"type": "string", "pattern": r"^[^\n]*$"})]


@route.get("/me", tags=["auth"])
def who_am_i(caller: Reader) -> Response:
    """The actor and role of the token sent."""
    return respond({"actor": caller.actor, "role": caller.role.name})


@route.get("/revision", tags=["queries"])
def head(caller: Reader, models: Service) -> Response:
    """The head of the log: the revision of the last change; refused (500)
    while the log's last events are deleted, as `catalog-es revision` is."""
    # Caught up first, as every read is: the node tells what it finds in the
    # log (another config's writes, a log gone back) at a request.
    models.refresh()
    revision = models.head()
    return respond({"revision": revision}, revision)


def _head_or(models: Models, past: int | None) -> int:
    """``past``, or the head as it is now, other nodes' writes included (a
    head this node has not caught up with would tag what it answers older
    than it is, and the If-Match sent back would fail for nothing)."""
    if past is not None:
        return past
    models.refresh()
    return models.revision


def _read_at(
    models: Models, at: int | datetime | None, declared_then: bool
) -> tuple[int | None, int]:
    """The revision a read asks for (``None``: now) and the one its answer is
    tagged with. ``declared=then`` reads the past only."""
    if declared_then and at is None:
        raise InputError("declared=then reads the past: give at too")
    past = None if at is None else models.resolve(at)
    return past, _head_or(models, past)


@route.get("/models", tags=["models"])
def list_models(caller: Reader, models: Service, at: At, declared_then: DeclaredThen) -> Response:
    """Every model in force (or at a revision or time), declared and runtime,
    as `model list --json` prints them."""
    # The head is read before the list: if a change lands in between, the
    # header is the older revision, so an If-Match sent back can only fail
    # (409), never overwrite a change its sender did not see.
    past, revision = _read_at(models, at, declared_then)
    # Sent as it is built: 100,000 models answered whole took 133 MB, held
    # for as long as a client did not read.
    return StreamingResponse(
        json_in_pieces(
            escaped_json, b",", models.models_as_read(past, declared_then=declared_then)
        ),
        media_type="application/json",
        headers=revision_headers(revision),
    )


@route.get(MODEL, tags=["models"], responses=errors(404))
def show_model(
    name: ModelName, caller: Reader, models: Service, at: At, declared_then: DeclaredThen
) -> Response:
    """One model as it will run (or as it was at a revision or time)."""
    past, revision = _read_at(models, at, declared_then)
    return respond(models.get_model(name, past, declared_then=declared_then), revision)


@route.post(
    "/models",
    tags=["commands"],
    responses=BODY_ERRORS,
    openapi_extra=body_of(ModelInput, "A model definition, as `model add` takes it."),
)
def add_model(
    caller: Writer,
    spec_data: Document,
    models: Service,
    expected: ExpectedRevision,
    reason: Reason,
    _place: WritePlace,
) -> Response:
    """Add a model, or replace the definition of a runtime one (`replaced`)."""
    spec = model_from_data(spec_data, BODY)
    return command_response(models.add(spec, **command_meta(caller, reason, expected)))


@route.delete(MODEL, tags=["commands"], responses={**WRITE_ERRORS, **errors(404)})
def remove_model(
    name: ModelName,
    caller: Writer,
    models: Service,
    expected: ExpectedRevision,
    reason: Reason,
    _place: WritePlace,
) -> Response:
    """Take a runtime model out of the catalog."""
    return command_response(models.remove(name, **command_meta(caller, reason, expected)))


# The per-model commands share one shape: the name in the path, the fields
# in the body, a call of the service.
Run = Callable[[Models, str, Fields, dict[str, Any]], CommandResult]


def model_command(verb: str, kind: type[Fields], summary: str, body: str, run: Run[Fields]) -> None:
    """Register ``POST /models/NAME/<verb>``, as ``catalog-es model <verb> NAME``."""

    def command(
        name: ModelName,
        caller: Writer,
        data: Document,
        models: Service,
        expected: ExpectedRevision,
        reason: Reason,
        _place: WritePlace,
    ) -> Response:
        meta = command_meta(caller, reason, expected)
        return command_response(run(models, name, fields(kind, data), meta))

    route.post(
        f"{MODEL}/{verb}",
        tags=["commands"],
        name=f"model {verb}",
        summary=summary,
        responses={**BODY_ERRORS, **errors(404)},
        openapi_extra=body_of(kind, body),
    )(command)


model_command(
    "scale",
    ScaleFields,
    "Replica bounds; a bound left out keeps its value",
    "`min`, `max`, or both.",
    lambda models, name, body, meta: models.scale(name, body.min, body.max, **meta),
)
model_command(
    "resources",
    ResourcesFields,
    "What a profile reserves of a node",
    "Memory and cores of one profile (default: every profile).",
    lambda models, name, body, meta: models.set_resources(
        name, profile=body.profile, memory_gb=body.memory_gb, cpu_cores=body.cpu_cores, **meta
    ),
)
model_command(
    "class",
    ClassFields,
    "The capacity class",
    'critical, standard, opportunistic, or "" for what the scaling implies.',
    lambda models, name, body, meta: models.set_class(name, body.capacity_class, **meta),
)
model_command(
    "owner",
    OwnerFields,
    "The owner",
    'org:ID, team:ID, project:ID, or "" for shared.',
    lambda models, name, body, meta: models.set_owner(name, body.owner, **meta),
)
model_command(
    "adapters",
    AdaptersFields,
    "Replace the LoRA adapters a runtime model serves",
    "The new set (`[]` for none).",
    lambda models, name, body, meta: models.set_adapters(name, body.to_adapters(), **meta),
)
model_command(
    "source",
    SourceFields,
    "Move a runtime model to other weights",
    "The weights' location and where they came from.",
    lambda models, name, body, meta: models.set_source(name, body.source, body.to_origin(), **meta),
)


@route.post(
    "/apply",
    tags=["commands"],
    responses=BODY_ERRORS,
    openapi_extra=body_schema(
        _changes_schema(), "A list of changes, each one key (as a `catalog-es apply` file)."
    ),
)
def apply_changes(
    caller: Writer,
    data: Changes,
    models: Service,
    expected: ExpectedRevision,
    reason: Reason,
    _place: WritePlace,
) -> Response:
    """Several changes in one transaction, all or nothing."""
    steps = changes_from_data(data, BODY)
    result = models.apply_changes(steps, **command_meta(caller, reason, expected))
    head = {key: result[key] for key in ("revision", "changes")}
    # Sent as it is built, so that a client that does not read holds only
    # what the connection buffers, not the whole answer.
    return StreamingResponse(
        json_in_pieces(escaped_json, b",", result["models"], head, "models"),
        media_type="application/json",
        headers=revision_headers(result["revision"]),
    )


@route.get("/diff", tags=["revisions"])
def diff(
    caller: Reader,
    models: Service,
    since: Annotated[str, Query(description="A revision or UTC time.")],
    until: Annotated[str | None, Query(description="Default: now.")] = None,
    model: Annotated[
        str | None, Query(description="Only this model.", json_schema_extra=NAME_TEXT)
    ] = None,
    declared_then: DeclaredThen = False,
) -> Response:
    """What changed from one revision (or time) to another, as `diff --json`."""
    later = None if until is None else query_time(until, revision_or_time)
    earlier = query_time(since, revision_or_time)
    result = models.diff(earlier, later, model=model, declared_then=declared_then)
    return respond(result, result["to"])


@route.post(
    "/rollback",
    tags=["revisions"],
    responses=BODY_ERRORS,
    openapi_extra=body_of(RollbackBody, "Where to go back to; `dry_run` writes nothing."),
)
def rollback(
    request: Request,
    caller: Reader,
    data: Document,
    models: Service,
    expected: ExpectedRevision,
    reason: Reason,
) -> Response:
    """Make the runtime catalog what it was at a revision, by compensating
    events in one transaction. Needs the admin role, except a dry run (a diff)."""
    body = fields(RollbackBody, data)
    if not body.dry_run and caller.role < Role.admin:
        raise forbidden(caller, "a rollback needs admin")
    to = body.to if isinstance(body.to, int) else revision_or_time(body.to)
    # A dry run reads; a rollback waits for the write lock as any write does.
    with nullcontext() if body.dry_run else write_place(request):
        result = models.rollback(
            to,
            model=body.model,
            only=body.only,
            dry_run=body.dry_run,
            **command_meta(caller, reason, expected),
        )
    return respond(result, result["revision"])


@route.get("/sources", tags=["queries"])
def sources(caller: Reader, models: Service, at: At, declared_then: DeclaredThen) -> Response:
    """Each weights source, and the models and adapters using it (now, or at
    a revision or time)."""
    past, revision = _read_at(models, at, declared_then)
    return respond(models.sources(past, declared_then=declared_then), revision)


def _in_digits(value: object) -> object:
    """A whole number in a query, as text, refused unless :func:`in_digits`
    (``+5`` is `` 5`` in a query)."""
    if isinstance(value, str) and not in_digits(value):
        raise PydanticCustomError("digits", "expected a whole number in digits alone")
    return value


# A whole-number query parameter (with Query's bounds beside it).
InDigits = BeforeValidator(_in_digits)


@route.get("/log", tags=["queries"])
def log_events(
    caller: Reader,
    models: Service,
    after: Annotated[
        int, Query(ge=0, le=MAX_REVISION, description="Only events after this revision."), InDigits
    ] = 0,
    limit: Annotated[
        int | None,
        Query(ge=1, le=MAX_ANSWER_ROWS, description=f"At most this many (≤ {MAX_ANSWER_ROWS})."),
        InDigits,
    ] = None,
    model: Annotated[
        str | None, Query(description="Only this model's events.", json_schema_extra=NAME_TEXT)
    ] = None,
    # No actor is empty (check_actor_filter), so neither is the filter.
    by: Annotated[
        str | None,
        Query(description="Only this actor's events.", json_schema_extra=text(minLength=1)),
    ] = None,
) -> Response:
    """The stored events with their revisions, oldest first (`log --json`, as a
    list); more than a page of them is refused: page with `after` and `limit`."""
    try:
        events = list(
            models.log_events(
                after=after,
                limit=limit or MAX_ANSWER_ROWS + 1,
                model=model,
                by=by,
                max_bytes=MAX_ANSWER_BYTES,
            )
        )
    except AnswerTooLarge:
        raise InputError(
            f"the events after revision {after} hold more than {MAX_ANSWER_BYTES:,} bytes: "
            "page with after and a smaller limit"
        ) from None
    if len(events) > MAX_ANSWER_ROWS:
        raise InputError(
            f"more than {MAX_ANSWER_ROWS:,} events after revision {after}: page with after "
            f"and limit (at most {MAX_ANSWER_ROWS:,})"
        )
    return respond(events)


@route.get("/skipped", tags=["queries"])
def skipped(caller: Reader, models: Service) -> Response:
    """Stored events the catalog in force leaves out, and why."""
    return respond([msgspec.to_builtins(s) for s in models.skipped()])


def resume_point(said: str, given: str | None, example: str) -> int | None:
    """The revision a reconnecting watch resumes after, as ``said`` (a header
    or a query parameter) gives it: digits alone, as If-Match takes them. Other
    text is refused, not ignored: the stream would replay from the start, or
    from ``from``, and the client take changes it has seen for new ones."""
    if given is None:
        return None
    revision = whole_number(given)
    if revision is not None:
        return revision
    if given.isascii() and given.isdigit():
        raise InputError(f"{said} {shown(given)}: past any revision a log can hold")
    raise InputError(f"{said} {shown(given, 40)}: not a revision (e.g. {example})")


@route.get(
    "/events",
    tags=["revisions"],
    response_class=Response,
    responses={200: {"content": {"text/event-stream": {}}, "description": "Server-sent events"}},
)
def watch(
    request: Request,
    caller: Reader,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    models: Service,
    after: Annotated[
        int | None,
        Query(alias="from", ge=0, le=MAX_REVISION, description="Every change after this revision."),
        InDigits,
    ] = None,
    last_event_id: Annotated[
        str | None,
        Header(
            description="The revision a reconnecting EventSource resumes after (the last "
            "`id` it was given), in digits; over `from` and `lastEventId`."
        ),
    ] = None,
    # Where EventSource polyfills that send a token put it, reconnecting.
    last_event_id_query: Annotated[
        str | None,
        Query(
            alias="lastEventId",
            description="`Last-Event-ID`, where a client that cannot send it puts it: over `from`.",
        ),
    ] = None,
    # No actor is empty (check_actor_filter), so neither is the filter.
    by: Annotated[
        str | None,
        Query(description="Only this actor's changes.", json_schema_extra=text(minLength=1)),
    ] = None,
) -> Response:
    """Every change after a revision, in order, then live, as server-sent
    events: `id` is the revision, `data` the event as `watch --json` prints it;
    given `by`, only that actor's. A reconnecting EventSource resumes after
    its Last-Event-ID."""
    if len(request.headers.getlist("last-event-id")) > 1:
        # Which one counts would be a guess a proxy and this server may make apart.
        raise InputError("more than one Last-Event-ID header: send one")
    # Both read, so that a bad one is told rather than hidden by the other; the
    # header wins, as an EventSource sends it on reconnecting.
    in_query = resume_point("lastEventId", last_event_id_query, "lastEventId=12")
    # White space around a header's value is not part of it (nor is it of If-Match's).
    header = None if last_event_id is None else last_event_id.strip()
    in_header = resume_point("Last-Event-ID", header, "Last-Event-ID: 12")
    resumed = in_header if in_header is not None else in_query
    if resumed is not None:
        after = resumed
    tokens: TokenStore = request.app.state.tokens
    assert credentials is not None  # the caller was verified by it
    token = credentials.credentials
    # Made before a place is taken (it holds nothing until read): a request
    # it refuses (an empty actor, a revision past the head) is told so, not
    # "try again later" while every place is taken, and takes no place.
    changes = models.watch(after or 0, by=by)
    places: StreamPlaces = request.app.state.stream_places
    head = HEAD_ASKED in request.scope
    # A HEAD starts no watch: it takes no place.
    give_back = _nothing_to_give_back if head else places.take()
    if give_back is None:
        raise TooBusy(
            f"{places.most} watches are open here, as many as this server serves "
            "(serve --max-watches); try again later"
        )
    return event_stream(
        changes,
        request.app.state.closing,
        lambda: tokens.verify(token) is not None,
        head=head,
        give_back=give_back,
    )


def _nothing_to_give_back() -> None:
    pass


# -- the audit trail ---------------------------------------------------------------


def change_filters(
    # No actor is empty (check_filters), so neither is the filter.
    by: Annotated[
        str | None, Query(description="Only this actor's.", json_schema_extra=text(minLength=1))
    ] = None,
    event: Annotated[
        str | None,
        Query(
            alias="type",
            description="Only this event type (e.g. `Scaled`; `Declared`, `Redeclared`, "
            "`Undeclared`: what a declared-config record did to a model's declared definition; "
            "`ConfigDeclared` in the audit; `Rollback`, `Apply`, `CheckUpdates` in the refusals).",
        ),
    ] = None,
    since: Annotated[
        str | None, Query(description="From this UTC time (or date) on, inclusive.")
    ] = None,
    until: Annotated[str | None, Query(description="Before this UTC time (or date).")] = None,
    limit: Annotated[
        int | None,
        Query(
            ge=1, le=MAX_ANSWER_ROWS, description=f"Only the most recent N (≤ {MAX_ANSWER_ROWS})."
        ),
        InDigits,
    ] = None,
) -> ChangeFilters:
    """The filters of ``catalog-es history``, read as it reads them."""
    return ChangeFilters(
        by=by,
        event_type=None if event is None else event_type(event, "type"),
        since=None if since is None else query_time(since, lambda text: utc_time(text, "since")),
        until=None if until is None else query_time(until, lambda text: utc_time(text, "until")),
        limit=limit,
    )


ChangeFilterParams = Annotated[ChangeFilters, Depends(change_filters)]


def audit_filters(
    filters: ChangeFilterParams,
    # Any name but an empty one (check_filters): a poison record, written by
    # hand, may name a model no command could, and the audit shows it.
    model: Annotated[
        str | None, Query(description="Only this model.", json_schema_extra=text(minLength=1))
    ] = None,
) -> Filters:
    """The filters of ``catalog-es audit`` and ``refusals``, read as they read them."""
    return {**filters, "model": model}


AuditFilters = Annotated[Filters, Depends(audit_filters)]


@route.get("/history/{name:path}", tags=["audit"], responses=errors(404))
def history(
    name: RecordedName, caller: Reader, models: Service, filters: ChangeFilterParams
) -> Response:
    """Every change to one model, oldest first, field by field (before → after),
    the config deploys that declared, changed or dropped it among them,
    filtered; more than a page of them is refused: give `limit`, or narrow them."""
    return respond_json(
        models.history_json(
            name, at_most=MAX_ANSWER_ROWS, at_most_bytes=MAX_ANSWER_BYTES, **filters
        )
    )


@route.get("/audit", tags=["audit"])
def audit(caller: Reader, models: Service, filters: AuditFilters) -> Response:
    """Changes across the catalog, oldest first, filtered; more than a page of
    them is refused: give `limit`, or narrow them."""
    return respond_json(
        models.audit_json(at_most=MAX_ANSWER_ROWS, at_most_bytes=MAX_ANSWER_BYTES, **filters)
    )


@route.get("/refusals", tags=["audit"])
def refusals(caller: Reader, models: Service, filters: AuditFilters) -> Response:
    """Commands that were refused: who tried what, and why. They changed
    nothing. More than a page of them is refused: give `limit`, or narrow them."""
    return respond(models.refusals(at_most=MAX_ANSWER_ROWS, **filters))


@route.get("/verify", tags=["audit"])
def verify(caller: Reader, models: Service) -> Response:
    """Walk the hash chain over the log: `ok`, or the first revision altered,
    removed or moved (`broken`); and the events load skips. A broken chain is
    still a 200: the report is the answer."""
    return respond(models.verify())


# -- the application -------------------------------------------------------------


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            components = document.setdefault("components", {}).setdefault("schemas", {})
            for name, model in _BODY_MODELS.items():
                model_schema = model.model_json_schema(
                    by_alias=True, ref_template="#/components/schemas/{model}"
                )
                components.update(model_schema.pop("$defs", {}))
                components[name] = model_schema
            app.openapi_schema = document
        return app.openapi_schema

    return schema


def _allowed(request: Request) -> str:
    """The methods the path of a request refused with 405 takes: of every
    route it matches (Starlette names the first one's only), HEAD with GET
    (:class:`_HeadAsGet`)."""
    methods: set[str] = set()
    # Matched from the app's root: a refusal of the console's files comes
    # with the mount's root instead.
    scope = {**request.scope, "root_path": request.scope.get("app_root_path", "")}
    for candidate in request.app.router.routes:
        if candidate.matches(scope)[0] == Match.NONE:
            continue
        if isinstance(candidate, Route):
            methods |= candidate.methods or set()
        elif isinstance(candidate, Mount):
            methods.add("GET")  # the console's files
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join(sorted(methods))


def _errors(app: FastAPI) -> None:
    @app.exception_handler(Refused)
    async def refused(_request: Request, refusal: Refused) -> Response:
        status = _status(refusal)
        return error_response(status, str(refusal), {"Retry-After": "1"} if status == 503 else None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        headers = error.headers
        if error.status_code == 405:
            headers = {**(headers or {}), "Allow": _allowed(request)}
        return error_response(error.status_code, str(error.detail), headers)

    @app.exception_handler(ClientDisconnect)
    async def gone(request: Request, _error: ClientDisconnect) -> Response:
        # Not the server's fault, nor worth a traceback: anyone could fill
        # the log with them by hanging up mid-body (hostile test).
        log.info(
            "%s %s: the client went away before its body came", request.method, request.url.path
        )
        return error_response(400, "the request's body did not all come")

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, error: RequestValidationError) -> Response:
        return error_response(422, describe_problems(list(error.errors())))

    @app.exception_handler(OutcomeUnknown)
    async def outcome_unknown(request: Request, error: OutcomeUnknown) -> Response:
        # Not 503 and Retry-After: the write may stand, and sent again
        # without If-Match it would be made twice. The client reads the log
        # (or sends it again with If-Match, which a write that stood refuses).
        log.warning("%s %s: %s", request.method, request.url.path, error)
        return error_response(500, error.message)

    @app.exception_handler(sa.exc.DBAPIError)
    async def database_error(request: Request, error: sa.exc.DBAPIError) -> Response:
        unusable = database_unusable(error)
        if unusable is None:
            raise error  # to the handler of the unexpected
        # What the driver said is for the server's log (one line), not for
        # clients. Down, restarting or failing over: try again later; set up
        # wrong (privileges, schema): not until an operator mends it.
        log.warning("%s %s: %s", request.method, request.url.path, unusable.told)
        if unusable.lasting:
            return error_response(500, "the database could not be used; the server's log says why")
        return error_response(
            503, "the database could not be used; try again", {"Retry-After": "1"}
        )

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, _error: Exception) -> Response:
        # Outside every other middleware: the guard's headers are given here.
        # Starlette logs the traceback after this answer.
        return error_response(
            500, "internal error; the server's log tells what happened", GUARD_HEADERS
        )


# Every answer's: never framed by another site's page (the console's buttons
# could be clicked through a frame), never read as another type than it says,
# and, outside the console's own files, never kept by a browser's cache once
# signed out (a catalog, its actors).
GUARD_HEADERS = {
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
# The console's own files are kept, but asked for again before each use (a
# 304 when unchanged): saying nothing, they were used for a tenth of their
# age without asking, an upgraded server's API driven by the old page.
CONSOLE_FILES_CACHE = "no-cache"


class _Guarded:
    """:data:`GUARD_HEADERS` on every answer the app makes; the console's
    files may be cached (:data:`CONSOLE_FILES_CACHE`), and an answer saying
    how keeps its own word."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        console_file = scope["path"].startswith("/console/")

        async def guarded(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in GUARD_HEADERS.items():
                    if name in headers:
                        continue  # the answer said how itself
                    cached = name == "Cache-Control" and console_file
                    headers[name] = CONSOLE_FILES_CACHE if cached else value
            await send(message)

        await self.app(scope, receive, guarded)


# In a request's scope when it was a HEAD answered as GET: what would only
# make a body (a stream's watch) is left undone.
HEAD_ASKED = "catalog_es.head"


class _HeadAsGet:
    """HEAD answered as GET is, headers only: a server that answers GET must
    answer HEAD (RFC 9110), and monitors and ``curl -I`` ask with it, but a
    FastAPI route takes only the methods it names. The body is dropped here,
    whatever the server does, and ``/events`` starts no watch."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        answered = False

        async def headers_only(message: Message) -> None:
            nonlocal answered
            if answered:
                return
            if message["type"] == "http.response.body":
                answered = True
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET", HEAD_ASKED: True}, receive, headers_only)


def end_streams(app: FastAPI) -> None:
    """Tell the open watch streams to end: the server is shutting down."""
    closing: threading.Event = app.state.closing
    closing.set()


def create_app(models: Models, tokens: TokenStore, *, max_watches: int = MAX_WATCHES) -> FastAPI:
    """The API and the console over one service and one tokens file;
    ``max_watches``: the event streams it keeps open at once, at most."""
    app = FastAPI(
        title="catalog-es",
        version=version("catalog-es"),
        description="The model catalog of an LLM-serving gateway, kept as an event-sourced log. "
        "Every command answers the revision it wrote (also in `ETag` and "
        f'`{REVISION_HEADER}`); errors are `{{"error": "..."}}`.',
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.models = models
    app.state.tokens = tokens
    app.state.closing = threading.Event()  # set by ``end_streams``
    app.state.stream_places = StreamPlaces(max_watches)
    app.state.write_places = threading.BoundedSemaphore(MAX_WRITES_WAITING)
    app.state.large_body_places = threading.BoundedSemaphore(MAX_LARGE_BODIES)
    _errors(app)
    # The routes themselves, analysed once as the module was imported: an
    # included router is analysed again for each app, at its first request
    # (60-130 ms of CPU, paid by every test's app).
    app.router.routes.extend(route.routes)
    app.add_middleware(_Guarded)
    app.add_middleware(_HeadAsGet)
    app.mount(
        "/console",
        StaticFiles(packages=[("catalog_es.web", "console")], html=True),
        name="console",
    )

    @app.get("/", include_in_schema=False)
    def home() -> RedirectResponse:
        return RedirectResponse("/console/")

    @app.get("/openapi.json", include_in_schema=False)
    def schema() -> JSONResponse:
        # Public, and read by /docs from an origin of its own.
        return JSONResponse(app.openapi(), headers={"Access-Control-Allow-Origin": "*"})

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        # Swagger UI is a CDN's script. Sandboxed, the page has an origin of
        # its own: it cannot read the token the console keeps in this
        # origin's session storage (it could; hostile test), and its "Try it
        # out" does not reach the API (curl does, or the console).
        page = get_swagger_ui_html(openapi_url="/openapi.json", title="catalog-es API")
        page.headers["Content-Security-Policy"] = (
            "sandbox allow-scripts allow-popups; frame-ancestors 'none'"
        )
        return page

    app.openapi = _openapi(app)  # type: ignore[method-assign]
    return app
