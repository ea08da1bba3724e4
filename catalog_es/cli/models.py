"""The model commands, and the log and sources queries."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from functools import partial
from typing import Any

import click

from catalog_es import bootstrap
from catalog_es.cli.base import (
    COUNT,
    INTEGER,
    REVISION,
    REVISION_OR_TIME,
    Settings,
    check_query,
    cli,
    declared_then_option,
    emit,
    emit_result,
    emit_rows,
    meta,
    pass_settings,
    query_options,
    read_as_usage,
    read_at,
    reads_only,
    say,
    scaling_text,
    shared_options,
    show_model,
    table,
    write_json_list,
    write_out,
)
from catalog_es.errors import InputError, counted, json_line, shown
from catalog_es.names import FINGERPRINT_SHOWN


@cli.group()
@shared_options
def model() -> None:
    """Read and change the models in the catalog."""


AT_HELP = "Read the catalog as it was at a revision or UTC time."

# Models named in the list's warning line; the rest are counted.
WARNED_NAMED = 5


@model.command("list")
@click.option("--at", type=REVISION_OR_TIME, help=AT_HELP)
@declared_then_option
@shared_options
@pass_settings
@reads_only
def model_list(settings: Settings, at: int | datetime | None, declared_then: bool) -> None:
    """Every model in force, declared and runtime."""
    revision = read_at(settings, at, declared_then)
    models = settings.models().models_as_read(revision, declared_then=declared_then)
    warned: list[str] = []

    def row(m: dict[str, Any]) -> list[str]:
        if m.get("warnings"):
            warned.append(m["name"])
        return [
            m["name"],
            "declared" if m["declared"] else "runtime",
            m["engine"],
            m["effective_class"],
            m["owner"] or "-",
            scaling_text(m),
            m["source"],
        ]

    def human() -> None:
        table(
            ["NAME", "LAYER", "ENGINE", "CLASS", "OWNER", "SCALING", "SOURCE"],
            (row(m) for m in models),
        )
        # The table has no room for them, and a model loaded with a warning
        # (a declared CPU-only model without memory) runs as it is: said once.
        if warned:
            named = ", ".join(warned[:WARNED_NAMED]) + (", …" if len(warned) > WARNED_NAMED else "")
            say(
                f"warning: {counted(len(warned), 'model')} with warnings ({named});"
                " model show NAME, or --json, says what",
                err=True,
            )

    emit_rows(settings, models, human)


@model.command("show")
@click.argument("name")
@click.option("--at", type=REVISION_OR_TIME, help=AT_HELP)
@declared_then_option
@shared_options
@pass_settings
@reads_only
def model_show(
    settings: Settings, name: str, at: int | datetime | None, declared_then: bool
) -> None:
    """One model as it will run (or as it was, with --at)."""
    check_query(model=name)  # no model in force has a name it refuses
    revision = read_at(settings, at, declared_then)
    m = settings.models().get_model(name, revision, declared_then=declared_then)
    emit(settings, m, lambda: show_model(m))


@model.command("add")
@click.argument("file", metavar="FILE|-")
@shared_options
@pass_settings
def model_add(settings: Settings, file: str) -> None:
    """Add a model from a YAML or JSON definition (- reads standard input).
    Re-adding a runtime model replaces its definition."""
    from catalog_es.inputs import read_model

    spec = read_model(file)
    said = meta(settings)
    result = settings.models().add(spec, **said)
    emit_result(settings, result, "added")


@model.command("remove")
@click.argument("name")
@shared_options
@pass_settings
def model_remove(settings: Settings, name: str) -> None:
    """Take a runtime model out of the catalog."""
    said = meta(settings)
    emit_result(settings, settings.models().remove(name, **said), "removed")


@model.command("scale")
@click.argument("name")
@click.option("--min", "minimum", type=INTEGER, help="Fewest replicas (0 lets it scale to zero).")
@click.option("--max", "maximum", type=INTEGER, help="Most replicas.")
@shared_options
@pass_settings
def model_scale(settings: Settings, name: str, minimum: int | None, maximum: int | None) -> None:
    """Change how many replicas a runtime model runs."""
    if minimum is None and maximum is None:
        raise click.UsageError("give --min, --max, or both")
    said = meta(settings)
    result = settings.models().scale(name, minimum, maximum, **said)
    emit_result(settings, result, "scaled")


@model.command("resources")
@click.argument("name")
@click.option("--profile", help="The profile to change (default: every profile).")
@click.option("--memory-gb", type=INTEGER, help="Host memory a replica reserves (min_memory_gb).")
@click.option("--cpu-cores", type=INTEGER, help="CPU cores a replica reserves.")
@shared_options
@pass_settings
def model_resources(
    settings: Settings,
    name: str,
    profile: str | None,
    memory_gb: int | None,
    cpu_cores: int | None,
) -> None:
    """Set what a profile reserves of a node."""
    if memory_gb is None and cpu_cores is None:
        raise click.UsageError("give --memory-gb, --cpu-cores, or both")
    # Given empty (``--profile "$P"``, the variable unset), it would change
    # every profile where one was meant.
    bootstrap.refuse_empty(profile, "--profile", "a profile's name")
    said = meta(settings)
    result = settings.models().set_resources(
        name, profile=profile, memory_gb=memory_gb, cpu_cores=cpu_cores, **said
    )
    emit_result(settings, result, "resources set on")


@model.command("class")
@click.argument("name")
@click.argument("capacity_class", metavar="CLASS")
@shared_options
@pass_settings
def model_class(settings: Settings, name: str, capacity_class: str) -> None:
    """Set the capacity class: critical, standard, opportunistic, or "" to go back
    to what the scaling implies."""
    said = meta(settings)
    result = settings.models().set_class(name, capacity_class, **said)
    emit_result(settings, result, "class set on")


@model.command("owner")
@click.argument("name")
@click.argument("owner")
@shared_options
@pass_settings
def model_owner(settings: Settings, name: str, owner: str) -> None:
    """Set the owner: org:ID, team:ID, project:ID, or "" for shared."""
    said = meta(settings)
    result = settings.models().set_owner(name, owner, **said)
    emit_result(settings, result, "owner set on")


def _pairs(
    values: Iterable[str], what: str, form: str, *, at_last: bool = False
) -> list[tuple[str, str]]:
    """``NAME=VALUE`` options, each name once: a second value for one name is
    refused rather than left to win. ``at_last``: split at the last ``=``,
    for names that may hold one and values that never do (a file path and
    its sha256)."""
    pairs: dict[str, str] = {}
    for value in values:
        key, sep, rest = value.rpartition("=") if at_last else value.partition("=")
        if not sep or not key or not rest:
            raise InputError(f"{what} {shown(value)}: expected {form}")
        if key in pairs:
            raise InputError(f"{what} {shown(key)} is given more than once")
        pairs[key] = rest
    return list(pairs.items())


def _pairs_option(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...], *, at_last: bool = False
) -> list[tuple[str, str]]:
    """The option's pairs (:func:`_pairs`), refused in the form its metavar shows."""
    return read_as_usage(ctx, _pairs, values, param.opts[0], str(param.metavar), at_last=at_last)


@model.command("adapters")
@click.argument("name")
@click.option(
    "--adapter",
    "adapters",
    multiple=True,
    metavar="NAME=SOURCE",
    callback=_pairs_option,
    help="A LoRA adapter; repeat for each. The set replaces the current one.",
)
@click.option("--none", "clear", is_flag=True, help="Serve no adapters.")
@shared_options
@pass_settings
def model_adapters(
    settings: Settings, name: str, adapters: list[tuple[str, str]], clear: bool
) -> None:
    """Replace the LoRA adapters a runtime model serves."""
    if bool(adapters) == clear:
        both = ", not both" if clear else ""
        raise click.UsageError(f"give --adapter NAME=SOURCE (one or more), or --none{both}")
    from catalog_es.spec import Adapter  # after the usage error, which loads no service

    parsed = tuple(Adapter(name=k, source=v) for k, v in adapters)
    said = meta(settings)
    result = settings.models().set_adapters(name, parsed, **said)
    emit_result(settings, result, "adapters set on")


@model.command("source")
@click.argument("name")
@click.argument("source")
@click.option("--repository", help="Registry repository the weights came from.")
@click.option("--revision", help="Commit in that repository (not a log revision).")
@click.option(
    "--file",
    "files",
    multiple=True,
    metavar="PATH=SHA256",
    callback=partial(_pairs_option, at_last=True),
    help="A weights file and its sha256 (split at the last '='); repeat for each.",
)
@shared_options
@pass_settings
def model_source(
    settings: Settings,
    name: str,
    source: str,
    repository: str | None,
    revision: str | None,
    files: list[tuple[str, str]],
) -> None:
    """Move a runtime model to other weights, recording where they came from."""
    from catalog_es.spec import Origin

    # Given empty (``--revision "$REV"``, the variable unset), it would write
    # the source with no origin at all, and exit 0.
    bootstrap.refuse_empty(repository, "--repository", "a registry repository (org/name)")
    bootstrap.refuse_empty(revision, "--revision", "a commit")
    origin = None
    if repository or revision or files:
        origin = Origin(
            repository=repository or "",
            revision=revision or "",
            files=dict(files),
        )
    said = meta(settings)
    result = settings.models().set_source(name, source, origin, **said)
    emit_result(settings, result, "source set on")


@cli.command("sources")
@click.option("--at", type=REVISION_OR_TIME, help=AT_HELP)
@declared_then_option
@shared_options
@pass_settings
@reads_only
def sources(settings: Settings, at: int | datetime | None, declared_then: bool) -> None:
    """Each weights source in the catalog, and the models and adapters using it."""
    revision = read_at(settings, at, declared_then)
    data = settings.models().sources(revision, declared_then=declared_then)
    emit(
        settings,
        data,
        lambda: table(
            ["SOURCE", "USED BY"],
            (
                [
                    source,
                    ", ".join(
                        u["model"] + (f" (adapter {u['adapter']})" if "adapter" in u else "")
                        for u in users
                    ),
                ]
                for source, users in data.items()
            ),
        ),
    )


@cli.command("log")
@click.option("--model", "model_name", metavar="NAME", help="Only this model's events.")
@click.option(
    "--after",
    type=REVISION,
    default=0,
    metavar="REV",
    help="Only events after this revision.",
)
@click.option("--limit", type=COUNT, metavar="N", help="At most N events.")
@query_options
@pass_settings
@reads_only
def log_command(settings: Settings, model_name: str | None, after: int, limit: int | None) -> None:
    """The raw events with their revisions, who and when, oldest first; --by
    names the actor."""
    check_query(model=model_name, by=settings.by)
    events = settings.models().log_events(
        after=after, limit=limit, model=model_name, by=settings.by
    )
    if settings.json:
        # Written as the events are read, a page at a time: one line each.
        write_out(json_line(e) for e in events)
        return
    # A table's columns are as wide as their widest cell, so it is written
    # once every row is read: only each row's text is kept until then.
    table(
        ["REV", "TIME", "BY", "MODEL", "EVENT", "CHANGE", "REASON"],
        (
            [
                str(e["revision"]),
                e["time"] or "?",
                e["by"] or "?",
                e["model"] or "-",
                e["event"],
                e.get("error") or _summary(e["fields"]),
                _why(e),
            ]
            for e in events
        ),
    )


def _why(event: dict[str, Any]) -> str:
    why: str = event["reason"] or ""
    if event["rollback_to"] is not None:
        why = f"{why} (rollback to {event['rollback_to']})".strip()
    return why


def _summary(fields: dict[str, Any]) -> str:
    if "spec" in fields:
        spec = fields["spec"]
        return f"{spec['engine']} {spec['source']}"
    if "fingerprint" in fields:
        return (
            f"{len(fields['models'])} declared models, engines {','.join(fields['engines'])}, "
            f"fingerprint {fields['fingerprint'][:FINGERPRINT_SHOWN]}"
        )
    return " ".join(f"{k}={json_line(v)}" for k, v in fields.items())


@cli.command("apply")
@click.argument("file", metavar="FILE|-")
@shared_options
@pass_settings
def apply_command(settings: Settings, file: str) -> None:
    """Apply a list of changes in one transaction, all or nothing.

    FILE is YAML or JSON: a list whose items each have one key, the kind of
    change — add (a definition), remove (a name), scale {name, min, max},
    resources {name, profile, memory_gb, cpu_cores}, class {name, class},
    owner {name, owner}, adapters {name, adapters}, source {name, source, origin}.
    """
    from catalog_es.inputs import read_changes

    changes = read_changes(file)  # refused before a log is opened, or made
    said = meta(settings)
    result = settings.models().apply_changes(changes, **said)

    if settings.json:
        head = {key: result[key] for key in ("revision", "changes")}
        write_json_list(result["models"], head, "models")
        return
    applied = counted(result["changes"], "change")
    click.echo(f"applied {applied}, now at revision {result['revision']}")
    for name in result["replaced"]:
        click.echo(f"replaced {name}")
