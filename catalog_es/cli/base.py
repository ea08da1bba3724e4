"""What every command shares: settings, options, output, error mapping, the root group.

Commands only parse, call the service and print. Data goes to stdout (a table,
or JSON with ``--json``), warnings and errors to stderr. Exit 0 on success,
1 when a command is refused (nothing is written), 2 on usage errors.

The service, and what it stands on (SQLAlchemy, pydantic, msgspec), is
imported where a command uses it, :meth:`Settings.models` first, not as the
command line is built: ``--help``, ``--version`` and a usage error load none
of it (a third of a second).
"""

from __future__ import annotations

import codecs
import functools
import io
import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from contextlib import suppress
from datetime import datetime
from itertools import chain
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, TextIO, TypeVar, cast

import click

from catalog_es import bootstrap, early_stop
from catalog_es.cli import tables
from catalog_es.errors import (
    NAME_SHOWN_LENGTH,
    UNSAFE_TEXT,
    ConfigError,
    InputError,
    OutcomeUnknown,
    Refused,
    came_of_a_stop,
    counted,
    first_line,
    json_in_pieces,
    json_line,
    shown,
)
from catalog_es.values import MAX_REVISION, in_digits, revision_or_time

if TYPE_CHECKING:
    import sqlalchemy as sa

    from catalog_es.application import CommandResult, Models
    from catalog_es.configuration import DeclaredConfig


def _check_digits(
    kind: WholeNumber | WholeNumberRange,
    value: Any,
    param: click.Parameter | None,
    ctx: click.Context | None,
) -> None:
    """An option's value given as text, refused unless :func:`in_digits`."""
    if isinstance(value, str) and not in_digits(value):
        kind.fail(f"{shown(value)} is not a whole number in digits", param, ctx)


class WholeNumber(click.types.IntParamType):
    """A whole number, in digits (:func:`_check_digits`)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        _check_digits(self, value, param, ctx)
        return super().convert(value, param, ctx)


class WholeNumberRange(click.IntRange):
    """A whole number, in digits (:func:`_check_digits`), within bounds."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        _check_digits(self, value, param, ctx)
        return super().convert(value, param, ctx)


# Revisions and counts, as the options that take them read them: no more than
# the 64-bit columns they are compared with hold.
REVISION = WholeNumberRange(0, MAX_REVISION)
COUNT = WholeNumberRange(1, MAX_REVISION)
# Any other whole number: what it must be is the domain's to say.
INTEGER = WholeNumber()

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

log = logging.getLogger("catalog_es")


# The models a stale-config hint names before it says how many more there are.
HINT_MODELS_SHOWN = 5

# Seconds between tries of a command that runs until stopped (watch, serve),
# starting while the database cannot be used.
START_RETRY_SECONDS = 1.0


def once_it_answers(
    settings: Settings,
    command: str,
    start: Callable[[], T],
    *,
    waiting: Callable[[], None] = lambda: None,
) -> T:
    """``start()`` of a command that runs until stopped, once the database
    answers: a replica or a server starting as its PostgreSQL fails over
    waits for it, as one already running does, where it exited 1
    (multi-node test; a supervisor gives up on a unit failing fast). A
    database set up wrong (a role, a password, a name), and a SQLite file
    that cannot be opened, are told at once, as any command tells them.
    While it waits, one engine without a pool looks every second: a service
    made each time kept some memory. ``waiting`` is called each time it
    starts to wait (the first before it says so): a database that answers
    and is gone again as ``start()`` runs is waited for again."""
    import sqlalchemy as sa

    from catalog_es.storage.engines import log_url, postgresql_engine, url_where

    probe: sa.Engine | None = None
    try:
        while True:
            try:
                return start()
            except sa.exc.DBAPIError as error:
                unusable = _passing(error)
                # As the log reads it: a bare postgresql:// is psycopg's (the
                # probe took it for psycopg2's, not installed; doc audit).
                url = log_url(bootstrap.database_url(settings.db))
                if unusable is None or url.get_backend_name() != "postgresql":
                    raise
                waiting()
                if probe is None:
                    say(
                        f"warning: {command}: the database {url_where(url)} could not be used "
                        f"({unusable}); trying again every {START_RETRY_SECONDS:g} s",
                        err=True,
                    )
                    probe = postgresql_engine(url, poolclass=sa.pool.NullPool)
                _until_it_answers(probe)
    finally:
        if probe is not None:
            probe.dispose()


def _passing(error: sa.exc.DBAPIError) -> str | None:
    """What the driver said, when ``error`` is an outage to wait out."""
    from catalog_es.storage.engines import database_unusable

    unusable = database_unusable(error)
    return None if unusable is None or unusable.lasting else unusable.said


def _until_it_answers(probe: sa.Engine) -> None:
    import sqlalchemy as sa

    while True:
        time.sleep(START_RETRY_SECONDS)
        try:
            with probe.connect():
                return
        except sa.exc.DBAPIError as error:
            if _passing(error) is None:
                raise


def check_query(*, model: str | None = None, by: str | None = None) -> None:
    """A query's model and actor filters, refused by the service's own checks
    before :meth:`Settings.models` opens the log: neither needs it, and on a
    path with no log a refused query made one first (review)."""
    from catalog_es.inputs import check_actor_filter
    from catalog_es.spec import check_name

    if model is not None:
        check_name(model)
    check_actor_filter(by)


class Settings:
    """What the root and every command may set; a command's own option wins."""

    def __init__(self) -> None:
        self.db: str | None = None
        self.config: str | None = None
        self.json = False
        self.by: str | None = None
        self.reason = ""
        self.expected_revision: int | None = None
        self._models: Models | None = None
        # The declared config, loaded once a run (see :meth:`_opened`).
        self._declared: DeclaredConfig | None = None
        # Where this run made a new log, there being none ("at FILE" on
        # SQLite, "in schema S of database D at HOST" on PostgreSQL): a path,
        # database or schema mistaken makes a new, empty log, so the run says
        # so (after its answer, or on its refusal's line).
        self.new_log: str | None = None
        # A command that writes nothing (:func:`reads_only`) makes no log:
        # where there is none, it answers as an empty log would, and
        # ``log_absent`` says where no log is.
        self.reads_only = False
        self.log_absent: str | None = None
        # A command that writes nothing but follows the log (watch from its
        # start): it makes a log to follow where there is none, and nothing
        # where there is one (a catalog_head dropped by hand stays so).
        self.follows = False
        # Each revision given that was read as another, as told
        # (:func:`warn_if_taken_as_another`): diff resolves two.
        self.taken_as: list[str] = []
        # Whether a read is over the declared config the log recorded then:
        # a refusal of it turned on that config, not this run's.
        self.declared_then = False

    def last_written(self) -> int | None:
        """The revision this run's last committed write answers, if it wrote
        (what an interrupt is told after); if the log cannot be asked, what
        the run knows of it."""
        if self._models is None:
            return None
        try:
            return self._models.written()
        except Exception:
            return self._models.last_written

    def models(self) -> Models:
        """The service, opened once per run and closed with the command (its
        held write connection and pool with it)."""
        if self._models is None:
            bootstrap.database_url(self.db)  # refused, loads no persistence
            self._models = self._opened()
            if self.new_log is not None:
                log.warning("no log %s yet: a new one is made there", self.new_log)
            elif self.log_absent is not None:
                log.warning("no log %s: answered as an empty log; none was made", self.log_absent)
            recorded = self._models.catalog.recorded_declaration
            if (
                not self._models.declared.given
                and not self.declared_then
                and recorded is not None
                and recorded[0] != self._models.declared.fingerprint
            ):
                # A run from a folder without the deploy's catalog.yaml reads
                # the catalog without its declared models or engines: not what
                # the nodes run (a read over the config recorded then goes
                # without nothing). A write is refused (NoConfigGiven), and its
                # warnings with it.
                from catalog_es.configuration import gone_without

                log.warning(
                    "no declared config given (%s): the log's nodes recorded one at "
                    "revision %d, and this run goes without %s",
                    bootstrap.CONFIG_GIVEN_BY,
                    recorded[1],
                    gone_without(self._recorded_config(recorded[1])),
                )
            context = click.get_current_context(silent=True)
            if context is not None:
                # With the root's context, once the command's answer is told
                # (CatalogGroup.invoke), not with the command's own.
                context.find_root().call_on_close(self._models.close)
        return self._models

    def _opened(self) -> Models:
        """The service on the log; for a command that writes nothing on a
        path with no log, on an empty one in memory, gone with the command:
        a read makes no log (the first write or a server does), and a
        mistyped path or schema is left as it was. Nothing of it outlives the
        process, however it ends (a file for it, in a temporary folder, stayed
        behind a read killed; hostile test). One that follows the log
        (``follows``) is on a log made there, to follow."""
        # Loaded once a run: read again, a config given as a pipe (`--config
        # <(…)`) was empty the second time, and refused so: a read's second
        # open, on a path with no log, and a start's next try once the
        # database it waited for was back (once_it_answers).
        if self._declared is None:
            self._declared = bootstrap.declared_config(self.config)
        declared = self._declared
        if self.reads_only or self.follows:
            from catalog_es.errors import NoLogYet

            try:
                return bootstrap.open_models(self.db, declared, make_log=False)
            except NoLogYet as absent:
                if self.reads_only:
                    self.log_absent = absent.where
                    return bootstrap.open_models(self.db, declared, in_memory=True)
        models = bootstrap.open_models(self.db, declared)
        self.new_log = models.store.log_made
        return models

    def another_config_explains(self, refusal: Exception) -> str:
        """What a refusal's line adds when the declared config the log last
        recorded is not this run's, and the two decide otherwise what the
        refusal turned on (:class:`~catalog_es.errors.TurnedOn`): the model
        refused as declared is not declared in the log's; one not found,
        named as a fallback, or naming the model refused as one, is (a
        change of a list's too), as is one on a fallback cycle refused (that
        one breaks it); an engine unknown here is known there.
        Nothing for any other refusal, which that difference cannot explain."""
        models = self._models
        if (
            models is None
            or self.declared_then
            or not isinstance(refusal, Refused)
            or refusal.turned_on is None
        ):
            return ""
        turned_on = refusal.turned_on
        recorded = models.catalog.recorded_declaration
        if recorded is None or recorded[0] == models.declared.fingerprint:
            return ""
        theirs = self._recorded_config(recorded[1])
        if theirs is None:
            return ""
        logs = f"the config the log last recorded, at revision {recorded[1]}"
        ours = f"this run's config ({models.declared.path or 'none given'})"
        if turned_on.engine:
            if turned_on.engine not in theirs.engines:
                return ""
            return f" (engine {shown(turned_on.engine)} is known in {logs}, but not in {ours})"
        declared_in_theirs = {spec.name for spec in theirs.models}
        decided_otherwise = [
            name for name in turned_on.models if (name in declared_in_theirs) != turned_on.declared
        ]
        if not decided_otherwise or (
            not turned_on.any_of and len(decided_otherwise) < len(turned_on.models)
        ):
            return ""
        which = ""
        if not turned_on.named:
            # A cycle through a thousand models may have them all declared there.
            names = ", ".join(
                shown(name, NAME_SHOWN_LENGTH) for name in decided_otherwise[:HINT_MODELS_SHOWN]
            )
            if len(decided_otherwise) > HINT_MODELS_SHOWN:
                names += f" and {len(decided_otherwise) - HINT_MODELS_SHOWN:,} more"
            which = f"model {names} is " if len(decided_otherwise) == 1 else f"models {names} are "
        if turned_on.declared:
            return f" ({which}declared in {ours}, but not in {logs})"
        return f" ({which}declared in {logs}, but not in {ours})"

    def _recorded_config(self, revision: int) -> DeclaredConfig | None:
        """:meth:`~catalog_es.application.Models.recorded_config`; None too
        with the database gone: only a hint or a warning's wording hangs on it,
        and what it goes with is told all the same."""
        import sqlalchemy as sa  # loaded with the service

        assert self._models is not None
        try:
            return self._models.recorded_config(revision)
        except sa.exc.SQLAlchemyError:
            return None

    def tell_another_config_recorded(self) -> None:
        """Warn, once the command is done, when the log last recorded another
        declared config than this run's, and the run did not record its own
        (it wrote nothing): it read the catalog over a layer the nodes that
        recorded theirs do not run. Not said of a write, which records this
        run's, as a deploy does; the service itself warns, once a write is
        committed, of one that records again a config the log had replaced. A
        run given no config is told so as it opens the log (:meth:`models`).
        Nor of a read ``--declared-then``, over the config the log recorded
        then."""
        models = self._models
        if models is None or not models.declared.path or self.declared_then:
            return
        recorded = models.catalog.recorded_declaration
        if recorded is not None and recorded[0] != models.declared.fingerprint:
            log.warning(
                "this run's declared config (%s) differs from the one the log recorded at "
                "revision %d: this run reads the catalog over its own config, and a write "
                "would record it",
                models.declared.path,
                recorded[1],
            )

    @property
    def actor(self) -> str:
        return bootstrap.actor(self.by)


def _set(attribute: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def callback(ctx: click.Context, _param: click.Parameter, value: Any) -> None:
        if value is not None and value is not False:
            setattr(ctx.ensure_object(Settings), attribute, value)

    return callback


def _set_expected_revision(ctx: click.Context, _param: click.Parameter, given: Any) -> None:
    # A condition, not a default a command may override: given twice (on the
    # root by a wrapper and on the command, or twice in one place), both must
    # hold, and keeping the last dropped a stale one silently.
    settings = ctx.ensure_object(Settings)
    said = {*given, *([] if settings.expected_revision is None else [settings.expected_revision])}
    if len(said) > 1:
        first, *others = sorted(said)
        raise click.BadParameter(
            f"given as {first} and as {', '.join(map(str, others))}: the log cannot be at both;"
            " give it once"
        )
    if said:
        settings.expected_revision = said.pop()


def shared_options(
    f: F,
    by_help: str = (
        "Who is making the change, on a command that writes"
        " (else $CATALOG_ES_ACTOR, else the OS user)."
    ),
) -> F:
    """``--json``, ``--by``, ``--reason`` and ``--expected-revision``: accepted on
    the root and on every command alike."""
    options = [
        click.option(
            "--json",
            "json_",
            is_flag=True,
            default=False,
            expose_value=False,
            callback=_set("json"),
            help="Machine-readable output.",
        ),
        click.option(
            "--by",
            metavar="ACTOR",
            expose_value=False,
            callback=_set("by"),
            help=by_help,
        ),
        click.option(
            "--reason",
            metavar="TEXT",
            expose_value=False,
            callback=_set("reason"),
            help="Why, recorded with a change.",
        ),
        click.option(
            "--expected-revision",
            type=REVISION,
            metavar="REV",
            multiple=True,
            expose_value=False,
            callback=_set_expected_revision,
            help="Refuse if the log has moved past this revision (commands that write, and "
            "rollback's dry run; reads ignore it).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def query_options(f: F) -> F:
    """:func:`shared_options` of the queries where ``--by`` is a filter: the
    audit's, ``log`` and ``watch``, which write nothing to record it with."""
    return shared_options(f, "Only this actor's (a filter here, not who is asking).")


pass_settings = click.make_pass_decorator(Settings, ensure=True)


def reads_only(f: F) -> F:
    """For a command that writes nothing, under :data:`pass_settings`: it
    makes no log, answering on a path with none as an empty log would, and
    says so (:meth:`Settings.models`). Reads made the log, and a mistyped
    path or schema was left with one that nothing asked for."""

    @functools.wraps(f)
    def command(settings: Settings, *args: Any, **kwargs: Any) -> Any:
        settings.reads_only = True
        return f(settings, *args, **kwargs)

    return cast(F, command)


def _note_declared_then(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    ctx.ensure_object(Settings).declared_then = value
    return value


# Reads of the past are replayed over today's declared config unless asked.
declared_then_option = click.option(
    "--declared-then",
    is_flag=True,
    callback=_note_declared_then,
    help="Over the declared config the log had recorded then (what the nodes ran), not today's.",
)


def read_at(settings: Settings, at: int | datetime | None, declared_then: bool) -> int | None:
    """``--at`` as the revision it reads (:func:`resolved`); ``--declared-then``,
    which reads the past, refused without it."""
    if at is None:
        if declared_then:
            raise click.UsageError("--declared-then reads the past: give --at too")
        return None
    return resolved(settings, at)


def resolved(settings: Settings, at: int | datetime) -> int:
    """The revision a revision or time given reads. One inside a write (or
    one PostgreSQL burned) reads the last before it where a write ends:
    said, where the answer was another revision's without a word (operator
    walkthrough)."""
    revision = settings.models().resolve(at)
    warn_if_taken_as_another(settings, at, revision)
    return revision


def warn_if_taken_as_another(settings: Settings, at: int | datetime, revision: int) -> None:
    """Tell that revision ``at`` was read as ``revision`` (see :func:`resolved`)."""
    if isinstance(at, int) and revision != at:
        # Asked only here, off a read's usual path. A gap is an event deleted
        # (SQLite numbers without gaps), or on PostgreSQL a number a failed
        # write burned: verify tells which, and the first was told as a write
        # of several changes.
        if settings.models().holds(at):
            said = (
                f"no write ends at revision {at} (a write of several changes lands whole): "
                f"taken as revision {revision}, the last one that does before it"
            )
        else:
            said = (
                f"revision {at} is not in the log (deleted, or on PostgreSQL burned by a "
                f"write that failed: verify tells which): taken as revision {revision}, "
                "the last before it"
            )
        # A warning, as the load's are: told after the answer. A refusal,
        # one line, says it too: it names the revision read, which the
        # operator never gave (operator walkthrough).
        settings.taken_as.append(said)
        log.warning("%s", said)


class RevisionOrTime(click.ParamType):  # type: ignore[type-arg]
    """A log revision (``1234``) or a UTC time (``2026-11-30T12:00:00Z``)."""

    name = "REV|TIME"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | datetime:
        if isinstance(value, int | datetime):
            return value
        try:
            return revision_or_time(str(value))
        except InputError as error:
            self.fail(str(error), param, ctx)


REVISION_OR_TIME = RevisionOrTime()


def read_as_usage(ctx: click.Context, read: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``read(*args, **kwargs)``, for an option callback: a value it cannot
    read (its :class:`InputError` names the option) is a usage error, exit 2,
    as a value one of click's types refuses is (DESIGN: 2 on usage errors)."""
    try:
        return read(*args, **kwargs)
    except InputError as error:
        raise click.UsageError(str(error), ctx) from None


# Looked up now, not as a warning is first escaped: Python imports a codec on
# first use, from a file, and a server out of descriptors then told each of
# its warnings as "--- Logging error ---" and a stack (hostile test).
codecs.lookup("unicode_escape")


def visible(text: str) -> str:
    """``text`` for a terminal, with what it would act on or hide written as
    ``repr`` writes it (``\\x1b``, ``\\u202e``). Sources stored before they
    were checked, and refused input, can hold any."""
    return UNSAFE_TEXT.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def say(text: str, *, err: bool = False) -> None:
    """A line for a person: on stdout, or on stderr with ``err``."""
    click.echo(visible(text), err=err)


class VisibleWarnings(logging.Formatter):
    """Log lines as :func:`say` writes them: a record or a config can carry
    what a terminal would act on into a warning. A traceback after the line
    is left as it is, one frame a line."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return visible(super().formatMessage(record))


def warnings_to(stream: TextIO) -> logging.Handler:
    """What the command line's log lines go through: :class:`VisibleWarnings`
    on ``stream``, less a Ctrl-C a library caught and logged on its way out,
    or an error that came of one. The command tells the stop itself
    (``Aborted!``, ``stopped``); SQLAlchemy's pool, interrupted as it took a
    connection back, added its traceback to a watch's ``stopped`` (a CI run),
    and once the error its reset raised while the stop was being handled.
    This code's own warnings are all told, whatever led to them: one says
    what stands (an applier that failed after a write)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(VisibleWarnings("warning: %(message)s"))
    handler.addFilter(_not_an_interrupt)
    return handler


def _not_an_interrupt(record: logging.LogRecord) -> bool:
    # Without a traceback, the error being handled as it was logged: psycopg
    # ending a pipeline a stop cut short logs what that failed on so
    # ("error ignored terminating <psycopg.Pipeline …>"; hostile test).
    error = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
    ours = record.name == "catalog_es" or record.name.startswith("catalog_es.")
    return error is None or ours or not came_of_a_stop(error)


# The most written to standard output at once (see ``write_out``).
CHUNK = 1 << 16


def write_out(lines: Iterable[str]) -> None:
    """Write lines out through ``sys.stdout`` as it is set up (what its
    encoding lacks written escaped; ``click.echo`` would write UTF-8 to a
    terminal that said it is ASCII), in pieces of at most ``CHUNK``: one
    larger write to a pipe its reader closed part-way was cut short without
    a word, and the command exited 0, not 141."""
    write_text(f"{line}\n" for line in lines)


def write_text(pieces: Iterable[str]) -> None:
    """:func:`write_out` of text in pieces, written as they come."""
    out = sys.stdout
    for text in pieces:
        for start in range(0, len(text), CHUNK):
            out.write(text[start : start + CHUNK])
    out.flush()


def print_table(
    header: Sequence[str] | None, rows: Iterable[Sequence[tables.Cell]], *, keys: bool = False
) -> None:
    # On a terminal, fit it; piped, never cut a name short.
    terminal = sys.stdout.isatty()
    width = shutil.get_terminal_size().columns if terminal else None
    bold = terminal and os.environ.get("TERM") != "dumb"
    write_out(tables.render(header, rows, width=width, bold=bold, keys=keys))


def emit(settings: Settings, data: Any, human: Callable[[], None]) -> None:
    if settings.json:
        write_out([json_line(data)])
    else:
        human()


def emit_rows(settings: Settings, rows: Iterable[Any], human: Callable[[], None]) -> None:
    """:func:`emit` of a list of rows, written as they come: the JSON array
    in pieces, never all of it (or all its rows) at once. ``rows`` is read
    once, by whichever of the two is written."""
    if settings.json:
        write_json_list(rows)
    else:
        human()


def write_json_list(
    items: Iterable[Any], data: dict[str, Any] | None = None, key: str = ""
) -> None:
    """One line of JSON, ``items`` as the list it is (or as ``data[key]``,
    its last key), written in pieces as the items come (:func:`json_in_pieces`)."""
    write_text(chain(json_in_pieces(json_line, ", ", items, data, key), ["\n"]))


def emit_result(settings: Settings, result: CommandResult, verb: str) -> None:
    import msgspec

    def human() -> None:
        name = result.removed or (result.model or {}).get("name", "")
        done = "replaced" if result.replaced else verb
        say(f"{done} {name} at revision {result.revision}")
        if result.model is not None:
            show_model(result.model)

    emit(settings, msgspec.to_builtins(result), human)  # as the HTTP API answers it


def scaling_text(m: dict[str, Any]) -> str:
    return f"{m['scaling']['min']}..{m['scaling']['max']}"


def profiles_text(m: dict[str, Any]) -> str:
    parts = []
    for p in m["profiles"]:
        what = counted(p["gpus"], "GPU") if p["gpus"] else "CPU"
        extras = [f"{p['gpu_memory_gb']} GB GPU"] if p["gpu_memory_gb"] else []
        extras += [f"{p['min_memory_gb']} GB"] if p["min_memory_gb"] else []
        extras += [counted(p["cpu_cores"], "core")] if p["cpu_cores"] else []
        parts.append(f"{p['name']} ({', '.join([what, *extras])})")
    return "; ".join(parts)


def origin_text(origin: dict[str, Any] | None) -> str:
    """``org/x@abc1234 (1 file)``, a part left out left out of it as cli.md
    shows (``org/x@``, ``2 files``); empty for an origin that holds nothing,
    as the config's ``origin: {}`` does: that is no origin (``@ (0 files)``)."""
    if origin is None:
        return ""
    files = len(origin["files"])
    if not origin["repository"] and not origin["revision"]:
        return counted(files, "file") if files else ""
    commit = f"{origin['repository'] or ''}@{origin['revision'] or ''}"
    return f"{commit} ({counted(files, 'file')})"


def show_model(m: dict[str, Any]) -> None:
    rows: list[tuple[str, str]] = [
        ("name", m["name"]),
        ("layer", "declared" if m["declared"] else "runtime"),
        ("engine", m["engine"]),
        ("source", m["source"]),
        ("profiles", profiles_text(m)),
        ("scaling", scaling_text(m)),
        ("class", m["effective_class"] + ("" if m["class"] else " (from scaling)")),
        ("owner", m["owner"] or "(shared)"),
        ("adapters", ", ".join(f"{a['name']}={a['source']}" for a in m["adapters"]) or "-"),
        ("fallbacks", ", ".join(m["fallbacks"]) or "-"),
    ]
    origin = origin_text(m.get("origin"))
    if origin:
        rows.append(("origin", origin))
    print_table(None, [((key,), (visible(value),)) for key, value in rows], keys=True)
    for warning in m.get("warnings", []):
        click.echo(f"warning: {warning}", err=True)


Text = str | list[str]


def table(columns: Sequence[str], rows: Iterable[Iterable[Text]]) -> None:
    """Rows of cells, each text or a list of lines: a line break inside a
    text is data, written as ``\\n`` like whatever else a terminal would act
    on, and a cell is only on several lines where it is made of them."""
    print_table(columns, ([_lines(cell) for cell in row] for row in rows))


def _lines(cell: Text) -> list[str]:
    return [visible(cell)] if isinstance(cell, str) else [visible(line) for line in cell]


# -- the root ----------------------------------------------------------------------


class HeldWarnings(logging.Handler):
    """The warnings a command gives while it runs (its load's: events the
    catalog skips, say), kept until it ends: told after a command that did
    what it was asked (its answer cut short too: 141, 74, where what it did
    stands), left out of a refusal, which is one line on stderr
    however long the log's list of skipped events (``verify`` tells it). A
    command that runs on (``serve``, ``watch``) lets them through as it
    starts (:func:`let_warnings_through`)."""

    _logger = logging.getLogger("catalog_es")

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self._propagated = True

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def hold(self) -> None:
        self._propagated = self._logger.propagate
        self._logger.addHandler(self)
        self._logger.propagate = False

    def stop(self, *, told: bool) -> None:
        """Stop holding; tell what was held if ``told``."""
        if self not in self._logger.handlers:
            return
        self._logger.removeHandler(self)
        self._logger.propagate = self._propagated
        records, self.records = self.records, []
        for record in records if told else ():
            self._logger.handle(record)


_held = HeldWarnings()


class StopAsked(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl-C is: what is under way (a PostgreSQL query, a
    write) is cancelled or rolled back as for a KeyboardInterrupt."""


# Said after ``stopped`` of a hang-up, which daemons often take as "read the
# config again": no command does.
HUNG_UP = " (SIGHUP: the declared config is read as a command starts; start it again to read it)"


def told_stopped(stops: Sequence[int]) -> str:
    """``stopped``, said of the first of ``stops``: the one that stopped the
    command (a supervisor's SIGTERM, then a terminal's hang-up as it closed,
    was told as the hang-up)."""
    return "stopped" + (HUNG_UP if stops and stops[0] == signal.SIGHUP else "")


def stopped_when_asked() -> StoppedWhenAsked:
    """For a command that runs until stopped (``serve``, ``watch``): Ctrl-C,
    SIGTERM (a supervisor's) or SIGHUP ends it with ``stopped`` on stderr and
    exit 0, whenever it comes, a long load included; not "Aborted!" and 1,
    which says a command was refused, nor death by the signal. uvicorn shuts
    down gracefully on SIGINT and SIGTERM, then raises the signal again for
    the handler it found: Python's for SIGINT (a KeyboardInterrupt), this one
    for SIGTERM; a SIGHUP is made a SIGTERM, to be shut down on alike. One
    ignored (``nohup``) stays so. Gives itself: ``stops``, the stops asked in
    the order they came, for a handler that takes them in its place
    (uvicorn's) to add to, and :meth:`~StoppedWhenAsked.hold` for while that
    handler is put in."""
    return StoppedWhenAsked()


class StoppedWhenAsked:
    """:func:`stopped_when_asked`. A class, not a generator: a stop as the
    generator reached its ``yield``, before the command started, was taken
    for one in it, and the generator ended without yielding."""

    def __init__(self) -> None:
        self.stops: list[int] = []
        # What each stop had before the command started, put back once it is done.
        self._found: dict[int, Any] = {}
        # How each stop is acted on; installed behind ``_take``.
        self._handlers: dict[int, Callable[[int, FrameType | None], None]] = {}
        # The stops that came while held (see ``hold``); None: not held.
        self._held: list[int] | None = None

    def _take(self, signum: int, frame: FrameType | None) -> None:
        # The one handler installed, holding or not: uvicorn puts back the
        # handler it found once it is done, and the stop it raises again
        # then must be acted on, not held.
        if self._held is None:
            self._handlers[signum](signum, frame)
        else:
            self._held.append(signum)

    def hold(self) -> None:
        """Stops noted, not acted on, until :meth:`let_through`: for while a
        library puts in handlers of its own. uvicorn's ``run`` makes its
        coroutine and its event loop before it does: a stop raised in
        between left them half made, and ``stopped`` was followed by "never
        awaited" and "Exception ignored" tracebacks (2 starts in 30)."""
        self._held = []

    def let_through(self) -> None:
        """The stops held raised again, for the handlers now in place."""
        # Swapped first: one that comes as they are raised is taken at once.
        held, self._held = self._held or [], None
        for signum in held:
            signal.raise_signal(signum)

    def _stop(self, signum: int, _frame: FrameType | None) -> None:
        self.stops.append(signum)
        raise StopAsked

    def _hang_up(self, signum: int, _frame: FrameType | None) -> None:
        self.stops.append(signum)
        signal.raise_signal(signal.SIGTERM)

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        self.stops.append(signum)
        self._found[signal.SIGINT](signum, frame)

    def __enter__(self) -> StoppedWhenAsked:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals are the main thread's to handle
        self._found = {signum: early_stop.handler_found(signum) for signum in early_stop.STOPS}
        self._handlers = {signal.SIGTERM: self._stop}
        if callable(self._found[signal.SIGINT]):
            self._handlers[signal.SIGINT] = self._interrupt
        if self._found[signal.SIGHUP] is not signal.SIG_IGN:
            self._handlers[signal.SIGHUP] = self._hang_up
        try:
            # Installed in place of early_stop's noting, then what it noted
            # read: no stop comes in between to the handler found (death).
            for signum in self._handlers:
                signal.signal(signum, self._take)
            asked = early_stop.take_over()
            if asked is not None:
                # Asked as the command started (its imports): told as any
                # stop, and it ends before it starts.
                self.stops.insert(0, asked)
                raise StopAsked
            return self
        except BaseException as error:
            if self.__exit__(type(error), error, error.__traceback__):
                raise click.exceptions.Exit(0) from None
            raise

    def __exit__(
        self,
        _type: type[BaseException] | None,
        error: BaseException | None,
        _traceback: TracebackType | None,
    ) -> bool:
        try:
            if error is None or not came_of_a_stop(error):
                return False
            say(told_stopped(self.stops), err=True)
            return True
        finally:
            for signum, handler in self._found.items():
                signal.signal(signum, handler)


def let_warnings_through() -> None:
    """Tell the warnings held so far, and those to come as they come."""
    _held.stop(told=True)


# The stops a command takes as Ctrl-C's (Python's own KeyboardInterrupt).
_STOPS_TAKEN = tuple(signum for signum in early_stop.STOPS if signum != signal.SIGINT)


def _ended_by(signum: int) -> None:
    """The process ended by ``signum``, as if it had not been handled."""
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


# 128 + SIGPIPE.
EXIT_PIPE_CLOSED = 141
# 128 + SIGINT, as for any process Ctrl-C ends: after a write committed.
EXIT_INTERRUPTED = 130
# An answer standard output could not take, after the command did its work.
EXIT_OUTPUT_FAILED = 74
# A write whose commit failed once begun: it may stand. Not 1, which says
# nothing was written: a script would take it for refused and move on, or
# make the change again, on a log that may hold it.
EXIT_OUTCOME_UNKNOWN = 3


class CatalogGroup(click.Group):
    """Maps domain errors to one line on stderr and exit code 1, for every command."""

    # The console script's: the process's stops are its own (not in-process
    # callers', tests', whose own it would take away). SIGTERM and SIGHUP
    # stop a command as Ctrl-C does, told alike (:meth:`_stop`). Once it is
    # done, none changes what it told (a Ctrl-C cut closing the log short
    # with `Aborted!` and 1, which says nothing was written, after a write
    # was told; review).
    owns_the_stops = False
    # The stop (SIGTERM, SIGHUP) that stopped the command: the process ends
    # by it (:meth:`main`).
    stopped_by: int | None = None

    def main(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().main(*args, **kwargs)
        finally:
            if self.stopped_by is not None:
                # Told, and the log closed: the status a supervisor expects
                # of its stop is death by it (systemd counts it a clean stop,
                # where it takes an exit status of 143 for a failure).
                for stream in (sys.stdout, sys.stderr):
                    with suppress(OSError, ValueError):
                        stream.flush()
                _ended_by(self.stopped_by)

    def _stop(self, signum: int, _frame: FrameType | None) -> None:
        """A SIGTERM or SIGHUP, raised as Ctrl-C is: a write under way rolled
        back, one committed told as standing (it exited 143 silently, after
        its commit too; hostile test). Asked twice (the stopping may hang:
        a slow database), the second is acted on at once, as early_stop's."""
        if self.stopped_by is not None:
            _ended_by(self.stopped_by)
        self.stopped_by = signum
        raise StopAsked

    def invoke(self, ctx: click.Context) -> Any:
        _held.hold()
        told = False
        if self.owns_the_stops:
            # Those still at their default: serve and watch have had theirs
            # noted from the first line (early_stop), and one ignored stays so.
            for signum in _STOPS_TAKEN:
                if signal.getsignal(signum) is signal.SIG_DFL:
                    signal.signal(signum, self._stop)
        try:
            result = super().invoke(ctx)
            settings = ctx.find_object(Settings)
            # Not after a server or a watch: they ran on their own config
            # by design, their log told what they met as it came.
            if settings is not None and ctx.invoked_subcommand not in early_stop.UNTIL_STOPPED:
                settings.tell_another_config_recorded()
            told = True
            return result
        except (Refused, ConfigError) as refusal:
            settings = ctx.find_object(Settings)
            said = f"error: {refusal}"
            if settings is not None:
                said += "".join(f"; {taken}" for taken in settings.taken_as)
                said += settings.another_config_explains(refusal)
                if settings.new_log:
                    said += f" (no log was {settings.new_log}: a new, empty one is made there)"
                elif settings.log_absent:
                    said += f" (no log is {settings.log_absent}: none was made)"
            say(said, err=True)
            self._exit(ctx, 1)
        except OutcomeUnknown as unknown:
            say(f"error: {unknown}", err=True)
            self._exit(ctx, EXIT_OUTCOME_UNKNOWN)
        except click.exceptions.Exit as done:
            told = done.exit_code == 0
            raise
        except click.ClickException as error:
            # Click quotes most of what it refuses, but not all (an extra
            # argument is told as given): its lines escaped as say() escapes.
            told_by_click = io.StringIO()
            error.show(file=told_by_click)
            for line in told_by_click.getvalue().splitlines():
                say(line, err=True)
            self._exit(ctx, error.exit_code)
        except (click.Abort, KeyboardInterrupt):
            settings = ctx.find_object(Settings)
            written = settings.last_written() if settings is not None else None
            if written is None:
                raise  # `Aborted!` and 1: a write it cut off is rolled back
            # Cut off as the answer was made or told: 1 would say nothing was
            # written (hostile test), and a script would make the change again.
            say(f"stopped: what it wrote stands, up to revision {written}", err=True)
            self._exit(ctx, EXIT_INTERRUPTED)
        except BrokenPipeError:
            # The reader went away (`catalog-es log | head`): nothing to tell
            # it, and nothing left to flush into the closed pipe at exit. Not
            # 1, which says nothing was written, of a write told after its
            # commit (a script would make the change again): the shell's
            # code for a process a closed pipe ended, as `yes | head` gives.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            told = True  # done, as asked: its warnings (a config put back) still hold
            self._exit(ctx, EXIT_PIPE_CLOSED)
        except Exception as error:  # the last guard: one line, not a traceback
            if isinstance(error, OSError) and _raised_writing_out(error):
                # Standard output could not take the answer (a full disk, an
                # I/O error): what the command did stands, so not 1, which
                # says nothing was written. sysexits' EX_IOERR.
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                with suppress(OSError):
                    say(f"error: the answer could not be written out: {error}", err=True)
                told = True  # not refused: what it did stands, and its warnings say of it
                self._exit(ctx, EXIT_OUTPUT_FAILED)
            if os.environ.get("CATALOG_ES_DEBUG"):
                told = True  # a traceback is no one line: what led to it may help
                raise
            say(failure_line(error), err=True)
            self._exit(ctx, 1)
        finally:
            self._done()
            _held.stop(told=told)

    def _done(self) -> None:
        """The command's status is said (told, refused, 74, 141): from here no
        stop changes it, as its log closes or the interpreter ends."""
        if self.owns_the_stops:
            for signum in early_stop.STOPS:
                signal.signal(signum, signal.SIG_IGN)

    def _exit(self, ctx: click.Context, code: int) -> NoReturn:
        # Click closes the context, and the log with it, before it exits.
        self._done()
        ctx.exit(code)


# Where every answer is written out: an error raised in one is the output's.
_WRITERS = {click.echo.__code__, write_out.__code__, write_text.__code__}


def _raised_writing_out(error: BaseException) -> bool:
    """Whether ``error`` came from writing an answer out, not from the work
    (a tokens file on a full disk is the command's own failure)."""
    frames = traceback.walk_tb(error.__traceback__)
    return any(frame.f_code in _WRITERS for frame, _ in frames)


def failure_line(error: Exception) -> str:
    """The one line an exception no command expected comes to. Library errors
    (SQLAlchemy's) run on over several lines; the first says what went wrong."""
    # Only a command that opened the log meets the database's errors: one
    # that did not is spared loading it, which fails too out of descriptors.
    engines = sys.modules.get("catalog_es.storage.engines")
    unusable = None if engines is None else engines.database_unusable(error)
    if unusable is not None:
        return f"error: {unusable.told}"
    return f"error: unexpected {type(error).__name__}: {first_line(str(error))}"


@click.group(cls=CatalogGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--db",
    metavar="URL",
    envvar=bootstrap.DB_ENV,
    help="Database URL (default sqlite:///catalog.db; env CATALOG_ES_DB).",
)
@click.option(
    "--config",
    metavar="FILE",
    envvar=bootstrap.CONFIG_ENV,
    help="Declared config (default ./catalog.yaml when present; env CATALOG_ES_CONFIG).",
)
@shared_options
@click.version_option(package_name="catalog-es")
@pass_settings
def cli(settings: Settings, db: str | None, config: str | None) -> None:
    """The model catalog of an LLM-serving gateway, kept as an event-sourced log."""
    settings.db = db
    settings.config = config


def meta(settings: Settings) -> dict[str, Any]:
    """Who makes a write, why, and at which revision, as the service takes
    them: refused by its own checks here, so asked for before the log is
    opened (a blank actor made a log first, on a path with none)."""
    from catalog_es.inputs import check_meta

    by = settings.actor  # the environment, else the OS user: asked once
    check_meta(by, settings.reason)
    return {
        "by": by,
        "reason": settings.reason,
        "expected_revision": settings.expected_revision,
    }
