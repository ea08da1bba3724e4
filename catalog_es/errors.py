"""Domain errors. Entrypoints map them to exit codes and HTTP statuses; the
message is written for the operator who typed the command."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

if TYPE_CHECKING:
    from pathlib import Path

# What a terminal acts on or draws other than as written: C0 and C1 controls
# (an escape sequence can retitle or clear it), the bidi controls (an override
# shows "evil\u202egpj.exe" as "evilexe.jpg"), the line and paragraph
# separators, and lone surrogates. Not every character Python calls
# unprintable: the joiners inside emoji and Persian words, the soft hyphen,
# and the no-break and ideographic spaces, are text.
UNSAFE_TEXT = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029\ud800-\udfff]"
)


def json_escaped(text: str) -> str:
    """JSON ``text`` with what :data:`UNSAFE_TEXT` matches written as a
    ``\\uXXXX`` escape: the same document, safe to print. (Outside its
    strings JSON holds nothing it matches.)"""
    return UNSAFE_TEXT.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


# How long a piece :func:`json_in_pieces` joins its items into grows before
# it is given (an item longer is a piece of its own): 64 items a piece held
# 640 MB for a client that did not read, of items of 10 MB (hostile test).
PIECE_LENGTH = 1 << 18
JSONText = TypeVar("JSONText", str, bytes)


def json_in_pieces(
    encode: Callable[[Any], JSONText],
    separator: JSONText,
    items: Iterable[Any],
    data: dict[str, Any] | None = None,
    key: str = "",
) -> Iterator[JSONText]:
    """``encode`` of ``items`` as one list, in pieces of about :data:`PIECE_LENGTH`
    (bytes, or characters): the same document as encoding it whole, for a list too large to
    hold whole (an apply's answer, an audit's rows). The list is the document
    itself, or, given ``data``, the value of its last key, ``key``."""
    empty = encode([]) if data is None else encode({**data, key: []})
    # Up to and with the list's "[", and from its "]" on (and the document's "}").
    opening, closing = (empty[:-1], empty[-1:]) if data is None else (empty[:-2], empty[-2:])
    yield opening
    later = empty[:0]
    group: list[JSONText] = []
    length = 0
    for item in items:
        group.append(encoded := encode(item))
        length += len(encoded)
        if length >= PIECE_LENGTH:
            yield later + separator.join(group)
            later, group, length = separator, [], 0
    if group:
        yield later + separator.join(group)
    yield closing


def json_line(data: Any) -> str:
    """``data`` as one line of JSON that is safe to print, as ``--json``, the
    event stream's ``data:`` and ``watch --json`` write it: what a terminal
    would act on is a ``\\uXXXX`` escape, which reads back as the same text."""
    return json_escaped(json.dumps(data, ensure_ascii=False))


# What UNSAFE_TEXT matches, as it is found in UTF-8 JSON: an encoder escapes
# the C0 controls, and no UTF-8 holds a lone surrogate, which leaves DEL,
# U+061C, the C1 controls, and the marks and separators of U+200E-U+2069.
# Each pattern begins with a byte, which the search skips to.
_C1_UTF8 = re.compile(rb"\xc2[\x80-\x9f]")
_MARKS_UTF8 = re.compile(rb"\xe2(?:\x80[\x8e\x8f\xa8-\xae]|\x81[\xa6-\xa9])")


def json_escaped_bytes(body: bytes) -> bytes:
    """:func:`json_escaped` of UTF-8 JSON, decoded only when it holds what
    it escapes: looked for in the bytes, an answer of 35 MB of text takes
    tens of milliseconds, where a search of the text took hundreds."""
    unsafe = b"\x7f" in body
    if not (unsafe or body.isascii()):
        unsafe = (
            b"\xd8\x9c" in body
            or _C1_UTF8.search(body) is not None
            or _MARKS_UTF8.search(body) is not None
        )
    return json_escaped(body.decode("utf-8")).encode("utf-8") if unsafe else body


# How much of a refused value a message quotes.
SHOWN_LENGTH = 60
# A model name, quoted: any valid one whole (128 characters and the quotes).
NAME_SHOWN_LENGTH = 130


def counted(count: int, noun: str) -> str:
    """``1 change``, ``3 changes``."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"


def missing_folder(folder: Path) -> str | None:
    """Why a file cannot be made in ``folder``, when it is no directory: the
    folder is not made for it, as a mistyped one would hold a file nothing reads.
    A folder that cannot be looked at says why (a name too long; for another
    user than root, one it may not enter)."""
    try:
        if folder.is_dir():
            return None
        return "not a directory" if folder.exists() else "no such directory; make it first"
    except OSError as error:
        return (error.strerror or type(error).__name__).lower()


def shown(value: object, limit: int = SHOWN_LENGTH) -> str:
    """``repr(value)`` cut short: a message quotes what it refuses, on one line
    (``repr`` escapes line breaks), and never a megabyte of it."""
    return cut_short(repr(value), limit)


def first_line(text: str) -> str:
    """What a library's message says first: SQLAlchemy's and the drivers' run
    on over several lines, the first saying what went wrong."""
    return next(iter(text.strip().splitlines()), "")


def cut_short(text: str, limit: int) -> str:
    """``text``, or its first ``limit`` characters and an ellipsis."""
    return text if len(text) <= limit else f"{text[:limit]}…"


class TurnedOn(NamedTuple):
    """What the declared config decided of a refusal: that it declares each
    of ``models`` (``declared``), or none of them; or that it does not know
    ``engine`` (its ``engines:``). Another config that decides it otherwise
    (the one the log's nodes last recorded, where a run is given a stale
    one) explains the refusal, and the command line's refusal says so
    (``Settings.another_config_explains``): otherwise for every one of
    ``models``, or, with ``any_of``, for any one (a fallback cycle, which
    one declared model on it breaks). ``named``: the refusal is about that
    one model, and names it already."""

    models: tuple[str, ...] = ()
    declared: bool = False
    engine: str = ""
    named: bool = False
    any_of: bool = False


class Refused(Exception):
    """A command was refused: nothing was written. ``turned_on``: what of it
    the declared config decided, if anything."""

    def __init__(self, message: str, turned_on: TurnedOn | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.turned_on = turned_on

    def __str__(self) -> str:
        return self.message


class OutcomeUnknown(Exception):
    """A write failed at its commit, once the commit had begun: the disk
    failed the sync of its frames (SQLite's commit is in the -wal file all
    the same, and a recovery of the file puts it back), or the session
    ended while the server committed. It may stand or not: not a refusal,
    which says nothing was written. ``message`` is for any client;
    ``str()`` adds what the database said, for the operator."""

    def __init__(self, first: int, last: int, said: str) -> None:
        self.first = first
        self.last = last
        self.said = said
        where = f"revision {last}" if first == last else f"revisions {first} to {last}"
        self.message = (
            "the write's outcome is unknown: its commit failed;"
            f" if it was written, the log holds it as {where}"
        )
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message.replace("failed;", f"failed ({self.said});", 1)


class InvalidModel(Refused):
    """A model, or the catalog it would be part of, does not validate."""

    def __init__(
        self, model: str, field: str, problem: str, turned_on: TurnedOn | None = None
    ) -> None:
        self.model = model
        self.field = field
        self.problem = problem
        super().__init__(f"model {shown(model, NAME_SHOWN_LENGTH)}: {field}: {problem}", turned_on)


class ModelNotFound(Refused):
    """The name is not a model in the catalog in force."""

    def __init__(self, name: str, detail: str = "is not in the catalog") -> None:
        self.name = name
        super().__init__(
            f"model {shown(name, NAME_SHOWN_LENGTH)} {detail}", TurnedOn((name,), named=True)
        )


class DeclaredInConfig(Refused):
    """The model ``name`` is declared in configuration, which wins every conflict."""

    def __init__(self, name: str, message: str) -> None:
        self.name = name
        super().__init__(message, TurnedOn((name,), declared=True, named=True))


class RevisionConflict(Refused):
    """The log has moved past the revision the command was based on."""

    def __init__(
        self, expected: int, head: int, written: int | None = None, *, skipped: bool = False
    ) -> None:
        """``written``: the last revision the log's head record says was
        written, past ``head`` when the last events were deleted by hand;
        ``skipped``: the log's revisions skip ``expected``, as PostgreSQL's
        do the number of a write that failed."""
        self.expected = expected
        self.head = head
        if skipped:
            # No read gives it (one of it reads the revision before): a
            # client made it up, and is not told someone wrote over it.
            why = (
                f"revision {expected} was never written (the log's revisions skip it);"
                " read it again and retry"
            )
        elif expected < head:
            why = "someone changed the catalog since you read it; read it again and retry"
        elif written is not None and expected <= written:
            # A read gave it, and the log was cut back under it since.
            why = (
                f"revision {expected} was written, but the log no longer holds it: the events"
                f" after revision {head} were deleted (catalog-es verify); read it again and retry"
            )
        else:
            # Past the head, no read gave it: retrying with it again cannot succeed.
            why = f"revision {expected} was never written"
        super().__init__(f"the log is at revision {head}, not {expected}: {why}")


def lost_events(why: str) -> str:
    """``why`` the log no longer holds events it held, and what most often
    makes it so; a hand edit of the log reads the same, which verify tells."""
    return (
        f"{why} (a failover, or a restored backup?); "
        "catalog-es verify says whether the log was edited"
    )


class LogRewritten(Refused):
    """The log no longer holds an event as a follower was given it: it lost
    events and took others in their place (a failover, a restored backup)."""

    @classmethod
    def at(cls, revision: int) -> LogRewritten:
        """Told to a watch whose last given event, at ``revision``, the log no
        longer holds as it gave it."""
        lost = lost_events(
            f"the log no longer holds revision {revision} as this watch gave it: it "
            "lost events and took others"
        )
        return cls(f"{lost}; watch again from a revision before the loss")


class NoConfigGiven(Refused):
    """A write by a run given no declared config at all (a shell in another
    folder than the deploy's), on a log whose nodes recorded one: it would
    record none over it, undeclaring every declared model (and its engines:
    the runtime models on them would be skipped). Surprising, and the
    dangerous direction: refused; `models: []` declares none on purpose."""

    def __init__(self, recorded: int, given_by: str) -> None:
        """``recorded``: the revision of the log's last declared config;
        ``given_by``: where a run takes its config from."""
        self.recorded = recorded
        super().__init__(
            f"no declared config given ({given_by}): the log's nodes recorded one at "
            f"revision {recorded}, and this write would record none over it (no models, "
            "the default engines); give that config, or one declaring what every node "
            "should run (`models: []`: no models)"
        )


class InputError(Refused):
    """Input that could not be parsed (file, YAML, JSON, arguments)."""


class ConfigError(Exception):
    """The declared configuration cannot be loaded; nothing starts on it."""


class DeclaredModelError(ConfigError):
    """A declared model breaks the catalog's rules: ``field`` of its
    ``place``-th declaration (0 for the first of its name, 1 for the second)."""

    def __init__(self, message: str, model: str, field: str = "", place: int = 0) -> None:
        self.model = model
        self.field = field
        self.place = place
        super().__init__(message)


class StorageBusy(Refused):
    """The database stayed locked by another writer past the bounded wait."""


class DamagedLog(Refused):
    """The log holds what its write path never writes (a hand edit): nothing
    can be appended to it as it is; ``catalog-es verify`` says what else."""


class DamagedReadModel(Refused):
    """A read model holds what its build never writes (a hand edit, a damaged
    disk): it is disposable, and ``catalog-es replay`` makes it again from the log."""


class UpgradeFailed(Refused):
    """The log's tables could not be brought to this version's layout: the
    database refused a step; nothing was changed."""


class NoLogYet(Exception):
    """No log is at the database given (no SQLite file, an empty one, or no
    log's table along the PostgreSQL search path), and it was opened not
    to make one: ``where`` says where it would be made."""

    def __init__(self, where: str) -> None:
        super().__init__(f"no log {where}")
        self.where = where


def came_of_a_stop(error: BaseException) -> bool:
    """Whether ``error`` is a Ctrl-C, or came of one: psycopg cancels the
    query a stop cuts off and tells it as its own error (the connection
    lost), and handing that connection back may then fail in turn ("can't
    change 'autocommit' now"), either taking the stop's place."""
    seen: BaseException | None = error
    for _ in range(10):  # a chain of contexts, never a loop, but bounded all the same
        if seen is None:
            return False
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__context__
    return False
