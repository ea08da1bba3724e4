#!/usr/bin/env python3
"""Benchmarks: each figure beside its baseline, measured in the same run.

Machines are noisy, so what this reports is the ratio to a baseline taken
moments before on the same files, as much as the absolute figure:

    python scripts/bench.py            # the full workloads of issue 6 (several minutes)
    python scripts/bench.py --quick    # a tenth of the sizes, under a minute (CI smoke)
    python scripts/bench.py --postgres postgresql+psycopg://postgres@127.0.0.1:5432/test

A benchmark, not a test: it asserts nothing and prints a table (and, with
``--markdown FILE``, writes it with a description of the machine).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

# Before the event library: catalog_es hides from its import what of the
# environment it must not take ($TZINFO_TOPIC; catalog_es/__init__.py).
import catalog_es  # noqa: F401

# isort: split
import sqlalchemy as sa
from eventsourcing.domain import Aggregate
from eventsourcing.persistence import JSONTranscoder, Mapper, StoredEvent

from catalog_es import commands
from catalog_es.application import Models
from catalog_es.catalog import Catalog
from catalog_es.collector import collector_paused
from catalog_es.configuration import DeclaredConfig
from catalog_es.mapper import EventMapper, decode_event
from catalog_es.model import Model, model_id
from catalog_es.persistence import SQLRecorder
from catalog_es.spec import ModelSpec, Profile, Scaling
from catalog_es.storage.engines import create_engine
from catalog_es.storage.sqlite_file import WAL_CHECKPOINT_PAGES, sqlite_synchronous
from projections.catalog import catch_up


@dataclass
class Figure:
    name: str
    workload: str
    value: float
    unit: str
    baseline: str
    baseline_value: float | None
    target: str

    @property
    def ratio(self) -> str:
        if not self.baseline_value:
            return "—"
        return f"{self.value / self.baseline_value:.2f}×"


T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


# -- synthetic logs -------------------------------------------------------------------------

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def spec_of(name: str, fallbacks: tuple[str, ...] = ()) -> ModelSpec:
    return ModelSpec(
        name=name,
        engine="vllm",
        source=f"hf://org/{name}",
        profiles=(Profile("gpu", 1, 24, 32, 4),),
        fallbacks=fallbacks,
    )


def synthetic_events(models: int, events: int, seed: int = 1) -> Iterator[Model.Event]:
    """``models`` Added, then scalings, owners and resources until ``events``.
    One transaction per event: each has its own, increasing timestamp."""
    rng = random.Random(seed)
    names = [f"model-{i:06d}" for i in range(models)]
    ids = {n: model_id(n) for n in names}
    versions = dict.fromkeys(names, 0)
    for i in range(events):
        name = names[i] if i < models else rng.choice(names)
        versions[name] += 1
        envelope: dict[str, Any] = {
            "originator_id": ids[name],
            "originator_version": versions[name],
            "timestamp": T0 + timedelta(microseconds=i),
            "by": f"user{i % 50}",
            "model": name,
        }
        if i < models:
            yield Model.Added(**envelope, spec=spec_of(name))
            continue
        kind = rng.random()
        if kind < 0.6:
            yield Model.Scaled(**envelope, scaling=Scaling(rng.randint(0, 2), rng.randint(2, 5)))
        elif kind < 0.8:
            yield Model.OwnerSet(**envelope, owner=rng.choice(["", "team:a", "org:b"]))
        else:
            yield Model.ResourcesSet(**envelope, profile="gpu", memory_gb=rng.randint(8, 64))


def write_log(url: str, events: Iterator[Model.Event]) -> None:
    """Through the recorder in large batches (one transaction), hash chain and all:
    building a log is not what is measured."""
    recorder = SQLRecorder(create_engine(url))
    mapper = EventMapper()
    batch: list[StoredEvent] = []
    with recorder.write() as conn:
        for event in events:
            batch.append(mapper.to_stored_event(event))
            if len(batch) == 5000:
                recorder.insert_events(batch, conn=conn)
                batch.clear()
        if batch:
            recorder.insert_events(batch, conn=conn)
    recorder.engine.dispose()


# -- the eventsourcing baseline ----------------------------------------------------------------


class ScaledES(Aggregate.Event):
    """The same payload as ``Model.Scaled``, as a plain eventsourcing event."""

    model: str
    by: str
    reason: str
    rollback_to: int | None
    min: int
    max: int


def eventsourcing_decode_rate(count: int) -> float:
    """Events per second eventsourcing's default mapper (JSON transcoder) decodes."""
    mapper: Mapper[uuid.UUID] = Mapper(transcoder=JSONTranscoder())
    from eventsourcing.persistence import DatetimeAsISO, UUIDAsHex

    mapper.transcoder.register(UUIDAsHex())  # type: ignore[attr-defined]
    mapper.transcoder.register(DatetimeAsISO())  # type: ignore[attr-defined]
    originator = uuid.uuid4()
    stored: list[StoredEvent] = []
    for i in range(count):
        event = object.__new__(ScaledES)
        event.__dict__.update(
            originator_id=originator,
            originator_version=i + 1,
            timestamp=T0 + timedelta(microseconds=i),
            model="m",
            by="user",
            reason="",
            rollback_to=None,
            min=i % 3,
            max=3,
        )
        stored.append(mapper.to_stored_event(event))
    seconds, _ = timed(lambda: [mapper.to_domain_event(s) for s in stored])
    return count / seconds


# -- figures --------------------------------------------------------------------------------------


def replay_figures(url: str, path: Path | None, events: int) -> list[Figure]:
    recorder = SQLRecorder(create_engine(url))
    figures = []
    floor = None
    if path is not None:
        # With the collector paused, as replay runs: the floor is the best case.
        with sqlite3.connect(path) as raw, collector_paused():
            sql = "SELECT revision, topic, state FROM catalog_events ORDER BY revision"
            scan_s, _ = timed(lambda: sum(1 for _ in raw.execute(sql)))
            decode_s, _ = timed(
                lambda: sum(1 for _, t, s in raw.execute(sql) if decode_event(t, s) is not None)
            )
        floor = events / decode_s
        figures.append(
            Figure(
                "raw scan (the floor)",
                f"{events:,} events",
                events / scan_s,
                "events/s",
                "—",
                None,
                "—",
            )
        )
    es_rate = eventsourcing_decode_rate(min(events, 200_000))

    def replay(split: bool) -> Catalog:
        catalog = Catalog()
        with recorder.read() as conn:
            catch_up(catalog, recorder, conn, split=split)
        return catalog

    replay_s, catalog = timed(lambda: replay(True))
    assert catalog.revision == events and not catalog.skipped
    rate = events / replay_s
    # The same replay kept in one process, as it runs where it cannot split.
    whole_s, whole = timed(lambda: replay(False))
    assert whole.aggregates == catalog.aggregates
    if floor is not None:
        figures.append(
            Figure(
                "replay (rebuild the catalog)",
                f"{events:,} events, as a load runs it (in two processes where it can)",
                rate,
                "events/s",
                "raw scan + msgspec decode",
                floor,
                "≥ 300,000/s, ratio ≥ 0.67",
            )
        )
        figures.append(
            Figure(
                "replay in one process",
                f"{events:,} events",
                events / whole_s,
                "events/s",
                "raw scan + msgspec decode",
                floor,
                "—",
            )
        )
    figures.append(
        Figure(
            "replay vs eventsourcing's JSON mapper",
            f"{events:,} events",
            rate,
            "events/s",
            "eventsourcing Mapper+JSONTranscoder decode only",
            es_rate,
            "—",
        )
    )
    recorder.engine.dispose()
    return figures


def quadratic_load(declared: list[ModelSpec], stored: list[ModelSpec]) -> int:
    """The original control plane's load: for each stored model, build and
    validate the whole catalog with it added (O(n²))."""
    accepted: list[ModelSpec] = []
    for spec in stored:
        try:
            Catalog([*declared, *accepted, spec])
        except Exception:
            continue
        accepted.append(spec)
    return len(accepted)


# A start-up as a node makes it: in a process of its own, whose caches (the
# model ids of every name, say) are as cold as a new node's. Neither imports
# nor what the first service a process opens sets up once (10 ms or so, which
# would flatter the linearity) are timed: only opening the log and
# rebuilding the catalog.
LOAD_IN_A_CHILD = """
import sys, tempfile, time
from scripts.bench import spec_of
from catalog_es.application import Models
from catalog_es.configuration import DeclaredConfig
config = DeclaredConfig(models=tuple(spec_of(f"declared-{i:03d}") for i in range(100)))
with tempfile.TemporaryDirectory() as empty:
    Models(config, env={"CATALOG_ES_DB": f"sqlite:///{empty}/empty.db"}).close()
start = time.perf_counter()
models = Models(config, snapshot_interval=10**9, env={"CATALOG_ES_DB": sys.argv[1]})
seconds = time.perf_counter() - start
assert len(models.catalog) == int(sys.argv[2]) + 100
print(seconds)
"""


def load_seconds(url: str, models_n: int) -> float:
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", LOAD_IN_A_CHILD, url, str(models_n)],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
    ).stdout
    return float(out)


def load_figures(tmp: Path, sizes: tuple[int, int], small: tuple[int, int]) -> list[Figure]:
    declared = [spec_of(f"declared-{i:03d}") for i in range(100)]
    urls = {n: f"sqlite:///{tmp}/load-{n}.db" for n in sizes}
    for n, url in urls.items():
        write_log(url, synthetic_events(n, n, seed=n))
    # Each size three times, taking turns, and the best of each: one start of
    # a tenth of a second is at the mercy of whatever else the machine does.
    times = dict.fromkeys(sizes, math.inf)
    for _ in range(3):
        for n, url in urls.items():
            times[n] = min(times[n], load_seconds(url, n))
    quad = {}
    for n in small:
        stored = [spec_of(f"model-{i:06d}") for i in range(n)]
        quad[n], _ = timed(partial(quadratic_load, declared, stored))
    a, b = sizes
    return [
        Figure(
            "load at start-up",
            f"{a:,} runtime + 100 declared",
            times[a],
            "s",
            f"original quadratic algorithm at {small[0]:,}",
            quad[small[0]],
            "≤ 1 s",
        ),
        Figure(
            "load, linearity",
            f"time at {b:,} / time at {a:,}",
            times[b] / times[a],
            "×",
            f"quadratic: {small[1]:,} / {small[0]:,}",
            quad[small[1]] / quad[small[0]],
            "≤ 2.2×",
        ),
    ]


# The rows of the raw baselines: about the size of a command's event.
PAYLOAD = b"x" * 300


@dataclass
class RawTable:
    """A plain driver connection to a table of ``PAYLOAD`` rows keyed as the
    log's are: the floor for the log's writes on the same database."""

    one: Callable[[], object]  # a row in a transaction of its own
    many: Callable[[int], object]  # that many rows in one transaction
    close: Callable[[], object]


def raw_sqlite(path: Path) -> RawTable:
    """A new file with the settings the log's connections use (WAL, the sync
    ``CATALOG_ES_SQLITE_SYNC`` asks for, the same checkpoint interval), keyed
    by a plain rowid (no AUTOINCREMENT)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={sqlite_synchronous()}")
    conn.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
    conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, b BLOB)")

    def one() -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO t (b) VALUES (?)", (PAYLOAD,))
        conn.execute("COMMIT")

    def many(rows: int) -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO t (b) VALUES (?)", [(PAYLOAD,)] * rows)
        conn.execute("COMMIT")

    return RawTable(one, many, conn.close)


def raw_postgres(url: str, table: str) -> RawTable:
    """``table`` made anew in the schema ``url`` names, keyed by a bigserial,
    through psycopg as the log's connections are (each statement its own
    round trip)."""
    # Imported here: the memory figure's child imports this module, and
    # libpq would count in its size (8 MB).
    import psycopg

    libpq = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = psycopg.connect(libpq)
    conn.execute(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, b bytea)")
    conn.commit()

    insert = f"INSERT INTO {table} (b) VALUES (%s)"

    def one() -> None:
        conn.execute(insert, (PAYLOAD,))
        conn.commit()

    def many(rows: int) -> None:
        with conn.cursor() as cursor:
            cursor.executemany(insert, [(PAYLOAD,)] * rows)
        conn.commit()

    return RawTable(one, many, conn.close)


def raw_executemany_rate(raw: RawTable, count: int) -> float:
    start = time.perf_counter()
    raw.many(count)
    rate = count / (time.perf_counter() - start)
    raw.close()
    return rate


def alternating(runs: dict[str, Callable[[int], object]], count: int) -> dict[str, float]:
    """The rate of each of ``runs`` (called with how many to do) over ``count``,
    timed in alternating slices: a disk whose fsyncs slow down for a while
    (another tenant's writeback) then slows each alike, where timing one run
    after the other put the whole drift on one of them."""
    seconds = dict.fromkeys(runs, 0.0)
    slices = max(2, count // 250)
    for _ in range(slices):
        for name, run in runs.items():
            start = time.perf_counter()
            run(count // slices)
            seconds[name] += time.perf_counter() - start
    return {name: count // slices * slices / spent for name, spent in seconds.items()}


def until_the_wal_is_full(run: Callable[[int], object], database: Path) -> None:
    """Commit through ``run`` until the WAL of ``database`` has grown to its
    checkpoint size: from then on each commit rewrites it in place. While it
    grows, each fsync also writes the file's new size (about 20 µs more a
    commit on the twelfth machine)."""
    wal = database.with_name(database.name + "-wal")
    with sqlite3.connect(database) as conn:
        (page_size,) = conn.execute("PRAGMA page_size").fetchone()
    # A frame is a page and its 24-byte header.
    full = WAL_CHECKPOINT_PAGES * (page_size + 24)
    for _ in range(WAL_CHECKPOINT_PAGES):
        if wal.exists() and wal.stat().st_size >= full:
            return
        run(50)
    raise RuntimeError(f"{wal} did not reach {full:,} bytes")


# CPU work between two raw commits, about what a command does besides its
# commit. On some hosts a commit's wait costs several times as much once
# anything but the next commit runs between two (by all appearances the
# host's side of the disk stops polling for it), so the back-to-back raw loop
# is a floor no loop that works between its commits reaches.
SPACING = 100e-6


def raw_commits(raw: RawTable, work: float, count: int) -> None:
    """``count`` single-row commits through ``raw``, each after ``work``
    seconds of CPU work (a busy wait: a sleep would idle the CPU, as no
    command does)."""
    for _ in range(count):
        if work:
            until = time.perf_counter() + work
            while time.perf_counter() < until:
                pass
        raw.one()


def command_figures(url: str, path: Path | None, models_n: int, commands: int) -> list[Figure]:
    write_log(url, synthetic_events(models_n, models_n))
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    names = [f"model-{i:06d}" for i in range(models_n)]
    rng = random.Random(7)
    scaled = 0

    def scale(count: int) -> None:
        nonlocal scaled
        for _ in range(count):
            models.scale(rng.choice(names), scaled % 2, 3, by="bench")
            scaled += 1

    runs: dict[str, Callable[[int], object]] = {"commands": scale}
    label = "SQLite file" if path is not None else "PostgreSQL"

    def raw_table(name: str) -> RawTable:
        if path is None:
            return raw_postgres(url, f"raw_{name}")
        return raw_sqlite(path.with_suffix(f".{name}"))

    raws = []
    # Spaced on SQLite only: what it shows is the host's side of a flush.
    for name, work in (("raw", 0.0), ("spaced", SPACING))[: 2 if path else 1]:
        raw = raw_table(name)
        raws.append(raw)
        runs[name] = partial(raw_commits, raw, work)
        if path is not None:
            # Measured as a running server sees them, once the WAL stopped
            # growing: the raw loop, writing half the pages a command does,
            # would otherwise spend more of its run growing it.
            until_the_wal_is_full(runs[name], path.with_suffix(f".{name}"))
    if path is not None:
        until_the_wal_is_full(scale, path)
    rates = alternating(runs, commands)
    for raw in raws:
        raw.close()
    figures = [
        Figure(
            f"validated command ({label})",
            f"scale one of {models_n:,}, one txn each",
            rates["commands"],
            "commands/s",
            "raw sqlite3 single-row commit, same settings"
            if path
            else "raw psycopg single-row commit, same server",
            rates["raw"],
            "≥ 3,000/s and ≥ 0.5× raw" if path else "—",
        )
    ]
    if path is not None:
        figures.append(
            Figure(
                "validated command, against commits spaced as work spaces them",
                f"scale one of {models_n:,}, one txn each",
                rates["commands"],
                "commands/s",
                f"the raw commit after {SPACING * 1e6:.0f} µs of CPU work each",
                rates["spaced"],
                "—",
            )
        )
    figures.append(
        Figure(
            f"batch of {BATCH:,} in one txn ({label})",
            f"apply, {BATCH_ROUNDS} rounds",
            batch_rate(models, names),
            "changes/s",
            "raw executemany, one txn",
            raw_executemany_rate(raw_table("many"), BATCH),
            "≥ 50,000/s" if path else "—",
        )
    )
    models.close()
    return figures


BATCH = 1000
BATCH_ROUNDS = 20


def batch_rate(models: Models, names: list[str]) -> float:
    """Changes a second in ``apply`` batches of ``BATCH`` scalings."""
    steps = [commands.scale(names[i % len(names)], 1, 2 + i % 3) for i in range(BATCH)]
    seconds, _ = timed(
        lambda: [models.apply_changes(steps, by="bench") for _ in range(BATCH_ROUNDS)]
    )
    return BATCH * BATCH_ROUNDS / seconds


def long_log_batch_figure(url: str, events: int, models_n: int) -> Figure:
    """The batch again, on the long log: what a write costs must not grow
    with the log (an index with an entry per event at a random place made
    it: each change of a batch dirtied a page of it)."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    rate = batch_rate(models, [f"model-{i:06d}" for i in range(models_n)])
    models.close()
    return Figure(
        f"batch of {BATCH:,} in one txn, long log (SQLite file)",
        f"apply, {BATCH_ROUNDS} rounds, on the {events:,}-event log",
        rate,
        "changes/s",
        "—",
        None,
        "—",
    )


def point_in_time_figures(url: str, events: int, interval: int, samples: int) -> list[Figure]:
    """A model, and the whole catalog, read at random past revisions. Snapshots
    trade space for read time, so what they take is printed with the figures."""
    models = Models(DeclaredConfig(), snapshot_interval=interval, env={"CATALOG_ES_DB": url})
    models.rebuild(audit=False)
    with models.store.read() as conn:
        stored = conn.execute(sa.text("SELECT sum(length(state)) FROM catalog_snapshots")).scalar()
    rng = random.Random(3)
    revisions = [rng.randint(1, events) for _ in range(samples)]

    def p99(read: Callable[[int], object]) -> float:
        latencies = sorted(timed(partial(read, r))[0] for r in revisions)
        return latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]

    one = p99(lambda r: models.get_model("model-000001", at=r))
    whole = p99(lambda r: models.list_models(at=r))

    def full_replay(revision: int) -> None:
        catalog = Catalog()
        with models.store.read() as conn:
            catch_up(catalog, models.store, conn, upto=revision)

    baseline = statistics.median(timed(partial(full_replay, r))[0] for r in revisions[:3])
    size = len(models.catalog)
    models.close()
    megabytes = int(stored or 0) / 2**20
    workload = f"any revision of {events:,}, snapshots every {interval:,} ({megabytes:,.0f} MB)"
    return [
        Figure(
            "point-in-time read of a model, p99",
            workload,
            one * 1000,
            "ms",
            "full replay to that revision (median)",
            baseline * 1000,
            "≤ 50 ms",
        ),
        Figure(
            f"point-in-time list of all {size:,} models, p99",
            workload,
            whole * 1000,
            "ms",
            "full replay to that revision (median)",
            baseline * 1000,
            "—",
        ),
    ]


def memory_figure(models_n: int) -> Figure:
    """Peak RSS of a process holding a catalog of ``models_n`` models (measured in
    a child). Its own peak (``VmHWM``), not ``ru_maxrss``: Linux carries the
    parent's peak into a child started with vfork, as subprocess starts them,
    so that reported this script's own size, 309 MB where the child's is 127."""
    code = (
        "import sys\n"
        "from scripts.bench import spec_of\n"
        "from catalog_es.catalog import Catalog\n"
        "from catalog_es.model import Model, model_id\n"
        "from datetime import datetime, UTC\n"
        "c = Catalog()\n"
        "for i in range(int(sys.argv[1])):\n"
        "    n = f'model-{i:06d}'\n"
        "    c.apply(Model.Added(originator_id=model_id(n), originator_version=1,\n"
        "            timestamp=datetime.now(UTC), by='b', model=n, spec=spec_of(n)), i + 1)\n"
        "with open('/proc/self/status') as status:\n"
        "    print(next(line.split()[1] for line in status if line.startswith('VmHWM:')))\n"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", code, str(models_n)],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
    ).stdout.split()
    rss_mb = int(out[0]) / 1024
    return Figure(
        "memory",
        f"catalog of {models_n:,} models in force",
        rss_mb,
        "MB RSS",
        "—",
        None,
        "≤ 500 MB",
    )


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores ({cpu}), "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 2**30} GiB; "
        f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, "
        f"SQLAlchemy {sa.__version__}"
    )


def render(figures: list[Figure]) -> str:
    lines = [
        "| figure | workload | measured | baseline | baseline value | ratio | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        base = f"{f.baseline_value:,.1f}" if f.baseline_value else "—"
        lines.append(
            f"| {f.name} | {f.workload} | {f.value:,.1f} {f.unit} | {f.baseline} | {base} | "
            f"{f.ratio} | {f.target} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the sizes")
    parser.add_argument("--postgres", metavar="URL", help="also measure on this PostgreSQL")
    parser.add_argument("--markdown", metavar="FILE", help="write the table and the machine")
    args = parser.parse_args()
    if args.postgres == "":  # `--postgres "$URL"`, the variable unset: skipped, unsaid
        parser.error("--postgres is empty: give a PostgreSQL URL, or leave --postgres out")
    scale = 10 if args.quick else 1
    events, models_n = 1_000_000 // scale, 10_000 // scale
    gc.collect()
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp_name:
        tmp = Path(tmp_name)
        log_path = tmp / "log.db"
        url = f"sqlite:///{log_path}"
        print(f"building a log of {events:,} events over {models_n:,} models…", file=sys.stderr)
        write_log(url, synthetic_events(models_n, events))
        figures += replay_figures(url, log_path, events)
        for interval in (2_000, 1_000):
            figures += point_in_time_figures(url, events, interval, 100 if args.quick else 300)
        print("a batch on the long log…", file=sys.stderr)
        figures.append(long_log_batch_figure(url, events, models_n))
        print("load at start-up…", file=sys.stderr)
        figures += load_figures(
            tmp, (models_n, 2 * models_n), (500 // scale * 2, 1000 // scale * 2)
        )
        print("commands…", file=sys.stderr)
        # What the steps before wrote (half a gigabyte of logs and snapshots)
        # is still being written back to the disk: the commands' fsyncs would
        # queue behind it, and the raw baseline, measured after, less so.
        os.sync()
        cmd_path = tmp / "commands.db"
        figures += command_figures(f"sqlite:///{cmd_path}", cmd_path, models_n, 3000 // scale)
        figures.append(memory_figure(100_000 // scale))
        if args.postgres:
            figures += postgres_figures(args.postgres, events // 10, models_n)
    table = render(figures)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(
            f"Measured {datetime.now(UTC):%Y-%m-%d} on {machine()}.\n\n{table}\n"
        )


def postgres_figures(url: str, events: int, models_n: int) -> list[Figure]:
    """Replay and commands on PostgreSQL, each in a schema of its own."""
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    figures = []
    for purpose in ("replay", "commands"):
        schema = f"catalog_es_bench_{purpose}_{uuid.uuid4().hex[:8]}"
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
        scoped = sa.make_url(url).update_query_dict({"options": f"-csearch_path={schema}"})
        scoped_url = scoped.render_as_string(hide_password=False)
        try:
            if purpose == "replay":
                write_log(scoped_url, synthetic_events(models_n, events))
                figures += [
                    Figure(
                        f.name + " (PostgreSQL)",
                        f.workload,
                        f.value,
                        f.unit,
                        f.baseline,
                        f.baseline_value,
                        "—",
                    )
                    for f in replay_figures(scoped_url, None, events)
                ]
            else:
                figures += command_figures(scoped_url, None, models_n, 1000)
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()
    return figures


if __name__ == "__main__":
    main()
