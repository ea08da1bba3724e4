"""Stops asked of ``watch`` and ``serve`` before they can take them.

Their imports take most of a second: a Ctrl-C in them was ``Aborted!`` and
1, a SIGTERM killed the process, where a command that runs until stopped
says ``stopped`` and exits 0 whenever it comes. So, for them alone, both are
noted from the first line until the command takes them over
(:func:`catalog_es.cli.base.stopped_when_asked`), which then stops at once.
Imports nothing heavy: it runs before the rest is imported.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from types import FrameType
from typing import Any

UNTIL_STOPPED = frozenset({"watch", "serve"})

# The root's options that take a value (a test holds this to the group's):
# the command is the first word that is none of theirs.
ROOT_VALUED_OPTIONS = frozenset({"--db", "--config", "--by", "--reason", "--expected-revision"})

# Ctrl-C, a supervisor's stop, and a hang-up (a terminal closed, or an
# operator's `kill -HUP` asking a reload no command does: it killed the
# server, cutting off what it was answering, without a word).
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_asked: list[int] = []
# The handlers noting replaced, to be put back when the command takes over.
_replaced: dict[int, Any] = {}


def command_named(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names, as the root group reads it."""
    args = iter(argv)
    for arg in args:
        if arg == "--":
            return next(args, None)
        if arg in ROOT_VALUED_OPTIONS:
            next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None


def note_stops(argv: Sequence[str]) -> None:
    """Note :data:`STOPS`, rather than act on them, if ``argv`` runs
    until stopped: a refusal (a usage error) still ends it as one. One
    ignored (a script's background job) stays so; one blocked is let through."""
    if command_named(argv) not in UNTIL_STOPPED:
        return
    for signum in STOPS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            _replaced[signum] = signal.signal(signum, _note)
    # A signal mask is inherited from the thread that starts the process:
    # started by a supervisor's thread that blocks them, serve and watch
    # stopped on nothing but SIGKILL (hostile test). Ignoring a stop is how
    # one is refused (nohup); a mask is no such choice. Let through once
    # noted: one sent in between comes to the noting.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)


def _note(signum: int, _frame: FrameType | None) -> None:
    if _asked:
        # Asked twice: the loading may hang (a slow file system), so the
        # second is acted on at once, as it would have been.
        handler = _replaced.pop(signum, signal.SIG_DFL)
        signal.signal(signum, handler)
        signal.raise_signal(signum)
        return
    _asked.append(signum)


def handler_found(signum: int) -> Any:
    """The handler ``signum`` had before :func:`note_stops` replaced it (its
    own if it was not): the one to put back once the command is done."""
    return _replaced.get(signum, signal.getsignal(signum))


def take_over() -> int | None:
    """The stop noted, if one was. The handlers :func:`note_stops` replaced
    are put back where the command installed none of its own: it installs
    them first, for no stop to come between to the handler found (SIGTERM's
    kills the process, with no ``stopped`` said)."""
    for signum, handler in list(_replaced.items()):
        if signal.getsignal(signum) is _note:
            signal.signal(signum, handler)
    _replaced.clear()
    asked = _asked[0] if _asked else None
    _asked.clear()
    return asked
