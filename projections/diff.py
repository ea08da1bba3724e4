"""What changed between two catalogs: models added, removed, and field by field."""

from __future__ import annotations

from typing import Any

from catalog_es.catalog import Catalog
from catalog_es.views import model_view


def diff_catalogs(before: Catalog, after: Catalog, *, model: str | None = None) -> dict[str, Any]:
    """``added`` and ``removed`` (model views), and ``changed``: per model, each
    field that differs with its value ``before`` and ``after``. Declared and
    runtime models alike, and a model moving from one to the other is changed
    (``declared``: the config now decides it, and runtime changes are refused);
    ``model`` limits it to one name."""
    old = {m.name: m for m in before.models() if model is None or m.name == model}
    new = {m.name: m for m in after.models() if model is None or m.name == model}
    changed = []
    for name in sorted(old.keys() & new.keys()):
        declared = before.is_declared(name), after.is_declared(name)
        if old[name] == new[name] and declared[0] == declared[1]:
            continue
        a = model_view(old[name], declared=declared[0])
        b = model_view(new[name], declared=declared[1])
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
