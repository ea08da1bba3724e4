"""``serve`` (the HTTP API and the console) and ``token`` (who may use them)."""

from __future__ import annotations

import copy
import errno
import gc
import logging
import resource
import signal
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

import click

from catalog_es import bootstrap
from catalog_es.cli.base import (
    Settings,
    WholeNumberRange,
    cli,
    emit,
    let_warnings_through,
    meta,
    once_it_answers,
    pass_settings,
    say,
    shared_options,
    stopped_when_asked,
    table,
)
from catalog_es.errors import InputError, shown
from catalog_es.web import MAX_WATCHES, Role

if TYPE_CHECKING:
    import asyncio

    from catalog_es.application import Models

tokens_option = click.option(
    "--tokens",
    "tokens_file",
    metavar="FILE",
    help="The tokens file (env CATALOG_ES_TOKENS; default ./catalog-tokens.json).",
)


@cli.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    type=WholeNumberRange(0, 65535),
    default=8080,
    show_default=True,
    help="Port to listen on; 0 takes a free one, said as the server starts.",
)
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
    $CATALOG_ES_ACTOR, else the OS user), with a warning if the log had
    recorded it before another replaced it; another node's writes under
    another config are told once a config. With --expected-revision, it starts
    only on a log at that revision (a request gives its own, If-Match).
    """
    # Loaded only to serve.
    import asyncio

    import uvicorn
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
    _warn_if_few_descriptors(max_watches)
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
    with stopped_when_asked() as asked, _closing(sockets):

        def started() -> tuple[Models, int]:
            if not sockets:
                # Listening again before anything is recorded: a port taken
                # while it waited refuses the start with nothing written (review).
                sockets.extend(_listening(host, port))
            # Before the warnings are let through: a start refused (a stale
            # --expected-revision) is one line, as any refusal.
            said = meta(settings)
            models = settings.models()
            return models, models.record_declaration(**said)

        def not_listening() -> None:
            # While it waits for the database: a connection would sit in the
            # queue unanswered, and a load balancer's check of the port take
            # the node for one that serves (review).
            for sock in sockets:
                sock.close()
            sockets.clear()

        models, revision = once_it_answers(settings, "serve", started, waiting=not_listening)
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
        # Until uvicorn's handlers are in (see Server.capture_signals): a
        # supervisor's stop as soon as the line is out came as uvicorn made
        # its coroutine and event loop, and left them half made.
        asked.hold()
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
            async def serve(self, sockets: list[socket.socket] | None = None) -> None:
                asyncio.get_running_loop().set_exception_handler(AcceptErrorsTold())
                await super().serve(sockets)

            @contextmanager
            def capture_signals(self) -> Iterator[None]:
                with super().capture_signals():
                    asked.let_through()  # to uvicorn: shut down before it serves
                    yield

            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                if sig == signal.SIGINT and interrupt_ignored:
                    return
                asked.stops.append(sig)  # the first is told, whatever came after
                # Watch streams never end by themselves: end them, or the
                # shutdown waits for its grace period and then cancels them.
                end_streams(app)
                super().handle_exit(sig, frame)

        Server(config).run(sockets=sockets)


log = logging.getLogger(__name__)

# How often, at most, a server tells that it cannot accept connections.
ACCEPT_ERRORS_TOLD_EVERY = 10.0


class AcceptErrorsTold:
    """A server's event loop's exception handler: a connection it cannot
    accept (out of descriptors, say) told in one line, and then, every
    ``every`` seconds while they go on, how many accepts failed since; any
    other exception to the loop's default handler.

    asyncio tells each failed accept() with its traceback and tries again a
    second later, as many times a tick as the listening backlog (uvicorn's
    2048): under ``ulimit -n 20``, 30 idle clients made 5.8 MB of stderr a
    second, at 97% CPU, enough to fill the database's disk (hostile test)."""

    def __init__(self, every: float = ACCEPT_ERRORS_TOLD_EVERY) -> None:
        self.every = every
        self.failed_since_told = 0
        self._next_count: asyncio.TimerHandle | None = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if isinstance(error, ValueError) and _retrying_accepts(context):
            # asyncio's retry of a failed accept, due a second after it, which
            # closing the server does not cancel: it found the listening
            # socket closed, and a stop within that second printed a traceback.
            return
        if not (isinstance(error, OSError) and _accepting(context)):
            loop.default_exception_handler(context)
        elif self._next_count is None:
            # The first in a while: told at once.
            log.warning(
                "%s: a connection could not be accepted (it waits, tried again each "
                "second); %s; how many more fail is told every %g s",
                _why_not_accepted(error),
                _remedy(error),
                self.every,
            )
            self._next_count = loop.call_later(self.every, self._tell_count, loop, error)
        else:
            self.failed_since_told += 1

    def _tell_count(self, loop: asyncio.AbstractEventLoop, error: OSError) -> None:
        if not self.failed_since_told:
            self._next_count = None  # over: the next is told at once
            return
        log.warning(
            "%s: accept() failed %s times in the last %g s (clients wait, or give up); %s",
            _why_not_accepted(error),
            f"{self.failed_since_told:,}",
            self.every,
            _remedy(error),
        )
        self.failed_since_told = 0
        self._next_count = loop.call_later(self.every, self._tell_count, loop, error)


def _accepting(context: dict[str, Any]) -> bool:
    """Whether the loop's ``context`` tells an accept() that failed: out of a
    resource (asyncio's own message), or with any other error, which asyncio
    raises out of its accept callback, to be told again each tick."""
    message = str(context.get("message", ""))
    return message.startswith("socket.accept()") or "_accept_connection" in message


def _retrying_accepts(context: dict[str, Any]) -> bool:
    """Whether the loop's ``context`` tells its retry of accepts failing."""
    return "_start_serving" in str(context.get("message", ""))


def _why_not_accepted(error: OSError) -> str:
    if error.errno == errno.EMFILE:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return f"out of file descriptors (limit {soft})"
    if error.errno == errno.ENFILE:
        return "the system is out of file descriptors"
    return f"cannot accept connections: {error.strerror or error}"


def _remedy(error: OSError) -> str:
    if error.errno == errno.EMFILE:
        return "raise the limit (ulimit -n) or serve fewer clients at once"
    if error.errno == errno.ENFILE:
        return "raise the system's (sysctl fs.file-max) or close what holds them"
    return "it is tried again each second"


# Descriptors a server may hold besides its event streams' sockets: SQLite's
# pool at its peak (15 connections, each the database, its WAL and its shared
# memory: 45), the requests under way (40 threads), the listener, the loop's
# own, standard streams, the tokens file as it is read, and a margin.
DESCRIPTORS_BESIDES_STREAMS = 128


def _warn_if_few_descriptors(max_watches: int) -> None:
    """A line at start when the descriptor limit is lower than a server at
    its --max-watches can need: beyond it, clients are left waiting, unseen
    until they are (hostile test). Linux's usual 1024 is enough for 256."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = max_watches + DESCRIPTORS_BESIDES_STREAMS
    if soft != resource.RLIM_INFINITY and soft < needed:
        say(
            f"warning: the file descriptor limit is {soft} (ulimit -n), below the "
            f"{needed} a server can need (one for each client, up to {max_watches} "
            f"event streams, and 3 for each SQLite connection): clients beyond it "
            f"are left waiting; raise it (ulimit -n 4096)",
            err=True,
        )


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
                # getaddrinfo's protocol, TCP: asyncio turns Nagle off only on
                # a socket that names it, and with it on, each answer on a kept
                # connection waited 40 ms for the client's delayed ACK.
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
    help="read: queries; write: model commands and apply; admin: rollback too.",
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
        # A file edited by hand may hold what a terminal acts on (token list shows it so).
        lambda: say(f"revoked token {entry.id} of {entry.actor}"),
    )
