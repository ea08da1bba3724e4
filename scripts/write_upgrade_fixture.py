#!/usr/bin/env python3
"""Write a log with every kind of stored event, as this version stores it, for
``tests/test_upgrade.py``:

    python -m scripts.write_upgrade_fixture tests/fixtures

writes ``log-<version>.jsonl`` (the ``catalog_events`` rows, one JSON object a
line, ``state`` as the JSON it holds), ``log-<version>.yaml`` (the declared
config the log was written and is read under) and
``log-<version>.expected.json`` (what reading it gives: the catalog, the
log, the skips).

Run it once per release whose stored form changed, and commit the files next
to the older ones: each stays as it was written, so every release must go on
reading every earlier one. Never regenerate an existing fixture to make a
test pass; write the upcaster.
"""

from __future__ import annotations

import json
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import msgspec
import sqlalchemy as sa

from catalog_es import commands
from catalog_es.application import Models
from catalog_es.batch import Batch
from catalog_es.inputs import load_config, model_from_data
from catalog_es.model import Model
from catalog_es.spec import Adapter, ModelSpec, Origin
from catalog_es.storage.schema import events_table

FIRST_CONFIG = """\
models:
  - name: base
    engine: vllm
    source: hf://org/base
    profiles: [{name: gpu, gpus: 1, gpu_memory_gb: 80}]
"""
# The config the log is read under: a second declared model, recorded by the
# first write after the change.
CONFIG = (
    FIRST_CONFIG
    + """\
  - name: embed
    engine: tgi
    source: hf://org/embed
    profiles: [{name: cpu, gpus: 0, min_memory_gb: 4, cpu_cores: 2}]
    scaling: {min: 0, max: 2}
"""
)
SHA = "5" * 64


def spec(name: str, **fields: Any) -> ModelSpec:
    data: dict[str, Any] = {
        "name": name,
        "engine": "vllm",
        "source": f"hf://org/{name}",
        "profiles": [{"name": "gpu", "gpus": 1, "gpu_memory_gb": 24}],
    }
    return model_from_data(data | fields, "fixture")


def history(folder: Path, url: str) -> Models:
    """Every kind of event, through the service, as operators write them."""
    first = folder / "first.yaml"
    first.write_text(FIRST_CONFIG)
    models = Models(load_config(str(first)), env={"CATALOG_ES_DB": url})
    models.add(spec("chat", owner="team:chat"), by="alice", reason="first runtime model")
    models.add(
        spec(
            "summarise",
            profiles=[{"name": "cpu", "gpus": 0, "min_memory_gb": 32, "cpu_cores": 8}],
            fallbacks=["chat"],
        ),
        by="alice",
    )
    models.scale("chat", 0, 3, by="bob", reason="night traffic")
    models.set_resources("summarise", profile="cpu", memory_gb=48, cpu_cores=12, by="bob")
    models.set_class("chat", "critical", by="carol")
    models.set_owner("summarise", "org:research", by="carol")
    models.set_adapters("chat", (Adapter("sql", "s3://adapters/sql"),), by="dave")
    models.set_source(
        "chat",
        "hf://org/chat-v2",
        Origin("org/chat-v2", "a" * 40, {"model.safetensors": SHA}),
        by="dave",
        reason="new weights",
    )
    models.set_origin("summarise", Origin("org/summarise", "b" * 40, {"w.gguf": SHA}))
    upstream = Origin("org/chat-v2", "c" * 40, {"model.safetensors": "6" * 64})

    def record_upstream(batch: Batch) -> None:
        event = batch.event(
            Model.UpstreamChanged,
            "chat",
            ref="main",
            revision="a" * 40,
            upstream=upstream,
            changed=("model.safetensors",),
        )
        batch.decide(event)

    models.write_plan(record_upstream, by="catalog-es", reason="check-updates")
    models.add(spec("scratch"), by="erin")
    before_scratch_went = models.revision
    models.remove("scratch", by="erin", reason="experiment over")
    models.apply_changes(
        [commands.add(spec("draft")), commands.scale("draft", 1, 2), commands.owner("draft", "")],
        by="frank",
        reason="one transaction",
    )
    models.rollback(before_scratch_went, model="scratch", by="grace", reason="needed after all")
    models.add(spec("summarise", fallbacks=["chat"]), by="heidi", reason="back to a GPU")
    models.close()
    # Then the config declares one more model; the next write records it.
    config = folder / "config.yaml"
    config.write_text(CONFIG)
    models = Models(load_config(str(config)), env={"CATALOG_ES_DB": url})
    models.scale("draft", 0, 1, by="ivan")
    return models


def main() -> None:
    out = Path(sys.argv[1])
    name = f"log-{version('catalog-es')}"
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/fixture.db"
        models = history(Path(tmp), url)
        t = events_table.c
        with models.store.read() as conn:
            rows = conn.execute(
                sa.select(
                    t.revision, t.originator_id, t.originator_version, t.topic, t.state
                ).order_by(t.revision)
            ).all()
        lines = []
        for revision, originator_id, originator_version, topic, state in rows:
            data = json.loads(state)
            # Loaded back with msgspec's encoder, which writes the same bytes.
            assert msgspec.json.encode(data) == state, revision
            row = {
                "revision": revision,
                "originator_id": str(originator_id),
                "originator_version": originator_version,
                "topic": topic,
                "state": data,
            }
            lines.append(json.dumps(row, ensure_ascii=False))
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        (out / f"{name}.yaml").write_text(CONFIG)
        expected = {
            "revision": models.revision,
            "models": models.list_models(),
            "skipped": [msgspec.to_builtins(s) for s in models.skipped()],
            "log": list(models.log_events()),
        }
        (out / f"{name}.expected.json").write_text(
            json.dumps(expected, indent=1, ensure_ascii=False) + "\n"
        )
        models.close()
    print(f"wrote {len(lines)} events to {out / name}.*")


if __name__ == "__main__":
    main()
