"""The audit side of :class:`catalog_es.application.Models`: who changed what and
when, who was refused, and whether the log is still the one that was written.

Queries return plain data (the shapes documented in docs/audit.md). Refused
commands are recorded here too, apart from the log: they have no revision and
never change the catalog.
"""

from __future__ import annotations

import errno
import logging
import tempfile
from collections.abc import Iterator, Sequence, Sized
from contextlib import closing, contextmanager
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

import msgspec
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from catalog_es.chain import check_chain
from catalog_es.collector import collector_paused
from catalog_es.configuration import DeclaredConfig
from catalog_es.errors import (
    DamagedLog,
    DamagedReadModel,
    InputError,
    ModelNotFound,
    Refused,
    StorageBusy,
    cut_short,
    first_line,
)
from catalog_es.inputs import check_actor_filter
from catalog_es.model import Model, utc_now, utc_text
from catalog_es.names import carried
from catalog_es.persistence import AnswerTooLarge, SQLRecorder
from catalog_es.storage.schema import refusals_table
from catalog_es.values import zoned
from catalog_es.views import refused_fields
from projections.audit import (
    AuditProjection,
    AuditView,
    ChangeFilters,
    Filters,
    ValuesReader,
    filter_text,
    listed,
    select_rows,
    stored_time,
)
from projections.snapshots import taken_since

if TYPE_CHECKING:
    from catalog_es.catalog import Skipped

log = logging.getLogger("catalog_es")

# What a query's views are read into: a list, or a spool (:class:`Spooled`).
Views = TypeVar("Views", bound=Sized)


class AuditTrail:
    """Mixed into :class:`catalog_es.application.Models`, whose store, declared
    config and name it uses."""

    name: str
    store: SQLRecorder
    declared: DeclaredConfig

    if TYPE_CHECKING:

        def skipped(self) -> list[Skipped]: ...

    @cached_property
    def _audit(self) -> AuditProjection:
        view = AuditView(self.store, self.declared.fingerprint)
        return AuditProjection(view, self.declared)

    def history(self, name: str, **filters: Unpack[ChangeFilters]) -> list[dict[str, Any]]:
        """Every stored event about one model matching the filters given (as
        :meth:`audit` takes them), and every config record's change of its
        declared definition, oldest first, with the field-level change it
        made (or why load skips it)."""
        return _rows(self._history_views(name, {**filters, "model": name}, listed))

    def history_rows(self, name: str, **filters: Unpack[ChangeFilters]) -> Iterator[dict[str, Any]]:
        """:meth:`history`, each row decoded as it is asked for, once every
        row is found sound (:class:`Spooled`)."""
        return self._history_views(name, {**filters, "model": name}, Spooled.read).rows()

    def history_json(
        self,
        name: str,
        *,
        at_most: int | None = None,
        at_most_bytes: int | None = None,
        **filters: Unpack[ChangeFilters],
    ) -> bytes:
        """:meth:`history` as JSON, as :meth:`audit_json` answers (``at_most``
        and ``at_most_bytes`` as its)."""
        wanted: Filters = {**filters, "model": name}
        views = self._history_views(name, _one_more(wanted, at_most), listed, at_most_bytes)
        _within(len(views), wanted, at_most)
        return _json(views)

    def _history_views(
        self,
        name: str,
        filters: Filters,
        into: ValuesReader[Views],
        at_most_bytes: int | None = None,
    ) -> Views:
        check_history_name(name)
        views = self._views(filters, into, at_most_bytes, query="history")
        # A name the rows do not mention was never in the log, nor in a
        # config it recorded (a config record has a row for each model it
        # declares anew): one indexed read, not the records read through.
        declared = any(m.name == name for m in self.declared.models)
        if views or declared or self._audit.view.mentions(self.name, name):
            return views
        raise _no_history(name)

    def audit(self, **filters: Unpack[Filters]) -> list[dict[str, Any]]:
        """The audit rows matching every filter given (``model``, ``by``,
        ``event_type``, ``since`` inclusive, ``until`` exclusive), oldest first;
        with a ``limit``, the most recent ones."""
        return _rows(self._views(filters, listed))

    def audit_rows(self, **filters: Unpack[Filters]) -> Iterator[dict[str, Any]]:
        """:meth:`audit`, each row decoded as it is asked for, once every row
        is found sound (:class:`Spooled`): what the CLI writes out a row at a
        time."""
        return self._views(filters, Spooled.read).rows()

    def audit_json(
        self,
        *,
        at_most: int | None = None,
        at_most_bytes: int | None = None,
        **filters: Unpack[Filters],
    ) -> bytes:
        """:meth:`audit` as the JSON array it encodes to, made without building
        the rows (what the HTTP API sends): most of a large answer's time is
        building them. ``at_most``: asked without a ``limit``, an answer of
        more rows than this is refused rather than built; ``at_most_bytes``:
        one of rows holding more than this in all is refused, limit or not,
        their sizes read before any row (one row is always answered)."""
        views = self._views(_one_more(filters, at_most), listed, at_most_bytes)
        _within(len(views), filters, at_most)
        return _json(views)

    def _views(
        self,
        filters: Filters,
        into: ValuesReader[Views],
        at_most_bytes: int | None = None,
        query: str = "audit",
    ) -> Views:
        """Each matching row as the JSON it is stored as, read by ``into``;
        ``query``: which (:data:`~catalog_es.names.QUERY_TYPES`), for the event types its rows
        carry."""
        check_filters(filters, query)
        try:
            return self._audit.answer(self.store, self.name, filters, into, at_most_bytes)
        except AnswerTooLarge:
            raise InputError(
                f"the rows that match hold more than {at_most_bytes:,} bytes: give a smaller "
                f"limit, or narrow them with {_narrowing(filters)}"
            ) from None

    def rebuild_audit(self) -> None:
        """Drop the audit tables and build them again from the log."""
        self._audit.rebuild(self.store, self.name)

    def refusals(
        self, *, at_most: int | None = None, **filters: Unpack[Filters]
    ) -> list[dict[str, Any]]:
        """Refused commands matching every filter given, as :meth:`audit` takes
        them (``at_most`` as :meth:`audit_json`'s)."""
        check_filters(filters, "refusals")
        with self.store.read() as conn:
            rows = select_rows(
                conn, refusals_table, (refusals_table.c.id,), _one_more(filters, at_most)
            )
        _within(len(rows), filters, at_most)
        return [
            {
                "id": row.id,
                "time": utc_text(row.time),
                "by": row.actor,
                "model": row.model or None,  # none: the whole catalog (a rollback, a list)
                "event": row.event,
                "refusal": row.refusal,
                "reason": row.reason,
                "fields": refused_fields(row.event, row.fields),
            }
            for row in rows
        ]

    def verify(self) -> dict[str, Any]:
        """Walk the hash chain: the first revision altered, removed or moved,
        if any; and the events load skips, with why."""
        with self.store.read() as conn:
            report = check_chain(
                self.store.scan_chain(conn),
                self.store.chain_head(conn),
                self.store.scan_streams(conn),
                gapless=self.store.dialect == "sqlite",
            )
            # A snapshot vouches for the log up to it by the hash at its own
            # revision, which an edit before it leaves as it was: one made
            # before the edit goes on giving loads the catalog as it was.
            since = (
                []
                if report.broken is None
                else taken_since(conn, self.declared.fingerprint, report.broken.revision)
            )
        return {
            "ok": report.broken is None,
            "events": report.events,
            "head": msgspec.to_builtins(report.head),
            "broken": msgspec.to_builtins(report.broken),
            "skipped": msgspec.to_builtins(self.skipped()),
            "snapshots_since_break": since,
        }

    def _record_refusal(
        self,
        event_class: type[Model.Event],
        name: str,
        by: str,
        reason: str,
        fields: dict[str, Any],
        refusal: Refused,
    ) -> None:
        """:meth:`record_refusal` of a command that writes one kind of event,
        its fields given as the command's keywords."""
        stored = _stored_names(event_class, fields)
        self.record_refusal(event_class.__name__, name, by, reason, stored, refusal)

    @contextmanager
    def refusals_recorded(
        self, event: str, name: str, by: str, reason: str, fields: dict[str, Any]
    ) -> Iterator[None]:
        """:meth:`record_refusal` of whatever the ``with`` refuses."""
        try:
            yield
        except Refused as refusal:
            self.record_refusal(event, name, by, reason, fields, refusal)
            raise

    def record_refusal(
        self,
        event: str,
        name: str,
        by: str,
        reason: str,
        fields: dict[str, Any],
        refusal: Refused,
    ) -> None:
        """Keep a refused command, in a transaction of its own (the refused one
        has rolled back): ``event``, what it would have written (or the
        command, for one that writes several kinds), about model ``name``
        (empty: the whole catalog). Input that could not be read, a
        database too busy to write to and a log edited past appending to are
        not refusals by the rules and are not kept."""
        if isinstance(refusal, InputError | StorageBusy | DamagedLog):
            return
        row = {
            "time": stored_time(utc_now()),
            "actor": _encodable(by),
            "model": _kept(name, MAX_KEPT_NAME),
            "event": event,
            "refusal": _kept(str(refusal), MAX_KEPT_REFUSAL),
            "reason": _encodable(reason),
            "fields": _kept_fields(fields),
        }
        try:
            with self.store.write_beside() as conn:
                conn.execute(sa.insert(refusals_table).values(row))
        except sa.exc.SQLAlchemyError as error:
            # The refusal itself must reach the operator even if its record
            # cannot: in the driver's first line, not SQLAlchemy's whole
            # message, whose statement and parameters (the command's fields
            # and reason) filled a line of the server's log each time its
            # sessions were ended (hostile test).
            said = first_line(str(getattr(error, "orig", None) or error))
            log.warning("could not record the refusal of %s for %r: %s", event, name, said)


def _no_history(name: str) -> ModelNotFound:
    return ModelNotFound(name, "has no history: it was never in the log or the config")


def check_history_name(name: str) -> None:
    """Refused, as no model's history, without the log: an empty name, which
    filters nothing (every row would be its "history"). Any other is looked
    for: a poison record, written by hand, may name a model no command could."""
    if not name:
        raise _no_history(name)


def check_filters(filters: Filters, query: str) -> None:
    wanted = filters.get("event_type")
    if wanted is not None:
        carried(wanted, query, "type")
    # An empty name is no model's: it matched the declared-config records,
    # which have no model, as if they were one.
    if filters.get("model") == "":
        raise InputError("model: the name is empty; give a model's name, or no model filter")
    check_actor_filter(filters.get("by"))
    since, until = filters.get("since"), filters.get("until")
    if since is not None:
        zoned(since, "since")
    if until is not None:
        zoned(until, "until")
    # A window closed before it opens (the bounds swapped) matched nothing,
    # said as if nothing had been done in it (hostile test).
    if since is not None and until is not None and since >= until:
        raise InputError(
            f"since {utc_text(since)} is not before until {utc_text(until)}: no time lies "
            "between them (since is inclusive, until exclusive)"
        )


def _rows(views: list[str]) -> list[dict[str, Any]]:
    """Rows from their stored views; decoded one by one rather than joined
    into one array first, which copied 8 MB about for 10,000 rows."""
    with collector_paused(lasting=True, cycles=False):
        return list(_decoded(views))


def _decoded(views: list[str] | list[bytes]) -> Iterator[dict[str, Any]]:
    """Each row of ``views``, decoded as it is asked for, its view let go as
    it is (the list is emptied): a caller that writes each row out and drops
    it holds one decoded row at a time, not the whole answer as dicts, its
    before and after definitions several times the size of its JSON (the CLI's
    200,000 rows took 1.4 GB)."""
    views.reverse()
    while views:
        yield _read(_row_decoder, views.pop())


def _checked(views: Sequence[str]) -> Sequence[str]:
    """``views``, once each is found to be one JSON object: a damaged row
    refuses the whole answer before any of it is sent or written, rather
    than cutting it short (an answer streamed out, ``[`` written and the
    rows before it) or sending it as JSON no client can read (the rows
    joined). Checked, not decoded: the values are skipped, not built, about
    a tenth of a decode's time, and nothing is held. A number past a float's
    range is the one thing a decode refuses that this lets through (valid
    JSON, which the HTTP API sends as it is; the CLI stops at it)."""
    for view in views:
        if not isinstance(view, str):
            # SQLite keeps whatever a hand edit put there: a decode took a
            # blob, and the HTTP API's join of the rows then failed as a bug.
            raise _damaged(f"a {type(view).__name__}, not text")
        _read(_row_checker, view)
    return views


def _read(decoder: msgspec.json.Decoder[Any], view: str | bytes) -> Any:
    try:
        return decoder.decode(view)
    except msgspec.DecodeError as error:
        raise _damaged(str(error)) from None
    except RecursionError:  # nested past what a decoder follows: no row of ours is
        raise _damaged("nested too deep") from None


def _damaged(problem: str) -> DamagedReadModel:
    return DamagedReadModel(
        f"an audit row cannot be read ({problem}): the audit's rows were damaged; "
        "run catalog-es replay to make them again from the log"
    )


def _json(views: Sequence[str]) -> bytes:
    """Rows from their stored views as one JSON array, once each is found
    sound (:func:`_checked`)."""
    # One join of the parts: adding the brackets to the joined rows copied
    # them twice more, into buffers large enough to be mapped afresh each time.
    return "".join(["[", ",".join(_checked(views)), "]"]).encode()


class _ChangeShape(msgspec.Struct):
    field: str
    before: msgspec.Raw
    after: msgspec.Raw


class _RowShape(msgspec.Struct):
    """A row's view with the keys every row has, of the types the CLI's table
    and the console read, the definitions in it skipped, not built: what
    :func:`_checked` reads a row as. A row without them (``{}``), or with a
    number for its changes, went out as a row, and the CLI's table failed on
    it as a bug."""

    revision: int
    time: str | None
    by: str | None
    reason: str | None
    model: str | None
    event: str
    class_version: int | None
    fields: msgspec.Raw
    rollback_to: int | None
    skipped: str | None
    changes: list[_ChangeShape]
    before: msgspec.Raw
    after: msgspec.Raw


_row_decoder = msgspec.json.Decoder(dict[str, Any])
_row_checker = msgspec.json.Decoder(_RowShape)

# How much of the views of an answer the CLI writes out is read, and checked,
# at a time: what it holds of them besides the spool's part in memory (a
# page of 100 rows took 2,000 round trips for 200,000 on PostgreSQL, 1.4 s
# more than one read of them all).
SPOOLED_PAGE_BYTES = 1 << 20
# What the spool of such an answer holds in memory; past it, it is a file.
SPOOLED_IN_MEMORY = 4 << 20
# Between two views in the spool: no JSON text holds a NUL (in a string it is
# escaped), so every view found sound is whole between two.
_APART = "\0"


class Spooled:
    """The views of an answer written out as it is decoded (the CLI's), each
    found sound (:func:`_checked`) as the read goes, a page at a time, and
    held in a temporary file until every one is: a damaged row refuses the
    whole answer before any of it is written, as when every view was read
    into a list first, which held them all (the views of 1,000,000 events
    took 974 MB). The file is in memory up to :data:`SPOOLED_IN_MEMORY`,
    then in the temporary directory (``TMPDIR``), where it has no name:
    nothing is left of it, however the command ends."""

    def __init__(self, newest_first: bool) -> None:
        # Closed by rows() once read, or by read() as it fails.
        self._file = tempfile.SpooledTemporaryFile(max_size=SPOOLED_IN_MEMORY)  # noqa: SIM115
        self._newest_first = newest_first
        # Where each page's views start and end in the file, in the order read.
        self._pages: list[tuple[int, int]] = []
        self._count = 0

    @classmethod
    def read(
        cls, store: SQLRecorder, conn: Connection, query: sa.Select[Any], newest_first: bool
    ) -> Spooled:
        """A :data:`~projections.audit.ValuesReader` of the views."""
        spooled = cls(newest_first)
        try:
            # Closed here, in the read's transaction, when a view is refused:
            # not later, as the refusal's traceback lets go of it.
            with closing(store.column_pages(conn, query, SPOOLED_PAGE_BYTES)) as pages:
                for page in pages:
                    spooled._add(_checked(page))
        except BaseException:
            spooled._file.close()
            raise
        return spooled

    def _add(self, views: Sequence[str]) -> None:
        start = self._file.tell()
        try:
            # Each page oldest first, whichever way it was read; joined, as a
            # write a view took three times as long.
            self._file.write(_APART.join(reversed(views) if self._newest_first else views).encode())
            # Written through: a folder that has no room for it is told as the
            # views are read, not once rows are written out.
            self._file.flush()
        except OSError as error:
            raise _not_held(error) from None
        self._pages.append((start, self._file.tell()))
        self._count += len(views)

    def __len__(self) -> int:
        return self._count

    def rows(self) -> Iterator[dict[str, Any]]:
        """Each row, oldest first, decoded as it is asked for (:func:`_decoded`);
        the file let go once they are all read, or the caller lets go."""
        pages = reversed(self._pages) if self._newest_first else self._pages
        with self._file:
            for start, end in pages:
                self._file.seek(start)
                yield from _decoded(self._file.read(end - start).split(_APART.encode()))


def _not_held(error: OSError) -> Refused:
    """The spool's file could not be written (a full disk, most often): what
    happened and what to do, not "unexpected OSError"."""
    # Found as the file was made; none when no folder would take one.
    folder = tempfile.tempdir
    where = f"the temporary folder {folder}" if folder else "a temporary folder"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        instead = "free room there, point TMPDIR at a folder with room"
    else:
        instead = "point TMPDIR at another folder"
    return Refused(
        f"the answer could not be held in {where} while its rows were checked: "
        f"{error.strerror or error}; {instead}, or narrow the query (--limit, the filters)"
    )


# A refused name can be anything the caller sent (a valid one is at most 128
# characters); what a refusal says quotes it. Enough of either is kept to
# tell who tried what, and never a megabyte.
MAX_KEPT_NAME = 256
MAX_KEPT_REFUSAL = 2000
# A refused add's fields are a kilobyte or two; an apply file can send 60 MB.
MAX_KEPT_FIELDS = 64 * 1024


def _kept(text: str, limit: int) -> str:
    """``text`` as a refusal's column can keep it (:func:`filter_text`, as
    filters match it: no NUL, and UTF-8, a name given as a lone surrogate
    having made the refusal's own record fail, "unexpected
    UnicodeEncodeError": a fuzz test), cut at ``limit``."""
    return cut_short(filter_text(text) or "", limit)


def _kept_fields(fields: dict[str, Any]) -> Any:
    """The refused command's fields, or what became of them when too large to keep."""
    data = msgspec.to_builtins(fields)
    try:
        size = len(msgspec.json.encode(data))
    except UnicodeEncodeError:
        # A lone surrogate (an argument no codec could read) has no UTF-8:
        # kept written out as Python writes it, ``\udcff``.
        data = _encodable(data)
        size = len(msgspec.json.encode(data))
    if size <= MAX_KEPT_FIELDS:
        return data
    return {"omitted": f"{size} bytes of fields; at most {MAX_KEPT_FIELDS} are kept"}


def _encodable(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, list):
        return [_encodable(v) for v in value]
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    return value


def _stored_names(event_class: type[Model.Event], fields: dict[str, Any]) -> dict[str, Any]:
    """Command keywords under the names the event stores them by (``class``,
    not ``capacity_class``), as ``log`` and ``audit`` show them."""
    names = {f.name: f.encode_name for f in msgspec.structs.fields(event_class)}
    return {names.get(key, key): value for key, value in fields.items()}


def _one_more(filters: Filters, at_most: int | None) -> Filters:
    """``filters`` asking, when they give no ``limit``, for one row more than
    an answer may hold: enough to tell it would hold too many."""
    if at_most is None or filters.get("limit") is not None:
        return filters
    return {**filters, "limit": at_most + 1}


def _within(count: int, filters: Filters, at_most: int | None) -> None:
    """Refuse an answer of more rows than ``at_most``, asked without a ``limit``."""
    if at_most is not None and filters.get("limit") is None and count > at_most:
        raise InputError(
            f"more than {at_most:,} rows match: give limit (the most recent N, at most "
            f"{at_most:,}), or narrow them with {_narrowing(filters)}"
        )


def _narrowing(filters: Filters) -> str:
    # Asked of one model (a history, or a model filter), a query is narrowed
    # by model already.
    return "by, type, since or until" if filters.get("model") else "model, by, type, since or until"
