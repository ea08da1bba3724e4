"""What changed between two catalogs: models added, removed, and field by field."""

from __future__ import annotations

from typing import Any

from catalog_es.catalog import Catalog
from catalog_es.views import model_view


def diff_catalogs(before: Catalog, after: Catalog, *, model: str | None = None) -> dict[str, Any]:
    """``added`` and ``removed`` (model views), and ``changed``: per model, each
    field that differs with its value ``before`` and ``after``. Declared and
    runtime models alike; ``model`` limits it to one name."""
    old = {m.name: m for m in before.models() if model is None or m.name == model}
    new = {m.name: m for m in after.models() if model is None or m.name == model}
    changed = []
    for name in sorted(old.keys() & new.keys()):
        if old[name] == new[name]:
            continue
        a = model_view(old[name], declared=before.is_declared(name))
        b = model_view(new[name], declared=after.is_declared(name))
        fields = {
            key: {"before": a.get(key), "after": b.get(key)}
            for key in dict.fromkeys([*a, *b])
            if a.get(key) != b.get(key)
        }
        changed.append({"model": name, "fields": fields})
    return {
        "from": before.revision,
        "to": after.revision,
        "added": [
            model_view(new[n], declared=after.is_declared(n))
            for n in sorted(new.keys() - old.keys())
        ],
        "removed": [
            model_view(old[n], declared=before.is_declared(n))
            for n in sorted(old.keys() - new.keys())
        ],
        "changed": changed,
    }
