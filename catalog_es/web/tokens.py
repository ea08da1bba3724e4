"""Bearer tokens: who a request is, and what it may do.

A token is ``ces_<id>_<secret>``. The tokens file keeps, per token, its id in
clear (to find the entry without trying every one), the actor and role it
stands for, a random salt and ``sha256(salt + secret)``; never the secret.
The secret is 32 random bytes, so a fast salted hash is enough: a slow
password hash (scrypt, argon2) defends low-entropy secrets that people pick,
and would cost every request its time. The file is written atomically with
mode 0600, and re-read when it changes, so adding or removing a token needs
no restart. Changes to it are serialised by a lock file beside it, so that
two at once cannot each read the file and write it back without the other's
(a token shown, never accepted).
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import os
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec

from catalog_es.errors import InputError, missing_folder, shown
from catalog_es.files import replace_file
from catalog_es.inputs import check_actor, empty_document, expected, open_to_read, read_at_most
from catalog_es.model import utc_now, utc_text
from catalog_es.web import Role

log = logging.getLogger(__name__)

TOKEN_PREFIX = "ces"
# An entry is about 300 bytes: a hundred thousand tokens take half of this.
# Read without a bound, a path to a device or to another large file took
# every command, and the server, to the end of memory (hostile test).
MAX_TOKENS_BYTES = 64 << 20
_ID_BYTES = 6
_SECRET_BYTES = 32


# A key the file does not have (a misspelt one, a hand-added expiry) is
# refused, not ignored: ignored, it would not do what its writer meant, and
# the next `token add` or `token remove` would write the file back without it.
class TokenEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One token as the file keeps it."""

    id: str
    actor: str
    role: str
    salt: str
    sha256: str
    created: datetime


class TokensFile(msgspec.Struct, forbid_unknown_fields=True):
    tokens: list[TokenEntry] = []


class Caller(msgspec.Struct, frozen=True):
    """Who a verified token stands for."""

    actor: str
    role: Role


def _digest(salt: str, secret: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt) + secret.encode()).hexdigest()


def parse_role(text: str) -> Role:
    """``read``, ``write`` or ``admin``."""
    try:
        return Role[text]
    except KeyError:
        known = ", ".join(r.name for r in Role)
        raise InputError(f"role {text!r}: not a role (known: {known})") from None


_NEVER_READ = (-1, -1, -1)


def _problem(data: bytes, error: msgspec.MsgspecError) -> str:
    """msgspec's words for what is not a tokens file, but for JSON whose
    whole is no mapping (``null``, a list): said as every input says it."""
    if isinstance(error, msgspec.ValidationError):
        try:
            # Decoded again: refused as it was read, the rest went unread.
            found = msgspec.json.decode(data)
        except msgspec.DecodeError as malformed:
            return str(malformed)
        if not isinstance(found, dict):
            return expected("a mapping of fields", found)
    return str(error)


class TokenStore:
    """The tokens file: create, list, revoke, and verify a presented token."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        # The file last read, as its inode, mtime and size (``None``: it was not
        # there; none before it is first read): every write replaces it, so a
        # new inode tells a change a coarse clock's mtime may not.
        self._loaded: tuple[int, int, int] | None = _NEVER_READ
        self._by_id: dict[str, TokenEntry] = {}
        # Whether the last try to read the file failed (told once a streak).
        self._unread = False

    # -- the file ----------------------------------------------------------------

    def _read(self) -> TokensFile:
        try:
            # Not waiting for a writer: a tokens file that is a pipe hung
            # every token command, and serve (hostile test).
            with open_to_read(str(self.path)) as file:
                data = read_at_most(file, MAX_TOKENS_BYTES)
        except FileNotFoundError:
            return TokensFile()
        except OSError as error:
            raise _Unread(f"{self.path}: {error.strerror or error}") from None
        if data is None:
            raise InputError(
                f"{self.path}: not a tokens file: larger than {MAX_TOKENS_BYTES >> 20} MiB"
            )
        if not data.strip():
            # msgspec's own words for it ("Input data was truncated") said
            # nothing an operator could act on (hostile test).
            instead = "remove it, and token add makes one"
            raise empty_document(str(self.path), data.decode(), instead)
        try:
            content = msgspec.json.decode(data, type=TokensFile)
        except msgspec.MsgspecError as error:
            raise InputError(f"{self.path}: not a tokens file: {_problem(data, error)}") from None
        # An entry copied by hand: `token remove` revoked the first, and the
        # server went on letting in the token by the other (hostile test).
        seen: set[str] = set()
        for entry in content.tokens:
            if entry.id in seen:
                twice = f"token id {shown(entry.id, 40)} appears more than once"
                raise InputError(f"{self.path}: not a tokens file: {twice}")
            seen.add(entry.id)
            # A role edited by hand to one there is not ("Admin"): listed as
            # such, its token refused as unknown or revoked (hostile test).
            try:
                parse_role(entry.role)
            except InputError as error:
                raise InputError(
                    f"{self.path}: not a tokens file: token {shown(entry.id, 40)}: {error}"
                ) from None
        return content

    def _write(self, content: TokensFile) -> None:
        try:
            replace_file(self.path, msgspec.json.format(msgspec.json.encode(content)) + b"\n")
        except OSError as error:
            # A full disk, a folder made read-only: told as "unexpected" (hostile test).
            raise InputError(f"{self.path}: cannot be written: {error.strerror or error}") from None

    @contextmanager
    def _changing(self) -> Iterator[TokensFile]:
        """The file's content to change, written back when the ``with`` ends,
        under an exclusive lock on ``.NAME.lock`` beside it: no other change
        reads it in between."""
        # Beside the file a link names, as replace_file writes it: a change
        # through the link and one through the file take the same lock.
        written = Path(os.path.realpath(self.path))
        lock_path = written.with_name(f".{written.name}.lock")
        folder = self.path.parent
        missing = missing_folder(folder)
        if missing is not None:
            raise InputError(f"{folder}: {missing}")
        try:
            lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            raise InputError(f"{lock_path}: {error.strerror or error}") from None
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError as error:  # a file system without locks (some NFS)
                why = error.strerror or error
                raise InputError(f"{lock_path}: cannot be locked: {why}") from None
            content = self._read()
            yield content
            self._write(content)
        finally:
            os.close(lock)  # and with it the lock

    def entries(self) -> list[TokenEntry]:
        return list(self._read().tokens)

    def require(self) -> None:
        """Refuse a tokens file that is not there."""
        if not self.path.exists():
            raise InputError(f"no tokens file at {self.path} (catalog-es token add makes one)")

    def add(self, actor: str, role: str) -> tuple[TokenEntry, str]:
        """A new token for ``actor``: its entry and the token itself, which is
        shown once and stored nowhere."""
        check_actor(actor)
        parse_role(role)
        token_id = secrets.token_hex(_ID_BYTES)
        secret = secrets.token_urlsafe(_SECRET_BYTES)
        salt = secrets.token_hex(16)
        entry = TokenEntry(
            id=token_id,
            actor=actor,
            role=role,
            salt=salt,
            sha256=_digest(salt, secret),
            created=utc_now(),
        )
        with self._changing() as content:
            content.tokens.append(entry)
        return entry, f"{TOKEN_PREFIX}_{token_id}_{secret}"

    def remove(self, token_id: str) -> TokenEntry:
        with self._changing() as content:
            for entry in content.tokens:
                if entry.id == token_id:
                    content.tokens.remove(entry)
                    return entry
            raise InputError(f"no token with id {token_id!r} in {self.path}")

    # -- verifying ---------------------------------------------------------------

    def _current(self) -> dict[str, TokenEntry]:
        """The entries by id, re-read when the file changed since last time."""
        try:
            stat = self.path.stat()
            seen: tuple[int, int, int] | None = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        except FileNotFoundError:
            seen = None
        with self._lock:
            if seen != self._loaded or seen is None:
                try:
                    self._by_id = {e.id: e for e in self._read().tokens}
                    self._unread = False
                    if not self._by_id and seen != self._loaded:
                        # Moved away or emptied while serving: every request is
                        # refused, and the operator told why, once each time.
                        why = "is gone" if seen is None else "holds no tokens"
                        log.warning(
                            "%s %s; every token is refused (catalog-es token add)", self.path, why
                        )
                except _Unread as error:
                    # Not read this time (out of descriptors, say): no token is
                    # let in on this request, and the file is read again on the
                    # next. Kept as read, it locked every token out until the
                    # file changed, long after the cause had gone (hostile test).
                    if not self._unread:
                        log.warning("%s; tokens are refused until it can be read", error)
                    self._unread = True
                    return {}
                except InputError as error:
                    # Spoiled while serving: no caller can be told who they are,
                    # so none is, and none is told why (it names the file); the
                    # operator is told here, once each time the file changes.
                    log.warning("%s; every token is refused until it is mended", error)
                    self._by_id = {}
                self._loaded = seen
            return self._by_id

    def verify(self, token: str) -> Caller | None:
        """The caller a presented token stands for, or ``None``."""
        prefix, _, rest = token.partition("_")
        token_id, _, secret = rest.partition("_")
        if prefix != TOKEN_PREFIX or not token_id or not secret:
            return None
        entry = self._current().get(token_id)
        if entry is None:
            return None
        try:
            expected = _digest(entry.salt, secret)
        except ValueError:  # a hand-edited salt that is not hex
            return None
        if not hmac.compare_digest(expected, entry.sha256):
            return None
        return Caller(actor=entry.actor, role=parse_role(entry.role))  # read, so a role

    def describe(self) -> list[dict[str, Any]]:
        """The entries without their hashes, for ``token list``."""
        return [
            {
                "id": e.id,
                "actor": e.actor,
                "role": e.role,
                "created": utc_text(e.created),
            }
            for e in self.entries()
        ]


class _Unread(InputError):
    """The tokens file could not be read this time; it may be next time."""
