"""Builders shared by the tests: model definitions, declared configs and events.

Plain functions rather than fixtures, so a test reads as data: given these
events, when this command, then this catalog.
"""

from __future__ import annotations

import gc
import hashlib
import io
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import IO, Any

import msgspec
import pytest
import sqlalchemy as sa
import yaml

from catalog_es.application import Watch
from catalog_es.catalog import Catalog
from catalog_es.cli.base import HUNG_UP
from catalog_es.inputs import model_from_data
from catalog_es.model import Model, model_id, utc_now
from catalog_es.spec import DEFAULT_ENGINES, ModelSpec, Profile
from catalog_es.storage.schema import events_table, head_table, streams_table
from projections.snapshots import snapshots_table, taken_since

GPU = Profile(name="gpu", gpus=1, gpu_memory_gb=24, min_memory_gb=32, cpu_cores=4)
CPU = Profile(name="cpu", gpus=0, min_memory_gb=8, cpu_cores=4)
# A CPU-only profile as models stored before the memory rule (and KubeAI's) have it.
CPU_NO_MEMORY = Profile(name="cpu", gpus=0, cpu_cores=2)

SHA = "ab" * 32
ACTOR = "test-operator"


def spec(name: str, **fields: Any) -> ModelSpec:
    """A valid runtime definition; ``fields`` override the defaults."""
    base: dict[str, Any] = {"engine": "vllm", "source": f"hf://org/{name}", "profiles": (GPU,)}
    return ModelSpec(name=name, **{**base, **fields})


def definition(name: str, **fields: Any) -> dict[str, Any]:
    """The input form of :func:`spec` (what a YAML/JSON file holds): only what
    a person would write, so the defaults are the service's to fill in."""
    base: dict[str, Any] = {
        "name": name,
        "engine": "vllm",
        "source": f"hf://org/{name}",
        "profiles": [{"name": "gpu", "gpus": 1, "gpu_memory_gb": 24}],
    }
    return {**base, **fields}


def model_data(name: str) -> dict[str, Any]:
    """The smallest runtime definition that validates: one GPU, everything else default."""
    return {
        "name": name,
        "engine": "vllm",
        "source": f"hf://org/{name}",
        "profiles": [{"name": "gpu", "gpus": 1}],
    }


def model_spec(name: str, **fields: Any) -> ModelSpec:
    """``model_data(name)`` with ``fields`` changed, parsed as input is."""
    return model_from_data(model_data(name) | fields, "test")


def parsed(name: str, **fields: Any) -> ModelSpec:
    """:func:`definition` read the way a command's input is, defaults filled in."""
    return model_from_data(definition(name, **fields), "test")


def config_yaml(*declared: ModelSpec, engines: Sequence[str] | None = None) -> str:
    """A declared config holding ``declared`` (and ``engines:`` when given)."""
    data: dict[str, Any] = {"models": [msgspec.to_builtins(m) for m in declared]}
    if engines is not None:
        data["engines"] = list(engines)
    return yaml.safe_dump(data, sort_keys=False)


# -- events ----------------------------------------------------------------------


def event(cls: type[Model.Event], name: str, *, version: int = 0, **fields: Any) -> Model.Event:
    """An event of ``cls`` on model ``name``; its stream version is stamped by
    :func:`given` or :func:`candidate`, or given as ``version`` to store it."""
    return cls(
        originator_id=model_id(name),
        originator_version=version,
        timestamp=utc_now(),
        model=name,
        by=ACTOR,
        **fields,
    )


def added(definition: ModelSpec) -> Model.Event:
    return event(Model.Added, definition.name, spec=definition)


def removed(name: str) -> Model.Event:
    return event(Model.Removed, name)


def given(
    *events: Model.Event,
    declared: Sequence[ModelSpec] = (),
    engines: Iterable[str] = DEFAULT_ENGINES,
) -> Catalog:
    """The catalog after replaying ``events`` (revisions 1..N) over ``declared``.
    Replay never applies the command-only rules: what is given here is history."""
    catalog = Catalog(declared, engines)
    for revision, e in enumerate(events, start=1):
        catalog.apply(candidate(catalog, e), revision)
    return catalog


def candidate(catalog: Catalog, e: Model.Event) -> Model.Event:
    """``e`` as the next event of its stream in ``catalog``."""
    version = catalog.aggregate(e.model).version + 1
    return msgspec.structs.replace(e, originator_version=version)


# -- the database ----------------------------------------------------------------


def schema_of(pg_url: str) -> str:
    """The schema a ``pg_url`` fixture's URL puts first on the search path."""
    options = sa.make_url(pg_url).query["options"]
    assert isinstance(options, str)
    return options.partition("=")[2]


def newest_snapshot(conn: sa.Connection, fingerprint: str) -> int:
    """The revision of the newest snapshot over this config, 0 for none."""
    return max(taken_since(conn, fingerprint, 0), default=0)


def count_events(url: str) -> int:
    """Rows in the log, read straight from the database (not through the code under test)."""
    engine = sa.create_engine(url)
    try:
        if not sa.inspect(engine).has_table("catalog_events"):
            return 0
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM catalog_events")).scalar_one())
    finally:
        engine.dispose()


@contextmanager
def round_trips(engine: sa.Engine | type[sa.Engine]) -> Iterator[list[list[str]]]:
    """The round trips to PostgreSQL of the connections ``engine`` (or every
    engine: ``sa.Engine``) makes or hands out inside the ``with`` (a
    connection made here from its first statement, those SQLAlchemy asks of
    a new engine's among them; one handed out here, from then on, in the
    pool too: its check before it is handed out again is counted, not that
    before its first), as libpq's trace tells them, each once its
    connection goes back to the pool or the block ends: each what the
    client sent before it waited for the server (the text of its
    statements, and ``Sync``). A BEGIN that psycopg sends of its own is
    one, as it costs."""
    # Here: the SQLite tests do not load libpq.
    from psycopg.pq import Trace

    traced: dict[Any, IO[str]] = {}
    trips: list[list[str]] = []
    files = ExitStack()

    def start(driver: Any, *_: Any) -> None:
        if driver not in traced:
            trace = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by ``files``)
            traced[driver] = files.enter_context(trace)
            driver.pgconn.trace(traced[driver].fileno())
            driver.pgconn.set_trace_flags(Trace.SUPPRESS_TIMESTAMPS | Trace.REGRESS_MODE)

    def connecting(dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
        if dialect.name != "postgresql":
            return None  # connected as it would be
        driver = dialect.connect(*cargs, **cparams)
        start(driver)
        return driver

    def stop(driver: Any, *_: Any) -> None:
        trace = traced.pop(driver, None)
        if trace is None:
            return
        driver.pgconn.untrace()  # flushes what libpq wrote
        trace.seek(0)
        sending: list[str] | None = None
        for line in trace.read().splitlines():
            # A message's line; a statement's text may go on over several.
            direction, _length, kind, *said = [*line.split("\t"), "", "", ""]
            if direction == "F":
                sending = sending or []
                sending.append(said[0].strip() if kind in ("Query", "Parse") else kind)
            elif direction == "B" and sending is not None:
                trips.append(sending)
                sending = None

    def returned(driver: Any, *_: Any) -> None:
        if driver is not None:  # None: invalidated, closed (and told) already
            stop(driver)
            start(driver)  # traced on in the pool, for its next check

    listeners: dict[str, Callable[..., Any]] = {
        "do_connect": connecting,
        "checkout": start,
        "checkin": returned,
        "close": stop,  # told before it closes
    }
    for event, listener in listeners.items():
        sa.event.listen(engine, event, listener)
    try:
        yield trips
    finally:
        for event, listener in listeners.items():
            sa.event.remove(engine, event, listener)
        with files:
            for driver in list(traced):
                stop(driver)


@contextmanager
def collections_seen() -> Iterator[list[int]]:
    """The generation of each cyclic collection that runs inside the ``with``."""
    seen: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)


# -- failovers ---------------------------------------------------------------------

LOG_TABLES = (events_table, streams_table, head_table, snapshots_table)


def log_rows(url: str) -> list[list[Any]]:
    """Every row of the log's tables, as a failover or a backup would keep them."""
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        rows = [[r._asdict() for r in conn.execute(sa.select(t))] for t in LOG_TABLES]
    engine.dispose()
    return rows


def put_back(url: str, saved: list[list[Any]]) -> None:
    """The log's tables as they were saved: what a failover to a standby that
    had not received the commits since, or a restored backup, leaves."""
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for table, rows in zip(LOG_TABLES, saved, strict=True):
            conn.execute(table.delete())
            if rows:
                conn.execute(table.insert(), rows)
    engine.dispose()


class CountedOutput(io.TextIOBase):
    """Standard output that keeps nothing of what is written: its length and digest."""

    def __init__(self) -> None:
        self.size = self.lines = 0
        self.digest = hashlib.sha256()

    def write(self, text: str) -> int:
        self.size += len(text)
        self.lines += text.count("\n")
        self.digest.update(text.encode())
        return len(text)

    def isatty(self) -> bool:
        return False


# docs/audit.md's way to put a deleted head back: the last event's revision and hash.
PUT_THE_HEAD_BACK = (
    "INSERT INTO catalog_head (id, revision, hash)"
    " SELECT 1, revision, hash FROM catalog_events ORDER BY revision DESC LIMIT 1"
)


@contextmanager
def commits_held(admin: sa.Engine, pg_url: str) -> Iterator[Callable[[Callable[[], object]], None]]:
    """Every write to the log of ``pg_url``'s schema waits at its commit, for
    as long as the block lasts: a deferred trigger waits there for an advisory
    lock held here. Yields ``end_the_waiting_session()``, which waits for a
    write to be held and ends its session, as a restart, a failover or
    ``pg_terminate_backend`` does: at the commit, every time. Yields
    ``ended_at_its_commit(write)``: ``write`` run on a thread of its own, its
    session ended once it waits at its commit, and waited for."""
    schema = schema_of(pg_url)
    key = f"hashtext('{schema}')"
    with admin.connect() as conn:
        conn.execute(
            sa.text(
                f"CREATE FUNCTION {schema}.wait_at_commit() RETURNS trigger LANGUAGE plpgsql"
                f" AS $$ BEGIN PERFORM pg_advisory_lock({key}); RETURN NULL; END $$"
            )
        )
        conn.execute(
            sa.text(
                f"CREATE CONSTRAINT TRIGGER wait_at_commit AFTER INSERT ON {schema}.catalog_events"
                " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
                f" EXECUTE FUNCTION {schema}.wait_at_commit()"
            )
        )

    def end_the_waiting_session() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with admin.connect() as conn:
                # The sessions of the schema's URL are named after it.
                ended = conn.execute(
                    sa.text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE application_name = :name AND wait_event_type = 'Lock'"
                        " AND wait_event = 'advisory'"
                    ),
                    {"name": schema},
                ).scalar()
            if ended:
                return
            time.sleep(0.01)
        raise AssertionError("no write came to wait at its commit")

    def ended_at_its_commit(write: Callable[[], object]) -> None:
        writer = threading.Thread(target=write)
        writer.start()
        try:
            end_the_waiting_session()
        finally:
            writer.join(timeout=30)

    try:
        with admin.connect() as holding:
            holding.execute(sa.text(f"SELECT pg_advisory_lock({key})"))
            try:
                yield ended_at_its_commit
            finally:
                # A session's lock outlives the connection's return to the pool.
                holding.execute(sa.text(f"SELECT pg_advisory_unlock({key})"))
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP TRIGGER wait_at_commit ON {schema}.catalog_events"))
            conn.execute(sa.text(f"DROP FUNCTION {schema}.wait_at_commit()"))


def following(watch: Watch) -> tuple[threading.Thread, list[int], list[BaseException]]:
    """``watch`` iterated on a thread of its own: the revisions it gives, and
    what it ended with."""
    seen: list[int] = []
    ended: list[BaseException] = []

    def follow() -> None:
        try:
            seen.extend(e["revision"] for e in watch)
        except Exception as error:
            ended.append(error)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    return thread, seen, ended


# How each stop asked of a command that runs until stopped is told: a
# hang-up with why no config is read again.
STOPS_TOLD = {
    signal.SIGINT: "stopped\n",
    signal.SIGTERM: "stopped\n",
    signal.SIGHUP: f"stopped{HUNG_UP}\n",
}
EVERY_STOP = pytest.mark.parametrize("stop", list(STOPS_TOLD), ids=["ctrl-c", "sigterm", "sighup"])
# Started as usual, or with the stops blocked, as a thread that blocks them
# leaves every process it starts (a signal mask is inherited).
STOPS_BLOCKED_OR_NOT = pytest.mark.parametrize(
    "blocked", [False, True], ids=["stops-let-through", "stops-blocked"]
)


def stops_blocked() -> None:
    """Run in a child before it runs the command (``preexec_fn``): the stops blocked."""
    signal.pthread_sigmask(signal.SIG_BLOCK, list(STOPS_TOLD))
