"""A writer to be killed: ``python -m tests.crash_writer URL CONFIG SNAPSHOT_INTERVAL``.

Started once, it imports the whole stack and says ``ready``. Then, for each
seed read from standard input, it forks a writer process and says ``started
PID``; the writer opens the catalog and issues random commands until it is
killed, printing after each one that succeeded::

    ok REVISION EVENTS KIND MODEL DIGEST

(the revision it answered, how many events its transaction wrote, the command,
the model, and a digest of the catalog in force after it), and ``begin`` before
each command, so the parent can tell a kill inside one. When the writer is
gone the server says ``exited PID EXIT_CODE``. Each line is one ``write()`` to
the pipe, so a kill can cut the list of successes short but never a line.

Forking from one warmed-up process is what makes fifty kills fit in seconds:
a fresh interpreter takes about a second to import the stack. The writer
opens its own database connections after the fork, as a fresh process would.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys

import msgspec

from catalog_es import commands
from catalog_es.application import Models
from catalog_es.catalog import Catalog
from catalog_es.errors import Refused
from catalog_es.inputs import load_config, model_from_data
from catalog_es.spec import Adapter, ModelSpec, Origin

NAMES = ("a", "b", "c", "d", "e")
DECLARED = "base"
# How many events an ``apply`` writes, and the reason that marks them, so the
# parent can tell a whole transaction from part of one.
APPLY_SIZE = 3
APPLY_REASON = "apply3"
KINDS = (
    "add",
    "add",
    "remove",
    "scale",
    "resources",
    "class",
    "owner",
    "adapters",
    "source",
    "origin",
    "apply",
    "rollback",
    "declared",
)
# The event each single-model command writes, as ``log`` names it.
EVENT_OF_KIND = {
    "add": "Added",
    "remove": "Removed",
    "scale": "Scaled",
    "resources": "ResourcesSet",
    "class": "ClassSet",
    "owner": "OwnerSet",
    "adapters": "AdaptersSet",
    "source": "SourceSet",
    "origin": "OriginSet",
}
SHA = "0" * 63


def catalog_digest(catalog: Catalog) -> str:
    """Identifies the models in force: equal digests, equal catalogs."""
    return hashlib.sha256(msgspec.json.encode(catalog.models())).hexdigest()[:16]


def definition(rng: random.Random, name: str) -> ModelSpec:
    others = [n for n in (*NAMES, DECLARED) if n != name]
    gpus = rng.choice([0, 1, 2])
    return model_from_data(
        {
            "name": name,
            "engine": rng.choice(["vllm", "sglang"]),
            "source": f"hf://org/{name}-{rng.randint(0, 9)}",
            "profiles": [{"name": "p", "gpus": gpus, "min_memory_gb": 0 if gpus else 8}],
            "fallbacks": rng.sample(others, rng.randint(0, 2)),
        },
        "crash writer",
    )


def command(models: Models, rng: random.Random, kind: str, name: str) -> int | None:
    """Issue one command; the revision it answered, or None when it wrote nothing."""
    by = "crash-writer"
    if kind == "add":
        return models.add(definition(rng, name), by=by).revision
    if kind == "remove":
        return models.remove(name, by=by).revision
    if kind == "scale":
        low = rng.randint(0, 2)
        return models.scale(name, low, max(1, low + rng.randint(0, 3)), by=by).revision
    if kind == "resources":
        return models.set_resources(
            name, memory_gb=rng.randint(1, 64), cpu_cores=rng.randint(0, 8), by=by
        ).revision
    if kind == "class":
        return models.set_class(name, rng.choice(["", "critical", "standard"]), by=by).revision
    if kind == "owner":
        return models.set_owner(name, rng.choice(["", "team:a", "org:b"]), by=by).revision
    if kind == "adapters":
        adapters = tuple(Adapter(f"l{i}", f"s3://lora/{i}") for i in range(rng.randint(0, 2)))
        return models.set_adapters(name, adapters, by=by).revision
    if kind == "source":
        origin = Origin(repository=f"org/{name}", revision=f"{rng.randint(0, 99):040x}")
        return models.set_source(name, f"hf://org/{name}", origin, by=by).revision
    if kind == "origin":
        files = {"model.safetensors": SHA + str(rng.randint(0, 9))}
        return models.set_origin(name, Origin(f"org/{name}", "1" * 40, files), by=by).revision
    if kind == "apply":
        steps = [
            commands.owner(name, rng.choice(["team:x", "org:y"])),
            commands.capacity_class(name, rng.choice(["critical", "standard"])),
            commands.scale(name, 0, rng.randint(1, 4)),
        ]
        assert len(steps) == APPLY_SIZE
        result = models.apply_changes(steps, by=by, reason=APPLY_REASON)
        return int(result["revision"])
    if kind == "rollback":
        to = rng.randint(max(0, models.revision - 15), models.revision)
        rolled = models.rollback(to, by=by)
        return int(rolled["revision"]) if rolled["written"] else None
    assert kind == "declared"
    # Always refused: configuration wins. The refusal path is under fire too.
    return models.scale(DECLARED, 0, 3, by=by).revision


def say(line: str) -> None:
    """One line, in one write() to the pipe, unbuffered."""
    os.write(1, (line + "\n").encode())


def write_until_killed(url: str, config: str, interval: int, seed: int) -> None:
    rng = random.Random(seed)
    models = Models(load_config(config), snapshot_interval=interval, env={"CATALOG_ES_DB": url})
    for _ in range(100_000):
        kind, name = rng.choice(KINDS), rng.choice(NAMES)
        before = models.revision
        say("begin")
        try:
            revision = command(models, rng, kind, name)
        except Refused:
            continue
        if revision is not None:
            events = revision - before
            say(f"ok {revision} {events} {kind} {name} {catalog_digest(models.catalog)}")


def serve(url: str, config: str, interval: int) -> None:
    say("ready")
    for line in sys.stdin:
        seed = int(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                write_until_killed(url, config, interval, seed)
            except BaseException as error:
                say(f"failed {type(error).__name__}: {error!r}"[:2000])
                code = 3
            os._exit(code)
        say(f"started {pid}")
        _, status = os.waitpid(pid, 0)
        say(f"exited {pid} {os.waitstatus_to_exitcode(status)}")


def main() -> None:
    url, config, interval = sys.argv[1:4]
    serve(url, config, int(interval))


if __name__ == "__main__":
    main()
