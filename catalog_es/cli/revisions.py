"""Commands over revisions: diff, rollback, watch, replay."""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Any

import click

from catalog_es.cli.base import (
    REVISION,
    REVISION_OR_TIME,
    Settings,
    check_query,
    cli,
    declared_then_option,
    emit,
    let_warnings_through,
    meta,
    once_it_answers,
    pass_settings,
    query_options,
    reads_only,
    resolved,
    say,
    shared_options,
    stopped_when_asked,
    table,
    warn_if_taken_as_another,
)
from catalog_es.errors import counted, json_line
from catalog_es.names import ROLLBACK_DIMENSIONS


def _change_rows(diff: dict[str, Any]) -> list[list[str]]:
    rows = [["+", m["name"], "", "", json_line(m["source"])] for m in diff["added"]]
    rows += [["-", m["name"], "", json_line(m["source"]), ""] for m in diff["removed"]]
    for change in diff["changed"]:
        for field, values in change["fields"].items():
            rows.append(
                [
                    "~",
                    change["model"],
                    field,
                    json_line(values["before"]),
                    json_line(values["after"]),
                ]
            )
    return rows


def show_diff(diff: dict[str, Any]) -> None:
    rows = _change_rows(diff)
    if not rows:
        click.echo(f"no change from revision {diff['from']} to {diff['to']}")
        return
    click.echo(f"from revision {diff['from']} to {diff['to']}:")
    table(["", "MODEL", "FIELD", "BEFORE", "AFTER"], rows)


@cli.command("revision")
@shared_options
@pass_settings
@reads_only
def revision(settings: Settings) -> None:
    """The head of the log: the revision of the last change (0: none yet)."""
    head = settings.models().head()
    emit(settings, {"revision": head}, lambda: click.echo(head))


@cli.command("diff")
@click.argument("since", type=REVISION_OR_TIME)
@click.argument("until", type=REVISION_OR_TIME, required=False)
@click.option("--model", "model_name", metavar="NAME", help="Only this model.")
@declared_then_option
@shared_options
@pass_settings
@reads_only
def diff_command(
    settings: Settings,
    since: int | datetime,
    until: int | datetime | None,
    model_name: str | None,
    declared_then: bool,
) -> None:
    """What changed from one revision (or UTC time) to another, default now."""
    check_query(model=model_name)
    diff = settings.models().diff(
        resolved(settings, since),
        None if until is None else resolved(settings, until),
        model=model_name,
        declared_then=declared_then,
    )

    def human() -> None:
        show_diff(diff)
        declared = diff["declared"]
        if None not in (declared["from"], declared["to"]) and declared["from"] != declared["to"]:
            click.echo("note: the declared config recorded in the log changed in between", err=True)
        # A record this version cannot read (a newer release's), in force at an end.
        ends = (declared["from"], declared["to"])
        for error in dict.fromkeys(end["error"] for end in ends if end and "error" in end):
            click.echo(f"note: {error}", err=True)

    emit(settings, diff, human)


# Notes a rollback tells, at most, then how many more: one for each of 10,000
# models buried the warning that followed them (hostile test).
NOTES_SHOWN = 10


@cli.command("rollback")
@click.option("--to", "to", type=REVISION_OR_TIME, required=True, help="The revision or UTC time.")
@click.option("--model", "model_name", metavar="NAME", help="Only this model.")
@click.option("--only", type=click.Choice(ROLLBACK_DIMENSIONS), help="Only this dimension.")
@click.option("--dry-run", is_flag=True, help="Show what would change; write nothing.")
@shared_options
@pass_settings
def rollback_command(
    settings: Settings,
    to: int | datetime,
    model_name: str | None,
    only: str | None,
    dry_run: bool,
) -> None:
    """Make the runtime catalog what it was at a revision, by appending
    compensating events in one transaction (the log is never rewritten)."""
    settings.reads_only = dry_run  # it writes nothing: nor does it make the log
    # Resolved by the service, so that a refusal records the revision or time
    # as given, as the HTTP API's does (doc audit).
    said = meta(settings)
    result = settings.models().rollback(to, model=model_name, only=only, dry_run=dry_run, **said)
    warn_if_taken_as_another(settings, to, result["to"])

    def human() -> None:
        notes = result["notes"]
        for note in notes[:NOTES_SHOWN]:
            say(f"note: {note}", err=True)
        if len(notes) > NOTES_SHOWN:
            more = counted(len(notes) - NOTES_SHOWN, "more note")
            say(f"note: … and {more} (rollback --json gives them all)", err=True)
        show_diff(result["diff"])
        events = counted(len(result["events"]), "event")
        if dry_run:
            click.echo(f"dry run: {events} would be written; nothing was")
        elif result["written"]:
            click.echo(
                f"rolled back to revision {result['to']}: {events}, "
                f"now at revision {result['revision']}"
            )
        elif result["notes"]:
            click.echo(f"nothing written: what differs from revision {result['to']} is left out")
        else:
            click.echo(f"already as at revision {result['to']}: nothing written")

    emit(settings, result, human)


@cli.command("watch")
@click.option(
    "--from",
    "after",
    type=REVISION,
    default=0,
    metavar="REV",
    help="Deliver every change after this revision first (default: all).",
)
@query_options
@pass_settings
def watch_command(settings: Settings, after: int) -> None:
    """Every change after a revision, in order, then follow live; --by names
    the actor. Ctrl-C, SIGTERM or SIGHUP stops it."""
    check_query(by=settings.by)
    # A revision past an empty log's head is refused, as a read's: on a path
    # with no log, making one first left it there (one from 0 waits on it).
    settings.reads_only = after > 0
    settings.follows = True
    with stopped_when_asked():
        changes = once_it_answers(
            settings, "watch", lambda: settings.models().watch(after, by=settings.by)
        )
        let_warnings_through()  # it runs until stopped
        for event in changes:
            if settings.json:
                click.echo(json_line(event))
            else:
                what = event.get("error") or json_line(event["fields"])
                # An undecodable record has no time or actor: "?", as log shows it.
                say(
                    f"{event['revision']} {event['time'] or '?'} {event['by'] or '?'} "
                    f"{event['model'] or '-'} {event['event']} {what}"
                )


@cli.command("replay")
@shared_options
@pass_settings
@reads_only  # it rebuilds read models of the log: where there is none, it makes none
def replay_command(settings: Settings) -> None:
    """Rebuild the read models (the catalog, its snapshots, the audit) from the log."""
    # Loaded only to replay: rich's progress bar was a tenth of every
    # command's start-up.
    import msgspec
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from catalog_es.catalog import Skipped

    models = settings.models()
    with Progress(
        TextColumn("replaying"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not sys.stderr.isatty(),  # piped, it left an empty line behind
    ) as bar:
        task = bar.add_task("replay", total=None)

        def progress(revision: int, head: int) -> None:
            if revision % 1000 == 0 or revision == head:
                bar.update(task, completed=revision, total=head)

        summary = models.rebuild(progress)

    def human() -> None:
        click.echo(
            f"replayed to revision {summary['revision']}: "
            f"{counted(summary['models'], 'model')} in force, "
            f"{counted(summary['snapshots'], 'snapshot')}, "
            f"{counted(len(summary['skipped']), 'event')} skipped"
        )
        for s in summary["skipped"]:
            what = msgspec.convert(s, Skipped).what()  # as the load's warning names it
            say(f"skipped revision {s['revision']} ({what}): {s['reason']}")

    emit(settings, summary, human)
