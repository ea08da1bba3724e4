"""``serve`` (the HTTP API and the console) and ``token`` (who may use them)."""

from __future__ import annotations

import copy
import gc
import logging
import signal
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import click

from catalog_es import bootstrap
from catalog_es.cli.base import (
    Settings,
    WholeNumberRange,
    cli,
    emit,
    let_warnings_through,
    meta,
    pass_settings,
    say,
    shared_options,
    stopped_when_asked,
    table,
)
from catalog_es.errors import InputError, shown
from catalog_es.web import MAX_WATCHES
from catalog_es.web.tokens import Role

tokens_option = click.option(
    "--tokens",
    "tokens_file",
    metavar="FILE",
    help="The tokens file (env CATALOG_ES_TOKENS; default ./catalog-tokens.json).",
)


@cli.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=WholeNumberRange(0, 65535), default=8080, show_default=True)
@click.option(
    "--access-log",
    is_flag=True,
    help="A line on stderr for each request: the client, the request line, the status.",
)
@click.option(
    "--max-watches",
    type=WholeNumberRange(1, 100_000),
    default=MAX_WATCHES,
    show_default=True,
    help="Event streams (GET /events) open at once, at most; each holds a thread. "
    "One more is refused with 503.",
)
@tokens_option
@shared_options
@pass_settings
def serve(
    settings: Settings,
    host: str,
    port: int,
    access_log: bool,
    max_watches: int,
    tokens_file: str | None,
) -> None:
    """Serve the HTTP API (OpenAPI at /docs) and the console (/console/).

    Every request needs a bearer token (catalog-es token add); changes are
    recorded as the token's actor. If the declared config differs from the
    one the log last recorded, it is recorded first, as --by (else
    $CATALOG_ES_ACTOR, else the OS user). With --expected-revision, it starts
    only on a log at that revision (a request gives its own, If-Match).
    """
    import uvicorn  # loaded only to serve
    from uvicorn.config import LOGGING_CONFIG

    from catalog_es.web.app import end_streams

    tokens = bootstrap.open_tokens(tokens_file)
    if not tokens.entries():
        raise InputError(
            f"no tokens in {tokens.path}: create one first, e.g. "
            f"catalog-es token add alice --role admin --tokens {tokens.path}"
        )
    mode = tokens.path.stat().st_mode & 0o777
    if mode & 0o022:
        # Not refused (it is the operator's file), but told: whoever can write
        # it can give themselves an admin token.
        say(
            f"warning: {tokens.path} can be written by others (mode {mode:o}): anyone "
            f"who can write it can add a token; chmod 600 {tokens.path}",
            err=True,
        )
    if not host:
        # The system's "no host" is every interface: an unset variable
        # (--host "$HOST") must not open the API to the network.
        raise InputError(
            "--host '': give the address to listen on (0.0.0.0 for every IPv4 interface)"
        )
    # Started with Ctrl-C ignored (a script's background job), a process keeps
    # ignoring it, as Python does; uvicorn would stop on it, without a word.
    interrupt_ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    # Listening first: a server that cannot (the port taken, a host that does
    # not resolve) is refused before it opens the database or records anything.
    sockets = _listening(host, port)
    with stopped_when_asked(), _closing(sockets):
        models = settings.models()
        # Before the warnings are let through: a start refused (a stale
        # --expected-revision) is one line, as any refusal.
        revision = models.record_declaration(**meta(settings))
        let_warnings_through()  # a server's log tells them as they come
        app = bootstrap.open_web_app(models, tokens, max_watches=max_watches)
        # What is loaded now (the code, the catalog in force) mostly lives as
        # long as the server: out of the collector's sight, a full collection
        # in the middle of a request rescans only what came after, not 20 ms of
        # heap for 10,000 models. Collected first, so no garbage is frozen with
        # it; what a command later replaces holds no cycles, and is freed as usual.
        gc.collect()
        gc.freeze()
        addresses = ", ".join(_url(sock) for sock in sockets)
        say(
            f"serving the catalog at revision {revision} on {addresses} "
            f"(console /console/, API docs /docs)",
            err=True,
        )
        # Logs on stderr, as every command's: uvicorn writes its access lines to stdout.
        log_config = copy.deepcopy(LOGGING_CONFIG)
        log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"
        config = uvicorn.Config(
            app,
            log_level="warning",
            log_config=log_config,
            access_log=access_log,
            use_colors=sys.stderr.isatty(),  # uvicorn asks stdout's terminal
            timeout_graceful_shutdown=5,
        )
        if access_log:
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                if sig == signal.SIGINT and interrupt_ignored:
                    return
                # Watch streams never end by themselves: end them, or the
                # shutdown waits for its grace period and then cancels them.
                end_streams(app)
                super().handle_exit(sig, frame)

        Server(config).run(sockets=sockets)


@contextmanager
def _closing(sockets: list[socket.socket]) -> Iterator[None]:
    """``sockets`` closed as the block ends, however it ends."""
    try:
        yield
    finally:
        for sock in sockets:
            sock.close()


# What uvicorn listens with unless told.
_BACKLOG = 2048


def _listening(host: str, port: int) -> list[socket.socket]:
    """Sockets listening on every address ``host`` names, as asyncio would
    bind them for uvicorn (``localhost``: IPv4 and IPv6 alike; an address of
    a family the system lacks passed over), all on one port (``0``: the one
    the first was given). Listening at once: a second server on the port is
    refused here, not after it has recorded anything."""
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, UnicodeError) as error:
        raise InputError(
            f"--host {shown(host)}: {getattr(error, 'strerror', None) or error}"
        ) from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, protocol, _, address in dict.fromkeys(found):
            try:
                sock = socket.socket(family, kind, protocol)
            except OSError:
                continue  # a family this system lacks (IPv6 turned off)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if len(sockets) > 1:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(_BACKLOG)
        if not sockets:
            raise OSError(f"no address of {host!r} can be listened on here")
    except OSError as error:
        for sock in sockets:
            sock.close()
        raise InputError(
            f"cannot listen on {shown(host)} port {port}: {error.strerror or error}"
        ) from None
    return sockets


def _url(sock: socket.socket) -> str:
    address, port = sock.getsockname()[:2]
    return (
        f"http://[{address}]:{port}/"
        if sock.family == socket.AF_INET6
        else f"http://{address}:{port}/"
    )


@cli.group("token")
@shared_options
def token() -> None:
    """Create, list and revoke the bearer tokens of the HTTP API."""


@token.command("add")
@click.argument("actor")
@click.option(
    "--role",
    type=click.Choice([r.name for r in Role]),
    default=Role.read.name,
    show_default=True,
    help="read: queries; write: model commands; admin: rollback too.",
)
@tokens_option
@shared_options
@pass_settings
def token_add(settings: Settings, actor: str, role: str, tokens_file: str | None) -> None:
    """A new token for ACTOR, printed once (only its salted hash is kept)."""
    entry, secret = bootstrap.open_tokens(tokens_file).add(actor, role)
    emit(
        settings,
        {"id": entry.id, "actor": entry.actor, "role": entry.role, "token": secret},
        lambda: click.echo(secret),
    )
    if not settings.json:
        click.echo(
            f"token {entry.id} for {entry.actor} ({entry.role}); it is not shown again", err=True
        )


@token.command("list")
@tokens_option
@shared_options
@pass_settings
def token_list(settings: Settings, tokens_file: str | None) -> None:
    """The tokens: id, actor, role, when created (never the tokens themselves)."""
    entries = bootstrap.open_tokens(tokens_file, existing=True).describe()
    emit(
        settings,
        entries,
        lambda: table(
            ["ID", "ACTOR", "ROLE", "CREATED"],
            ([e["id"], e["actor"], e["role"], e["created"]] for e in entries),
        ),
    )


@token.command("remove")
@click.argument("token_id", metavar="ID")
@tokens_option
@shared_options
@pass_settings
def token_remove(settings: Settings, token_id: str, tokens_file: str | None) -> None:
    """Revoke a token; a running server refuses it from its next request on."""
    entry = bootstrap.open_tokens(tokens_file, existing=True).remove(token_id)
    emit(
        settings,
        {"id": entry.id, "actor": entry.actor, "role": entry.role},
        lambda: click.echo(f"revoked token {entry.id} of {entry.actor}"),
    )
