"""Time making a new log: what every new node's schema pays once, and every
PostgreSQL test.

Each sample is a new schema (PostgreSQL) or file (SQLite): the engine made,
connected, then ``SQLRecorder(engine)`` (with ``--audit`` the audit's tables
too, as ``catalog-es audit`` makes them), closed. Printed: the median ms of
the recorder's part and of the whole. Given ``--against`` another checkout,
its code is timed too, in a process of its own, the two taking turns sample
by sample (the machines here are shared and noisy), and the median of the
paired differences is printed as well.

    .venv/bin/python scripts/bench_new_log.py --db postgresql+psycopg://postgres@127.0.0.1/test
    .venv/bin/python scripts/bench_new_log.py --db sqlite -n 40 --against /path/to/other/checkout
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

HERE = Path(__file__).resolve().parent.parent
WARM = 3  # samples left out: the first imports and connections


def sample(db: str, audit: bool) -> tuple[float, float]:
    """One new log made on ``db``: (whole, recorder's part) in ms."""
    from catalog_es.persistence import SQLRecorder
    from catalog_es.storage.engines import create_engine
    from projections.audit import AuditView

    admin, schema, folder = None, "", ""
    if db == "sqlite":
        folder = tempfile.mkdtemp(prefix="bench_new_log_")
        url = f"sqlite:///{folder}/catalog.db"
    else:
        schema = f"bench_new_log_{uuid.uuid4().hex[:12]}"
        admin = sa.create_engine(db, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
        url = (
            sa.make_url(db)
            .update_query_dict({"options": f"-csearch_path={schema}"})
            .render_as_string(hide_password=False)
        )
    start = time.perf_counter()
    engine = create_engine(url)
    with engine.connect():
        pass
    connected = time.perf_counter()
    store = SQLRecorder(engine)
    if audit:
        AuditView(store, "bench").resume_from("bench")
    made = time.perf_counter()
    store.close()
    engine.dispose()
    if admin is not None:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
        admin.dispose()
    if folder:
        shutil.rmtree(folder)
    return (made - start) * 1000, (made - connected) * 1000


def worker(db: str, audit: bool) -> None:
    """A sample for each line read, printed."""
    for _ in sys.stdin:
        whole, part = sample(db, audit)
        print(f"{whole:.3f} {part:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="sqlite", help="'sqlite', or a PostgreSQL URL")
    parser.add_argument("-n", type=int, default=40, help="samples of each code (default 40)")
    parser.add_argument("--audit", action="store_true", help="the audit's tables too")
    parser.add_argument("--against", type=Path, help="another checkout, timed in turn")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.db == "":  # `--db "$URL"`, the variable unset: a traceback from each worker
        parser.error("--db is empty: give 'sqlite' or a PostgreSQL URL, or leave --db out")
    if args.worker:
        worker(args.db, args.audit)
        return
    codes = {"this": HERE} | ({} if args.against is None else {"against": args.against})
    command = [sys.executable, __file__, "--worker", "--db", args.db]
    workers = {
        name: subprocess.Popen(
            [*command, *(["--audit"] if args.audit else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(root)},
        )
        for name, root in codes.items()
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in codes}
    for i in range(WARM + args.n):
        # Each takes the lead in turn.
        for name in list(workers)[:: 1 if i % 2 else -1]:
            process = workers[name]
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write("\n")
            process.stdin.flush()
            whole, part = map(float, process.stdout.readline().split())
            if i >= WARM:
                samples[name].append((whole, part))
    for process in workers.values():
        assert process.stdin is not None
        process.stdin.close()
        process.wait()
    for j, what in enumerate(("whole (engine, connection, tables)", "SQLRecorder(engine)")):
        medians = ", ".join(
            f"{name} {statistics.median(s[j] for s in got):.2f} ms" for name, got in samples.items()
        )
        line = f"{what}: median of {args.n}: {medians}"
        if args.against is not None:
            paired = [b[j] - a[j] for a, b in zip(samples["against"], samples["this"], strict=True)]
            line += f"; this minus against, paired: {statistics.median(paired):+.2f} ms"
        print(line)


if __name__ == "__main__":
    main()
