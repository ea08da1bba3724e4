"""The weights provenance commands: model updates, check-updates, update, rollback."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from catalog_es import bootstrap
from catalog_es.cli.base import (
    F,
    Settings,
    emit,
    meta,
    pass_settings,
    reads_only,
    say,
    shared_options,
    table,
)
from catalog_es.cli.models import model
from catalog_es.errors import counted

if TYPE_CHECKING:
    from catalog_es.weights import Weights


def registry_options(f: F) -> F:
    """``--mirror`` and ``--weights``: where the registry is, where fetched commits go."""
    f = click.option(
        "--weights",
        "weights_dir",
        metavar="DIR",
        help="Where fetched commits are kept, one folder each (env CATALOG_ES_WEIGHTS; "
        "default ./weights).",
    )(f)
    return click.option(
        "--mirror",
        metavar="DIR",
        help="The registry: a mirror folder, <org>/<repo>/<commit>/ and <org>/<repo>/refs "
        "(env CATALOG_ES_MIRROR).",
    )(f)


def _weights(settings: Settings, mirror: str | None, weights_dir: str | None) -> Weights:
    return bootstrap.open_weights(settings.models, mirror, weights_dir)


def _short(revision: str | None) -> str:
    return (revision or "")[:12] or "-"


def _files_text(change: dict[str, Any]) -> str:
    return (
        f"{len(change['changed'])} changed, {len(change['added'])} added, "
        f"{len(change['removed'])} removed"
    )


def _show_updates(report: dict[str, Any]) -> None:
    for unchecked in report["unchecked"]:
        say(f"note: model {unchecked['model']} not checked: {unchecked['reason']}", err=True)
    updates = report["updates"]
    if not updates:
        unchecked = len(report["unchecked"])
        if unchecked:
            # "No upstream changes" alone would vouch for models nobody
            # compared (every model, where the mirror's refs is broken).
            click.echo(
                f"no upstream changes found at revision {report['revision']}; "
                f"{counted(unchecked, 'model')} not checked (see the notes)"
            )
        else:
            click.echo(f"no upstream changes at revision {report['revision']}")
        return
    table(
        ["MODEL", "LAYER", "REPOSITORY", "RUNNING", "UPSTREAM", "FILES", "FIRST SEEN"],
        (
            [
                u["model"],
                "declared" if u["declared"] else "runtime",
                u["repository"],
                _short(u["running"]) + ("" if u["running_in_registry"] else " (gone)"),
                f"{_short(u['upstream'])} ({u['ref']})",
                _files_text(u),
                f"revision {u['first_seen']['revision']}" if u["first_seen"] else "-",
            ]
            for u in updates
        ),
    )


@model.command("updates")
@registry_options
@shared_options
@pass_settings
@reads_only
def model_updates(settings: Settings, mirror: str | None, weights_dir: str | None) -> None:
    """The models whose upstream (the registry's main branch) has other weights
    than they run: another commit, or other file checksums. Writes nothing."""
    report = _weights(settings, mirror, weights_dir).updates()
    emit(settings, report, lambda: _show_updates(report))


@model.command("check-updates")
@registry_options
@shared_options
@pass_settings
def model_check_updates(settings: Settings, mirror: str | None, weights_dir: str | None) -> None:
    """Like updates, and record what is new: the origin of each runtime model
    that has none or only part of one, and each upstream change not recorded
    before (once, so the log shows when it was first seen)."""
    said = meta(settings)
    report = _weights(settings, mirror, weights_dir).check_updates(**said)

    def human() -> None:
        for origin in report["origins"]:
            say(
                f"recorded the origin of {origin['model']}: "
                f"{origin['repository']}@{_short(origin['revision'])}"
            )
        _show_updates(report)
        if report["recorded"]:
            click.echo(f"recorded {counted(len(report['recorded']), 'new upstream change')}")

    emit(settings, report, human)


def _show_move(result: dict[str, Any], verb: str) -> None:
    name = result["model"]["name"]
    before, after = result["from"], result["to"]
    if not result["written"]:
        # Its first digits, as the line of a move shows them (--json has all).
        where = f"{after['repository']}@{_short(after['revision'])}"
        # Its folder was checked, and what was missing from it fetched.
        fetched = result["fetched"]
        again = f" ({counted(len(fetched), 'file')} fetched into its folder)" if fetched else ""
        say(f"{name} already runs {where}: nothing written{again}")
        return
    back = f" (the weights of revision {result['rollback_to']})" if result["rollback_to"] else ""
    say(
        f"{verb} {name} from {before['repository'] or before['source']}"
        f"@{_short(before['revision'])} to {after['repository']}@{_short(after['revision'])}"
        f"{back} at revision {result['revision']}: {_files_text(result)}; "
        "replicas are replaced one at a time"
    )
    say(f"source {after['source']}")


@model.command("update")
@click.argument("name")
@click.option(
    "--revision",
    metavar="COMMIT|BRANCH",
    help="In the registry, not a log revision (default: where main points).",
)
@registry_options
@shared_options
@pass_settings
def model_update(
    settings: Settings,
    name: str,
    revision: str | None,
    mirror: str | None,
    weights_dir: str | None,
) -> None:
    """Move a runtime model to other weights of its repository: fetched beside
    the ones it runs, every checksum verified, then its replicas replaced one at
    a time. Refused, writing nothing, if any file is missing or differs."""
    said = meta(settings)
    result = _weights(settings, mirror, weights_dir).update(name, revision, **said)
    emit(settings, result, lambda: _show_move(result, "updated"))


@model.command("rollback")
@click.argument("name")
@click.option(
    "--to",
    metavar="COMMIT",
    help="A commit the model ran before (an id or a prefix of one), not a log revision "
    "(default: the weights before the current ones).",
)
@registry_options
@shared_options
@pass_settings
def model_rollback(
    settings: Settings,
    name: str,
    to: str | None,
    mirror: str | None,
    weights_dir: str | None,
) -> None:
    """Move a runtime model back to weights it ran before, with the checksums
    the log recorded for them, verified the same way as an update."""
    said = meta(settings)
    result = _weights(settings, mirror, weights_dir).rollback(name, to, **said)
    emit(settings, result, lambda: _show_move(result, "rolled back"))
