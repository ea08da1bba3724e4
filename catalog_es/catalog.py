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

from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from uuid import UUID

import msgspec

from catalog_es.chain import ChainHead
from catalog_es.configuration import Configuration
from catalog_es.errors import DeclaredModelError, InvalidModel, ModelNotFound, Refused, TurnedOn
from catalog_es.model import DomainEvent, Model, model_key
from catalog_es.names import CONFIG_DECLARED
from catalog_es.spec import DEFAULT_ENGINES, EVERY_FIELD, ModelSpec, check_spec

_DECLARED = Configuration.Declared

# The fingerprint :attr:`Catalog.recorded_declaration` holds for a
# declared-config record that cannot be read (one a newer release wrote,
# say): no config's, so it is never this node's, and its next write records
# this node's own.
UNREADABLE_DECLARATION = ""


class Skipped(msgspec.Struct, frozen=True):
    """A stored event that load did not apply, and why."""

    revision: int
    model: str
    event: str
    reason: str

    @property
    def config_record(self) -> bool:
        """Whether the record skipped is the declared config's: no model's
        (a snapshot of an older release may name a model's record whose topic
        only ended like the config's so: the model it names tells it apart)."""
        return self.event == CONFIG_DECLARED and not self.model

    def what(self) -> str:
        """What was skipped, as a load's warning and replay's summary name it:
        the model's name quoted as ``repr`` quotes it, ``?`` where the record
        gives none that can be read."""
        if self.config_record:
            return "the declared config's record"
        return f"model {repr(self.model) if self.model else '?'}, {self.event}"


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
        # The time of the log's last event: commands stamp theirs strictly
        # later, so time in the log never runs backwards, whichever node's
        # clock is slow (see Models._next_timestamp).
        self.last_timestamp: datetime | None = None
        # The declared layer the log last recorded (fingerprint, from revision);
        # UNREADABLE_DECLARATION for a record this code cannot read.
        self.recorded_declaration: tuple[str, int] | None = None
        # The log's chain where this catalog was last read or written to: at
        # its revision, the hash of the event there, which a log rewritten
        # under the catalog (a failover, a restored backup, then new writes)
        # no longer has (see chain_hash).
        self.chain: ChainHead | None = None
        self.skipped: list[Skipped] = []
        # Told of each model a removal takes out of force, with the definition
        # it had: the audit gives each a row (no event of its own says so).
        self.taken_out: Callable[[Skipped, ModelSpec], object] | None = None
        # Models whose latest event load left out and no later one put right.
        self._unhealed: set[str] = set()
        # name -> its aggregate id as an int, for the check every replayed event
        # passes: worked out once per name, not once per event.
        self._ids: dict[str, int] = {}
        for spec in declared:
            self._add_declared(spec)
        self._check_declared_graph()

    # -- reading ---------------------------------------------------------------

    def name_of(self, originator_id: UUID) -> str | None:
        """The model whose stream ``originator_id`` is, of those this catalog has
        replayed an event of or holds the stream of (one restored from a
        snapshot holds every stream the snapshot has, but has replayed only
        the events since: looked for among those alone, a stream with none
        since went unnamed; review): for a record that cannot say so itself.
        Rare, so each is looked for afresh (a few milliseconds at 100,000 models)."""
        wanted = originator_id.int
        replayed = (name for name, known in self._ids.items() if known == wanted)
        held = (name for name, aggregate in self.aggregates.items() if aggregate.id.int == wanted)
        return next(replayed, None) or next(held, None)

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

    @property
    def chain_hash(self) -> str | None:
        """The log's hash at this catalog's revision, if known: ``chain`` is
        passed over once a replay has moved the revision on past it."""
        chain = self.chain
        return chain.hash if chain is not None and chain.revision == self.revision else None

    def was_skipped(self, name: str) -> bool:
        """Whether load left out this model's latest event, and nothing applied
        since (so a removal can heal it, once)."""
        return name in self._unhealed

    def holds(self, name: str) -> bool:
        """Whether the log holds a definition of ``name`` that commands act on:
        one in force, or one load skipped, which a removal or a re-add (that
        replaces it) heals."""
        return self.get(name) is not None or name in self._unhealed

    def taken_out_by(self, name: str) -> Skipped:
        """The skip that took a model :meth:`was_skipped` out of force: the
        last of its skips that is not a mere follow-on (an event on a model
        already out, "not in the catalog"), which only repeats that it is out."""
        # Its own records only: one filed in another model's stream names it
        # but never moved it (nor made it unhealed).
        elsewhere = _filed_elsewhere(name)
        skips = [s for s in self.skipped if s.model == name and s.reason != elsewhere]
        follow_on = str(ModelNotFound(name))
        return next((s for s in reversed(skips) if s.reason != follow_on), skips[-1])

    def standing_skips(self) -> list[Skipped]:
        """What load leaves out that still counts, by revision: for each model
        a skip keeps out of force, or from its latest change, the skip that
        did (:meth:`taken_out_by`), unless it hides nothing (a removal of a
        name the config declares); and each record that is no model's change
        (its model cannot be read, or it is filed in another's stream)."""
        standing = [
            skip for skip in map(self.taken_out_by, self._unhealed) if not _hides_nothing(skip)
        ]
        standing += (
            s for s in self.skipped if not s.model or s.reason == _filed_elsewhere(s.model)
        )
        # By name too: models a removal takes out together share its revision.
        return sorted(standing, key=lambda s: (s.revision, s.model))

    def unhealed(self) -> list[str]:
        """Every model :meth:`was_skipped` tells of, by name."""
        return sorted(self._unhealed)

    def referrers(self, name: str) -> set[str]:
        return self._referrers.get(name, set())

    def runtime_fallbacks(self) -> Iterator[tuple[str, str]]:
        """Each ``(model, fallback)`` where the fallback is not declared."""
        for target, names in self._referrers.items():
            if target not in self.declared:
                for name in names:
                    yield name, target

    def aggregate(self, name: str) -> Model:
        return self.aggregates.get(name) or Model.new(name)

    def __len__(self) -> int:
        return len(self.declared) + sum(1 for _ in self.runtime())

    # -- validating ------------------------------------------------------------

    def check(
        self, name: str, new: ModelSpec | None, touches: tuple[str, ...] = EVERY_FIELD
    ) -> None:
        """Refuse the runtime change of ``name`` to ``new`` (``None``: removed) if
        the catalog it makes would be invalid. ``touches``: the fields the change
        can have made invalid; the rest were valid before it."""
        if new is None:
            others = sorted(r for r in self.referrers(name) if r != name)
            if others:
                # Removing a model another names as a fallback would leave it
                # pointing at nothing, found out during the outage it covers.
                # No command sets fallbacks: a model is added again with new
                # ones (each is runtime: a declared one cannot name a runtime one).
                which, its, example = (
                    ("that model", "its", repr(others[0]))
                    if len(others) == 1
                    else ("those models", "their", "NAME")
                )
                raise InvalidModel(
                    name,
                    "fallbacks",
                    f"is a fallback of {', '.join(map(repr, others))}; add {which} again "
                    f"without {name!r} in {its} fallbacks first (model show {example} --json "
                    "> FILE, edit it, model add FILE)",
                    TurnedOn(tuple(others)),
                )
            return
        check_spec(new, self.engines, touches)
        if "fallbacks" not in touches:
            return
        for target in new.fallbacks:
            if self.get(target) is None:
                raise InvalidModel(
                    name,
                    "fallbacks",
                    f"names {target!r}, which is not in the catalog",
                    TurnedOn((target,)),
                )
        cycle = self._cycle_through(name, new)
        if cycle:
            # Each model on it names a runtime one (the next, up to this one),
            # so each is runtime: one declared instead, which names only
            # declared models, breaks it.
            raise InvalidModel(
                name,
                "fallbacks",
                f"form a cycle: {_cycle_text(cycle)}",
                TurnedOn(tuple(cycle[1:-1]), any_of=True),
            )

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

    def restore(
        self,
        *,
        revision: int,
        last_timestamp: datetime | None,
        recorded_declaration: tuple[str, int] | None,
        aggregates: Iterable[Model],
        skipped: Iterable[Skipped],
        unhealed: Iterable[str],
    ) -> None:
        """Take up a snapshot's state. Only on a catalog that has replayed nothing.
        ``unhealed``: the skipped models no later event has healed."""
        assert self.revision == 0 and not self.aggregates
        # Every point-in-time read starts here, over thousands of models: one
        # dict built at once, and links only for models that name a fallback.
        self.aggregates = {aggregate.name: aggregate for aggregate in aggregates}
        for aggregate in self.aggregates.values():
            if aggregate.spec is not None and aggregate.spec.fallbacks:
                self._link(aggregate.spec)
        self.revision = revision
        self.last_timestamp = last_timestamp
        self.recorded_declaration = recorded_declaration
        self.skipped = [_named(s) for s in skipped]
        # Snapshots written before an unreadable config record counted as
        # the one in force name the readable record before it.
        skips = self.skipped
        unreadable = max((s.revision for s in skips if s.config_record), default=0)
        if unreadable > (recorded_declaration[1] if recorded_declaration else 0):
            self.recorded_declaration = (UNREADABLE_DECLARATION, unreadable)
        # Snapshots written before unreadable names were left out may hold "".
        self._unhealed = {name for name in unhealed if name}

    def adopt(
        self, aggregates: Iterable[Model], unhealed: Iterable[str], theirs: Callable[[str], bool]
    ) -> None:
        """Take over the models ``theirs`` tells apart from a replay of their
        streams alone, from the same state as this one: their aggregates, and
        which of them that replay left unhealed."""
        for aggregate in aggregates:
            old = self.aggregates.get(aggregate.name)
            self._put(aggregate.name, aggregate.version, old.spec if old else None, aggregate.spec)
        self._unhealed = {name for name in self._unhealed if not theirs(name)} | set(unhealed)

    def copy(self) -> Catalog:
        """An independent catalog in the same state, to try a series of changes on."""
        other = Catalog.__new__(Catalog)
        other.__dict__.update(self.__dict__)
        other.aggregates = dict(self.aggregates)
        other._referrers = {k: set(v) for k, v in self._referrers.items()}
        other.skipped = list(self.skipped)
        other._unhealed = set(self._unhealed)
        other.taken_out = None  # the copy's changes are tried, not the log's
        return other

    def replay_copy(self) -> Catalog:
        """A copy of this catalog, which has replayed nothing, to replay a log
        over on its own: it shares nothing a replay changes, not even the ids
        worked out for names, which ``copy`` shares (catalogs replayed on two
        threads, the service's and a read of the past's, would change one dict)."""
        assert self.revision == 0 and not self.aggregates
        other = self.copy()
        other._ids = {}
        return other

    def apply(self, event: DomainEvent, revision: int) -> Skipped | None:
        """Replay one stored event: apply it if the catalog stays valid, else
        skip it (the stream's version still advances) and say why. The hot
        loop of every load: keep it lean (``catch_up`` keeps the time); each
        attribute is read once, since in this loop reads are much of the cost."""
        self.revision = revision
        if type(event) is _DECLARED:
            # Replay is always over today's config; the record says what was in force then.
            self.recorded_declaration = (event.fingerprint, revision)
            return None
        change: Model.Event = event  # type: ignore[assignment]  # every other kind is
        name = change.model
        aggregate = self.aggregates.get(name) or Model.new(name)
        # The first event's string from here on, the key of both dicts: the next
        # lookup matches it by identity, and the aggregate no longer holds each
        # event's own copy of the name, to be freed, cold, by the next event.
        name = aggregate.name
        expected_id = self._ids.get(name)
        if expected_id is None:
            expected_id = self._ids[name] = model_key(name)
        # By value of the 128-bit ints: UUID.__eq__ is slow in a hot loop.
        if change.originator_id.int != expected_id:
            # Filed in another model's stream: it moves neither model. Taken as
            # the named model's, its version put that model ahead of its own
            # stream, and every command on it was refused as a hand edit.
            event_type = type(change).__name__
            return self.skip(revision, name, event_type, _filed_elsewhere(name), its_own=False)
        declared = name in self.declared
        observation = change.observation
        current = aggregate.spec
        try:
            if declared and not observation:
                raise Refused(_declared_wins(name))
            new = change.evolve(current)
            if new is not None and not observation:
                touches = change.touches
                if "fallbacks" not in touches:
                    check_spec(new, self.engines, touches)
                else:
                    self.check(name, new, touches)
        except Refused as refusal:
            self.aggregates[name] = aggregate.mutate(change, current)
            return self.skip(revision, name, type(change).__name__, str(refusal))
        if observation:
            if declared:
                return None  # see commit()
            if current is None:
                # What upstream did puts no definition back: a model load left
                # out stays out, and removable (a command refuses the record).
                self.aggregates[name] = aggregate.mutate(change, None)
                return None
        self._put(name, change.originator_version, current, new)
        if new is None and name in self._referrers:
            self._fall_with(name, revision)
        return None

    def _fall_with(self, removed: str, revision: int) -> None:
        """Take out of force each runtime model that names ``removed`` as a
        fallback, and each naming one of those in turn, reported as skipped
        at ``revision``. A removal always stands on replay: a command decided
        it while those models were not in force (skipped, say, while the
        config declared their name), and putting the removed model back when
        they return would run what its operator took away. The original
        control plane ends the same way: the row deleted, the model naming it
        skipped on load, its fallback gone."""
        falling = [(removed, name) for name in sorted(self.referrers(removed))]
        while falling:
            gone, name = falling.pop(0)
            aggregate = self.aggregates.get(name)
            if aggregate is None or aggregate.spec is None or name in self.declared:
                continue
            spec = aggregate.spec
            self._put(name, aggregate.version, spec, None)
            skipped = self.skip(
                revision,
                name,
                "Removed",
                f"model {name!r}: fallbacks: names {gone!r}, which this revision removed; "
                "out of force until added again",
            )
            if self.taken_out is not None:
                self.taken_out(skipped, spec)
            falling += [(name, referrer) for referrer in sorted(self.referrers(name))]

    def saw(self, timestamp: datetime) -> None:
        """Keep the time of the last event, in the log's order: the one a
        command follows. Not the newest: one stamped by a clock hours fast
        would be followed by every node whose own clock came within an hour
        of it, where commands passed it over while it was last."""
        self.last_timestamp = timestamp

    def skip(
        self, revision: int, model: str, event: str, reason: str, *, its_own: bool = True
    ) -> Skipped:
        """Report a record load left out. ``its_own``: whether it is of the
        model's own stream, whose latest event it then may be (not so of one
        filed in another's stream)."""
        skipped = Skipped(revision=revision, model=model, event=event, reason=reason)
        self.skipped.append(skipped)
        # A record whose model's name cannot be read is no model's to heal: a
        # rollback took "" for a model and wrote a removal of it.
        if its_own and model:
            self._unhealed.add(model)
        self.revision = max(self.revision, revision)
        return skipped

    def skip_declaration(self, revision: int, reason: str) -> Skipped:
        """Report a declared-config record load cannot read. The layer in
        force from it on is not known, but it is not the one recorded before
        it: :attr:`recorded_declaration` says so, as a read of the config
        recorded then (``--declared-then``) refuses it."""
        self.recorded_declaration = (UNREADABLE_DECLARATION, revision)
        return self.skip(revision, "", CONFIG_DECLARED, reason)

    def commit(self, event: Model.Event, new: ModelSpec | None) -> None:
        """Put an event that was checked into force."""
        self.saw(event.timestamp)
        if event.observation and event.model in self.declared:
            # Configuration is its definition: there is no runtime stream to
            # advance, and a rollback must not take the record for runtime history.
            return
        self._put(event.model, event.originator_version, self.aggregate(event.model).spec, new)

    def _put(self, name: str, version: int, old: ModelSpec | None, new: ModelSpec | None) -> None:
        """Version ``version`` of ``name``'s stream puts ``new`` in place of ``old``."""
        old_fallbacks = old.fallbacks if old is not None else ()
        new_fallbacks = new.fallbacks if new is not None else ()
        if old_fallbacks is not new_fallbacks and old_fallbacks != new_fallbacks:
            if old is not None:
                self._unlink(old)
            if new is not None:
                self._link(new)
        self.aggregates[name] = Model(name, version, new)
        if self._unhealed:  # nearly always empty: the test is cheaper than a discard
            self._unhealed.discard(name)

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
        # A name's second declaration: what is wrong with it is told there,
        # not at the first's field of that name (review).
        place = 1 if spec.name in self.declared else 0
        try:
            check_spec(spec, self.engines)
        except InvalidModel as error:
            raise DeclaredModelError(str(error), spec.name, error.field, place) from None
        if place:
            raise DeclaredModelError(
                f"model {spec.name!r} is declared more than once", spec.name, place=place
            )
        self.declared[spec.name] = spec
        self._link(spec)

    def _check_declared_graph(self) -> None:
        for spec in self.declared.values():
            for target in spec.fallbacks:
                if target not in self.declared:
                    raise DeclaredModelError(
                        f"model {spec.name!r}: fallbacks: names {target!r}, which is not declared",
                        spec.name,
                        "fallbacks",
                    )
        # The first model on a cycle is told, by the path from it back to it
        # that a change to it is told by. Each model searched from in turn, a
        # chain N deep took N²/2 steps: half a second at 2,000, on every start.
        on_cycles = _on_cycles(self.declared)
        for spec in self.declared.values():
            if spec.name in on_cycles:
                cycle = self._cycle_through(spec.name, spec)
                raise DeclaredModelError(
                    f"model {spec.name!r}: fallbacks: form a cycle: {_cycle_text(cycle)}",
                    spec.name,
                    "fallbacks",
                )


# The models a cycle's refusal names before it says how many more it leaves
# out: a cycle through 1,000 models was told in one line of 9 KB.
CYCLE_SHOWN = 5


def _cycle_text(cycle: list[str]) -> str:
    """``a -> b -> c -> a``, the path from a model back to it; of a longer
    one, its first :data:`CYCLE_SHOWN` models, how many more, and back."""
    models = cycle[:-1]
    if len(models) <= CYCLE_SHOWN + 1:  # one left out is said by its name
        return " -> ".join(cycle)
    more = len(models) - CYCLE_SHOWN
    return " -> ".join([*models[:CYCLE_SHOWN], f"… ({more:,} more)", cycle[0]])


def _on_cycles(models: dict[str, ModelSpec]) -> set[str]:
    """The models on a fallback cycle, each of whose fallbacks is one of
    ``models``: those of a strongly connected component of more than one (no
    model is its own fallback), found by Tarjan's algorithm, which follows
    each fallback once. Iterative: a chain may be deeper than Python recurses."""
    order: dict[str, int] = {}  # when each model was reached
    low: dict[str, int] = {}  # the earliest reached, still pending, it leads back to
    pending: list[str] = []  # reached, in no component yet
    is_pending: set[str] = set()
    walk: list[tuple[str, Iterator[str]]] = []  # the path followed, and what is left of each
    found: set[str] = set()

    def reach(name: str) -> None:
        order[name] = low[name] = len(order)
        pending.append(name)
        is_pending.add(name)
        walk.append((name, iter(models[name].fallbacks)))

    for root in models:
        if root not in order:
            reach(root)
        while walk:
            name, targets = walk[-1]
            for target in targets:
                if target not in order:
                    reach(target)
                    break
                if target in is_pending:
                    low[name] = min(low[name], order[target])
            else:
                walk.pop()
                if walk:
                    above = walk[-1][0]
                    low[above] = min(low[above], low[name])
                if low[name] == order[name]:
                    # Its component: those reached from here, still pending.
                    component = [pending.pop()]
                    while component[-1] != name:
                        component.append(pending.pop())
                    is_pending.difference_update(component)
                    if len(component) > 1:
                        found.update(component)
    return found


def _named(skip: Skipped) -> Skipped:
    """A skip as this code names it: a snapshot written before unreadable
    config records were named as readable ones are has ``Declared``."""
    if skip.event == "Declared" and not skip.model:
        return msgspec.structs.replace(skip, event=CONFIG_DECLARED)
    return skip


def _filed_elsewhere(name: str) -> str:
    """Why a record filed in another model's stream is skipped."""
    return f"its aggregate id does not belong to model {name!r}"


def _declared_wins(name: str) -> str:
    """Why a runtime change of a name the config declares is skipped."""
    return f"model {name!r} is declared in configuration, which wins every conflict"


def _hides_nothing(skip: Skipped) -> bool:
    """Whether the skip of a model's latest change hides nothing from the
    catalog in force: a removal of a name the config declares. Without the
    declaration no runtime definition of it would be in force either, so it
    is no change the config keeps out (an add or a scale is: told on every
    load, as the runtime model the declared one hides), only history,
    which ``verify`` and the audit list."""
    return skip.event == Model.Removed.__name__ and skip.reason == _declared_wins(skip.model)
