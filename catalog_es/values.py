"""Reading the single values people give: revisions, counts and times
(``--at``, ``--since``, ``--limit``, ``?at=``, ``limit=``, If-Match).

Apart from :mod:`catalog_es.inputs`, whose model definitions and declared
config need pydantic and YAML: the command line reads these as it parses its
options, and its ``--help`` and usage errors load none of the service.
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta

from catalog_es.errors import InputError, shown

# A revision or a count is a 64-bit integer, which is what the databases hold.
MAX_REVISION = 2**63 - 1

_MAX_DIGITS = len(str(MAX_REVISION))


def in_digits(text: str) -> bool:
    """Whether ``text`` is an integer written in ASCII digits, a minus sign
    allowed first (what it may be is then its bounds' to say): Python and
    pydantic read ``1_0`` as 10 and `` 5``, ``+5``, ``5\n`` or a full-width
    digit as numbers, so a slip in ``--max`` or ``limit=`` changed what was
    asked, silently."""
    return _IN_DIGITS.fullmatch(text) is not None


_IN_DIGITS = re.compile(r"-?[0-9]+")


def whole_number(text: str) -> int | None:
    """``text`` as a revision or a count, or ``None`` if it is not one: ASCII
    digits only (``str.isdigit`` also takes superscripts and circled digits),
    leading zeros aside no more than a 64-bit integer has. (Python reads no
    number of more than 4,300 digits, leading zeros counted.)"""
    if not (text.isascii() and text.isdigit()):
        return None
    significant = text.lstrip("0")
    if len(significant) > _MAX_DIGITS:
        return None
    value = int(significant or "0")
    return value if value <= MAX_REVISION else None


def revision_or_time(text: str) -> int | datetime:
    """A log revision (``1234``) or a UTC time (``2026-11-30T12:00:00Z``). A
    time without a zone is refused rather than guessed. A revision is ASCII
    digits alone, as If-Match takes it: ``?at=+1`` (a space once read) or
    ``1%0A`` is a slip, not revision 1. A time may have white space around it."""
    revision = whole_number(text)
    if revision is not None:
        return revision
    if text.isascii() and text.isdigit():
        raise InputError(f"{shown(text)} is past any revision a log can hold (2^63 - 1)")
    text, given = text.strip(), text
    if text.isascii() and text.isdigit():
        raise InputError(
            f"{shown(given, 40)} is not a revision: write it in digits alone, "
            "with no white space around it"
        )
    try:
        moment = _iso_time(text)
    except ValueError:
        raise InputError(f"{text[:40]!r} is neither a revision nor an ISO 8601 time") from None
    if moment.tzinfo is None:
        # A date alone is read as its midnight: the example must say that time.
        example = f"{text[:40]}T00:00:00" if _is_date(text) else text[:40]
        raise InputError(f"{text[:40]!r} has no time zone: give UTC, e.g. {example}Z")
    return in_utc(moment, repr(text[:40]))


def _iso_time(text: str) -> datetime:
    """``text`` as an ISO 8601 time. RFC 3339 lets UTC be written ``z`` as
    well as ``Z`` (and Python reads a ``t`` separator), but Python reads the
    capital alone: ``2026-12-06T10:00:00z`` was refused, ``…t…Z`` taken."""
    return datetime.fromisoformat(f"{text[:-1]}Z" if text.endswith("z") else text)


def _is_date(text: str) -> bool:
    try:
        date.fromisoformat(text)
    except ValueError:
        return False
    return True


def zoned(moment: datetime, what: str = "time") -> datetime:
    """``moment``, if it says which zone it is in: a library caller's time
    without one is refused rather than taken for UTC or for local time."""
    if moment.utcoffset() is None:
        raise InputError(
            f"{what} {moment.isoformat()} has no time zone: give it in UTC "
            "(tzinfo=datetime.UTC) or with its offset"
        )
    return moment


def utc_time(text: str, option: str) -> datetime:
    """A UTC ISO 8601 time (``2026-11-30T12:00:00Z``, or another offset), or a
    date for its midnight UTC. A time without a zone is refused rather than guessed."""
    try:
        day = date.fromisoformat(text)
    except ValueError:
        pass
    else:
        return datetime(day.year, day.month, day.day, tzinfo=UTC)
    try:
        moment = _iso_time(text)
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise InputError(
            f"{option} {shown(text)}: not a UTC time; write it like 2026-11-30T12:00:00Z "
            "(or give a date, or another offset)"
        )
    moment = in_utc(moment, f"{option} {text!r}")
    if _between_microseconds(text) and moment < _LAST_MICROSECOND:
        # Times are kept to the microsecond, and Python drops finer digits: a
        # bound between two is the next one, before which and at or after
        # which lie the same events.
        moment += timedelta(microseconds=1)
    return moment


_LAST_MICROSECOND = datetime.max.replace(tzinfo=UTC)
_FRACTION = re.compile(r"[.,](\d+)")


def _between_microseconds(text: str) -> bool:
    """Whether a time's fraction of a second has nonzero digits past the sixth."""
    fraction = _FRACTION.search(text)
    return fraction is not None and fraction.group(1)[6:].strip("0") != ""


def in_utc(moment: datetime, said: str) -> datetime:
    """``moment`` in UTC; ``said``: how the caller wrote it, for the refusal of a
    time near an end of the calendar whose offset takes it past that end."""
    try:
        return moment.astimezone(UTC)
    except OverflowError:
        raise InputError(f"{said}: outside the times UTC can hold (years 1 to 9999)") from None
