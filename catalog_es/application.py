"""``Models``: the application service that changes the catalog without a restart.

Every command reads the log up to its head, decides against the catalog in
force, and appends its event, all inside one write transaction, so a decision
is never made on stale grounds even with other writers on the same database.
Commands are also serialised in-process and push the catalog to the applier
before the next one starts, so catalogs are applied in log order.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from datetime import datetime, timedelta
from itertools import islice
from typing import Any, ClassVar, TypeVar, overload
from uuid import UUID

import msgspec
import sqlalchemy as sa
from eventsourcing.application import Application
from eventsourcing.persistence import Notification
from eventsourcing.utils import Environment, EnvType, get_topic
from sqlalchemy.engine import Connection

from catalog_es import commands
from catalog_es.audit import AuditTrail
from catalog_es.batch import Batch, Change, KnownVersions, declaration_differs
from catalog_es.bootstrap import CONFIG_GIVEN_BY, from_env
from catalog_es.catalog import UNREADABLE_DECLARATION, Catalog, Skipped
from catalog_es.catalog_lock import CatalogLock
from catalog_es.chain import ChainHead, DamagedHead, UnwritableHead, deleted_tail, stored_head
from catalog_es.collector import collector_paused
from catalog_es.configuration import Configuration, DeclaredConfig, gone_without, named_config
from catalog_es.errors import (
    NAME_SHOWN_LENGTH,
    ConfigError,
    DamagedLog,
    InputError,
    LogRewritten,
    ModelNotFound,
    NoConfigGiven,
    OutcomeUnknown,
    Refused,
    RevisionConflict,
    StorageBusy,
    came_of_a_stop,
    counted,
    cut_short,
    first_line,
    lost_events,
    shown,
)
from catalog_es.inputs import check_actor_filter, check_meta
from catalog_es.mapper import (
    EventMapper,
    UndecodableEvent,
    decode_event,
    model_of_state,
    readable_declaration,
    spelling_marks,
)
from catalog_es.model import MAX_CLOCK_SKEW, DomainEvent, Model, model_id, utc_now, utc_text
from catalog_es.names import APPLY, CONFIG_DECLARED, ROLLBACK
from catalog_es.persistence import (
    AnswerTooLarge,
    Appended,
    Factory,
    Kept,
    PullingSubscription,
    SQLRecorder,
    Standing,
    within_bytes,
)
from catalog_es.ports import AcceptAll, Applier, NoApplier, PreAddCheck
from catalog_es.rollback import plan_rollback
from catalog_es.spec import Adapter, ModelSpec, Origin, check_name
from catalog_es.storage.engines import commit_may_have_stood, database_unusable
from catalog_es.storage.schema import check_walk_end, events_table, holds_bytes, stream_walk
from catalog_es.storage.sqlite_file import FileNotTheLog
from catalog_es.storage.waits import acquire_within, holds, release_to
from catalog_es.values import zoned
from catalog_es.views import (
    event_fields,
    event_view,
    model_view,
    model_views,
    undecodable_view,
)
from projections import pointintime, snapshots
from projections.catalog import catch_up
from projections.diff import diff_catalogs

log = logging.getLogger("catalog_es")

# Who records what the system works out by itself (an origin, say).
SYSTEM_ACTOR = "catalog-es"
# Events a write catches up with while it holds the log's write lock, which
# every node's writes queue behind (2,000 scalings: 8 ms). A node further
# behind (it served nothing while others wrote) lets go of the lock and
# catches up first: a backlog of 300,000 scalings held it 0.76 s.
CATCH_UP_HELD = 2_000
# Looks a thread takes through the configs other nodes recorded, one after
# another: those noted by other threads as it looked are left to it (and
# a server gone idle makes no next call). Bounded, so that a request thread
# under writes on two configs that go on is not kept looking.
CONFIG_LOOKS = 2


At = int | datetime | None


def _skips_of(catalog: Catalog, name: str) -> str:
    """What load skipped of a model not in force, said where it is looked for:
    the reason is otherwise only in the load's warnings."""
    if not catalog.was_skipped(name):
        return ""  # never skipped, or removed since (its removal is why it is gone)
    skips = sum(s.model == name for s in catalog.skipped)
    cause = catalog.taken_out_by(name)
    return (
        f" (load skips {counted(skips, 'event')} of it, out of force since revision"
        f" {cause.revision}, {cause.event}: {cause.reason}; catalog-es verify lists them)"
    )


def _declaration(catalog: Catalog) -> dict[str, Any] | None:
    """The declared layer the log had recorded as in force at a catalog's
    revision. A record that cannot be read has no fingerprint, and says why:
    it is the one in force there all the same (``--declared-then`` refuses
    to read over it), not the readable one before it."""
    if catalog.recorded_declaration is None:
        return None
    fingerprint, revision = catalog.recorded_declaration
    if fingerprint != UNREADABLE_DECLARATION:
        return {"fingerprint": fingerprint, "recorded_at": revision}
    why = next(
        (s.reason for s in catalog.skipped if s.revision == revision),
        "written by another version of catalog-es",
    )
    return {
        "fingerprint": None,
        "recorded_at": revision,
        "error": f"the declared config recorded at revision {revision} cannot be read: {why}",
    }


def _event_views(
    rows: Iterable[Any], model: str | None, by: str | None = None, max_bytes: int | None = None
) -> Iterator[dict[str, Any]]:
    """Each stored row as ``log --json`` prints it, decoded as it is asked
    for. Given ``by``, only the events that actor recorded, told from the
    event decoded (the bytes a database matched may be another field's), so
    none that cannot be decoded: it names no one. ``max_bytes``: what the
    stored forms of those shown may hold in all, as :func:`within_bytes` has
    it, refused (:class:`AnswerTooLarge`) once they are read past it."""
    given, read = 0, 0
    for revision, topic, state in rows:
        try:
            event: DomainEvent | None = decode_event(topic, state)
        except UndecodableEvent as error:
            event, why = None, str(error)
        if by is not None and (event is None or event.by != by):
            continue
        if max_bytes is not None:
            read += len(state)
            if given and read > max_bytes:
                raise AnswerTooLarge
        given += 1
        if event is not None:
            yield event_view(revision, event)
        else:
            # Asked for one model, every row is of its stream: one whose
            # bytes cannot say so is still its, as history has it.
            named = model_of_state(state) or model or ""
            yield undecodable_view(revision, topic, named, why)


class CommandResult(msgspec.Struct, frozen=True):
    """What a command answers: the revision it wrote and the model as it will run."""

    revision: int
    model: dict[str, Any] | None
    replaced: bool = False
    removed: str | None = None
    written: bool = True


# The most of the stored events' bytes ``log`` reads at once (and
# ``PullingSubscription.page`` events at most), as a watch pages but a
# quarter of its bytes: a page is written out as soon as it is read, so a
# smaller one costs little, and held a page of 1 MiB took 2.4 MB.
LOG_PAGE_BYTES = 1 << 18

# How many model views an answer builds at once, at most (an apply's items,
# a list of the models), and the weight of their definitions (a profile, an
# adapter, an origin's file each count one) past which fewer are: 64 models of
# 5,000 adapters each took 640 MB to build at once (hostile test).
VIEWS_PAGE = 64
VIEWS_PAGE_WEIGHT = 256


T = TypeVar("T")


def _applied(outcomes: list[commands.Outcome]) -> Iterator[dict[str, Any]]:
    """An apply's answer items, one per change, each with the model as that
    change left it, built a page at a time as they are read: a list of
    5,000 changes to one model with a hundred adapters answered 58 MB, and a
    server held it whole for each client that did not read it."""
    for page in _pages(outcomes, lambda outcome: outcome[1]):
        specs = [new for _, new, _ in page if new is not None]
        definitions = iter(model_views(specs, lambda _: False))
        for event, new, replaced in page:
            yield {
                "model": event.model,
                "event": type(event).__name__,
                "replaced": replaced,
                "definition": next(definitions) if new is not None else None,
            }


def _views(specs: list[ModelSpec], is_declared: Callable[[str], bool]) -> Iterator[dict[str, Any]]:
    """:func:`model_views` built a page at a time as they are read: a list of
    100,000 models took 133 MB more than the catalog to answer whole."""
    for page in _pages(specs, lambda spec: spec):
        yield from model_views(page, is_declared)


def _pages(items: list[T], spec_of: Callable[[T], ModelSpec | None]) -> Iterator[list[T]]:
    page: list[T] = []
    weight = 0
    for item in items:
        page.append(item)
        if (spec := spec_of(item)) is not None:
            origin_files = len(spec.origin.files) if spec.origin is not None else 0
            weight += 1 + len(spec.profiles) + len(spec.adapters) + origin_files
        if len(page) == VIEWS_PAGE or weight >= VIEWS_PAGE_WEIGHT:
            yield page
            page, weight = [], 0
    if page:
        yield page


class InForce(Sequence[ModelSpec]):
    """The models in force, as the applier is handed them: listed (and sorted)
    only if the applier reads them, so an applier that follows the log itself
    costs a command nothing on a large catalog. Read it during the call."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        self._models: list[ModelSpec] | None = None

    def _listed(self) -> list[ModelSpec]:
        if self._models is None:
            self._models = self._catalog.models()
        return self._models

    @overload
    def __getitem__(self, index: int) -> ModelSpec: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[ModelSpec]: ...
    def __getitem__(self, index: int | slice) -> ModelSpec | Sequence[ModelSpec]:
        return self._listed()[index]

    def __len__(self) -> int:
        return len(self._listed())


class _FarBehind(Exception):
    """A write, holding the log's write lock, found its node more than
    :data:`CATCH_UP_HELD` events behind, or on events the log lost."""


class _WriteAsked(msgspec.Struct, frozen=True):
    """What a write was asked (:meth:`Models._write`), built once: made
    again after catching up (:class:`_FarBehind`), it is asked the same."""

    plan: Callable[[Batch], None]
    by: str
    reason: str
    expected_revision: int | None
    rollback_to: int | None
    several: bool
    dry_run: bool
    records_only: bool
    # The ids of the models whose stream versions the plan will need.
    streams: list[UUID]


class _Written(msgspec.Struct, frozen=True):
    """What one try at a write answers (:meth:`Models._write_once`): the
    revision and changes :meth:`Models._write` answers, and what the write
    leaves to be done with neither of this process's locks held, which
    every other writer of the process would wait for."""

    revision: int
    changes: list[Change]
    # The snapshot it made due, of the catalog as the write left it.
    snapshot: snapshots.SnapshotState | None = None
    # The revision of the config record this write recorded its own over,
    # and that of its own (:meth:`Models._tell_config_put_back`).
    put_over: tuple[int, int] | None = None


def _tell_skipped(skipped: Sequence[Skipped]) -> None:
    """A warning for each record a replay left out, ten at most and then a count."""
    for skip in skipped[:10]:
        log.warning("skipped revision %d (%s): %s", skip.revision, skip.what(), skip.reason)
    if len(skipped) > 10:
        log.warning(
            "… and %d more skipped events (catalog-es verify lists them)", len(skipped) - 10
        )


def _tell_standing_skips(catalog: Catalog) -> None:
    """What a load leaves out that still counts (:meth:`Catalog.standing_skips`),
    as :func:`_tell_skipped` tells it. The rest (later changes to those
    models, records of models re-added or removed since) only in one line
    of the process's log: told on every command for good, they pushed the
    one new conflict out of sight (operator walkthrough)."""
    standing = catalog.standing_skips()
    _tell_skipped(standing)
    others = len(catalog.skipped) - len(standing)
    if others:
        log.info(
            "load skips %s more: later changes to those models, and records of models "
            "re-added or removed since (catalog-es verify lists them)",
            counted(others, "event"),
        )


def _refused_change(number: int, step: commands.Step, refusal: Refused) -> Refused:
    """The refusal of a list of changes, for its change ``number``, ``step``
    (a name longer than any model's cut short: its own refusal quotes it);
    what the declared config decided of it is what it decided of the change."""
    return Refused(
        f"change {number} ({step.verb} {cut_short(step.name, 128)}) refused, nothing applied:"
        f" {refusal}",
        refusal.turned_on,
    )


def _outcome_unknown(error: BaseException, revisions: list[int]) -> OutcomeUnknown | None:
    """What to tell of ``error``, raised by a write once it appended
    ``revisions`` (none: before it), when it failed the commit once begun,
    which may have stood. Worked out here, not in the writer's frame: a name
    there holding the error (and so its traceback, and so that frame) would
    keep the write's generators alive, their transaction and its lock
    unended, until a collection (an interrupt test: every run)."""
    if not revisions or not commit_may_have_stood(error):
        return None
    said = error.orig if isinstance(error, sa.exc.DBAPIError) else error
    return OutcomeUnknown(revisions[0], revisions[-1], first_line(str(said)))


def _lost(catalog: Catalog, kept: Kept) -> str | None:
    """Why the log, as ``kept`` tells it, no longer holds the events
    ``catalog`` was built from (a failover to a standby that had not received
    them, a file restored from a backup, perhaps new writes since); ``None``
    while it does, as far as can be told."""
    chain = catalog.chain
    if kept.last < catalog.revision:
        return lost_events(
            f"the log ends at revision {kept.last}, before this node's catalog (at "
            f"{catalog.revision}): it lost events"
        )
    if chain is None:
        return None  # nothing to check against: revision 0, or a hash left unreadable
    if chain.revision != catalog.revision:
        # Nothing vouches for what a catch-up applied, or a write put in
        # force, before it was cut off (the read failing, an interrupt): a
        # catch-up's chain moves once it is done, a write's first and its
        # revision last, so the two disagree until then.
        return (
            f"this node's catalog was left part-way at revision {catalog.revision} by a "
            "catch-up or a write cut off before it was done"
        )
    # A hash a hand edit left unreadable there is verify's to tell, not a reload's.
    unreadable = kept.hash is not None and _chain(chain.revision, kept.hash) is None
    if kept.hash == chain.hash or unreadable:
        return None
    return lost_events(
        f"the log holds other events at revision {catalog.revision} than this node's "
        "catalog was built from: it lost events and took others since"
    )


def _chain(revision: int, hash_: object) -> ChainHead | None:
    """The log's chain at ``revision`` as read: ``None`` at 0, and for a hash
    a hand edit left unreadable (nothing to check against; verify tells)."""
    head = stored_head(revision, hash_)
    return head if isinstance(head, ChainHead) and revision > 0 else None


def _end_if_replaced(error: Exception, last: int) -> None:
    """Ends a watch whose SQLite file was renamed over: reading on would mix
    the two files, and which log the path now holds, and whether it follows
    on from the last event given, is for a new watch to find out."""
    said = error.orig if isinstance(error, sa.exc.DBAPIError) else error
    if isinstance(said, FileNotTheLog) and said.replaced:
        raise LogRewritten(f"{said}; watch again from revision {last}, the last it gave")


class _Outage:
    """Whether this process's watches wait for the database: told when the
    first finds it gone and when the last finds it back, not once a watch (a
    server may have a hundred streams open)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting = 0
        self._where = ""  # where the database waited for is (SQLRecorder.where)

    def began(self, where: str, unusable: str) -> None:
        with self._lock:
            self._waiting += 1
            first = self._waiting == 1
            if first:
                self._where = where
        if first:
            log.warning(
                "watch: the database %s could not be used (%s); following on once it can",
                where,
                unusable,
            )

    def ended(self, *, back: bool) -> None:
        """One watch no longer waits: the database is ``back``, or it stopped."""
        with self._lock:
            self._waiting -= 1
            last = self._waiting == 0
        if last and back:
            log.warning("watch: the database %s is back; following on", self._where)


_outage = _Outage()


class Watch:
    """Changes as they commit, as ``log --json`` shows them: iterate it, and
    ``stop()`` it from any thread (a signal handler, a closed HTTP stream).

    A follower outlives the database going away (restarted, failed over, its
    sessions ended): it subscribes again after the last revision it gave, so
    it follows on with no gap and no repeat once the database is back. Should
    the log no longer hold that revision as it was given (a failover to a
    standby that missed it, then other writes numbered the same), it ends
    with :class:`LogRewritten`: following on would miss those. So it does
    when a page it reads does not follow on from the last event it gave (a
    backup restored in place under it, or, on SQLite, renamed over it)."""

    # Seconds between tries while the database cannot be used.
    retry_seconds = 1.0

    def __init__(
        self,
        subscribe: Callable[[int, Any], PullingSubscription],
        after: int,
        given: Any,
        by: str | None = None,
        *,
        where: str,
    ) -> None:
        # Makes a subscription after a revision, the hash of the event given
        # there; it asks the database as it does, so one made means the
        # database answers.
        self._subscribe = subscribe
        self._after = after
        self._given = given
        self._by = by  # only this actor's changes are given
        self._where = where  # where the database is, as a wait for it tells (SQLRecorder.where)
        self._stopped = threading.Event()
        self._subscription: PullingSubscription | None = None
        # Changes read already that ready() decoded, by revision: each as it
        # is given, None for another actor's. Decoded once, given from here.
        self._decoded: dict[int, dict[str, Any] | None] = {}

    def __iter__(self) -> Generator[dict[str, Any], None, None]:
        last, given, away = self._after, self._given, False
        try:
            while not self._stopped.is_set():
                try:
                    self._decoded.clear()  # a subscription of its own reads them again
                    self._subscription = subscription = self._subscribe(last, given)
                    if away:  # subscribing asks the database: it answered
                        away = False
                        _outage.ended(back=True)
                    if self._stopped.is_set():
                        subscription.stop()  # stopped while it was made: it ends at once
                    with subscription as notifications:
                        for n in notifications:
                            last, given = n.id, n.hash
                            view = (
                                self._decoded.pop(n.id) if n.id in self._decoded else self._view(n)
                            )
                            if view is not None:
                                yield view
                    return
                except Exception as error:
                    if self._stopped.is_set():
                        return  # stopped: what ended the subscription is no longer news
                    unusable = database_unusable(error)
                    if unusable is None or came_of_a_stop(error):
                        # A Ctrl-C that cut a query short comes back as the
                        # driver's error, the connection's lost: taken for an
                        # outage, the watch waited on, the stop forgotten.
                        raise
                    _end_if_replaced(error, last)
                    if not away:
                        away = True
                        _outage.began(self._where, unusable.said)
                    self._stopped.wait(self.retry_seconds)
        finally:
            if away:
                _outage.ended(back=False)

    def stop(self) -> None:
        self._stopped.set()
        if self._subscription is not None:
            self._subscription.stop()

    def ready(self) -> bool:
        """Whether the next change is read already: taking it waits for
        nothing (neither the database nor a commit). Given an actor, one of
        theirs is: the others' read before it are passed over at once, but
        with none of theirs read, the next waits for a commit."""
        subscription = self._subscription
        if subscription is None or self._stopped.is_set():
            return False
        pulled = subscription.pulled()
        if self._by is None:
            return bool(pulled)
        for n in pulled:
            if n.id not in self._decoded:
                self._decoded[n.id] = self._view(n)
            if self._decoded[n.id] is not None:
                return True
        return False

    def _view(self, n: Notification) -> dict[str, Any] | None:
        """The change ``n`` is, as given; ``None`` for another actor's."""
        return next(_event_views([(n.id, n.topic, n.state)], None, self._by), None)


# The event library's settings that encrypt stored events (with the service's
# name before them too). catalog-es does not encrypt, and one who set them
# believes the log is encrypted at rest: refused, where the library's other
# settings are ignored.
CIPHER_SETTINGS = ("CIPHER_TOPIC", "CIPHER_KEY")


class Models(AuditTrail, Application[UUID]):
    """The catalog's application service: commands, and queries returning plain data
    (the audit queries come from :class:`catalog_es.audit.AuditTrail`)."""

    name = "catalog"
    env: ClassVar[dict[str, str]] = {
        "PERSISTENCE_MODULE": "catalog_es.persistence:Factory",
        "MAPPER_TOPIC": get_topic(EventMapper),
    }
    mapper: EventMapper

    def __init__(
        self,
        declared: DeclaredConfig | None = None,
        *,
        applier: Applier | None = None,
        pre_add_check: PreAddCheck | None = None,
        snapshot_interval: int = snapshots.DEFAULT_INTERVAL,
        env: EnvType | None = None,
    ) -> None:
        if snapshot_interval < 1:
            raise ValueError("snapshot_interval must be at least 1")
        self.snapshot_interval = snapshot_interval
        self.declared = declared or DeclaredConfig(given=False)
        self.applier = applier or NoApplier()
        self.pre_add_check = pre_add_check or AcceptAll()
        # Serialises commands in this process, held while one waits for the
        # database; the write transaction serialises them across processes.
        self._lock = threading.RLock()
        # The lock wait, and the refusal of a write that waited it out for
        # that lock: worded once a wait, not by every write in case it is
        # refused (3,000 instructions, 0.6% of a scale command's).
        self._lock_busy: tuple[float | None, str] = (None, "")
        # Guards the catalog in force, which commands change in place. A
        # command takes it only once it holds the database, so a read (an
        # HTTP server's) never waits on a write that waits for another process;
        # then before the reads that come after it, as it holds up every node.
        self._state = CatalogLock()
        self._known = KnownVersions()
        # The head whose deleted events this node last told of.
        self._deleted_tail_told: int | None = None
        # What the load found wrong with the head record (missing while the
        # log holds events, or damaged): every write is refused until it is
        # put back.
        self._unwritable_head: UnwritableHead | None = None
        # The declared configs (fingerprints) this node has nothing to tell
        # of: its own, and each other it told of; and the revisions, after
        # one and up to another, whose config records a catch-up met and no
        # one has looked through yet (:meth:`_tell_other_configs`); and
        # whether a thread is looking through some (one at a time, so that
        # a config is told once, at its first record; what others note
        # meanwhile it looks through next, CONFIG_LOOKS bounding it).
        self._configs_known = {self.declared.fingerprint}
        self._configs_unread: tuple[int, int] | None = None
        self._configs_looking = False
        # The revision this node started at, as a server does
        # (:meth:`record_declaration`): only one running on tells of the
        # configs others write under; what a catch-up met before was
        # recorded before it started.
        self._started_at: int | None = None
        # The revision of this service's last committed write: what an
        # interrupt after it, as the answer is made or told, cannot undo.
        self.last_written: int | None = None
        # The last revision and event of the write being committed, until it
        # is known to be (see :meth:`written`).
        self._committing: tuple[int, tuple[str, bytes]] | None = None
        super().__init__(env)
        assert isinstance(self.recorder, SQLRecorder)
        assert isinstance(self.mapper, EventMapper)
        self.store: SQLRecorder = self.recorder
        try:
            self.catalog = self._load()
        except BaseException:
            # Its engine and pool go with it: a watch starting while the
            # database is away makes a service a second until it is back.
            self.close()
            raise

    def construct_env(self, name: str, env: EnvType | None = None) -> Environment:
        """The library's settings: this class's and those given (the database
        URL, else ``$CATALOG_ES_DB``), never the rest of the process
        environment, which the library would merge in: an operator's shell
        may hold another eventsourcing app's COMPRESSOR_TOPIC,
        PERSISTENCE_MODULE or CATALOG_CATALOG_ES_DB, which stored events no
        reader here decodes, broke every command, or wrote to another log
        than ``--db``. Those that would encrypt are refused."""
        for setting in CIPHER_SETTINGS:
            for key in Environment(name).create_keys(setting):
                if os.environ.get(key):  # empty is unset, as the library reads it
                    raise ConfigError(
                        f"${key} is set, but catalog-es does not encrypt its log: events "
                        "would be stored unencrypted; unset it for catalog-es (encrypt the "
                        "database's storage instead)"
                    )
        given = {**type(self).env, **(env or {})}
        if Factory.URL not in given:
            # Its own setting aside: a caller's environment names the log, as
            # the command line's does, and set empty is refused as there
            # (./catalog.db was another log than meant).
            url = from_env(Factory.URL, "a database URL")
            if url is not None:
                given[Factory.URL] = url
        elif given[Factory.URL] == "":
            # A script's URL given empty (its $URL unset) was taken for none
            # given: ./catalog.db, another log than meant.
            raise InputError(f"{Factory.URL} is given empty: give a database URL, or leave it out")
        return Environment(name, given)

    def _load(self) -> Catalog:
        """The catalog in force: the newest snapshot over this config, then the
        log after it. A long tail is snapshotted so the next start is quick."""
        with self.store.read() as conn:
            catalog = self._restored(conn, upto=None)
            since = catalog.revision
            catch_up(catalog, self.store, conn, split=True)
            kept, head = self.store.kept_with_head(conn, catalog.revision)
            catalog.chain = _chain(catalog.revision, kept.hash)
            self._tell_undeclared(conn, catalog)
            self._tell_deleted_tail(head, kept.last, "the next write")
            self._unwritable_head = UnwritableHead.of(head, kept.last)
        if catalog.revision - since >= self.snapshot_interval:
            self._save_snapshot(snapshots.state_of(catalog))
        _tell_standing_skips(catalog)
        return catalog

    def _restored(self, conn: Connection, upto: int | None) -> Catalog:
        """The declared layer, and over it the newest snapshot over this config
        (at ``upto`` or before) if there is one."""
        catalog = self._new_catalog()
        snapshots.restore(conn, catalog, self.declared.fingerprint, upto=upto)
        return catalog

    def _chain_at(self, conn: Connection, revision: int) -> ChainHead | None:
        """The log's chain at ``revision``, as ``conn``'s transaction reads it."""
        return _chain(revision, self.store.kept(conn, revision).hash)

    def _tell_deleted_tail(
        self, head: ChainHead | DamagedHead | None, last: int, which: str
    ) -> None:
        """Warn while the head record (``head``) is past the log's last event
        (``last``): the last events were deleted, which nothing else but
        verify would tell. Said as a command loads, and by the write that
        goes on after the head (``which``), unless this node said so of that
        head already: a server loaded before the deletion tells it there.
        The write is not refused: that would leave the cluster's catalog
        unchangeable over what is evidence, not a bad record, and the gap it
        leaves keeps that evidence for verify. A head missing or damaged is
        verify's to tell (and a write refuses a damaged one)."""
        if not isinstance(head, ChainHead) or head.revision == self._deleted_tail_told:
            return
        deleted = deleted_tail(head, last)
        if deleted is not None:
            self._deleted_tail_told = head.revision
            log.warning(
                "%s (catalog-es verify); %s is numbered after revision %d, leaving the gap",
                deleted.problem,
                which,
                head.revision,
            )

    def _tell_undeclared(self, conn: Connection, catalog: Catalog) -> None:
        """Warn of each model the config last recorded declared, no longer
        declares, and that is in force all the same: a runtime definition the
        declared one hid, come back as it was (configuration won while it
        declared the name; the log kept the runtime layer)."""
        recorded = catalog.recorded_declaration
        if recorded is None or not declaration_differs(catalog, self.declared):
            return
        for page in self.store.scan(conn, after=recorded[1] - 1, upto=recorded[1]):
            for _, topic, state in page:
                record = readable_declaration(topic, state)
                if record is None:
                    return
                for spec in record.models:
                    if not catalog.is_declared(spec.name) and catalog.get(spec.name) is not None:
                        log.warning(
                            "model %r is no longer declared: its runtime definition, which "
                            "the declared one hid, is in force again (remove it if unwanted)",
                            spec.name,
                        )

    def _new_catalog(self) -> Catalog:
        """The declared layer alone, its rules checked."""
        try:
            return self.declared.new_catalog()
        except ConfigError as error:
            # The catalog rules do not know the file; the operator must be told it.
            if not self.declared.path:
                raise
            raise ConfigError(f"{self.declared.path}: {error}") from None

    def _tell_config_put_back(self, replaced: int, recorded: int) -> None:
        """Warn when the config this service recorded at ``recorded``, over
        another's at ``replaced``, is one the log had recorded before that:
        nodes (or shells) writing with different configs each record their
        own, and declared models go in and out of force. A config the log
        never recorded is a deploy, said nothing of. Looked up once the write
        is committed, its locks let go: the records it reads, up to
        ``replaced``, are no write's to change, and under the log's write
        lock every node's writes waited for it (181 ms for 40 records of
        2,000 models on PostgreSQL). Only a warning hangs on it: the write
        stands, told, whatever the read meets."""
        try:
            with self.store.read() as conn:
                put_back = snapshots.last_replaced(conn, self.declared.fingerprint, upto=replaced)
        except (sa.exc.SQLAlchemyError, Refused) as error:
            log.debug("the configs the log recorded were not looked through: %s", error)
            return
        if put_back is not None:
            before, replaced_at = put_back
            # The config that replaced it and the one this write replaces are
            # both named when they differ (configs taking turns, or deploys
            # since): the last record alone read as when it was replaced.
            last = "" if replaced_at == replaced else f", last by another at revision {replaced}"
            log.warning(
                "this node's declared config (%s), recorded at revision %d, was "
                "replaced by another at revision %d%s, and is recorded again at revision "
                "%d: every node should run the same one, unless it was put back on purpose",
                self.declared.path or "none given",
                before,
                replaced_at,
                last,
                recorded,
            )

    def _save_snapshot(self, snapshot: snapshots.SnapshotState) -> None:
        # Best effort: a snapshot only saves time, so failing to write one
        # (a read-only database, a busy one) must not fail what asked for it.
        encoded = snapshots.encode(snapshot)
        try:
            # Saved with the process's write lock let go (:meth:`_write`).
            with self.store.write(beside_commands=True) as conn:
                snapshots.save(conn, self.declared.fingerprint, snapshot.revision, encoded)
        except (sa.exc.SQLAlchemyError, Refused) as error:
            log.debug("no snapshot at revision %d: %s", snapshot.revision, error)

    # -- commands ----------------------------------------------------------------

    def add(
        self, spec: ModelSpec, *, by: str, reason: str = "", expected_revision: int | None = None
    ) -> CommandResult:
        """Add a model, or replace the definition of a runtime one."""
        try:
            step = commands.add(spec)
            check_meta(by, reason)

            def plan(batch: Batch) -> None:
                step.decide(batch)

            self._before_probing(
                plan, by=by, reason=reason, expected_revision=expected_revision, several=False
            )
            self.pre_add_check.check(spec)
        except Refused as refusal:
            self._record_refusal(Model.Added, spec.name, by, reason, {"spec": spec}, refusal)
            raise
        return self._command(step, by, reason, expected_revision)

    def remove(
        self, name: str, *, by: str, reason: str = "", expected_revision: int | None = None
    ) -> CommandResult:
        return self._command(commands.remove(name), by, reason, expected_revision)

    def scale(
        self,
        name: str,
        minimum: int | None = None,
        maximum: int | None = None,
        *,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> CommandResult:
        """Replica bounds; a bound left ``None`` keeps its current value."""
        step = commands.scale(name, minimum, maximum)
        return self._command(step, by, reason, expected_revision)

    def set_resources(
        self,
        name: str,
        *,
        profile: str | None = None,
        memory_gb: int | None = None,
        cpu_cores: int | None = None,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> CommandResult:
        """Host memory and CPU cores of one profile, or of every profile."""
        step = commands.resources(name, profile, memory_gb, cpu_cores)
        return self._command(step, by, reason, expected_revision)

    def set_class(
        self,
        name: str,
        capacity_class: str,
        *,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> CommandResult:
        """critical, standard or opportunistic; empty goes back to what scaling implies."""
        step = commands.capacity_class(name, capacity_class)
        return self._command(step, by, reason, expected_revision)

    def set_owner(
        self,
        name: str,
        owner: str,
        *,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> CommandResult:
        """org:ID, team:ID or project:ID; empty makes the model shared."""
        return self._command(commands.owner(name, owner), by, reason, expected_revision)

    def set_adapters(
        self,
        name: str,
        adapters: tuple[Adapter, ...],
        *,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> CommandResult:
        """Replace the LoRA adapters; replicas load the new set when they next start."""
        return self._command(commands.adapters(name, adapters), by, reason, expected_revision)

    def set_source(
        self,
        name: str,
        source: str,
        origin: Origin | None = None,
        *,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> CommandResult:
        """Other weights; running replicas keep what they loaded until replaced."""
        step = commands.source(name, source, origin)
        return self._command(step, by, reason, expected_revision)

    def set_origin(
        self,
        name: str,
        origin: Origin | None,
        *,
        by: str = SYSTEM_ACTOR,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> CommandResult:
        """Record where a model's weights came from without changing them. For a
        declared model this is a no-op: its origin is worked out again when needed."""
        if self.catalog.is_declared(name):
            with self._reading() as catalog:
                return CommandResult(
                    revision=catalog.revision,
                    model=model_view(catalog.declared[name], declared=True),
                    written=False,
                )
        return self._command(commands.origin(name, origin), by, reason, expected_revision)

    def apply_changes(
        self,
        steps: Sequence[commands.Step],
        *,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> dict[str, Any]:
        """Several changes in one transaction, all or nothing, each decided on
        the catalog the ones before it leave. The answer's ``models`` (each
        change's item, as ``apply --json`` gives it) is an iterator, to be
        read once, that builds its items as it is read; ``replaced`` names
        the runtime models an ``add`` replaced."""
        check_meta(by, reason)
        outcomes: list[commands.Outcome] = []
        # The change a refusal is about: the one that could not go; none when
        # the list as a whole was refused (a stale ``expected_revision``).
        current: commands.Step | None = None

        def plan(batch: Batch) -> None:
            nonlocal current
            batch.prefetch(step.name for step in steps)
            for number, step in enumerate(steps, start=1):
                current = step
                try:
                    outcomes.append(step.decide(batch))
                except DamagedLog:
                    raise
                except Refused as refusal:
                    raise _refused_change(number, step, refusal) from None
            current = None

        try:
            for number, step in enumerate(steps, start=1):
                current = step
                try:
                    check_name(step.name)  # as a single command's is
                except Refused as refusal:
                    raise _refused_change(number, step, refusal) from None
            # Deciding the list before a probe may refuse it as a whole.
            current = None
            added = [
                (number, step)
                for number, step in enumerate(steps, start=1)
                if step.event_class is Model.Added
            ]
            if added:
                self._before_probing(
                    plan, by=by, reason=reason, expected_revision=expected_revision, several=True
                )
                outcomes.clear()
            for number, step in added:
                current = step
                try:
                    self.pre_add_check.check(step.fields["spec"])
                except Refused as refusal:
                    raise _refused_change(number, step, refusal) from None
            current = None
            revision, _ = self._write(
                plan, by=by, reason=reason, expected_revision=expected_revision, several=True
            )
        except Refused as refusal:
            if current is not None:
                self._record_refusal(
                    current.event_class, current.name, by, reason, current.refused_fields, refusal
                )
            else:
                changes = [f"{step.verb} {step.name}" for step in steps]
                self.record_refusal(APPLY, "", by, reason, {"changes": changes}, refusal)
            raise
        return {
            "revision": revision,
            "changes": len(outcomes),
            "replaced": [event.model for event, _, replaced in outcomes if replaced],
            "models": _applied(outcomes),
        }

    def _before_probing(
        self,
        plan: Callable[[Batch], None],
        *,
        by: str,
        reason: str,
        expected_revision: int | None,
        several: bool,
    ) -> None:
        """Decide ``plan`` and write nothing, so that what the rules refuse (a
        declared name, a stale ``expected_revision``, an invalid catalog) is
        refused before the pre-add check probes the weights, which can be slow.
        The write decides again: the log may move in between."""
        if not self.pre_add_check.probes:
            return
        self._write(
            plan,
            by=by,
            reason=reason,
            expected_revision=expected_revision,
            several=several,
            dry_run=True,
        )

    def _command(
        self, step: commands.Step, by: str, reason: str, expected_revision: int | None
    ) -> CommandResult:
        """Decide and append one change."""
        outcome: list[commands.Outcome] = []

        def plan(batch: Batch) -> None:
            outcome.append(step.decide(batch))

        try:
            revision, _ = self._write(
                plan, by=by, reason=reason, expected_revision=expected_revision, streams=[step.name]
            )
        except Refused as refusal:
            self._record_refusal(
                step.event_class, step.name, by, reason, step.refused_fields, refusal
            )
            raise
        _, new, replaced = outcome[0]
        log.info("%s %s at revision %d by %s", step.verb, step.name, revision, by)
        return CommandResult(
            revision=revision,
            model=model_view(new, declared=False) if new is not None else None,
            replaced=replaced,
            removed=step.name if new is None else None,
        )

    def write_plan(
        self,
        plan: Callable[[Batch], None],
        *,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
        rollback_to: int | None = None,
        dry_run: bool = False,
    ) -> tuple[int, list[Change]]:
        """The events ``plan`` decides into its batch, each against the catalog
        the ones before it leave, written in one transaction: for commands
        composed outside this class (weights updates). ``plan`` runs inside the
        write transaction, so what it checks still holds when the events land;
        ``dry_run`` decides everything and writes nothing."""
        return self._write(
            plan,
            by=by,
            reason=reason,
            expected_revision=expected_revision,
            rollback_to=rollback_to,
            several=True,
            dry_run=dry_run,
        )

    def _write(
        self,
        plan: Callable[[Batch], None],
        *,
        by: str,
        reason: str,
        expected_revision: int | None,
        rollback_to: int | None = None,
        several: bool = False,
        dry_run: bool = False,
        records_only: bool = False,
        streams: Sequence[str] = (),
    ) -> tuple[int, list[Change]]:
        """Read the log to its head, plan the events against the catalog in
        force and append them, in one write transaction; then put them in force
        and push the catalog to the applier, still serialised. Answers the last
        revision written (the head, when the plan wrote nothing). ``dry_run``
        plans and decides everything, then writes nothing, and refuses what
        the write would (it checks one before slow work); ``records_only``
        writes the declared-config record even with no change planned;
        ``streams``: the models whose stream versions the plan will need.
        A write that lets go of the lock to catch up (:class:`_FarBehind`)
        is made again as it was asked, once caught up. What it leaves to be
        done (:class:`_Written`) is done once both locks are let go."""
        check_meta(by, reason)
        for name in streams:
            # A name no model can have, refused (and kept in the refusals by
            # the command) before it takes the lock, a model id or a query.
            check_name(name)
        asked = _WriteAsked(
            plan,
            by=by,
            reason=reason,
            expected_revision=expected_revision,
            rollback_to=rollback_to,
            several=several,
            dry_run=dry_run,
            records_only=records_only,
            streams=[model_id(name) for name in streams],
        )
        started = time.monotonic()
        lock_left: float | None = None
        while True:
            try:
                written = self._write_once(asked, lock_left)
            except _FarBehind:
                pass  # nothing was planned or written: caught up with below, then again
            else:
                # The locks let go: every other writer of this process waited
                # there for these (a snapshot of 100,000 models: 120 ms, a
                # write alone taking 4).
                if written.put_over is not None:
                    self._tell_config_put_back(*written.put_over)
                if written.snapshot is not None:
                    self._save_snapshot(written.snapshot)
                self._tell_other_configs()  # what its catch-up met
                return written.revision, written.changes
            # The lock wait bounds the two takes of the lock together, not the catch-up.
            lock_left = max(self.store.lock_wait - (time.monotonic() - started), 0.001)
            self.refresh()

    def _write_once(self, asked: _WriteAsked, lock_left: float | None) -> _Written:
        """One try at the write :meth:`_write` describes: take the locks,
        decide the plan and append it (:meth:`_decide`), then put it in force
        (:meth:`_after_commit`), and let go of the locks however it ends.
        ``lock_left``: the write again, after catching up outside the lock,
        with that much of the lock wait left; before then, a write holding
        the lock that finds its node far behind raises :class:`_FarBehind`,
        having planned and written nothing."""
        # A dry run reads one view of the log and writes nothing: it neither
        # waits for writers nor holds them up (a reader's dry-run rollback of
        # a large catalog held every node's writes for seconds).
        locked = not asked.dry_run
        known, state = self._known, self._state
        # What this thread holds of the catalog's lock and of the write lock
        # on coming in: all it takes beyond that is let go on the way out,
        # however it leaves (an interrupt as the write lock's wait ends).
        entered, held = state.depth(), holds(self._lock)
        try:
            wait = self._take_write_lock(lock_left) if locked else None
            if wait is None:
                wait = lock_left
            if locked:
                # A reader of this process catching up a backlog holds the
                # catalog for as long as that takes: waited out before the
                # log's write lock, which every node's writes queue behind, not
                # while holding it (5.2 s behind 300,000 events).
                state.acquire(write=True)
                state.release()
            # Set once the events are appended: from there on, an error is
            # the commit's (the block's end), and the write may stand.
            revisions: list[int] = []
            with collector_paused():
                try:
                    with self.store.write(wait) if locked else self.store.read() as conn:
                        # Its turn before reads that come after it: it holds
                        # the log's lock (:class:`CatalogLock`).
                        state.acquire(write=locked)
                        try:
                            batch, standing, head, replaced = self._decide(
                                conn, asked, held=locked and lock_left is None
                            )
                            if asked.dry_run:
                                return _Written(head, batch.changes)
                            if not (batch.changes or (asked.records_only and batch.records)):
                                self.store.end_unwritten(conn)
                                return _Written(head, batch.changes)
                        except Refused:
                            # Refused before it wrote anything: ended as such,
                            # which on PostgreSQL keeps what psycopg prepared (a
                            # rollback cost the next writes their plans: with one
                            # command in ten refused, nearly a third of the rate).
                            # The refusal is what is told, the end's error aside.
                            if locked:
                                with suppress(sa.exc.SQLAlchemyError):
                                    self.store.end_unwritten(conn)
                            raise
                        # The config the log recorded last, when this write records
                        # its own over it: whether the log recorded this one before
                        # is looked up once the write is done (_write).
                        put_over = (
                            replaced
                            if isinstance(batch.records[0], Configuration.Declared)
                            else None
                        )
                        # Straight to the recorder: eventsourcing's EventStore.put
                        # would build a Recording per event only for us to read its
                        # revision.
                        stored = [self.mapper.to_record(e) for e in batch.records]
                        appended = self.store.append(conn, stored, standing, known.revisions)
                        revisions = appended.revisions
                        self._committing = (revisions[-1], (stored[-1].topic, stored[-1].state))
                except BaseException as error:
                    # A database error may come of a version this service thought it
                    # knew (rows edited by hand): all are read again next time.
                    known.forget()
                    unknown = _outcome_unknown(error, revisions)
                    if unknown is not None:
                        # The catalog in force is left as before the write, the
                        # writer's connection is dropped, and the next read or
                        # write asks the log where it is.
                        raise unknown from error
                    raise
                # Committed: only now are the changes in force.
                self.last_written, self._committing = revisions[-1], None
                # Told by the write that went on, not one refused or with
                # nothing to write, which would use the telling up.
                self._tell_deleted_tail(standing.head, standing.ends, "this write")
                snapshot = self._after_commit(batch, appended, head, asked.several, entered)
            return _Written(
                revisions[-1],
                batch.changes,
                snapshot,
                None if put_over is None else (put_over[1], revisions[0]),
            )
        finally:
            # Both let go down to what this thread held coming in. An
            # interrupt lands as a call begins or returns, these included:
            # one landing as they let go has them let go again before it is
            # told, or a lock is left held by no one's write (review).
            try:
                state.release_to(entered)
                release_to(self._lock, held)
            except KeyboardInterrupt:
                state.release_to(entered)
                release_to(self._lock, held)
                raise

    def _decide(
        self, conn: Connection, asked: _WriteAsked, *, held: bool
    ) -> tuple[Batch, Standing, int, tuple[str, int] | None]:
        """The batch ``asked``'s plan decides in ``conn``'s write transaction,
        against the catalog in force caught up with the log (``held``: the
        log's write lock, which a catch-up too long for it leaves,
        :meth:`_catch_up`); with where the log stood, its head, and the
        config the log recorded last."""
        known, state = self._known, self._state
        # One read says whether another writer moved the log since
        # this service last looked, what to chain onto, and the
        # versions of the streams the plan names that it does not know.
        ids = asked.streams
        wanted = known.unknown(ids)
        standing = self.store.standing(conn, wanted)
        if standing.last != known.at:
            # Moved by another writer: what this service knew may not hold.
            known.forget()
            if len(wanted) < len(ids):
                standing = self.store.standing(conn, ids)
        # The log moved since this node wrote or read it, or is
        # no longer the one it read: its head is not where this
        # node's catalog and chain are.
        chain, at = self.catalog.chain, self.catalog.revision
        if (
            standing.head != chain
            or standing.last != at
            or (chain is not None and chain.revision != at)
        ):
            self._catch_up(conn, held=held)
        head = self.catalog.revision
        if asked.expected_revision is not None and asked.expected_revision != head:
            raise self._revision_conflict(conn, asked.expected_revision, head, standing)
        batch = Batch(
            self.store,
            conn,
            self.catalog.copy() if asked.several else self.catalog,
            by=asked.by,
            reason=asked.reason,
            timestamp=self._next_timestamp(),
            rollback_to=asked.rollback_to,
            tentative=asked.several,
            versions=standing.versions,
            known=known.versions,
        )
        replaced = batch.catalog.recorded_declaration
        if (
            not self.declared.given
            and replaced is not None
            and declaration_differs(batch.catalog, self.declared)
        ):
            # Decided here, under the log's lock, for every
            # entrypoint: another node may have recorded one
            # since this service loaded.
            raise NoConfigGiven(replaced[1], CONFIG_GIVEN_BY)
        batch.record_declaration(self.declared)
        if asked.several:
            # The plan works on its own copy, and no other writer
            # can move the log while this one holds it: reads go
            # on meanwhile (a large apply takes seconds), and the
            # lock is taken again to put the result in force.
            state.release()
        asked.plan(batch)
        return batch, standing, head, replaced

    def _after_commit(
        self,
        batch: Batch,
        appended: Appended,
        head: int,
        several: bool,
        entered: int,
    ) -> snapshots.SnapshotState | None:
        """Put ``batch``, committed as ``appended`` over the log at ``head``, in
        force and push it to the applier, under the catalog's lock (taken
        again if the plan let go of it, down to ``entered``), and let go of
        it. Answers what a snapshot keeps of the catalog the write left, when
        one is due: :meth:`_write` saves it, the write lock let go."""
        state = self._state
        if state.depth() == entered:
            state.acquire(write=True)
        revision = appended.revisions[-1]
        self._known.learn(batch.versions, revision, appended.last_revisions)
        if self.catalog.revision == head:
            self._put_in_force(batch, appended, several)
        # Else a read caught up with the log between the commit and the
        # lock (it is let go while a batch is planned): these changes,
        # and perhaps another writer's after them, are in force already,
        # and the batch's own catalog would put it back.
        self._push()
        snapshot: snapshots.SnapshotState | None = None
        if (
            revision // self.snapshot_interval > head // self.snapshot_interval
            and self.catalog.revision == revision
        ):
            snapshot = snapshots.state_of(self.catalog)
        # Encoded and written with the catalog let go: another process
        # may hold the database by then, and reads must not wait for it.
        state.release()
        return snapshot

    def written(self) -> int | None:
        """The revision this service's last committed write answers, if it
        wrote; also of one an interrupt cut off as its commit returned (it
        said `Aborted!` and 1 of a change written; hostile test), which the
        log is asked about."""
        if self._committing is not None:
            revision, last = self._committing
            self._committing = None
            with self.store.read() as conn:
                if self.store.event_at(conn, revision) == last:
                    self.last_written = revision
        return self.last_written

    def _put_in_force(self, batch: Batch, appended: Appended, several: bool) -> None:
        """The catalog in force after ``batch``, as ``appended``. Cut off on the
        way (an interrupt between two lines), the catalog must read as left
        part-way (:func:`_lost`) and be loaded again: caught up instead, from
        the revision before the batch, it would replay the changes over
        themselves (a Scaled after the model's removal, skipped). So the chain
        moves first and the revision last, and a batch's own catalog is put
        in force whole."""
        revisions = appended.revisions
        catalog = batch.catalog
        catalog.chain = appended.head
        if not several:  # the catalog in force itself
            for event, new in batch.changes:
                catalog.commit(event, new)
        for record, written in zip(batch.records, revisions, strict=True):
            if isinstance(record, Configuration.Declared):
                catalog.saw(record.timestamp)
                catalog.recorded_declaration = (record.fingerprint, written)
        catalog.revision = revisions[-1]
        self.catalog = catalog

    def _revision_conflict(
        self, conn: Connection, expected: int, head: int, standing: Standing
    ) -> RevisionConflict:
        """The refusal of a command based on revision ``expected`` of the log
        ``conn`` reads, at ``head`` and ``standing`` so: told whether the log
        was cut back under it, or skipped it."""
        written = standing.head.revision if standing.head else None
        # Only PostgreSQL skips numbers; one SQLite's log lacks was deleted
        # by hand, which verify names.
        skipped = (
            self.store.dialect != "sqlite"
            and expected < head
            and self.store.hash_at(conn, expected) is None
        )
        return RevisionConflict(expected, head, written, skipped=skipped)

    def _take_write_lock(self, bound: float | None = None) -> float | None:
        """Take this process's write lock (:func:`acquire_within`), waiting
        ``lock_wait`` seconds or ``bound``."""
        lock_wait = self.store.lock_wait
        if self._lock_busy[0] != lock_wait:
            self._lock_busy = (
                lock_wait,
                f"the log stayed locked by another write for {lock_wait:g} s; "
                "nothing was written, try again",
            )
        return acquire_within(self._lock, lock_wait if bound is None else bound, self._lock_busy[1])

    def record_declaration(
        self, *, by: str, reason: str = "", expected_revision: int | None = None
    ) -> int:
        """Record the declared config in the log if it differs from the one the
        log last recorded (what ``serve`` does at start, so the log says which
        layer a long-running server put in force). Answers the head. Looked
        at first without the write lock: a node restarting on the config the
        log has must not wait for, or be refused by, another's long write.
        ``expected_revision``: refused, nothing written, unless the log is
        there, as every write is, whether or not there is a config to record."""
        asked = {"fingerprint": self.declared.fingerprint}
        with self.refusals_recorded(CONFIG_DECLARED, "", by, reason, asked):
            with self._state:
                if expected_revision is None:
                    # Nothing to refuse: most starts find the log where the
                    # load left it, which one statement tells (:meth:`refresh`),
                    # where a read transaction cost two round trips more.
                    self.refresh()
                else:
                    # One view of the log, so that a refusal tells of the log it read.
                    with self.store.read() as conn:
                        self._catch_up(conn)
                        if expected_revision != self.catalog.revision:
                            # Refused on what the read saw, not behind another
                            # node's write: the log only moves on.
                            raise self._revision_conflict(
                                conn,
                                expected_revision,
                                self.catalog.revision,
                                self.store.standing(conn),
                            )
                at = self.catalog.revision
                differs = declaration_differs(self.catalog, self.declared)
            if differs:
                at, _ = self._write(
                    lambda _batch: None,
                    by=by,
                    reason=reason,
                    expected_revision=expected_revision,
                    records_only=True,
                )
        with self._state:
            # Recorded before this start, which records its own over them (a
            # node still on one records it again, told then).
            self._configs_unread = None
            self._started_at = self.catalog.revision
        if self._unwritable_head is not None:
            # A server would otherwise start without a word, and its
            # operator learn of it only as the first write is refused.
            log.warning("%s", self._unwritable_head.warning())
        return at

    def _push(self) -> None:
        """Hand the catalog to the applier, with the revision it is at. The
        change is written and in force whatever the applier does, so its
        failure is logged, never reported as a refusal: the controller also
        follows the log, and catches up."""
        revision = self.catalog.revision
        try:
            self.applier.replace_catalog(InForce(self.catalog), revision)
        except Exception:
            log.exception(
                "the applier failed on the catalog at revision %d; the change is written", revision
            )

    def _next_timestamp(self) -> datetime:
        """Now, or just after the log's last event if this clock is behind it
        by no more than clocks drift apart; a time further ahead than that is a
        bad record (or a bad clock), and following it would stamp every command
        after it in the future, or past the end of time."""
        now = utc_now()
        last = self.catalog.last_timestamp
        if last is None or now > last:
            return now
        if last - now > MAX_CLOCK_SKEW:
            log.warning(
                "the log's newest time %s is %s ahead of this clock; not following it",
                utc_text(last),
                last - now,
            )
            return now
        return last + timedelta(microseconds=1)

    # -- reading ---------------------------------------------------------------

    def _catch_up(self, conn: Connection, *, held: bool = False) -> None:
        """Apply what other writers appended since this node last looked; or,
        when the log no longer holds the events of the catalog in force, load
        it afresh. ``held``: the caller holds the log's write lock, which every
        node's writes queue behind, and leaves a long catch-up or a reload to
        be done outside it (:class:`_FarBehind`)."""
        catalog = self.catalog
        recorded, before = catalog.recorded_declaration, catalog.revision
        kept = self.store.kept(conn, catalog.revision)
        lost = _lost(catalog, kept)
        if lost is None:
            if kept.last > catalog.revision:
                if held and kept.last - catalog.revision > CATCH_UP_HELD:
                    raise _FarBehind
                # Told as they come: a node that runs on (serve) loaded long
                # ago, and another node's config may take what this one's cannot.
                _tell_skipped(catch_up(catalog, self.store, conn))
                catalog.chain = _chain(kept.last, kept.last_hash)
        else:
            if held:
                raise _FarBehind
            # Decided on, what the log lost would be written over (a fallback
            # naming a model the log no longer has; revisions handed out again),
            # and served as if committed.
            log.warning("%s; loading the catalog from the log", lost)
            self._known.forget()
            catalog = self._restored(conn, upto=kept.last)
            _tell_skipped(catch_up(catalog, self.store, conn))
            catalog.chain = _chain(kept.last, kept.last_hash)
            self.catalog = catalog
        if catalog.recorded_declaration != recorded:
            self._tell_no_config_given(conn)
        if catalog.recorded_declaration != recorded or lost is not None:
            # Looked through once the log is let go: this may hold its write
            # lock. A log that went back is looked through from where this
            # node started: it may hold records made since, numbered below
            # the revision the node was at (the configs told are not again).
            if lost is not None and self._started_at is not None:
                before = min(before, self._started_at)
            self._note_unread(before, catalog.revision)

    def _note_unread(self, after: int, upto: int) -> None:
        """Note the revisions after ``after`` and up to ``upto`` as to be
        looked through for other configs, with those noted already (under
        the catalog's lock)."""
        unread = self._configs_unread
        self._configs_unread = (
            (min(unread[0], after), max(unread[1], upto)) if unread else (after, upto)
        )

    def _tell_no_config_given(self, conn: Connection) -> None:
        """Warn, as a catch-up first meets it, of a config another node
        recorded while this one was given none: its writes are refused from
        then on (:class:`NoConfigGiven`), but its reads (a server's) went on
        over no declared layer without a word. As the CLI tells a run at its
        start; once a record, not on every read after it."""
        recorded = self.catalog.recorded_declaration
        if (
            self.declared.given
            or recorded is None
            or not declaration_differs(self.catalog, self.declared)
        ):
            return
        log.warning(
            "no declared config given (%s) as this node started: another node recorded one "
            "at revision %d, and this node's reads go without %s; restart it with that config",
            CONFIG_GIVEN_BY,
            recorded[1],
            gone_without(self.recorded_config(recorded[1], conn)),
        )

    def _tell_other_configs(self) -> None:
        """Warn of each declared config, other than this node's, that another
        node recorded since this one started, the first time a catch-up meets
        it (:meth:`_catch_up` notes where): nodes on two configs each record
        theirs as they write, and the declared models go in and out of force,
        which a server's operator learns from no refusal (its clients are
        given no hint: they cannot mend its config). Once a config, for as
        long as the node runs; one recorded before it started
        (:meth:`record_declaration`) is not told (its start records its own
        over it, and a node still on that one records it again with its next
        write, told then). A service not started so, a command's run, tells
        none: its write warns of a config put back, as the docs say. Only a
        warning hangs on it, so the log is read with neither of this
        process's locks held, which every read and write of a server would
        wait for: a call holding one (a read, inside :meth:`_reading`)
        leaves the lookup to the call made once it lets go."""
        if self._configs_unread is None or self._started_at is None:
            return  # most calls: read without the catalog's lock, set under it
        if self._state.depth() or holds(self._lock):
            return  # told by this thread's call once it lets go of them
        for _ in range(CONFIG_LOOKS):
            with self._state:
                if self._configs_looking:
                    return  # looked through by that thread, or left to the next call
                unread, self._configs_unread = self._configs_unread, None
                if unread is None or not self.declared.given:
                    return  # a node given none is told so (_tell_no_config_given)
                self._configs_looking = True
            try:
                found = self._configs_recorded(unread)
            finally:
                self._configs_looking = False
            if found is None:
                return
            for revision, record in found:
                log.warning(
                    "another node writes under another declared config, %s, recorded at "
                    "revision %d by %s; this node's is %s: the nodes serve different declared "
                    "layers, and the log records each in turn; run every node on one config "
                    "(told once for each other config)",
                    named_config(record.fingerprint, record.path),
                    revision,
                    shown(record.by, NAME_SHOWN_LENGTH),
                    named_config(self.declared.fingerprint, self.declared.path),
                )

    def _configs_recorded(
        self, unread: tuple[int, int]
    ) -> list[tuple[int, Configuration.Declared]] | None:
        """The configs other than those known that the log recorded in the
        revisions ``unread`` names, now known; ``None`` when the log could
        not be read, the revisions noted again for the next call."""
        try:
            with self.store.read() as conn:
                found = snapshots.configs_recorded_between(
                    conn, *unread, besides=self._configs_known
                )
        except (sa.exc.SQLAlchemyError, Refused) as error:
            # Kept for the next call: dropped, its configs were never told.
            with self._state:
                self._note_unread(*unread)
            log.debug("the configs the log recorded were not looked through, yet: %s", error)
            return None
        self._configs_known.update(record.fingerprint for _, record in found)
        return found

    def refresh(self) -> None:
        """Apply what other writers appended since this service last looked.
        Most reads find the log where this node left it, which one statement
        tells (:meth:`SQLRecorder.kept_alone`)."""
        with self._state:
            kept = self.store.kept_alone(self.catalog.revision)
            if (
                kept is None
                or kept.last != self.catalog.revision
                or _lost(self.catalog, kept) is not None
            ):
                with self.store.read() as conn:
                    self._catch_up(conn)
        self._tell_other_configs()

    @property
    def revision(self) -> int:
        return self.catalog.revision

    def head(self) -> int:
        """The log's last revision, as ``catalog-es revision`` answers it,
        read with the head record in one statement: refused while the head
        is past it (the last events were deleted), which verify reports as a
        break. Answered with a warning, exit 0, the revision before them
        passed for the head of a log whole."""
        kept, head = self.store.end_alone()
        deleted = deleted_tail(head, kept.last) if isinstance(head, ChainHead) else None
        if deleted is not None:
            raise DamagedLog(
                f"{deleted.problem}; revision {kept.last} is not the head (catalog-es verify)"
            )
        return kept.last

    def resolve(self, at: int | datetime) -> int:
        """The revision an ``at`` (a revision, or a UTC time) reads: a
        transaction boundary, refused when beyond the head."""
        if isinstance(at, datetime):
            zoned(at)
        with self.store.read() as conn:
            head = self.store.head(conn)
            if isinstance(at, datetime):
                return pointintime.resolve_time(conn, head, at)
            return pointintime.resolve_revision(conn, head, at)

    def holds(self, revision: int) -> bool:
        """Whether the log has an event at ``revision`` (deleted, or burned on
        PostgreSQL, it has none): asked only of an ``at`` read as another."""
        with self.store.read() as conn:
            return self.store.hash_at(conn, revision) is not None

    @contextmanager
    def _reading(self, at: At = None, *, declared_then: bool = False) -> Iterator[Catalog]:
        """The catalog to read from, for the span of the ``with``: the one in
        force is held under its lock, because a command in another thread (an
        HTTP server's) changes it in place; a past one is private."""
        if at is None:
            with self._state:
                self.refresh()
                yield self.catalog
            self._tell_other_configs()  # what the refresh met, the catalog let go
        else:
            yield self.catalog_at(at, declared_then=declared_then)

    def catalog_at(self, at: At = None, *, declared_then: bool = False) -> Catalog:
        """The catalog in force now, or at a past revision or time: the
        caller's own (the one in force, copied; see :meth:`_reading`).
        ``declared_then``: a past one over the declared config the log had
        recorded then, rather than today's (see :meth:`_declared_at`)."""
        if at is None:
            with self._reading() as catalog:
                return catalog.copy()
        revision = self.resolve(at)
        with self.store.read() as conn:
            declared = self._declared_at(conn, revision, declared_then)
            return pointintime.catalog_at(self.store, conn, declared, revision)

    def recorded_config(
        self, revision: int, conn: Connection | None = None
    ) -> DeclaredConfig | None:
        """The declared config the log had recorded as in force at ``revision``,
        read in ``conn``'s transaction when given; None for a record this
        release cannot read: only a warning's or a hint's wording hangs on it."""
        if conn is None:
            with self.store.read() as conn:
                return self.recorded_config(revision, conn)
        try:
            return pointintime.declared_at(conn, revision)
        except Refused:
            return None

    def _declared_at(self, conn: Connection, revision: int, then: bool) -> DeclaredConfig:
        """The declared layer a read of the past is replayed over: today's, as
        a node starting now would (and a rollback restores onto); or, ``then``,
        the one the log had recorded as in force at ``revision``, which is what
        the nodes ran (an incident's question: a model declared since shows as
        declared at revisions where it ran as a runtime model, over today's)."""
        return pointintime.declared_at(conn, revision) if then else self.declared

    def list_models(self, at: At = None, *, declared_then: bool = False) -> list[dict[str, Any]]:
        return model_views(*self._models_at(at, declared_then))

    def models_as_read(
        self, at: At = None, *, declared_then: bool = False
    ) -> Iterator[dict[str, Any]]:
        """:meth:`list_models`, each view built as it is read (an answer to
        write out): the catalog is read now, and what it held then answered."""
        return _views(*self._models_at(at, declared_then))

    def _models_at(
        self, at: At, declared_then: bool
    ) -> tuple[list[ModelSpec], Callable[[str], bool]]:
        with self._reading(at, declared_then=declared_then) as catalog:
            return catalog.models(), catalog.is_declared

    def get_model(self, name: str, at: At = None, *, declared_then: bool = False) -> dict[str, Any]:
        where = ""
        if at is None:
            with self._reading() as catalog:
                spec, declared = catalog.get(name), catalog.is_declared(name)
                if spec is None:
                    where = _skips_of(catalog, name)
        else:
            # One model's past is read from its own events, not the whole catalog's.
            revision = self.resolve(at)
            with self.store.read() as conn:
                spec, declared = pointintime.model_at(
                    self.store,
                    conn,
                    self._declared_at(conn, revision, declared_then),
                    revision,
                    name,
                )
            where = f" at revision {revision}"
        if spec is None:
            raise ModelNotFound(name, f"is not in the catalog{where}")
        return model_view(spec, declared=declared)

    def diff(
        self,
        since: int | datetime,
        until: At = None,
        *,
        model: str | None = None,
        declared_then: bool = False,
    ) -> dict[str, Any]:
        """What changed from one revision (or time) to another (default: now);
        ``declared_then``: each past end over the declared config recorded then."""
        if model is not None:
            # A name no model can have is a typo, not "no change" (review).
            check_name(model)
        before = self.catalog_at(since, declared_then=declared_then)
        with self._reading(until, declared_then=declared_then) as after:
            result = diff_catalogs(before, after, model=model)
        result["declared"] = {
            "from": _declaration(before),
            "to": _declaration(after),
            "today": self.declared.fingerprint,
        }
        return result

    def rollback(
        self,
        to: int | datetime,
        *,
        model: str | None = None,
        only: str | None = None,
        dry_run: bool = False,
        by: str,
        reason: str = "",
        expected_revision: int | None = None,
    ) -> dict[str, Any]:
        """Make the runtime layer what it was at ``to`` (over today's config), by
        appending compensating events in one transaction, each marked with the
        revision rolled back to. ``dry_run`` shows the diff and writes nothing.
        A refused rollback is recorded as ``Rollback`` (a dry run tried nothing)."""
        asked = {"to": to, **({"only": only} if only else {})}
        recorded = (
            nullcontext()
            if dry_run
            else self.refusals_recorded(ROLLBACK, model or "", by, reason, asked)
        )
        with recorded:
            if model is not None:
                # A name no model can have is a typo, not a model with no history.
                check_name(model)
            target_revision = self.resolve(to)
            with self.store.read() as conn:
                # The log is append-only: the catalog at a past revision cannot change.
                target = pointintime.catalog_at(self.store, conn, self.declared, target_revision)
            notes: list[str] = []
            result_diff: dict[str, Any] = {}

            def plan(batch: Batch) -> None:
                # The batch's own copy of the catalog at the head, kept before
                # the plan changes it: the one in force may move meanwhile (a
                # dry run holds no lock).
                head = batch.catalog.copy()
                notes.extend(plan_rollback(batch, target, model=model, only=only))
                # From the head to what the rollback makes: the catalog at ``to``.
                result_diff.update(
                    diff_catalogs(head, batch.catalog, model=model),
                    to=target_revision,
                    declared={
                        "from": _declaration(head),
                        "to": _declaration(target),
                        "today": self.declared.fingerprint,
                    },
                )

            revision, changes = self.write_plan(
                plan,
                by=by,
                reason=reason,
                expected_revision=expected_revision,
                rollback_to=target_revision,
                dry_run=dry_run,
            )
            return {
                "revision": revision,
                "to": target_revision,
                "dry_run": dry_run,
                "written": bool(changes) and not dry_run,
                "events": [
                    {"model": e.model, "event": type(e).__name__, "fields": event_fields(e)}
                    for e, _ in changes
                ],
                "diff": result_diff,
                "notes": notes,
            }

    def watch(
        self, after: int = 0, *, by: str | None = None, poll_interval: float | None = None
    ) -> Watch:
        """Every change after revision ``after``, in order and once each, then
        the new ones as they commit; given ``by``, only that actor's. ``poll_interval``:
        the seconds between looks with nothing heard (on SQLite, which has no
        notifications, every look; on PostgreSQL, those in case a
        notification never comes)."""
        check_actor_filter(by)
        # As ``log --by`` reads them: the database passes on only the events
        # whose bytes hold the actor, each then decoded to tell (_event_views).
        containing = () if by is None else spelling_marks(by)
        with self.store.read() as conn:
            head = self.store.head(conn)
            given = self.store.hash_at(conn, after)
        if after < 0 or after > head:
            raise Refused(f"revision {after} is beyond the head of the log ({head})")

        def subscribe(last: int, given: Any) -> PullingSubscription:
            # Asked first, so that a watch knows the database answers (the
            # subscription reads only once it is iterated); and whether the
            # log still holds what it gave last (its hash, that of the log up
            # to it), so that what follows on is what comes after it. The
            # subscription checks that of each page it reads.
            with self.store.read() as conn:
                if self.store.hash_at(conn, last) != given:
                    raise LogRewritten.at(last)
            subscription = self.store.subscribe(gt=last, gt_hash=given, containing=containing)
            if poll_interval is not None:
                subscription.interval = poll_interval
            return subscription

        return Watch(subscribe, after, given, by, where=self.store.where)

    def rebuild(
        self, progress: Callable[[int, int], None] | None = None, *, audit: bool = True
    ) -> dict[str, Any]:
        """Replay the whole log into a new catalog, new snapshots (every
        ``snapshot_interval`` revisions) and new audit tables. Read models are
        disposable: this is how they are made again. ``audit=False`` leaves the
        audit tables as they are (they follow the log by themselves)."""
        with self._lock:
            with self.store.write() as conn:
                snapshots.clear(conn, self.declared.fingerprint)
            catalog = self._new_catalog()
            written = 0
            with self.store.read() as conn:
                head = self.store.head(conn)

                def step(revision: int) -> None:
                    nonlocal written
                    if revision % self.snapshot_interval == 0:
                        catalog.chain = self._chain_at(conn, revision)
                        state = snapshots.encode(snapshots.state_of(catalog))
                        with self.store.write() as wconn:
                            snapshots.save(wconn, self.declared.fingerprint, revision, state)
                        written += 1
                    if progress is not None:
                        progress(revision, head)

                catch_up(catalog, self.store, conn, upto=head, progress=step)
                catalog.chain = self._chain_at(conn, catalog.revision)
            with self._state:
                self.catalog = catalog
        if audit:
            try:
                self.rebuild_audit()
            except StorageBusy as error:
                # The catalog and its snapshots stand: the operator must know
                # that only the audit is left to make again.
                raise StorageBusy(
                    f"the catalog and its snapshots were made again, the audit's rows not: {error}"
                ) from None
        return {
            "revision": catalog.revision,
            "models": len(catalog),
            "snapshots": written,
            "skipped": [msgspec.to_builtins(s) for s in catalog.skipped],
        }

    def skipped(self) -> list[Skipped]:
        """Stored events the catalog in force leaves out, and why."""
        with self._reading() as catalog:
            return list(catalog.skipped)

    def sources(
        self, at: At = None, *, declared_then: bool = False
    ) -> dict[str, list[dict[str, str]]]:
        """Each weights source in the catalog (now, or at a past revision or
        time), and the models (or adapters of models) that use it."""
        with self._reading(at, declared_then=declared_then) as catalog:
            specs = catalog.models()
        out: dict[str, list[dict[str, str]]] = {}
        for m in specs:
            out.setdefault(m.source, []).append({"model": m.name})
            for a in m.adapters:
                out.setdefault(a.source, []).append({"model": m.name, "adapter": a.name})
        return dict(sorted(out.items()))

    def log_events(
        self,
        *,
        after: int = 0,
        limit: int | None = None,
        model: str | None = None,
        by: str | None = None,
        max_bytes: int | None = None,
    ) -> Iterator[dict[str, Any]]:
        """The stored events with their revisions, oldest first, undecodable ones
        included (with the error). A name no model can have, an empty
        actor, and an ``after`` beyond the head (as a watch refuses it), are
        refused here, not once the events are first asked for. ``max_bytes``:
        what the events' stored forms may hold in all (:func:`within_bytes`),
        read as one list. Without it they are read as they are asked for, a
        page at a time (as a watch reads them), up to the head as it stood
        when asked: ``log`` of 900,000 events held them all (2.3 GB) before
        its first line.

        ``by``: only the events that actor recorded, ``limit`` of them. No
        column holds the actor, only each event's stored form: they are read
        a page at a time whatever ``max_bytes``, the database passing on only
        the rows whose bytes hold the name (:func:`holds_bytes`), so one
        matching nothing reads no event out of a log however large."""
        t = events_table.c
        if model is not None:
            # Refused before its id is worked out: ids are cached, and any
            # text a client sent was kept, without bound.
            check_name(model)
        check_actor_filter(by)
        if by is not None:
            theirs = self._log_rows(after, None, model, spelling_marks(by))
            return islice(_event_views(theirs, model, by, max_bytes), limit)
        if max_bytes is None:
            return _event_views(self._log_rows(after, limit, model), model)
        query = sa.select(t.revision, t.topic, t.state).where(t.revision > after)
        if model is not None:
            # Only as far back as ``after``: a page of a long history reads that page.
            stream = stream_walk(model_id(model), after)
            query = query.where(t.revision.in_(sa.select(stream.c.revision)))
        query = query.order_by(t.revision)
        if limit is not None:
            query = query.limit(limit)
        with self.store.read() as conn:
            pointintime.within_head(after, self.store.head(conn))
            measured = conn.execute(
                query.with_only_columns(
                    t.revision, t.originator_version, t.stream_previous, sa.func.length(t.state)
                )
            ).all()
            if model is not None:
                # The first row is the oldest the walk reached: one cut short
                # is told from it, not from a walk of its own.
                oldest = measured[0][:3] if measured else None
                check_walk_end(conn, model_id(model), oldest, f"model {shown(model)}", after)
            within_bytes([size for *_, size in measured], max_bytes)
            rows = conn.execute(query).all()
        return _event_views(rows, model)

    def _log_rows(
        self, after: int, limit: int | None, model: str | None, containing: Sequence[bytes] = ()
    ) -> Iterator[Any]:
        """The rows :meth:`log_events` shows, read a page at a time, each page
        in a short transaction of its own: the log is append-only, so pages
        read up to one head are the log as it stood at that head. The head
        (and a model's revisions, as numbers) are read at once, so that a
        database that cannot be used is told before anything is written.
        Only those holding one of ``containing`` (:func:`holds_bytes`)."""
        with self.store.read() as conn:
            head = self.store.head(conn)
            pointintime.within_head(after, head)
            among: list[int] | None = None
            if model is not None:
                stream = stream_walk(model_id(model), after)
                query = sa.select(
                    stream.c.revision, stream.c.originator_version, stream.c.stream_previous
                )
                if containing:
                    # Whether each holds them is a column, not a WHERE: the
                    # walk's end is checked on its oldest row, which filtered
                    # would be the oldest holding them; only those are kept.
                    query = query.add_columns(holds_bytes(containing)).join(
                        events_table, events_table.c.revision == stream.c.revision
                    )
                walked = sorted(conn.execute(query))
                oldest = walked[0][:3] if walked else None
                check_walk_end(conn, model_id(model), oldest, f"model {shown(model)}", after)
                kept = (r for r in walked if r[0] <= head and (not containing or r[3]))
                among = [r[0] for r in kept][:limit]
                containing = ()
        return self._log_pages(after, head, limit, among, containing)

    def _log_pages(
        self,
        after: int,
        head: int,
        limit: int | None,
        among: list[int] | None,
        containing: Sequence[bytes] = (),
    ) -> Iterator[Any]:
        """Rows after ``after`` up to ``head`` (only those of the revisions
        ``among``, in order, when given, and those holding one of
        ``containing``), at most ``limit``, in pages as a watch pulls them
        (:meth:`SQLRecorder.page_end`): so many events or ``LOG_PAGE_BYTES``
        of them."""
        t = events_table.c
        left = limit if among is None else len(among)
        start = 0  # where ``among`` is up to
        while after < head and (left is None or left > 0):
            count = (
                PullingSubscription.page if left is None else min(PullingSubscription.page, left)
            )
            chunk = None if among is None else among[start : start + count]
            end = self.store.page_end(
                after, count, LOG_PAGE_BYTES, upto=head, among=chunk, containing=containing
            )
            if end is None:
                return
            query = sa.select(t.revision, t.topic, t.state).where(
                t.revision > after, t.revision <= end
            )
            if chunk is not None:
                query = query.where(t.revision.in_(chunk))
            if containing:
                query = query.where(holds_bytes(containing))
            with self.store.read() as conn:
                rows = conn.execute(query.order_by(t.revision)).all()
            yield from rows
            after = end
            if left is not None:
                left -= len(rows)
            if among is not None:
                start = bisect_right(among, end)
                left = len(among) - start
