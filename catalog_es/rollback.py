"""Rolling the runtime layer back: the compensating events, in an order that is valid.

A rollback never rewrites the log. It compares the runtime layer in force now
with the one at the target revision (replayed over today's config) and plans
the events that make the first equal the second: a removal, a re-add, or the
event of each dimension that differs. Each is decided in turn against the
catalog the ones before it leave, so every intermediate state is valid: a
fallback has to exist before a model names it, and must outlive the models
naming it. The order follows the fallbacks, and what it cannot settle is
tried again until nothing more can go.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from catalog_es import commands
from catalog_es.batch import Batch
from catalog_es.catalog import Catalog, Skipped
from catalog_es.errors import (
    NAME_SHOWN_LENGTH,
    DeclaredInConfig,
    InputError,
    InvalidModel,
    Refused,
    TurnedOn,
    shown,
)
from catalog_es.model import Model
from catalog_es.spec import ModelSpec

_Planner = Callable[[ModelSpec, ModelSpec], list[commands.Step]]


def _one_field(event_class: type[Model.Event], attribute: str) -> _Planner:
    """The planner of a dimension one event sets whole, under the same name."""

    def plan(now: ModelSpec, then: ModelSpec) -> list[commands.Step]:
        value = getattr(then, attribute)
        if getattr(now, attribute) == value:
            return []
        return [commands.Step(event_class, then.name, {attribute: value})]

    return plan


def _source(now: ModelSpec, then: ModelSpec) -> list[commands.Step]:
    if (now.source, now.origin) == (then.source, then.origin):
        return []
    return [commands.source(then.name, then.source, then.origin)]


def _resources(now: ModelSpec, then: ModelSpec) -> list[commands.Step]:
    """One ``ResourcesSet`` per profile of both whose memory or cores differ.
    A profile only one of them has takes a re-add (:func:`_steps_for`), or,
    under ``--only resources``, is left as it is, with a note."""
    profiles_now = {p.name: p for p in now.profiles}
    return [
        commands.Step(
            Model.ResourcesSet,
            then.name,
            {"profile": b.name, "memory_gb": b.min_memory_gb, "cpu_cores": b.cpu_cores},
        )
        for b in then.profiles
        if (a := profiles_now.get(b.name)) is not None
        and (a.min_memory_gb, a.cpu_cores) != (b.min_memory_gb, b.cpu_cores)
    ]


def _resources_left(now: ModelSpec, then: ModelSpec) -> list[str]:
    """Notes on what of the profiles ``--only resources`` cannot roll back:
    a profile only one revision has, and GPUs (a resources change sets
    memory and cores; an "already as at" said nothing of the GPUs)."""
    notes = []
    profiles_now = {p.name: p for p in now.profiles}
    changed = profiles_now.keys() ^ {p.name for p in then.profiles}
    if changed:
        notes.append(
            f"model {now.name!r}: --only resources leaves the profiles only one revision "
            f"has as they are ({', '.join(sorted(changed))})"
        )
    gpus = [
        b.name
        for b in then.profiles
        if (a := profiles_now.get(b.name)) is not None
        and (a.gpus, a.gpu_memory_gb) != (b.gpus, b.gpu_memory_gb)
    ]
    if gpus:
        notes.append(
            f"model {now.name!r}: --only resources leaves the GPUs of profiles as they are "
            f"({', '.join(gpus)}); a rollback without --only restores them"
        )
    return notes


def _check_mixed_memory(mixed: ModelSpec, then: ModelSpec) -> None:
    # A rollback is spared the memory rule as it puts back what was in force;
    # --only resources can instead give today's CPU-only profile the memory
    # its GPU profile had then: a definition never in force, held to the rule.
    missing = [p for p in mixed.missing_memory() if p not in then.missing_memory()]
    if missing:
        raise InvalidModel(
            mixed.name,
            f"profile {missing[0]!r}",
            "--only resources would leave it without a GPU and without memory "
            "(min_memory_gb); roll it back without --only",
        )


DIMENSIONS: dict[str, _Planner] = {
    "source": _source,
    "scaling": _one_field(Model.Scaled, "scaling"),
    "resources": _resources,
    "class": _one_field(Model.ClassSet, "capacity_class"),
    "owner": _one_field(Model.OwnerSet, "owner"),
    "adapters": _one_field(Model.AdaptersSet, "adapters"),
}


def _apply_steps(spec: ModelSpec, steps: list[commands.Step], batch: Batch) -> ModelSpec:
    for step in steps:
        evolved = batch.event(step.event_class, step.name, **step.fields).evolve(spec)
        assert evolved is not None
        spec = evolved
    return spec


def _steps_for(
    now: ModelSpec | None, then: ModelSpec | None, only: str | None, batch: Batch
) -> list[commands.Step]:
    if now == then:
        return []
    if only is not None:
        if now is None or then is None:
            return []
        return DIMENSIONS[only](now, then)
    if then is None:
        assert now is not None
        return [commands.remove(now.name)]
    if now is None:
        return [commands.add(then)]
    steps = [step for planner in DIMENSIONS.values() for step in planner(now, then)]
    if _apply_steps(now, steps, batch) != then:
        # It differs where no dimension event reaches (engine, fallbacks,
        # profiles): the whole definition, as it was, replaces it.
        return [commands.add(then)]
    return steps


def plan_rollback(
    batch: Batch, target: Catalog, *, model: str | None = None, only: str | None = None
) -> list[str]:
    """Decide, into ``batch``, the events that make its runtime layer equal the
    target's. Returns notes on what was left out."""
    if only is not None and only not in DIMENSIONS:
        raise InputError(f"only {only!r}: choose one of {', '.join(DIMENSIONS)}")
    current = batch.catalog
    notes: list[str] = []
    names = sorted(
        set(current.aggregates)
        | set(target.aggregates)
        | set(target.unhealed())
        | set(current.unhealed())
    )
    if model is not None:
        if current.is_declared(model):
            # What is in force for it is the config's, whatever its history.
            raise DeclaredInConfig(
                model, f"model {model!r} is declared in configuration; roll it back there"
            )
        if model not in names:
            raise Refused(
                f"model {shown(model, NAME_SHOWN_LENGTH)} has no runtime history to roll back",
                TurnedOn((model,), named=True),
            )
        names = [model]
    steps: list[commands.Step] = []
    batch.prefetch(names)
    for name in names:
        if current.is_declared(name):
            # Its history now holds all it had at the target, and what came after.
            if current.aggregate(name).version > 0:
                notes.append(
                    f"model {name!r} is declared in configuration now; "
                    "its runtime history is left out"
                )
            continue
        now, then = current.aggregate(name).spec, target.aggregate(name).spec
        # In force neither now nor then, but a record written since stands:
        # it would come back the day the config takes it again, as it was not.
        unloaded = now is None and then is None and current.was_skipped(name)
        since = _last_skip(current, name) if unloaded else None
        if since is not None and since.revision > target.revision:
            if only is not None:
                notes.append(
                    f"model {name!r} is in force at neither revision; --only {only} leaves "
                    "its record"
                )
                continue
            cause = current.taken_out_by(name)
            notes.append(
                f"model {name!r} is removed: it is not in force now, as its record at "
                f"revision {cause.revision} does not load over today's config ({cause.reason}), "
                f"and was not at revision {target.revision}"
            )
            steps.append(commands.remove(name))
            continue
        if then is None and target.was_skipped(name):
            # Today's config cannot take what it was then: said, not passed over.
            # As read today it was not in force then, so one in force now goes.
            skip = target.taken_out_by(name)
            outcome = "is removed" if now is not None and only is None else "is left out"
            notes.append(
                f"model {name!r} {outcome}: over today's config its record at revision "
                f"{skip.revision} does not load ({skip.reason})"
            )
        planned = _steps_for(now, then, only, batch)
        if only is not None and now != then and (now is None or then is None):
            notes.append(
                f"model {name!r} is in force at only one of the two revisions; "
                f"--only {only} leaves it"
            )
        elif only == "resources" and now is not None and then is not None:
            notes.extend(_resources_left(now, then))
            _check_mixed_memory(_apply_steps(now, planned, batch), then)
        steps.extend(planned)
    _decide_in_a_valid_order(batch, steps, target.revision)
    return notes


def _last_skip(catalog: Catalog, name: str) -> Skipped:
    return next(s for s in reversed(catalog.skipped) if s.model == name)


def _decide_in_a_valid_order(batch: Batch, steps: list[commands.Step], revision: int) -> None:
    # Removals first, then changes, then additions: what usually lets the rest
    # go. A removal goes after those of the models naming it, an addition after
    # those of the models its fallbacks lead to, by way of others too (what it
    # falls back to must be there, and must not lead back to it): tried in
    # name order instead, a chain of fallbacks went a link a pass, quadratic
    # in its length, the log locked throughout.
    catalog = batch.catalog
    removals = {step.name: step for step in steps if step.event_class is Model.Removed}
    additions = {step.name: step for step in steps if step.event_class is Model.Added}

    def naming_now(name: str) -> list[str]:
        # In name order: a set's changes from one process to the next, and so
        # did a rollback's events.
        return sorted(catalog.referrers(name))

    def fallbacks_then(name: str) -> tuple[str, ...]:
        if name in additions:
            spec: ModelSpec = additions[name].fields["spec"]
            return spec.fallbacks
        now = catalog.get(name)
        return now.fallbacks if now is not None else ()

    pending = [
        *(removals[name] for name in _ordered(removals, naming_now)),
        *(step for step in steps if step.event_class not in (Model.Removed, Model.Added)),
        *(additions[name] for name in _ordered(additions, fallbacks_then, through=True)),
    ]
    # What the order above cannot settle (a swap of fallbacks, a cycle cut
    # short) is tried again while anything is left that can go.
    while pending:
        refusal: Refused | None = None
        left: list[commands.Step] = []
        for step in pending:
            try:
                step.decide(batch)
            except Refused as error:
                refusal = refusal or error
                left.append(step)
        if refusal is not None and len(left) == len(pending):
            raise Refused(
                f"rolling back to revision {revision} would make the catalog invalid: {refusal}"
            )
        pending = left


def _ordered(
    names: Collection[str], first: Callable[[str], Iterable[str]], *, through: bool = False
) -> list[str]:
    """``names``, each after those of them that ``first`` says go before it
    (``through``: by way of names not among them too), else in their own
    order; of a cycle, where it was entered (a chain tens of thousands long:
    no recursion)."""
    among = set(names)
    placed: set[str] = set()
    order: list[str] = []
    for root in names:
        if root in placed:
            continue
        placed.add(root)
        path = [(root, iter(first(root)))]
        while path:
            name, before = path[-1]
            for other in before:
                if (through or other in among) and other not in placed:
                    placed.add(other)
                    path.append((other, iter(first(other))))
                    break
            else:
                path.pop()
                if name in among:
                    order.append(name)
    return order
