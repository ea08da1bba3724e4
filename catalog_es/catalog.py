"""The catalog in force: declared models plus runtime ones, validated as a whole.

Validation is incremental. A change to one model can only break the rules
through that model (its own fields, its fallbacks, a cycle through it) or
through the models that name it as a fallback, so that is all that is
checked: a command costs the same on a catalog of ten models or of a hundred
thousand, and a replay is linear in the length of the log. Checking each
change against everything already accepted also means one bad record cannot
take a good one with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import msgspec

from catalog_es.errors import ConfigError, InvalidModel, Refused
from catalog_es.model import Model
from catalog_es.spec import DEFAULT_ENGINES, ModelSpec, check_spec


class Skipped(msgspec.Struct, frozen=True):
    """A stored event that load did not apply, and why."""

    revision: int
    model: str
    event: str
    reason: str


class Catalog:
    """Declared models (always in force) and the runtime layer replayed over them."""

    def __init__(
        self, declared: Sequence[ModelSpec] = (), engines: Iterable[str] = DEFAULT_ENGINES
    ) -> None:
        self.engines = frozenset(engines)
        self.declared: dict[str, ModelSpec] = {}
        # Every model stream seen in the log, removed ones included, so the next
        # event of a name continues its version.
        self.aggregates: dict[str, Model] = {}
        # fallback target -> the models naming it, across both layers.
        self._referrers: dict[str, set[str]] = {}
        self.revision = 0
        self.skipped: list[Skipped] = []
        for spec in declared:
            self._add_declared(spec)
        self._check_declared_graph()

    # -- reading ---------------------------------------------------------------

    def get(self, name: str) -> ModelSpec | None:
        spec = self.declared.get(name)
        if spec is not None:
            return spec
        aggregate = self.aggregates.get(name)
        return aggregate.spec if aggregate is not None else None

    def is_declared(self, name: str) -> bool:
        return name in self.declared

    def runtime(self) -> Iterator[ModelSpec]:
        for aggregate in self.aggregates.values():
            if aggregate.spec is not None:
                yield aggregate.spec

    def models(self) -> list[ModelSpec]:
        """Every model in force, by name."""
        return sorted([*self.declared.values(), *self.runtime()], key=lambda m: m.name)

    def referrers(self, name: str) -> set[str]:
        return self._referrers.get(name, set())

    def aggregate(self, name: str) -> Model:
        return self.aggregates.get(name) or Model.new(name)

    def __len__(self) -> int:
        return len(self.declared) + sum(1 for _ in self.runtime())

    # -- validating ------------------------------------------------------------

    def check(self, name: str, new: ModelSpec | None) -> None:
        """Refuse the runtime change of ``name`` to ``new`` (``None``: removed) if
        the catalog it makes would be invalid."""
        if new is None:
            others = sorted(r for r in self.referrers(name) if r != name)
            if others:
                # Removing a model another names as a fallback would leave it
                # pointing at nothing, found out during the outage it covers.
                raise InvalidModel(
                    name,
                    "fallbacks",
                    f"is a fallback of {', '.join(map(repr, others))}; "
                    "change their fallbacks first",
                )
            return
        check_spec(new, self.engines)
        for target in new.fallbacks:
            if self.get(target) is None:
                raise InvalidModel(
                    name, "fallbacks", f"names {target!r}, which is not in the catalog"
                )
        cycle = self._cycle_through(name, new)
        if cycle:
            raise InvalidModel(name, "fallbacks", f"form a cycle: {' -> '.join(cycle)}")

    def _cycle_through(self, name: str, new: ModelSpec) -> list[str]:
        """A fallback path from ``name`` back to itself, if the change makes one.
        Only the changed model gains edges, so any new cycle passes through it,
        and enters it from a model naming it: with none, there is no cycle (the
        common case, a model added before anything names it, costs nothing).
        Each model is visited once and the path is rebuilt only when found, so
        a deep chain costs its length, not its length squared."""
        if not self.referrers(name) - {name}:
            return []
        came_from: dict[str, str] = {}
        stack: list[str] = []
        for target in new.fallbacks:
            if target not in came_from:
                came_from[target] = name
                stack.append(target)
        while stack:
            current = stack.pop()
            if current == name:
                path = [name]
                node = came_from[name]
                while node != name:
                    path.append(node)
                    node = came_from[node]
                return [name, *reversed(path)]
            spec = self.get(current)
            if spec is None:
                continue
            for target in spec.fallbacks:
                if target not in came_from:
                    came_from[target] = current
                    stack.append(target)
        return []

    # -- changing --------------------------------------------------------------

    def apply(self, event: Model.Event, revision: int) -> Skipped | None:
        """Replay one stored event: apply it if the catalog stays valid, else
        skip it (the stream's version still advances) and say why."""
        aggregate = self.aggregate(event.model)
        self.revision = revision
        try:
            if event.originator_id != aggregate.id:
                raise Refused(f"its aggregate id does not belong to model {event.model!r}")
            if event.model in self.declared:
                raise Refused(
                    f"model {event.model!r} is declared in configuration, which wins every conflict"
                )
            new = event.evolve(aggregate.spec)
            self.check(event.model, new)
        except Refused as refusal:
            self.aggregates[event.model] = aggregate.mutate(event, aggregate.spec)
            return self.skip(revision, event.model, type(event).__name__, str(refusal))
        self.commit(event, new)
        return None

    def skip(self, revision: int, model: str, event: str, reason: str) -> Skipped:
        skipped = Skipped(revision=revision, model=model, event=event, reason=reason)
        self.skipped.append(skipped)
        self.revision = max(self.revision, revision)
        return skipped

    def commit(self, event: Model.Event, new: ModelSpec | None) -> None:
        """Put an event that was checked into force."""
        aggregate = self.aggregate(event.model)
        if aggregate.spec is not None:
            self._unlink(aggregate.spec)
        if new is not None:
            self._link(new)
        self.aggregates[event.model] = aggregate.mutate(event, new)

    def _link(self, spec: ModelSpec) -> None:
        for target in spec.fallbacks:
            self._referrers.setdefault(target, set()).add(spec.name)

    def _unlink(self, spec: ModelSpec) -> None:
        for target in spec.fallbacks:
            names = self._referrers.get(target)
            if names is not None:
                names.discard(spec.name)
                if not names:
                    del self._referrers[target]

    # -- the declared layer ----------------------------------------------------

    def _add_declared(self, spec: ModelSpec) -> None:
        try:
            check_spec(spec, self.engines)
        except InvalidModel as error:
            raise ConfigError(str(error)) from None
        if spec.name in self.declared:
            raise ConfigError(f"model {spec.name!r} is declared more than once")
        self.declared[spec.name] = spec
        self._link(spec)

    def _check_declared_graph(self) -> None:
        for spec in self.declared.values():
            for target in spec.fallbacks:
                if target not in self.declared:
                    raise ConfigError(
                        f"model {spec.name!r}: fallbacks: names {target!r}, which is not declared"
                    )
        for spec in self.declared.values():
            cycle = self._cycle_through(spec.name, spec)
            if cycle:
                raise ConfigError(
                    f"model {spec.name!r}: fallbacks: form a cycle: {' -> '.join(cycle)}"
                )
