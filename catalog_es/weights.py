"""Weights provenance: where each model's weights came from, what upstream has
now, and moving a model between commits deliberately (issue 8).

What a model runs is its origin (repository, commit, file checksums). A model
whose origin was never recorded runs whatever its source named when it was
first looked at: ``check-updates`` records that as its origin, by the system
actor, so later changes upstream can be told apart. A declared model's origin
is the config's, filled in from the registry where the config leaves it out.

Moving a model (``update``, ``rollback``) fetches the commit into a folder of
its own beside the others and verifies every checksum before anything is
written; the model's source becomes that folder, so replicas load exactly the
files that were checked. Fetching and hashing happen outside the write
transaction (weights are large); inside it the move is refused if the model
changed meanwhile.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from catalog_es import commands
from catalog_es.application import SYSTEM_ACTOR, Models
from catalog_es.batch import Batch, Change
from catalog_es.decisions import check_origin, declared_refusal
from catalog_es.errors import (
    DeclaredInConfig,
    InputError,
    InvalidModel,
    ModelNotFound,
    Refused,
    shown,
)
from catalog_es.mapper import UndecodableEvent, decode_event, topic_of
from catalog_es.model import Model, model_id
from catalog_es.names import CHECK_UPDATES
from catalog_es.registry import (
    DEFAULT_BRANCH,
    Registry,
    RegistryError,
    check_commit,
    check_repository,
    inside,
    open_inside,
    relative_file,
    resolved,
    unreadable,
    verify,
)
from catalog_es.spec import ModelSpec, Origin
from catalog_es.storage.schema import check_walk, events_table, stream_walk
from catalog_es.views import event_view, model_view
from projections import pointintime

log = logging.getLogger("catalog_es")

_UPSTREAM_TOPIC = topic_of(Model.UpstreamChanged)
_ADDED_TOPIC = topic_of(Model.Added)


class VerificationFailed(Refused):
    """Fetched weights are not an exact copy of the commit: nothing is written."""


def file_changes(old: Mapping[str, str], new: Mapping[str, str]) -> dict[str, list[str]]:
    """The paths ``new`` adds, removes and changes relative to ``old`` ({path: sha256})."""
    return {
        "added": sorted(new.keys() - old.keys()),
        "removed": sorted(old.keys() - new.keys()),
        "changed": sorted(p for p in old.keys() & new.keys() if old[p] != new[p]),
    }


def _list_digest(files: Mapping[str, str]) -> str:
    """The sha256 of the paths of a list of files: which list a folder holds."""
    return hashlib.sha256(msgspec.json.encode(sorted(files))).hexdigest()


def _holds_other_files(folder: Path, files: Mapping[str, str]) -> bool:
    """Whether ``folder`` holds a file ``files`` does not list: one no fetch
    of that list left, killed or not. By their names: nothing is read."""
    for directory, _folders, names in os.walk(folder):
        for name in names:
            if Path(directory, name).relative_to(folder).as_posix() not in files:
                return True
    return False


# The digits of a list's digest in the name of its folder: enough that two
# lists of one commit never share one.
_DIGEST_SHOWN = 16


# Where the list each commit's folder holds is recorded, under the store's
# root: not in the folder, where an engine loading it would see it, nor among
# the repository's folders. No organisation's name begins with a dot.
_LISTS = ".lists"


class WeightsStore:
    """Where fetched commits are kept, each in a folder of its own beside the
    others (``<root>/<org>/<repo>/<commit>/``), and where replicas load them from.

    Origins of one commit may list other files (one given with the weights
    file alone): a folder holds one list, or a model would load files it was
    not checked to run, and a rollback onto it be refused for a file that is
    no part of its list (hostile test). The commit's folder holds the first
    list staged there, recorded apart (``.lists/<org>/<repo>/<commit>``, the
    digest of its paths); another list has a folder of its own,
    ``<commit>.<digest>``."""

    def __init__(self, root: Path, *, apart_from: Path | None = None) -> None:
        self.root = root
        # The registry's own folder, where no commit is fetched to.
        self.apart_from = apart_from

    def folder(self, origin: Origin, running: Sequence[ModelSpec]) -> Path:
        """Where the files ``origin`` lists are kept: the commit's folder,
        unless it holds another list of them. ``running``: the models in
        force, which tell the list of a folder they run from."""
        org, name = check_repository(origin.repository)
        commit = self.root / org / name / check_commit(origin.revision)
        listed = _list_digest(origin.files)
        held = self._held_list(commit, running)
        # With no list known, a file this list has not is another list's
        # copy, which a staging of this one would add files to, or be
        # refused for and record its list over (hostile test).
        if held == listed or (held is None and not _holds_other_files(commit, origin.files)):
            return commit
        return commit.with_name(f"{commit.name}.{listed[:_DIGEST_SHOWN]}")

    def _held_list(self, commit: Path, running: Sequence[ModelSpec]) -> str | None:
        """The digest of the list a commit's folder is for: that of the models
        running from it, "" if they run other lists or none known; else (none
        runs from it) as recorded; ``None`` for no list yet. The models
        first: a record edited by hand, or cut short, sent another list's
        files into the folder a model ran from, or moved that model off it
        with a download (hostile test); and an older release recorded none.
        Not told by the files it holds: a fetch killed half-way leaves some
        of its list, and a file planted there is to be reported."""
        source = self.source(commit)
        lists = {
            _list_digest(model.origin.files) if model.origin else ""
            for model in running
            if model.source == source
        }
        if lists:
            return lists.pop() if len(lists) == 1 else ""
        return self._recorded_list(commit)

    def _recorded_list(self, commit: Path) -> str | None:
        record = self._list_record(commit)
        if not os.path.lexists(record):
            return None
        try:
            with open_inside(record, self.root) as file:
                return file.read().decode("ascii", "replace")
        except OSError as error:
            raise unreadable(record, error) from None

    def _list_record(self, commit: Path) -> Path:
        return self.root / _LISTS / commit.relative_to(self.root)

    def _record_list(self, folder: Path, origin: Origin, running: Sequence[ModelSpec]) -> bool:
        """Record the list a commit's folder holds, the first time: of two
        stagings at once of other lists there, the second is refused (run
        again, it takes a folder of its own). Whether this call recorded it."""
        if folder.name != origin.revision:
            return False  # a list's own folder, named for it
        record = self._list_record(folder)
        listed = _list_digest(origin.files)
        recorded = False
        if not os.path.lexists(record):
            record.parent.mkdir(parents=True, exist_ok=True)
            # Written whole, then linked: the record is there whole or not at all.
            try:
                descriptor, written = tempfile.mkstemp(
                    dir=inside(record.parent, self.root), prefix=f".{record.name}."
                )
            except OSError as error:
                # Told of the folder it was to be made in, not of a random
                # name no one could find (a store mounted read-only; hostile test).
                raise OSError(error.errno, error.strerror, str(record.parent)) from None
            try:
                with os.fdopen(descriptor, "w") as file:
                    # Readable as the weights are, by the other nodes sharing the store.
                    os.fchmod(file.fileno(), 0o644)
                    file.write(listed)
                with suppress(FileExistsError):  # made meanwhile: read below
                    os.link(written, record)
                    recorded = True
            finally:
                Path(written).unlink()
        if self._held_list(folder, running) != listed:
            raise RegistryError(
                f"{folder} was taken meanwhile for other files of {origin.repository}@"
                f"{origin.revision}; nothing was written, run the command again"
            )
        return recorded

    @staticmethod
    def source(folder: Path) -> str:
        """The model source of a folder kept here: a ``file://`` URL, of the
        folder itself (links and ``..`` resolved): another spelling of the
        store, or a link to it pointed elsewhere later, names the same files."""
        return resolved(folder).as_uri()

    def stage(
        self, registry: Registry, origin: Origin, folder: Path, running: Sequence[ModelSpec]
    ) -> list[str]:
        """Make ``folder`` (:meth:`folder` of ``origin`` and ``running``) an
        exact copy of the files of ``origin``, recorded as theirs: fetch
        those not there yet, then hash every one. A file already there that
        differs is reported, never replaced, so tampering stays visible.
        Answers the files fetched."""
        where = f"{origin.repository}@{origin.revision}"
        if not origin.files:
            raise VerificationFailed(f"{where} lists no files: there is nothing to verify")
        # A folder linked elsewhere would be written there, and hashed there.
        inside(folder, self.root)
        if self.apart_from is not None and resolved(folder).is_relative_to(
            resolved(self.apart_from)
        ):
            # The store given as the mirror itself: models ran from the
            # mirror's folders, and a file changed there in place changed
            # what they load, under the checksums the log recorded (hostile
            # test). Or written into it.
            raise RegistryError(
                f"the weights store {self.root} is inside the mirror {self.apart_from}: "
                "give --weights a folder apart from it; nothing was written"
            )
        # Refused, a staging takes away the folder it made, if left empty,
        # with the record of its list: a refused fetch left an empty commit
        # folder in the store (review). Only with no other staging of the
        # repository under way, in any process (each holds a shared lock on
        # its records' folder): the folder was empty while another's fetch
        # copied its first file, and that fetch then had nowhere to put it.
        with self._staging(folder) as alone:
            return self._stage(registry, origin, folder, running, where, alone)

    @contextmanager
    def _staging(self, folder: Path) -> Iterator[Callable[[], bool]]:
        """A shared lock for a staging into ``folder``, held for the span of
        the ``with``; what it gives tells whether no other staging of that
        repository holds one (it then holds it alone)."""
        records = self._list_record(folder).parent
        try:
            records.mkdir(parents=True, exist_ok=True)
            held = os.open(inside(records, self.root), os.O_RDONLY | os.O_DIRECTORY)
        except OSError as error:
            raise self._unwritable(error) from None
        try:
            try:
                fcntl.flock(held, fcntl.LOCK_SH)
                locked = True
            except OSError:
                # No locks on this file system (some NFS mounts): staging
                # works, and what another may be using is never taken away.
                locked = False

            def alone() -> bool:
                try:
                    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    return False
                return locked

            yield alone
        finally:
            os.close(held)

    def _unwritable(self, error: OSError) -> RegistryError:
        # Which of its paths: "File exists" alone did not tell which file was.
        where = f"{error.filename}: " if error.filename else ""
        return RegistryError(
            f"the weights store {self.root}: {where}{error.strerror or error}; nothing was written"
        )

    def _stage(
        self,
        registry: Registry,
        origin: Origin,
        folder: Path,
        running: Sequence[ModelSpec],
        where: str,
        alone: Callable[[], bool],
    ) -> list[str]:
        made = not os.path.lexists(folder)
        recorded = False
        try:
            try:
                recorded = self._record_list(folder, origin, running)
                missing = {
                    path: digest
                    for path, digest in origin.files.items()
                    if not (folder / relative_file(path)).is_file()
                }
                if missing:
                    registry.fetch(origin.repository, origin.revision, missing, folder)
            except OSError as error:  # the store a file, or a name too long for it
                raise self._unwritable(error) from None
            problems = verify(folder, origin.files, self.root)
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                # A file missing is fetched by the next run: deleting the
                # folder, as told of one that differs, was no remedy for it.
                if all(problem.endswith(": missing") for problem in problems):
                    advice = "the next run fetches what is missing, once the registry holds it"
                else:
                    advice = "once no model runs from that folder, delete it to fetch it again"
                raise VerificationFailed(
                    f"the weights of {where} in {folder} do not verify: {problems[0]}{more}; "
                    f"nothing was written ({advice})"
                )
        except BaseException:
            if made and alone():
                with suppress(OSError):  # not empty: what it holds stays, and its list
                    folder.rmdir()
                    if recorded:
                        self._list_record(folder).unlink()
            raise
        return sorted(missing)


class _Lookups:
    """One command's questions to the registry, each asked once: models share
    repositories, and listing a commit hashes its files."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._heads: dict[str, str] = {}
        self._files: dict[tuple[str, str], dict[str, str]] = {}

    def head(self, repository: str) -> str:
        if repository not in self._heads:
            self._heads[repository] = self.registry.resolve(repository, DEFAULT_BRANCH)
        return self._heads[repository]

    def files(self, repository: str, revision: str) -> dict[str, str]:
        key = (repository, revision)
        if key not in self._files:
            self._files[key] = self.registry.files(repository, revision)
        return self._files[key]

    def holds(self, repository: str, revision: str) -> bool:
        try:
            # That very commit: not another that its id begins.
            return self.registry.resolve(repository, revision) == revision
        except RegistryError:
            return False


class _Finding(msgspec.Struct, frozen=True):
    """A model whose upstream differs from what it runs."""

    spec: ModelSpec
    declared: bool
    running: Origin
    upstream: Origin
    running_in_registry: bool

    def event_fields(self) -> dict[str, Any]:
        changes = file_changes(self.running.files, self.upstream.files)
        return {
            "ref": DEFAULT_BRANCH,
            "revision": self.running.revision,
            "upstream": self.upstream,
            **{key: tuple(paths) for key, paths in changes.items()},
        }

    def recorded_by(self, event: Model.UpstreamChanged) -> bool:
        return (event.revision, event.upstream) == (self.running.revision, self.upstream)


class _Scan(msgspec.Struct):
    """The catalog compared with the registry at one log revision."""

    revision: int
    findings: list[_Finding]
    # Runtime models with no recorded origin, and the origin worked out for each.
    unrecorded: list[tuple[ModelSpec, Origin]]
    unchecked: list[dict[str, str]]

    def pass_over(self, spec: ModelSpec, reason: str) -> None:
        """A model that could not be checked, and why."""
        self.unchecked.append({"model": spec.name, "source": spec.source, "reason": reason})


def _last_finding(conn: Connection, name: str) -> tuple[int, Model.UpstreamChanged] | None:
    """The newest upstream change recorded on a model since it was last
    added, with its log revision: one recorded of a model of that name
    before (removed, or replaced) was taken for this one's first sighting,
    and never recorded for it (hostile test)."""
    t = events_table.c
    # Newest first, stopping at the first found: not the model's whole history,
    # once a finding, inside the write transaction.
    stream = stream_walk(model_id(name))
    found = conn.execute(
        sa.select(stream.c.revision, stream.c.topic)
        .where(stream.c.topic.in_((_UPSTREAM_TOPIC, _ADDED_TOPIC)))
        .limit(1)
    ).first()
    if found is None:
        # Nothing met may be a walk cut short by a hand edit, not no finding.
        check_walk(conn, model_id(name), f"model {shown(name)}")
    if found is None or found.topic != _UPSTREAM_TOPIC:
        return None
    row = conn.execute(sa.select(t.revision, t.state).where(t.revision == found.revision)).one()
    try:
        event = decode_event(_UPSTREAM_TOPIC, row[1])
    except UndecodableEvent:
        return None
    assert isinstance(event, Model.UpstreamChanged)
    return int(row[0]), event


def _origin_set_by(event: dict[str, Any]) -> Origin | None:
    """The origin a logged event (``log_events`` shape) put in force, if it set one."""
    fields = event["fields"]
    # Added holds it in its definition; SourceSet and OriginSet carry it; an
    # undecodable record has no fields.
    data = (fields.get("spec") or fields).get("origin")
    if not data:
        return None
    # A field left out is null in the view, empty text in the stored form.
    return msgspec.convert({k: v for k, v in data.items() if v is not None}, Origin)


def _runs_as_read(now: ModelSpec, read: ModelSpec, repository: str | None) -> bool:
    """Whether ``now`` still runs the weights ``read`` did: its source, and its
    origin, or, where ``read`` had none or part of one, that origin completed
    meanwhile: what it gave kept, of ``repository``, the one ``read``'s
    weights come from (its origin's, else its source's; ``None``: not known).
    That records what it ran (``check-updates``, from cron): taken for a
    change, it refused an update once its download was done (hostile test).
    Another repository, or the part cleared, is an operator's change, which
    the move wrote over (review)."""
    if now.source != read.source:
        return False
    if now.origin == read.origin:
        return True
    was, found = read.origin or Origin(), now.origin or Origin()
    if was.revision and was.files:
        return False  # recorded whole: another is a change
    return (
        bool(repository)
        and found.repository == repository
        and was.revision in ("", found.revision)
        and was.files.items() <= found.files.items()
    )


def _not_recorded(updates: list[dict[str, Any]], refused: Refused | None) -> dict[str, Any] | None:
    """What ``check-updates`` answers of findings its write could not record:
    ``recorded`` empty said the same as nothing new to record, to a script
    reading the JSON (only stderr told them apart). The models of the
    updates no record has seen (``first_seen`` null), and why."""
    if refused is None:
        return None
    unseen = [update["model"] for update in updates if update["first_seen"] is None]
    return {"models": unseen, "reason": str(refused)}


def _weights_view(source: str, origin: Origin | None) -> dict[str, str | None]:
    """Weights as `model update` and `model rollback` say them: a field no
    origin gives is null, as in every model view."""
    return {
        "source": source,
        "repository": (origin.repository if origin else "") or None,
        "revision": (origin.revision if origin else "") or None,
    }


class Weights:
    """Provenance queries and commands over the catalog, a registry and a weights store."""

    def __init__(self, models: Models, registry: Registry, store: WeightsStore) -> None:
        self.models = models
        self.registry = registry
        self.store = store

    # -- what upstream has -----------------------------------------------------

    def updates(self) -> dict[str, Any]:
        """The models whose upstream commit or file checksums differ from what
        they run, declared ones included; and the models that could not be
        compared, with the reason. Reads only."""
        return self._report(self._scan())

    def check_updates(
        self, *, by: str, reason: str = "", expected_revision: int | None = None
    ) -> dict[str, Any]:
        """``updates``, recording what is new: the origin of each runtime model
        that had none, or part of one (``OriginSet`` by the system actor), then each finding
        not recorded before (``UpstreamChanged``), declared models' too: the
        record changes no definition, and the audit shows when it was first seen.
        ``expected_revision``: refused, nothing written, if the log has moved
        past it, as every write is; checked before the registry is read, and
        by the run's first write."""
        refused: Refused | None = None  # the findings' write, once the origins' has written
        with self.models.refusals_recorded(CHECK_UPDATES, "", by, reason, {}):
            # What refuses any write (a log moved past expected_revision, a
            # run given no config) refuses this one before the registry is
            # asked, and with nothing new to record too, as any command's.
            self.models.write_plan(
                lambda _batch: None,
                by=by,
                reason=reason,
                expected_revision=expected_revision,
                dry_run=True,
            )
            scan = self._scan()
            origins = self._record_origins(scan.unrecorded, expected_revision)
            if not scan.unrecorded:  # the findings' write is the run's first
                recorded = self._record_findings(
                    scan.findings, by=by, reason=reason, expected_revision=expected_revision
                )
        if scan.unrecorded:
            # The origins are written: a refusal from here on would be one of
            # a run that wrote something, and not kept as the run's. The
            # findings' write checks each model is still as it was read.
            try:
                recorded = self._record_findings(
                    scan.findings, by=by, reason=reason, expected_revision=None
                )
            except Refused as refusal:
                # Told as the run's refusal, exit 1, it said nothing was
                # written over the origins that were (hostile test): as an
                # applier's failure after a move, the write stands, and is told.
                log.warning(
                    "the upstream changes found were not recorded (%s); the origins are "
                    "written at revision %d, and the next run records the changes",
                    refusal,
                    self.models.revision,
                )
                recorded, refused = [], refusal
        report = self._report(scan)
        report.update(
            revision=self.models.revision,
            origins=origins,
            recorded=recorded,
            not_recorded=_not_recorded(report["updates"], refused),
        )
        return report

    def _repository_of(self, spec: ModelSpec) -> str | None:
        """The repository ``spec``'s weights come from: its origin's, else the
        one its source names here; none, if neither says."""
        return (spec.origin.repository if spec.origin else "") or (
            self.registry.repository_for(spec.source)
        )

    def _repository(self, spec: ModelSpec) -> str:
        repository = self._repository_of(spec)
        if not repository:
            raise RegistryError(
                f"source {spec.source} is not in the registry, and no origin names a repository"
            )
        return repository

    def _running(self, spec: ModelSpec, lookups: _Lookups) -> Origin:
        """What ``spec`` runs: its origin, with what it leaves out (all of it,
        for a model that has none) worked out from the registry."""
        origin = spec.origin or Origin()
        if origin.files and not origin.revision:
            # Paired with the head, they would say it holds what it may not.
            raise RegistryError(
                "its origin gives file checksums but no commit: which commit they are "
                "of cannot be told (give origin.revision)"
            )
        repository = self._repository(spec)
        revision = origin.revision or lookups.head(repository)
        files = origin.files or lookups.files(repository, revision)
        return Origin(repository=repository, revision=revision, files=files)

    def _scan(self) -> _Scan:
        catalog = self.models.catalog_at()
        lookups = _Lookups(self.registry)
        scan = _Scan(revision=catalog.revision, findings=[], unrecorded=[], unchecked=[])
        for spec in catalog.models():
            declared = catalog.is_declared(spec.name)
            try:
                running = self._running(spec, lookups)
                head = lookups.head(running.repository)
                files = lookups.files(running.repository, head)
                if head == running.revision:
                    # An origin speaks for the files it lists, as it is taken
                    # (not completed) when it lists any: on its own commit, a
                    # file it leaves out is no difference, where one it lists
                    # changed or gone is. Compared whole, an origin given with
                    # the weights file alone was a finding of its commit
                    # against itself, recorded (hostile test).
                    files = {
                        path: digest for path, digest in files.items() if path in running.files
                    }
                upstream = Origin(repository=running.repository, revision=head, files=files)
            except RegistryError as error:
                scan.pass_over(spec, str(error))
                continue
            # A runtime origin given in part (no commit, say) is completed
            # as a missing one is: else the model follows main unreported.
            if running != spec.origin and not declared:
                try:
                    # An older release's origin may break today's input rules
                    # (a file name too long to fetch): refused in the batch
                    # of every model's origins, it refused them all, each run.
                    check_origin(spec.name, running)
                except InvalidModel as refusal:
                    scan.pass_over(
                        spec,
                        f"its origin, stored before today's rules, cannot be completed: "
                        f"{refusal.field}: {refusal.problem} (model update moves it to other "
                        "weights)",
                    )
                    continue
                scan.unrecorded.append((spec, running))
            if upstream != running:
                held = lookups.holds(running.repository, running.revision)
                scan.findings.append(_Finding(spec, declared, running, upstream, held))
        return scan

    def _report(self, scan: _Scan) -> dict[str, Any]:
        with self.models.store.read() as conn:
            updates = [self._finding_view(finding, conn) for finding in scan.findings]
        return {"revision": scan.revision, "updates": updates, "unchecked": scan.unchecked}

    def _finding_view(self, finding: _Finding, conn: Connection) -> dict[str, Any]:
        last = _last_finding(conn, finding.spec.name)
        first_seen = None
        if last is not None and finding.recorded_by(last[1]):
            logged = event_view(*last)
            first_seen = {key: logged[key] for key in ("revision", "time", "by")}
        return {
            "model": finding.spec.name,
            "declared": finding.declared,
            "repository": finding.upstream.repository,
            "ref": DEFAULT_BRANCH,
            "running": finding.running.revision,
            "upstream": finding.upstream.revision,
            "running_in_registry": finding.running_in_registry,
            **file_changes(finding.running.files, finding.upstream.files),
            "first_seen": first_seen,
        }

    def _record_origins(
        self, unrecorded: list[tuple[ModelSpec, Origin]], expected_revision: int | None
    ) -> list[dict[str, str | None]]:
        recorded: list[dict[str, str | None]] = []

        def plan(batch: Batch) -> None:
            for spec, origin in unrecorded:
                if batch.catalog.get(spec.name) != spec:
                    continue  # changed since it was read: the next run looks again
                commands.origin(spec.name, origin).decide(batch)
                recorded.append({"model": spec.name, **_weights_view(spec.source, origin)})

        if unrecorded:
            self.models.write_plan(
                plan,
                by=SYSTEM_ACTOR,
                reason="origin worked out from the registry",
                expected_revision=expected_revision,
            )
        return recorded

    def _record_findings(
        self, findings: list[_Finding], *, by: str, reason: str, expected_revision: int | None
    ) -> list[str]:
        recorded: list[str] = []

        def plan(batch: Batch) -> None:
            # Inside the write transaction: two runs at once record a finding once.
            for finding in findings:
                name = finding.spec.name
                # As read, or with the origin this run recorded (_record_origins).
                completed = msgspec.structs.replace(finding.spec, origin=finding.running)
                if batch.catalog.get(name) not in (finding.spec, completed):
                    continue
                last = _last_finding(batch.conn, name)
                if last is not None and finding.recorded_by(last[1]):
                    continue
                batch.decide(batch.event(Model.UpstreamChanged, name, **finding.event_fields()))
                recorded.append(name)

        if findings:
            self.models.write_plan(plan, by=by, reason=reason, expected_revision=expected_revision)
        return recorded

    # -- moving a model between commits ------------------------------------------

    def update(
        self,
        name: str,
        revision: str | None = None,
        *,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> dict[str, Any]:
        """Move a runtime model to a commit of its repository (a commit id or a
        branch; default: where ``main`` points), fetched and verified first."""
        if revision == "":
            raise InputError("the revision: give a branch or a commit (default: main)")
        ref = revision or DEFAULT_BRANCH
        with self.models.refusals_recorded("SourceSet", name, by, reason, {"revision": ref}):
            spec = self._movable(name, by=by, reason=reason, expected_revision=expected_revision)
            repository = self._repository(spec)
            commit = self.registry.resolve(repository, ref)
            target = Origin(
                repository=repository,
                revision=commit,
                files=self.registry.files(repository, commit),
            )
            return self._move(
                spec, target, by=by, reason=reason, expected_revision=expected_revision
            )

    def rollback(
        self,
        name: str,
        to: str | None = None,
        *,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> dict[str, Any]:
        """Move a runtime model back to weights it ran before, as the log
        recorded them (checksums included), verified the same way: the ones
        before the current by default, or the latest it ran of commit ``to``
        (an id or a prefix of one). The event is marked with the log revision
        those weights were recorded at (the end of the write that did)."""
        if to == "":
            # Input, as update's empty revision is: kept among the refusals,
            # it was told as no commit id (hostile test).
            raise InputError(
                "the commit to go back to: give one the model ran "
                "(default: the weights before the current ones)"
            )
        with self.models.refusals_recorded("SourceSet", name, by, reason, {"to": to}):
            spec = self._movable(name, by=by, reason=reason, expected_revision=expected_revision)
            recorded_at, target = self._earlier_weights(spec, to)
            with self.models.store.read() as conn:
                # The end of the write that recorded them: a revision inside
                # one (an apply's first add) reads as the state before it,
                # where the model may not be at all (review).
                rollback_to = pointintime.write_end(conn, recorded_at)
            return self._move(
                spec,
                target,
                by=by,
                reason=reason,
                expected_revision=expected_revision,
                rollback_to=rollback_to,
            )

    def _movable(
        self, name: str, *, by: str, reason: str, expected_revision: int | None
    ) -> ModelSpec:
        spec = self.models.catalog_at().get(name)
        if spec is None:
            raise ModelNotFound(name)

        def plan(batch: Batch) -> None:
            # Refused now, before anything is fetched, when the write would
            # be: a declared model (configuration owns its weights), a log
            # moved past --expected-revision, a model gone. Only that: the
            # weights it runs are what the move replaces, not input. Dry-run
            # as a SourceSet to themselves, a source or an origin an older
            # release stored, which today's rules refuse, refused the move
            # off it, naming what the operator never typed (hostile test).
            if batch.catalog.is_declared(name):
                asked = batch.event(Model.SourceSet, name, source=spec.source, origin=spec.origin)
                raise DeclaredInConfig(name, declared_refusal(asked))
            if batch.catalog.get(name) is None:
                raise ModelNotFound(name)

        self.models.write_plan(
            plan, by=by, reason=reason, expected_revision=expected_revision, dry_run=True
        )
        return spec

    def _earlier_weights(self, spec: ModelSpec, to: str | None) -> tuple[int, Origin]:
        name = spec.name
        skipped = {s.revision for s in self.models.skipped() if s.model == name}
        ran: list[tuple[int, Origin]] = []
        for event in self.models.log_events(model=name):
            if event["event"] == "Removed" and event["revision"] not in skipped:
                ran.clear()  # a model of that name added since is another model
                continue
            origin = _origin_set_by(event)
            # An origin with no commit says not what ran, but what to work
            # out; one with no files, nothing a copy could be checked against.
            if (
                origin is not None
                and origin.revision
                and origin.files
                and event["revision"] not in skipped
            ):
                ran.append((event["revision"], origin))
        if to is None:
            ran = [(r, origin) for r, origin in ran if origin != spec.origin]
        else:
            # The weights it runs now count: asked for them, it is told it
            # runs them already, as an update to them is.
            check_commit(to)
            ran = [(r, origin) for r, origin in ran if origin.revision.startswith(to)]
            if len({origin.revision for _, origin in ran}) > 1:
                raise Refused(f"commit {to} is ambiguous among the weights model {name!r} ran")
            if not ran:
                raise Refused(
                    f"model {name!r} has not run commit {to} before, by the log "
                    f"(model update --revision {to} moves it to a commit it has not run)"
                )
        if not ran:
            raise Refused(f"model {name!r}: the log records no earlier weights to go back to")
        return ran[-1]

    def _move(
        self,
        spec: ModelSpec,
        target: Origin,
        *,
        by: str,
        reason: str,
        expected_revision: int | None,
        rollback_to: int | None = None,
    ) -> dict[str, Any]:
        running = self.models.catalog_at().models()
        folder = self.store.folder(target, running)
        source = self.store.source(folder)
        result: dict[str, Any] = {
            "rollback_to": rollback_to,
            "from": _weights_view(spec.source, spec.origin),
            "to": _weights_view(source, target),
            **file_changes(spec.origin.files if spec.origin else {}, target.files),
        }
        if (source, target) == (spec.source, spec.origin):
            # Its folder is checked all the same, and what is missing fetched
            # again: "already runs" was told, exit 0, of a store wiped or
            # tampered with since, which no replica could load (hostile test).
            result["fetched"] = self.store.stage(self.registry, target, folder, running)
            view = model_view(spec, declared=False)
            return {"revision": self.models.revision, "written": False, "model": view, **result}
        write = partial(
            self._write_source,
            spec,
            source,
            target,
            by=by,
            reason=reason,
            expected_revision=expected_revision,
            rollback_to=rollback_to,
        )
        # What the write would refuse of the new source (a store path too
        # long for one), refused before gigabytes are fetched for it.
        write(dry_run=True)
        result["fetched"] = self.store.stage(self.registry, target, folder, running)
        revision, changes = write()
        if not changes:
            # Moved there meanwhile (the same update run twice at once): what
            # was asked holds. It was refused, to be run again for that, when
            # it would then say "already runs" (hostile test).
            view = model_view(self.models.catalog_at().get(spec.name) or spec, declared=False)
            return {"revision": revision, "written": False, "model": view, **result}
        new = changes[-1][1]
        assert new is not None
        try:
            self.models.applier.replace_replicas(new, revision)
        except Exception:
            # As a catalog the applier fails on (Models._push): the move is
            # written, and the controller, following the log, catches up.
            log.exception(
                "the applier failed to replace the replicas of %r; the move is written at "
                "revision %d",
                new.name,
                revision,
            )
        view = model_view(new, declared=False)
        return {"revision": revision, "written": True, "model": view, **result}

    def _write_source(
        self,
        spec: ModelSpec,
        source: str,
        origin: Origin | None,
        *,
        by: str,
        reason: str,
        expected_revision: int | None,
        rollback_to: int | None = None,
        dry_run: bool = False,
    ) -> tuple[int, list[Change]]:
        """``SourceSet`` on ``spec``'s model, refused if its weights are no
        longer those of ``spec`` by the time the write transaction holds;
        nothing written (no changes answered) if they are already those."""

        repository = self._repository_of(spec)

        def plan(batch: Batch) -> None:
            now = batch.catalog.get(spec.name)
            if now is not None and (now.source, now.origin) == (source, origin):
                return  # moved there meanwhile: nothing to write
            if now is None or not _runs_as_read(now, spec, repository):
                raise Refused(
                    f"model {spec.name!r} changed while its weights were being fetched; "
                    "nothing was written, run the command again"
                )
            commands.source(spec.name, source, origin).decide(batch)

        return self.models.write_plan(
            plan,
            by=by,
            reason=reason,
            expected_revision=expected_revision,
            rollback_to=rollback_to,
            dry_run=dry_run,
        )
