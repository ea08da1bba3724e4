"""Deciding a runtime change: a pure function of the catalog in force.

Given the catalog (built by replaying events) and a candidate event, either
the definition that will run comes back or the change is refused. The replay
path (:meth:`Catalog.apply`) shares the catalog rules; what only a command
faces — configuration's precedence worded as advice, the host-memory rule,
printable sources, origins a registry could name — is here.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Collection

from catalog_es.catalog import Catalog
from catalog_es.errors import DeclaredInConfig, InvalidModel, ModelNotFound, Refused, shown
from catalog_es.model import Model
from catalog_es.registry import check_commit, check_repository, relative_file
from catalog_es.spec import ModelSpec, Origin


def declared_refusal(event: Model.Event) -> str:
    """What to tell someone changing a declared model at runtime: where to go instead."""
    name = event.model
    if isinstance(event, Model.Added):
        return (
            f"model {name!r} is declared in configuration; "
            "edit that rather than adding a second definition"
        )
    if isinstance(event, Model.Removed):
        return (
            f"model {name!r} is declared in configuration; "
            "remove it there, or it comes back on the next restart"
        )
    return (
        f"model {name!r} is declared in configuration; "
        f"{event.what} there, or it reverts on the next restart"
    )


def decide(catalog: Catalog, event: Model.Event) -> ModelSpec | None:
    """The definition ``event`` puts in force (``None``: removed), or a refusal."""
    name = event.model
    if event.observation:
        # A record of what was seen, of any model in force: the definition stays.
        current = catalog.get(name)
        if current is None:
            raise ModelNotFound(name)
        return event.evolve(current)
    if catalog.is_declared(name):
        raise DeclaredInConfig(name, declared_refusal(event))
    current = catalog.aggregate(name).spec
    if isinstance(event, Model.Removed) and not catalog.holds(name):
        raise ModelNotFound(name)
    new = event.evolve(current)
    catalog.check(name, new, event.touches)
    if new is not None and event.rollback_to is None:
        # A rollback puts back a definition that was in force: it is not new
        # input, and one stored before these rules must come back as it was.
        _check_memory(event, new)
        _check_sources(event, new)
    return new


def _check_memory(event: Model.Event, new: ModelSpec) -> None:
    # A model with no GPU is all host memory, and one that declares none fits
    # everywhere as far as placement can tell, however many of it there already
    # are. Required of what is added or resized now; models stored before the
    # rule, and declared ones, still load and say what they are missing.
    if "resources" not in event.touches:
        return
    if isinstance(event, Model.ResourcesSet):
        touched = [p for p in new.missing_memory() if not event.profile or p == event.profile]
    else:
        touched = new.missing_memory()
    if touched:
        raise InvalidModel(
            new.name,
            f"profile {touched[0]!r}",
            "runs without a GPU and declares no memory (min_memory_gb): "
            "placement could not tell when a node is full",
        )


def _check_sources(event: Model.Event, new: ModelSpec) -> None:
    # A control or format character in a weights location (NUL, a terminal
    # escape, a bidi override) reaches loaders, logs and terminals as it is,
    # or shows as what it is not. Required of the sources a change sets now;
    # models stored before the rule, and declared ones, still load.
    touches = event.touches
    if "source" in touches:
        _check_printable(new.name, "source", new.source)
    if "adapters" in touches:
        for i, adapter in enumerate(new.adapters):
            _check_printable(new.name, f"adapters[{i}].source", adapter.source)
    if "origin" in touches and new.origin is not None:
        check_origin(new.name, new.origin)


def check_origin(model: str, origin: Origin) -> None:
    # An origin says where in a registry the weights came from, and `update`
    # and `rollback` later build paths from it: held to the rules they read
    # it by, so what is written now can be moved back to.
    problem = _origin_problem(origin)
    if problem is not None:
        raise InvalidModel(model, *problem)


def origin_warnings(origin: Origin | None) -> list[str]:
    """What ``model show`` warns of an origin :func:`check_origin` refuses,
    which a declared model gives all the same: it loads (declared models
    always do), and says what is wrong with it, as one short of memory does."""
    problem = _origin_problem(origin) if origin is not None else None
    if problem is None:
        return []
    field, why = problem
    return [f"{field}: {why}, which a runtime change must give and the weights commands need"]


def _origin_problem(origin: Origin) -> tuple[str, str] | None:
    """The first field of ``origin`` that breaks the rules a registry reads
    it by, and why; ``None`` when none does."""
    named: tuple[tuple[str, Callable[[str], object], str], ...] = (
        ("origin.repository", check_repository, origin.repository),
        ("origin.revision", check_commit, origin.revision),
    )
    for field, check, value in named:
        why = _refusal(check, value) if value else None
        if why is not None:
            return field, why
    for path in origin.files:
        why = _refusal(relative_file, path)
        if why is not None:
            return f"origin.files[{shown(path)}]", why
    return _file_and_folder(origin.files)


def _file_and_folder(paths: Collection[str]) -> tuple[str, str] | None:
    """A file that another of ``paths`` lists as a folder (``x`` beside
    ``x/y``): no revision holds both, so no update or rollback could fetch
    them (hostile test)."""
    folders: dict[str, str] = {}
    for path in paths:
        parts = path.split("/")
        for end in range(1, len(parts)):
            folders.setdefault("/".join(parts[:end]), path)
    clash = next((path for path in paths if path in folders), None)
    if clash is None:
        return None
    inside = folders[clash]
    return (
        f"origin.files[{shown(clash)}]",
        f"is a file, and a folder of {shown(inside)}: no revision holds both",
    )


def _refusal(check: Callable[[str], object], value: str) -> str | None:
    try:
        check(value)
    except Refused as refusal:
        return str(refusal)
    return None


def _check_printable(model: str, field: str, value: str) -> None:
    bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Cf")), None)
    if bad is not None:
        raise InvalidModel(model, field, f"holds U+{ord(bad):04X}, a control or format character")
