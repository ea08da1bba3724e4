"""The model definition as it will run: value objects and the rules for one model.

These are the stored form (msgspec structs: immutable, cheap to decode on
replay). Input from people and files is parsed by :mod:`catalog_es.inputs`
first, for its error messages, and then checked here, because a stored event
has to pass the same rules again when the log is replayed over a config that
may have changed since it was written.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import msgspec

from catalog_es.errors import InvalidModel, TurnedOn, shown

DEFAULT_ENGINES: tuple[str, ...] = ("vllm", "sglang", "llamacpp", "tgi")
CLASSES: tuple[str, ...] = ("critical", "standard", "opportunistic")
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
OWNER_PATTERN = re.compile(r"(org|team|project):[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
MAX_SOURCE_LENGTH = 2048
# The largest count a field holds (GPUs, gigabytes, cores, replicas): a 64-bit
# integer's, so that the controller, and anything else reading the catalog's
# JSON into fixed-size integers, can read every number in it.
MAX_COUNT = 2**63 - 1


class Value(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Base of the value objects: immutable, compared by value."""


class Profile(Value, frozen=True):
    """One way a replica can be placed: what it takes of a node."""

    name: str
    gpus: int = 0
    gpu_memory_gb: int = 0
    min_memory_gb: int = 0
    cpu_cores: int = 0

    @property
    def cpu_only(self) -> bool:
        return self.gpus == 0


class Scaling(Value, frozen=True):
    min: int = 1
    max: int = 1


class Adapter(Value, frozen=True):
    """A LoRA adapter served on top of the base weights."""

    name: str
    source: str


class Origin(Value, frozen=True):
    """Where the weights came from: registry repository, commit and checksums."""

    repository: str = ""
    revision: str = ""
    files: dict[str, str] = {}


class ModelSpec(Value, frozen=True):
    """A model in the catalog. Defaults are part of the definition: what is
    stored and what is returned is what will run."""

    name: str
    engine: str
    source: str
    profiles: tuple[Profile, ...]
    scaling: Scaling = Scaling()
    capacity_class: str = msgspec.field(default="", name="class")
    owner: str = ""
    adapters: tuple[Adapter, ...] = ()
    fallbacks: tuple[str, ...] = ()
    origin: Origin | None = None

    @property
    def effective_class(self) -> str:
        return effective_class(self.capacity_class, self.scaling.min)

    def missing_memory(self) -> list[str]:
        """Names of CPU-only profiles that declare no host memory."""
        return profiles_missing_memory(self.profiles)


def profiles_missing_memory(profiles: Iterable[Profile]) -> list[str]:
    """Names of those of ``profiles`` that are CPU-only and declare no host memory."""
    return [p.name for p in profiles if p.cpu_only and p.min_memory_gb <= 0]


def name_warnings(name: str) -> list[str]:
    """What ``model show`` warns of a name with a ``.`` or ``..`` segment
    (``x/../m1``): HTTP clients resolve such segments away before they send
    a path (RFC 3986: curl, browsers), so a request for that model reaches
    another (``m1``), or none, unless the name's slashes are sent as ``%2F``
    (browsers resolve ``%2E%2E`` too). Allowed names all the same (DESIGN's
    rule), and told."""
    if "/." not in name:  # a name starts with a letter or a digit
        return []
    segments = dict.fromkeys(s for s in name.split("/") if s in {".", ".."})
    return [
        f"its name has a {s!r} segment, which HTTP clients resolve away before they send"
        " a path (RFC 3986): over HTTP, send the name with its slashes as %2F"
        for s in segments
    ]


def memory_warnings(missing: Iterable[str]) -> list[str]:
    """What ``model show`` warns of a definition whose CPU-only profiles
    ``missing`` declare no host memory."""
    return [
        f"profile {p!r} runs without a GPU and declares no memory (min_memory_gb)" for p in missing
    ]


def effective_class(capacity_class: str, minimum: int) -> str:
    """The class placement uses: the one set, else what the scaling implies
    (a model allowed to scale to zero is opportunistic by nature)."""
    if capacity_class:
        return capacity_class
    return "standard" if minimum >= 1 else "opportunistic"


def check_name(name: str, *, model: str | None = None, field: str = "name") -> None:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        short = name if isinstance(name, str) and len(name) <= 40 else f"{str(name)[:40]}…"
        # Quoted as shown, cut short as shown: a name of line separators
        # (each "\u2028" written out) made a 466-character line (fuzz test).
        raise InvalidModel(
            model if model is not None else short,
            field,
            f"{shown(short, 40)} is not a valid name: 1-128 characters of A-Z a-z 0-9 . _ : / -, "
            "starting with a letter or digit",
        )


def _check_unique(model: str, field: str, names: Iterable[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InvalidModel(model, field, f"{name!r} appears more than once")
        seen.add(name)


def _check_count(model: str, field: str, value: int) -> None:
    if value < 0:
        raise InvalidModel(model, field, "cannot be negative")
    _check_not_huge(model, field, value)


def _check_not_huge(model: str, field: str, value: int) -> None:
    if value > MAX_COUNT:
        raise InvalidModel(model, field, f"is larger than 2^63 - 1 ({MAX_COUNT})")


_WHITE_SPACE = re.compile(r"\s")


def _check_source(model: str, field: str, source: str) -> None:
    if not source.strip():
        raise InvalidModel(model, field, "must not be empty")
    if len(source) > MAX_SOURCE_LENGTH:
        raise InvalidModel(model, field, f"is longer than {MAX_SOURCE_LENGTH} characters")
    if _WHITE_SPACE.search(source):
        raise InvalidModel(model, field, "must not contain white space")


# One checker per field, so a change is checked only where it can break a
# rule: replaying a million scalings must not re-check a million names.


def _name(spec: ModelSpec, engines: frozenset[str]) -> None:
    check_name(spec.name)


def _engine(spec: ModelSpec, engines: frozenset[str]) -> None:
    if spec.engine not in engines:
        known = ", ".join(sorted(engines))
        raise InvalidModel(
            spec.name,
            "engine",
            f"{shown(spec.engine)} is not a known engine (known: {known})",
            TurnedOn(engine=spec.engine),
        )


def _source(spec: ModelSpec, engines: frozenset[str]) -> None:
    _check_source(spec.name, "source", spec.source)


def _profiles(spec: ModelSpec, engines: frozenset[str]) -> None:
    name = spec.name
    if not spec.profiles:
        raise InvalidModel(name, "profiles", "at least one profile is required")
    for i, p in enumerate(spec.profiles):
        # Tried first, and the field named only when it fails: every load runs
        # this once a model, and naming the fields was most of its time.
        if not (isinstance(p.name, str) and NAME_PATTERN.fullmatch(p.name)):
            check_name(p.name, model=name, field=f"profiles[{i}].name")
        if not (
            0 <= p.gpus <= MAX_COUNT
            and 0 <= p.gpu_memory_gb <= MAX_COUNT
            and 0 <= p.min_memory_gb <= MAX_COUNT
            and 0 <= p.cpu_cores <= MAX_COUNT
        ):
            for field in ("gpus", "gpu_memory_gb", "min_memory_gb", "cpu_cores"):
                _check_count(name, f"profiles[{i}].{field}", getattr(p, field))
    if len(spec.profiles) > 1:
        _check_unique(name, "profiles", (p.name for p in spec.profiles))


def _resources(spec: ModelSpec, engines: frozenset[str]) -> None:
    """The numbers of each profile only: what a change of resources can break."""
    for i, p in enumerate(spec.profiles):
        # Compared first, and the field named only when it fails: this runs on replay.
        if not (0 <= p.min_memory_gb <= MAX_COUNT and 0 <= p.cpu_cores <= MAX_COUNT):
            _check_count(spec.name, f"profiles[{i}].min_memory_gb", p.min_memory_gb)
            _check_count(spec.name, f"profiles[{i}].cpu_cores", p.cpu_cores)


def _scaling(spec: ModelSpec, engines: frozenset[str]) -> None:
    low, high = spec.scaling.min, spec.scaling.max
    if high > MAX_COUNT or low > MAX_COUNT:
        _check_not_huge(spec.name, "scaling.min", low)
        _check_not_huge(spec.name, "scaling.max", high)
    if low < 0 or high < 1 or low > high:
        raise InvalidModel(
            spec.name, "scaling", f"min {low}, max {high}: need 0 <= min <= max and max >= 1"
        )


def _class(spec: ModelSpec, engines: frozenset[str]) -> None:
    if spec.capacity_class and spec.capacity_class not in CLASSES:
        raise InvalidModel(
            spec.name,
            "class",
            f"{shown(spec.capacity_class)} is not one of {', '.join(CLASSES)} (or empty)",
        )


def _owner(spec: ModelSpec, engines: frozenset[str]) -> None:
    if spec.owner and not OWNER_PATTERN.fullmatch(spec.owner):
        raise InvalidModel(
            spec.name,
            "owner",
            f"{shown(spec.owner)} is not org:ID, team:ID or project:ID (or empty); an ID is "
            "1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit",
        )


def _adapters(spec: ModelSpec, engines: frozenset[str]) -> None:
    for i, a in enumerate(spec.adapters):
        check_name(a.name, model=spec.name, field=f"adapters[{i}].name")
        _check_source(spec.name, f"adapters[{i}].source", a.source)
    _check_unique(spec.name, "adapters", (a.name for a in spec.adapters))


def _fallbacks(spec: ModelSpec, engines: frozenset[str]) -> None:
    for i, f in enumerate(spec.fallbacks):
        check_name(f, model=spec.name, field=f"fallbacks[{i}]")
        if f == spec.name:
            raise InvalidModel(spec.name, "fallbacks", "a model cannot be its own fallback")
    _check_unique(spec.name, "fallbacks", spec.fallbacks)


def _origin(spec: ModelSpec, engines: frozenset[str]) -> None:
    if spec.origin is not None:
        for path, digest in spec.origin.files.items():
            if not SHA256_PATTERN.fullmatch(digest):
                raise InvalidModel(
                    spec.name,
                    f"origin.files[{shown(path)}]",
                    "is not a lower-case hex sha256 digest",
                )


_CHECKS: dict[str, Callable[[ModelSpec, frozenset[str]], None]] = {
    "name": _name,
    "engine": _engine,
    "source": _source,
    "profiles": _profiles,
    "resources": _resources,
    "scaling": _scaling,
    "class": _class,
    "owner": _owner,
    "adapters": _adapters,
    "fallbacks": _fallbacks,
    "origin": _origin,
}
EVERY_FIELD: tuple[str, ...] = tuple(_CHECKS)


def check_spec(
    spec: ModelSpec, engines: frozenset[str], fields: tuple[str, ...] = EVERY_FIELD
) -> None:
    """Refuse a model that is malformed on its own, naming the field. ``fields``
    limits the check to what a change touched (the rest was valid already).

    Rules that need the rest of the catalog (collisions, fallbacks) are the
    catalog's; see :class:`catalog_es.catalog.Catalog`.
    """
    for field in fields:
        _CHECKS[field](spec, engines)
