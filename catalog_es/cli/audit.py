"""The audit commands: ``history``, ``audit``, ``refusals`` and ``verify``.

On these queries ``--by`` names the actor to look for. A ``--since``,
``--until`` or ``--type`` value that cannot be read, or a type the query
never carries, is a usage error (exit 2), as a value click's own types
refuse is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Unpack, cast

import click

from catalog_es.cli.base import (
    COUNT,
    F,
    Settings,
    cli,
    emit,
    emit_rows,
    pass_settings,
    query_options,
    read_as_usage,
    reads_only,
    shared_options,
    table,
)
from catalog_es.errors import Refused, counted, json_line
from catalog_es.values import utc_time

if TYPE_CHECKING:
    from projections.audit import ChangeFilters, Filters


def _time_option(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    return None if value is None else read_as_usage(ctx, utc_time, value, param.opts[0])


def _query_type(value: str, query: str) -> str:
    # The event types are the model's: loaded when a type is given.
    from catalog_es.names import carried, event_type

    return carried(event_type(value, "--type"), query, "--type")


def change_filters(query: str) -> Callable[[F], F]:
    """The filters ``history``, ``audit`` and ``refusals`` share (``--by`` is a
    shared option), for ``query`` (a key of
    :data:`~catalog_es.names.QUERY_TYPES`, the event types its rows carry)."""

    def event_option(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
        return None if value is None else read_as_usage(ctx, _query_type, value, query)

    options = [
        click.option(
            "--type",
            "event_type",
            metavar="EVENT",
            callback=event_option,
            help="Only this event type (e.g. Scaled; Declared, Redeclared, Undeclared: what "
            "a declared-config record did to a model's declared definition; ConfigDeclared: "
            "the record, in audit; Rollback, Apply, CheckUpdates: a refused rollback, list of "
            "changes or check for updates, in refusals).",
        ),
        click.option(
            "--since",
            metavar="TIME",
            callback=_time_option,
            help="From this UTC time on (inclusive), e.g. 2026-11-30T12:00:00Z; a date"
            " alone is its midnight.",
        ),
        click.option(
            "--until",
            metavar="TIME",
            callback=_time_option,
            help="Before this UTC time (a date alone: its midnight).",
        ),
        click.option("--limit", type=COUNT, metavar="N", help="Only the N most recent."),
    ]

    def decorate(f: F) -> F:
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


def audit_filters(query: str) -> Callable[[F], F]:
    """The filters of ``audit`` and ``refusals``: those of a model's changes,
    and which model."""

    def decorate(f: F) -> F:
        return click.option("--model", metavar="NAME", help="Only this model.")(
            change_filters(query)(f)
        )

    return decorate


def _changes_text(row: dict[str, Any]) -> list[str]:
    """A line per field changed."""
    if row["skipped"] is not None:
        return [f"skipped on load: {row['skipped']}"]
    lines = [
        f"{c['field']}: {json_line(c['before'])} → {json_line(c['after'])}" for c in row["changes"]
    ]
    return lines or ["(no change)"]


def _event_text(row: dict[str, Any]) -> str:
    if row["rollback_to"] is not None:
        return f"{row['event']} (rollback to {row['rollback_to']})"
    # A config record's rows (a record is never a rollback's compensation):
    # the record is the first event of its write, so a read at the row's
    # revision is of the catalog before the deploy.
    if "write_end" in row:
        return f"{row['event']} (the write ends at {row['write_end']})"
    return str(row["event"])


def _show_changes(rows: Iterable[dict[str, Any]], *, with_model: bool) -> Callable[[], None]:
    """The table of ``rows``, which holds their cells' text only: each row is
    let go once its cells are made (its definitions before and after are most
    of it)."""

    def human() -> None:
        table(
            ["REV", "TIME", "BY", *(["MODEL"] if with_model else []), "EVENT", "CHANGES", "REASON"],
            (
                [
                    str(r["revision"]),
                    r["time"] or "?",
                    r["by"] or "?",
                    *([r["model"] or "-"] if with_model else []),
                    _event_text(r),
                    _changes_text(r),
                    r["reason"] or "",
                ]
                for r in rows
            ),
        )

    return human


def _checked(settings: Settings, filters: ChangeFilters, query: str) -> None:
    """``filters`` given ``--by``'s actor, and refused
    (:func:`~catalog_es.audit.check_filters`) before the log is opened: on a
    path with no log, a refused query made one first (review)."""
    from catalog_es.audit import check_filters

    filters["by"] = settings.by
    check_filters(cast("Filters", filters), query)  # history's: no model among them


@cli.command("history")
@click.argument("name")
@change_filters("history")
@query_options
@pass_settings
@reads_only
def history(settings: Settings, name: str, **filters: Unpack[ChangeFilters]) -> None:
    """Every change to one model, oldest first, field by field (the config
    deploys that declared, changed or dropped it among them), filtered; --by
    names the actor."""
    from catalog_es.audit import check_history_name

    check_history_name(name)
    _checked(settings, filters, "history")  # before the log is opened
    rows = settings.models().history_rows(name, **filters)
    emit_rows(settings, rows, _show_changes(rows, with_model=False))


@cli.command("audit")
@audit_filters("audit")
@query_options
@pass_settings
@reads_only
def audit(settings: Settings, **filters: Unpack[Filters]) -> None:
    """Changes across the catalog, oldest first, filtered; --by names the actor."""
    _checked(settings, filters, "audit")  # before the log is opened
    rows = settings.models().audit_rows(**filters)
    emit_rows(settings, rows, _show_changes(rows, with_model=True))


@cli.command("refusals")
@audit_filters("refusals")
@query_options
@pass_settings
@reads_only
def refusals(settings: Settings, **filters: Unpack[Filters]) -> None:
    """Commands that were refused: who tried what, and why. They changed nothing."""
    _checked(settings, filters, "refusals")  # before the log is opened
    rows = settings.models().refusals(**filters)
    emit_rows(
        settings,
        rows,
        lambda: table(
            ["TIME", "BY", "MODEL", "EVENT", "REFUSED BECAUSE", "REASON"],
            (
                [r["time"], r["by"], r["model"] or "-", r["event"], r["refusal"], r["reason"]]
                for r in rows
            ),
        ),
    )


def _skipped_rows(skipped: Iterable[dict[str, Any]]) -> Iterable[list[str]]:
    return ([str(s["revision"]), s["model"], s["event"], s["reason"]] for s in skipped)


@cli.command("verify")
@shared_options
@pass_settings
@reads_only
def verify(settings: Settings) -> None:
    """Check the hash chain over the log; exit 1 naming the first revision
    altered, removed or moved. Lists the events load skips either way."""
    report = settings.models().verify()
    if settings.log_absent is not None:
        # An empty log's chain is intact, but a check run on a mistyped path
        # (a monitor's) would pass for good.
        raise Refused("nothing to verify")

    def human() -> None:
        head = report["head"]
        if report["ok"]:
            at = f", head at revision {head['revision']} ({head['hash']})" if head else ""
            click.echo(f"chain intact: {counted(report['events'], 'event')}{at}")
        if report["skipped"]:
            click.echo("skipped on load:")
            table(["REV", "MODEL", "EVENT", "REASON"], _skipped_rows(report["skipped"]))
        else:
            click.echo("no event is skipped on load")
        since = report["snapshots_since_break"]
        if since:
            # Which were made before the edit, and which by a replay since, a
            # snapshot cannot tell.
            click.echo(
                f"{counted(len(since), 'snapshot')} taken at or after revision"
                f" {report['broken']['revision']}: one made before the edit holds the catalog as"
                " it was, and loads start from it (what they skip and read is not a replay's);"
                " unless one ran since the edit, catalog-es replay makes them again from the log"
                " as it is"
            )

    emit(settings, report, human)
    broken = report["broken"]
    if broken is not None:
        click.echo(
            f"error: chain broken at revision {broken['revision']}: {broken['problem']}", err=True
        )
        raise click.exceptions.Exit(1)
