"""Audit query times on a large log.

Builds a log of N events (default 1,000,000) over many models and actors by
inserting stored events straight through the recorder (hash chain included,
no command checks), builds the audit tables, then times the queries operators
ask and prints p50/p99 of each.

    .venv/bin/python scripts/bench_audit.py                   # SQLite in a temp dir
    .venv/bin/python scripts/bench_audit.py --db postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

# Before the event library: catalog_es hides from its import what of the
# environment it must not take ($TZINFO_TOPIC; catalog_es/__init__.py).
import catalog_es  # noqa: F401

# isort: split
import msgspec
from eventsourcing.persistence import StoredEvent

from catalog_es.application import Models
from catalog_es.mapper import EventMapper
from catalog_es.model import Model, model_id
from catalog_es.persistence import SQLRecorder
from catalog_es.spec import ModelSpec, Profile, Scaling
from catalog_es.web.app import MAX_ANSWER_BYTES, MAX_ANSWER_ROWS
from projections.audit import Filters

T0 = datetime(2026, 1, 1, tzinfo=UTC)
STEP = timedelta(seconds=30)
BATCH = 5_000


def events(count: int, models: int, actors: int) -> Iterator[Model.Event]:
    """A plausible history: each model added once, then scaled, re-owned,
    re-classed and resized in turn, by actors picked at random."""
    pick = random.Random(7)
    changes: list[Callable[[int], dict[str, Any]]] = [
        lambda n: {"scaling": Scaling(min=n % 3, max=3 + n % 5)},
        lambda n: {"owner": f"team:t{n % 40}"},
        lambda n: {"capacity_class": ("critical", "standard", "opportunistic")[n % 3]},
        lambda n: {"memory_gb": 16 + n % 64},
    ]
    kinds = [Model.Scaled, Model.OwnerSet, Model.ClassSet, Model.ResourcesSet]
    for i in range(count):
        name = f"model-{i % models:05d}"
        version = i // models + 1
        envelope: dict[str, Any] = {
            "originator_id": model_id(name),
            "originator_version": version,
            "timestamp": T0 + i * STEP,
            "model": name,
            "by": f"user-{pick.randrange(actors):03d}",
        }
        if version == 1:
            spec = ModelSpec(
                name=name,
                engine="vllm",
                source=f"hf://org/{name}",
                profiles=(Profile(name="gpu", gpus=1, gpu_memory_gb=80, min_memory_gb=64),),
            )
            yield Model.Added(**envelope, spec=spec)
        else:
            kind = (version - 2) % len(kinds)
            yield kinds[kind](**envelope, **changes[kind](i))


def build_log(recorder: SQLRecorder, count: int, models: int, actors: int) -> None:
    mapper = EventMapper()
    batch: list[StoredEvent] = []
    for event in events(count, models, actors):
        batch.append(mapper.to_stored_event(event))
        if len(batch) == BATCH:
            recorder.insert_events(batch)
            batch = []
    if batch:
        recorder.insert_events(batch)


def measure(name: str, query: Callable[[], list[dict[str, Any]] | bytes], runs: int) -> None:
    """p50, p99 and the slowest of ``query``, which answers rows or a JSON array of them."""
    times: list[float] = []
    sizes: list[int] = []
    for _ in range(runs):
        start = time.perf_counter()
        answer = query()
        times.append(time.perf_counter() - start)
        # Counted without building the rows: 10,000 dicts made here, with the
        # collector on, would be promoted into the oldest generation and bring
        # on a full collection inside a later, timed query.
        sizes.append(len(_raw_items.decode(answer) if isinstance(answer, bytes) else answer))
        # Let go before the next run starts: freeing 10,000 rows (about 25 ms)
        # is the caller's, whenever it drops them, not the next query's.
        del answer
    times.sort()
    p50 = statistics.median(times) * 1000
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))] * 1000
    rows = statistics.mean(sizes)
    print(
        f"{name:<34} p50 {p50:8.2f} ms   p99 {p99:8.2f} ms   "
        f"slowest {times[-1] * 1000:8.2f} ms   ({rows:,.0f} rows, {runs} runs)"
    )


_raw_items = msgspec.json.Decoder(list[msgspec.Raw])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="database URL (default: SQLite in a temp dir)")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--models", type=int, default=1_000)
    parser.add_argument("--actors", type=int, default=100)
    parser.add_argument("--runs", type=int, default=200, help="runs of each query")
    args = parser.parse_args()
    if args.db == "":  # `--db "$URL"`, the variable unset: SQLite was measured instead
        parser.error("--db is empty: give a database URL, or leave --db out")
    with tempfile.TemporaryDirectory() as tmp:
        url = args.db or f"sqlite:///{Path(tmp) / 'bench.db'}"
        started = time.perf_counter()
        service = Models(env={"CATALOG_ES_DB": url})
        build_log(service.store, args.events, args.models, args.actors)
        print(f"log of {args.events:,} events written in {time.perf_counter() - started:.1f} s")

        started = time.perf_counter()
        service.rebuild_audit()
        print(f"audit tables built in {time.perf_counter() - started:.1f} s")

        pick = random.Random(11)

        def model() -> str:
            return f"model-{pick.randrange(args.models):05d}"

        def actor() -> str:
            return f"user-{pick.randrange(args.actors):03d}"

        def window() -> Filters:
            since = T0 + pick.randrange(args.events) * STEP
            return {"since": since, "until": since + timedelta(hours=1)}

        runs = args.runs
        measure("by model (all its rows)", lambda: service.audit(model=model()), runs)
        measure("by model, --limit 100", lambda: service.audit(model=model(), limit=100), runs)
        measure("history NAME", lambda: service.history(model()), runs)
        measure("by actor, --limit 100", lambda: service.audit(by=actor(), limit=100), runs)
        # Fewer runs of the largest answers, but enough that the p99 is not
        # simply the slowest run (the first, on a machine whose fresh memory
        # is slow to touch; see docs/benchmarks-history.md, eleventh run).
        large = max(runs // 2, 5)
        measure("by actor (all its rows)", lambda: service.audit(by=actor()), large)
        measure("by actor (all its rows), as JSON", lambda: service.audit_json(by=actor()), large)
        measure(
            # A page of /audit: its rows' sizes read first, to bound the answer.
            "by actor, a page of /audit",
            lambda: service.audit_json(
                by=actor(), limit=MAX_ANSWER_ROWS, at_most_bytes=MAX_ANSWER_BYTES
            ),
            large,
        )
        measure("by actor and model", lambda: service.audit(by=actor(), model=model()), runs)
        measure("one hour (--since/--until)", lambda: service.audit(**window()), runs)
        measure("by type, --limit 100", lambda: service.audit(event_type="Scaled", limit=100), runs)
        # The worst case for the indexes: only an upper time bound far back,
        # and a limit, so the newest-first scan walks most of the table.
        early = T0 + args.events // 10 * STEP
        measure("--until (10% in), --limit 100", lambda: service.audit(until=early, limit=100), 20)
        service.close()


if __name__ == "__main__":
    main()
