"""Writing a file that others read while it changes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def replace_file(path: Path, content: bytes) -> None:
    """Make ``content`` the file at ``path`` in one step: a reader finds the
    old content or the new, never part of either. The new is on disk before
    it takes the old one's place, so a crash leaves one or the other whole,
    not an empty file; and the folder is synced once it has taken it, so the
    new is what a crash after the return leaves (a `token remove` told done
    could otherwise come back). Readable and writable by its owner alone
    (0600), as :func:`tempfile.mkstemp` makes it. Through a link, the file
    it names is replaced and the link kept: the link replaced, the file
    others read was left as it was (a token revoked through a link to the
    tokens file still let in; hostile test)."""
    path = Path(os.path.realpath(path))
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        Path(temporary).replace(path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
