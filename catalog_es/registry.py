"""Where weights come from: the ``Registry`` port, and an offline mirror of a model hub.

A hub client (Hugging Face, say) would implement the same four operations
later: name the repository a source points at, resolve a branch to a commit,
list a commit's files with their sha256, and fetch them to a local folder.
Checking what was fetched is not the registry's word but ours
(:func:`verify`): the files are hashed where they landed.

The mirror is a directory tree, the shape an offline copy of a hub has::

    <mirror>/<org>/<repo>/refs              one line per branch: "<branch> <commit>"
    <mirror>/<org>/<repo>/<commit>/<files>  the files of that commit

for the source ``hf://<org>/<repo>``. See docs/weights.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import stat
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from io import BufferedReader
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from catalog_es.errors import UNSAFE_TEXT, Refused, shown

SCHEME = "hf://"
DEFAULT_BRANCH = "main"
REFS_FILE = "refs"
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
COMMIT_PATTERN = re.compile(r"[0-9a-f]{7,64}")
_BRANCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")


class RegistryError(Refused):
    """The registry cannot answer: no such repository, branch, commit or file."""


def check_repository(repository: str) -> tuple[str, str]:
    """``org/repo`` as its two folder names; anything else (``..``, a third
    part) is refused, since the parts become paths."""
    parts = repository.split("/")
    if len(parts) != 2 or not all(_PART.fullmatch(p) and ".." not in p for p in parts):
        raise RegistryError(f"repository {repository[:80]!r} is not org/name")
    return parts[0], parts[1]


def check_commit(revision: str) -> str:
    if not COMMIT_PATTERN.fullmatch(revision):
        raise RegistryError(
            f"revision {revision[:80]!r} is not a commit id (7-64 lower-case hex digits)"
        )
    return revision


# The bytes a file system takes for one name; and for a path inside a
# revision, what leaves room for the folders it is kept in within the 4,095 a
# whole path may have.
_NAME_MAX, _PATH_MAX = 255, 1024


def _not_text(path: str) -> str:
    """Why ``path``, holding lone surrogates, is refused. A file name whose
    bytes are not UTF-8 is read with each such byte as one (U+DC80-U+DCFF):
    it was told as holding "a NUL, or a lone surrogate", where the operator
    has a name in another encoding; said with its bytes, as the disk has it."""
    try:
        as_on_disk = path.encode("utf-8", "surrogateescape")
        as_on_disk.decode("utf-8")
    except UnicodeDecodeError:
        return f"file path {as_on_disk[:80]!r} is not UTF-8 text, as the log's file names are"
    except UnicodeEncodeError:
        pass
    return f"file path {path[:80]!r} holds a lone surrogate, which no file name can"


def relative_file(path: str) -> PurePosixPath:
    """A file path inside a revision, refused if it could point outside it,
    if no file system could hold it (found only when the file is fetched,
    after it was recorded in the log), or if a terminal would act on it."""
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or any(part in ("", ".", "..") for part in path.split("/")):
        raise RegistryError(f"file path {path[:80]!r} is not a plain path inside a revision")
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        raise RegistryError(_not_text(path)) from None
    if b"\0" in encoded:
        raise RegistryError(f"file path {path[:80]!r} holds a NUL, which no file name can")
    # A file's name is shown, logged and made a path: held to what a terminal
    # acts on, not to every format character as a source typed in is (a
    # joiner in a registry's file name is text).
    unsafe = UNSAFE_TEXT.search(path)
    if unsafe is not None:
        raise RegistryError(
            f"file path {path[:80]!r} holds U+{ord(unsafe.group()):04X}, which a terminal acts on"
        )
    longest = max(len(part.encode("utf-8")) for part in path.split("/"))
    if longest > _NAME_MAX or len(encoded) > _PATH_MAX:
        raise RegistryError(
            f"file path {path[:80]!r}… is longer than a weights folder holds "
            f"({_NAME_MAX} bytes a name, {_PATH_MAX} in all)"
        )
    return pure


def open_inside(path: Path, within: Path) -> BufferedReader:
    """``path`` opened for reading, once the file opened is known to be a
    regular file in ``within``, links followed: refused otherwise. What
    leads outside is refused before it is opened; and what is opened is
    checked, so a link swapped in between is refused unread. Opened without
    waiting: opening a pipe to read waits for a writer, and every weights
    command hung on a ``refs`` that was one."""
    _real_inside(path, within)
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:  # not there, not readable (a mode, a lock)
        raise unreadable(path, error) from None
    try:
        # Asked of the descriptor, before it is made a file object: one of a
        # folder was refused as "[Errno 21] Is a directory: 6" (hostile test).
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise RegistryError(f"{path} is not a file (a folder, a pipe?): refused")
        os.set_blocking(descriptor, True)
        if not os.path.samestat(status, _real_inside(path, within).stat()):
            raise RegistryError(f"{path} changed while it was read: refused")
        return os.fdopen(descriptor, "rb")
    except OSError as error:
        os.close(descriptor)
        raise unreadable(path, error) from None
    except BaseException:
        os.close(descriptor)
        raise


def unreadable(path: Path | str, error: OSError) -> RegistryError:
    """The refusal of a file or folder that could not be read: in one line,
    naming it once. A file of the mirror this process may not read (its
    mode) was an unexpected PermissionError that ended every check of
    every model, not the one model's (hostile test)."""
    return RegistryError(f"{path}: cannot be read: {error.strerror or error}; refused")


def checksums(folder: Path, within: Path) -> dict[str, str]:
    """Every file under ``folder`` and its sha256, by POSIX path, sorted. A
    link is followed, as in a hub cache whose snapshots link to its blobs
    (or to folders of them), but only inside ``within``: one that leads out
    of it is refused, or a link planted in the mirror would copy any file
    this process can read into the weights, and its checksum into the log.
    Whatever is not a file or a folder (a link to nothing, a pipe) is
    refused: passed over, it was in a copy that verified."""
    top = _real_inside(folder, within)
    found: dict[str, str] = {}
    walked: set[Path] = set()
    reals: dict[Path, Path] = {}  # each folder walked: what it names

    def not_listed(error: OSError) -> None:
        raise unreadable(error.filename, error)

    # Top-down: a folder is seen before anything under it is walked.
    for directory, _dirs, names in os.walk(folder, followlinks=True, onerror=not_listed):
        walking = Path(directory)
        real = _real_below(reals.get(walking.parent), walking) or _real_inside(walking, within)
        reals[walking] = real
        if real in walked:
            raise RegistryError(f"{directory} links to a folder already read: refused")
        if walked and top.is_relative_to(real):
            # A link up to a folder holding this one would walk all of it.
            raise RegistryError(f"{directory} links to a folder above it: refused")
        walked.add(real)
        below = Path(directory).relative_to(folder).as_posix()
        if len(os.fsencode(below)) >= _PATH_MAX:
            # No file under it could be kept; and walked deeper, a tree
            # a thousand folders deep ended every check of every model
            # with an unexpected RecursionError (hostile test).
            raise RegistryError(
                f"{folder}: folder {below[:80]!r}… is deeper than a weights folder holds "
                f"({_PATH_MAX} bytes a path): refused"
            )
        for name in names:
            path = Path(directory, name)
            try:
                if not path.is_file():
                    raise RegistryError(
                        f"{path} is not a file (a link to nothing, a pipe?): refused"
                    )
                # A name the log could not record is refused here, where a scan
                # lists its model as unchecked, not when its finding is written.
                listed = relative_file(path.relative_to(folder).as_posix()).as_posix()
                with open_inside(path, within) as f:
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
            except OSError as error:  # in a folder not searchable; a disk's read error
                raise unreadable(path, error) from None
            found[listed] = digest
    return dict(sorted(found.items()))


def inside(path: Path, within: Path) -> Path:
    """``path``, once what it names (links followed, as far as it exists) is
    known to be in ``within``; else refused."""
    _real_inside(path, within)
    return path


def _real_inside(path: Path, within: Path) -> Path:
    """What ``path`` names, resolved once, if it is in ``within``."""
    real, root = resolved(path), resolved(within)
    if not real.is_relative_to(root):
        raise RegistryError(f"{path} leads to {real}, outside {within}: refused")
    return real


def _real_below(parent: Path | None, directory: Path) -> Path | None:
    """What ``directory`` names, from what its parent folder names (``parent``,
    known inside), when it is no link; else ``None``, to be resolved from the
    root. Resolving each folder from the root lstat()s every folder above it:
    a tree 500 folders deep took 130,000 calls, 4 s, to be refused. (A folder
    above swapped since for a link out is still refused: each file is
    resolved from the root as it is opened, :func:`open_inside`.)"""
    if parent is None:
        return None
    here = parent / directory.name
    try:
        # A link's own lstat() is never the folder's stat(): it is resolved.
        return here if os.path.samestat(here.lstat(), directory.stat()) else None
    except OSError:
        return None


def _is_file(path: Path) -> bool:
    """Whether ``path`` is a file (links followed); refused, not raised,
    when that cannot be told."""
    try:
        return path.is_file()
    except OSError as error:
        raise unreadable(path, error) from None


def _is_dir(path: Path) -> bool:
    """Whether ``path`` is a folder (links followed); refused, not raised,
    when that cannot be told (a folder above it not searchable)."""
    try:
        return path.is_dir()
    except OSError as error:
        raise unreadable(path, error) from None


def resolved(path: Path) -> Path:
    """``path`` with its links and ``..`` resolved, as far as it exists;
    refused when its links loop."""
    try:
        return path.resolve()
    except RuntimeError:  # a loop of links (Python 3.11; 3.13 resolves as far as it can)
        raise RegistryError(f"{path} is a loop of links: refused") from None
    except OSError as error:
        raise unreadable(path, error) from None


def verify(folder: Path, expected: Mapping[str, str], within: Path) -> list[str]:
    """What is wrong with ``folder`` (in ``within``) as a copy of exactly
    ``expected`` ({path: sha256}): files missing, files whose checksum
    differs, and files that should not be there (an engine loading the folder
    would see them). Empty when it is an exact copy."""
    present = checksums(folder, within) if _is_dir(folder) else {}
    problems = []
    for path, digest in sorted(expected.items()):
        relative_file(path)
        if path not in present:
            problems.append(f"{path}: missing")
        elif present[path] != digest:
            problems.append(f"{path}: sha256 {present[path][:12]}…, expected {digest[:12]}…")
    # In the order of their paths, as the others: a set's order named
    # another file first on each run (hostile test).
    extra = sorted(present.keys() - expected)
    problems.extend(f"{path}: not part of the revision" for path in extra)
    return problems


class Registry(ABC):
    """A source of model weights: a hub, or a mirror of one."""

    @abstractmethod
    def repository_for(self, source: str) -> str | None:
        """The repository a model source names here (``hf://org/repo`` ->
        ``org/repo``), ``None`` when the source is not one of this registry's."""

    @abstractmethod
    def resolve(self, repository: str, ref: str) -> str:
        """The commit a branch points to; a commit id names itself (the
        mirror's: or the one commit it begins, at least 7 digits). Raises
        :class:`RegistryError` when the repository or the ref is unknown."""

    @abstractmethod
    def files(self, repository: str, revision: str) -> dict[str, str]:
        """Each file of a commit and its sha256, as the registry states them."""

    @abstractmethod
    def fetch(self, repository: str, revision: str, files: Mapping[str, str], into: Path) -> None:
        """Copy the named files of a commit under ``into`` ({path: sha256}),
        each one whole and with that checksum, or not at all: a copy that
        differs is refused and not kept, so the next fetch fetches it again.
        A path the commit does not have is not written: :func:`verify`
        reports it."""


class MirrorRegistry(Registry):
    """A registry kept as folders on this machine (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _repository_folder(self, repository: str) -> Path:
        org, name = check_repository(repository)
        folder = self.root / org / name
        if not _is_dir(folder):
            raise RegistryError(f"repository {repository} is not in the mirror {self.root}")
        return folder

    def _revision_folder(self, repository: str, revision: str) -> Path:
        folder = self._repository_folder(repository) / check_commit(revision)
        if not _is_dir(folder):
            raise RegistryError(f"{repository} has no commit {revision} in the mirror")
        return inside(folder, self.root)

    def refs(self, repository: str) -> dict[str, str]:
        """The branches of a repository and the commit each points to."""
        path = self._repository_folder(repository) / REFS_FILE
        try:
            with open_inside(path, self.root) as file:  # as every file the mirror gives
                # A byte-order mark, as some editors on Windows save UTF-8,
                # is no part of the first line (its branch was refused).
                text = file.read().decode("utf-8-sig")
        except OSError as error:
            raise unreadable(path, error) from None
        except UnicodeDecodeError as error:
            raise RegistryError(
                f"{path}: cannot read the refs: not UTF-8 text (byte {error.start})"
            ) from None
        refs: dict[str, str] = {}
        for number, line in enumerate(text.splitlines(), start=1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            # Why, where it can be told: a commit id in capitals, or one
            # character short, was told as a line of the wrong shape.
            why = ""
            if len(words) == 2 and not _BRANCH.fullmatch(words[0]):
                why = f": {shown(words[0])} is no branch name"
            elif len(words) == 2 and not COMMIT_PATTERN.fullmatch(words[1]):
                why = f": {shown(words[1])} is no commit id (7-64 lower-case hex digits)"
            if len(words) != 2 or why:
                raise RegistryError(f"{path} line {number}: expected '<branch> <commit>'{why}")
            if words[0] in refs:
                raise RegistryError(f"{path} line {number}: branch {words[0]} is listed twice")
            refs[words[0]] = words[1]
        return refs

    def repository_for(self, source: str) -> str | None:
        if not source.startswith(SCHEME):
            return None
        return source.removeprefix(SCHEME).rstrip("/")

    def resolve(self, repository: str, ref: str) -> str:
        refs = self.refs(repository)
        if ref in refs:
            commit = refs[ref]
            if (
                commit != ref
                and COMMIT_PATTERN.fullmatch(ref)
                and _is_dir(self._repository_folder(repository) / ref)
            ):
                # A branch may be named in hex: which one was meant cannot be told.
                raise RegistryError(
                    f"{repository}: {ref!r} is both a branch (at {commit}) and a commit:"
                    " rename the branch in the mirror's refs"
                )
        elif COMMIT_PATTERN.fullmatch(ref):
            commit = self._commit_named(repository, ref)
        else:
            # Quoted cut short, and the branches too: a --revision of 100,000
            # characters was said back whole (hostile test).
            named = sorted(refs)
            known = ", ".join(named[:10]) + (
                f", … ({len(named)} in all)" if len(named) > 10 else ""
            )
            raise RegistryError(
                f"{repository} has no branch {shown(ref)} (branches: {known or 'none'})"
            )
        self._revision_folder(repository, commit)
        return commit

    def _commit_named(self, repository: str, ref: str) -> str:
        """The commit ``ref`` names: itself, or the one commit of the mirror
        it begins. The commits ``updates`` and ``update`` show are cut to 12
        digits, and ``--revision`` given one was refused as a commit the
        mirror has not (hostile test)."""
        folder = self._repository_folder(repository)
        if _is_dir(folder / ref):
            return ref
        try:
            names = [entry.name for entry in folder.iterdir()]
        except OSError as error:
            raise unreadable(folder, error) from None
        begun = sorted(
            name
            for name in names
            if name.startswith(ref) and COMMIT_PATTERN.fullmatch(name) and _is_dir(folder / name)
        )
        if len(begun) > 1:
            raise RegistryError(
                f"{repository}: commit {ref} is ambiguous in the mirror ({', '.join(begun[:3])}"
                f"{', …' if len(begun) > 3 else ''}): give more of it"
            )
        return begun[0] if begun else ref  # none: told as a commit the mirror has not

    def files(self, repository: str, revision: str) -> dict[str, str]:
        return checksums(self._revision_folder(repository, revision), self.root)

    def fetch(self, repository: str, revision: str, files: Mapping[str, str], into: Path) -> None:
        folder = self._revision_folder(repository, revision)
        # Partial copies are made in a folder of this fetch's own beside the
        # revision's, and renamed into place: a file in the revision's folder
        # is whole, and what a killed or a concurrent fetch has there under
        # way is never taken for part of the revision.
        into.parent.mkdir(parents=True, exist_ok=True)
        _delete_abandoned(into.parent)
        partials, held = _partial_folder(into.parent, into.name)
        try:
            for path, expected in files.items():
                source = folder / relative_file(path)
                if not _is_file(source):
                    continue
                # A folder of the copy linked elsewhere would be written through.
                target = inside(into / relative_file(path), into)
                # What cannot be read of the mirror is told as the mirror's:
                # it was told as a copy the weights store could not take.
                partial = partials / "copy"
                with open_inside(source, self.root) as src:
                    try:
                        target.parent.mkdir(parents=True, exist_ok=True)
                        with partial.open("wb") as out:
                            copied = _Hashing(out)
                            shutil.copyfileobj(_Reading(src, source), copied, 1 << 20)
                            out.flush()
                            os.fsync(out.fileno())
                    except OSError as error:  # the disk full, a name too long for it…
                        raise _not_copied(path, into, partial, error) from None
                digest = copied.sha256.hexdigest()
                if digest != expected:
                    # Kept, the copy would be found there by every later fetch
                    # and refused each time, though the mirror were put right.
                    raise RegistryError(
                        f"{repository}@{revision}: {path} was copied with sha256 "
                        f"{digest[:12]}…, expected {expected[:12]}… (changed in the mirror, "
                        "or while it was read); the copy was not kept"
                    )
                try:
                    partial.replace(target)
                except OSError as error:  # a folder where the file goes
                    raise _not_copied(path, into, partial, error) from None
        finally:
            shutil.rmtree(partials, ignore_errors=True)
            os.close(held)


def _not_copied(path: str, into: Path, partial: Path, error: OSError) -> RegistryError:
    """The refusal of a file of a commit that could not be copied into
    ``into``: naming the path in the way, when it is not the partial copy's
    own (a name of this fetch's, gone once it ends). "File exists" alone did
    not say the commit's folder was a file; a folder where the file goes was
    told as the partial copy's "Is a directory" (hostile test)."""
    in_the_way = [
        name for name in (error.filename, error.filename2) if name and Path(name) != partial
    ]
    where = f"{in_the_way[0]}: " if in_the_way else ""
    return RegistryError(f"{path}: cannot be copied into {into}: {where}{error.strerror or error}")


class _Reading:
    """A file of the mirror being read, whose read errors (a disk's) are
    refusals naming it."""

    def __init__(self, file: BinaryIO, path: Path) -> None:
        self.file = file
        self.path = path

    def read(self, size: int = -1) -> bytes:
        try:
            return self.file.read(size)
        except OSError as error:
            raise unreadable(self.path, error) from None


class _Hashing:
    """A file being written, and the sha256 of what was written to it."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


# A fetch holds a lock (flock) on a file in its folder of partial copies for
# as long as it runs, and the system lets go of it when the process ends,
# however it ends: a folder whose lock can be taken was left by a fetch killed
# outright, and its copies (gigabytes, for weights) would otherwise stay for
# good. Where no lock can be had (some NFS mounts), a folder is never deleted:
# whether its fetch runs cannot be told.
_PARTIAL = ".partial."
_LOCK_FILE = ".fetching"


_STARTING = ".starting."


def _partial_folder(parent: Path, name: str) -> tuple[Path, int]:
    """A new folder for one fetch's partial copies, in ``parent``, and the
    descriptor of its lock file. Made under another name and renamed once
    locked, so that no fetch ever sees it unlocked; while it is made, a
    shared lock on ``parent`` tells the fetches that would delete one a
    killed fetch left under that name (:func:`_delete_abandoned`) that it
    is not abandoned."""
    with _lock_on(parent, fcntl.LOCK_SH):
        starting: Path | None = None
        try:
            starting = Path(tempfile.mkdtemp(dir=parent, prefix=f".{name}{_STARTING}"))
            held = os.open(starting / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as error:
            # No inode left for the lock file: the folder made for it is not
            # left behind (it was, by a refusal that said nothing was written).
            if starting is not None:
                shutil.rmtree(starting, ignore_errors=True)
            # Told of the folder it was to be made in, not of a random name.
            raise OSError(error.errno, error.strerror, str(parent)) from None
        try:
            with suppress(OSError):  # no lock here: the folder is never taken for abandoned
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            partials = parent / starting.name.replace(_STARTING, _PARTIAL, 1)
            starting.rename(partials)
        except BaseException:
            os.close(held)
            shutil.rmtree(starting, ignore_errors=True)
            raise
    return partials, held


@contextmanager
def _lock_on(folder: Path, operation: int) -> Iterator[bool]:
    """A lock (flock) on ``folder`` itself for the span of the ``with``: whether
    it was had (none on a file system without locks, or held otherwise with
    ``LOCK_NB``)."""
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(descriptor, operation)
        except OSError:
            yield False
        else:
            yield True
    finally:
        os.close(descriptor)  # and with it the lock


def _delete_abandoned(parent: Path) -> None:
    """Delete the folders of partial copies in ``parent`` whose fetch has
    ended: their lock file is there, and its lock can be taken. And those a
    fetch killed as it made one left under the name it starts with: with no
    fetch making one (none holds ``parent``'s shared lock), any is abandoned
    (the next fetches found none, and it stayed for good)."""
    with _lock_on(parent, fcntl.LOCK_EX | fcntl.LOCK_NB) as none_starting:
        if none_starting:
            for folder in parent.glob(f".*{_STARTING}*"):
                shutil.rmtree(folder, ignore_errors=True)
    for folder in parent.glob(f".*{_PARTIAL}*"):
        try:
            found = os.open(folder / _LOCK_FILE, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, or not a folder of ours (an older release's)
        try:
            fcntl.flock(found, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a fetch under way, or no lock to be had here
        else:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(found)
