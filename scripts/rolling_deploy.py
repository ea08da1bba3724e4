"""Nodes on several declared configs sharing one database, as in a rolling
deploy that changes ``catalog.yaml``: each process writes, asks the audit and,
at the end, replays, and the script counts what was answered and what failed.

    python scripts/rolling_deploy.py [DATABASE_URL] [--configs 2] [--nodes 4]
                                     [--seconds 20] [--log 100000]

Without a URL it uses a SQLite file in a temporary folder. Give PostgreSQL an
empty database of its own: the script writes a log of ``--log`` events first.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from catalog_es import commands
from catalog_es.application import Models
from catalog_es.inputs import load_config
from catalog_es.spec import ModelSpec, Profile

DECLARED = (
    "models:\n  - {name: base, engine: vllm, source: hf://o/base, profiles: [{name: g, gpus: 1}]}\n"
)
# Each config after the first declares one model more of its own: each
# replays the log differently.
EXTRA = "  - {{name: extra{0}, engine: vllm, source: hf://o/e, profiles: [{{name: g, gpus: 1}}]}}\n"


def attempt(what: str, seen: collections.Counter[str], step: Callable[[], object]) -> None:
    try:
        step()
        seen[f"{what}: answered"] += 1
    except Exception as error:  # counted, not raised: the failures are the measure
        seen[f"{what}: {type(error).__name__}: {error}"[:110]] += 1


def node(config: str, db: str, number: int, seconds: float) -> collections.Counter[str]:
    """Scale this node's model, then ask the audit, until the time is up; then replay."""
    models = Models(load_config(config), env={"CATALOG_ES_DB": db})
    seen: collections.Counter[str] = collections.Counter()
    end = time.monotonic() + seconds
    name = f"m{number}"

    def ask() -> None:
        models.audit(limit=10)
        models.history(name)

    rounds = 0
    while time.monotonic() < end:
        rounds += 1
        attempt("write", seen, partial(models.scale, name, 1, 1 + rounds % 5, by="node"))
        attempt("audit", seen, ask)
    attempt("replay", seen, models.rebuild)
    models.close()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "db", nargs="?", metavar="DATABASE_URL", help="database URL (default: a new SQLite file)"
    )
    parser.add_argument("--configs", type=int, default=2, help="declared configs at once")
    parser.add_argument("--nodes", type=int, default=4, help="processes, spread over them")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--log", type=int, default=100_000, help="events written first")
    args = parser.parse_args()
    if args.db == "":  # `"$URL"`, the variable unset: a new SQLite file was written instead
        parser.error("DATABASE_URL is empty: give a database URL, or leave it out")
    folder = Path(tempfile.mkdtemp())
    configs = [folder / f"config{number}.yaml" for number in range(args.configs)]
    for number, config in enumerate(configs):
        config.write_text(DECLARED + (EXTRA.format(number) if number else ""))
    db = args.db or f"sqlite:///{folder / 'catalog.db'}"
    models = Models(load_config(str(configs[0])), env={"CATALOG_ES_DB": db})
    profiles = (Profile("g", gpus=1),)
    for number in range(args.nodes):
        models.add(ModelSpec(f"m{number}", "vllm", "hf://o/m", profiles=profiles), by="setup")
    for _ in range(args.log // 1000):
        steps = [commands.scale("m0", 1, 1 + i % 7) for i in range(1000)]
        models.apply_changes(steps, by="setup")
    models.close()
    nodes = [(str(configs[n % args.configs]), db, n, args.seconds) for n in range(args.nodes)]
    with multiprocessing.Pool(args.nodes) as pool:
        counts = pool.starmap(node, nodes)
    total: collections.Counter[str] = collections.Counter()
    for count in counts:
        total.update(count)
    for outcome, times in sorted(total.items()):
        print(f"{times:7,d}  {outcome}")


if __name__ == "__main__":
    main()
