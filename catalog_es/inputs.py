"""Parsing what people and files hand us: model definitions and the declared config.

Pydantic checks shape and types (unknown fields, a string where a number goes)
and words the error; the catalog rules themselves live in
:mod:`catalog_es.spec` and :mod:`catalog_es.catalog`, because stored events must
pass them again on replay. Every failure is one line naming where it is.
"""

from __future__ import annotations

import json
import os
import re
import sys
import unicodedata
from collections.abc import Callable, Sequence
from contextlib import suppress
from datetime import date
from functools import lru_cache
from typing import Annotated, Any, BinaryIO, ClassVar, NoReturn, TypeVar

import msgspec
import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    FailFast,
    Field,
    JsonValue,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_serializer,
    field_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError
from yaml._yaml import CParser

from catalog_es import commands
from catalog_es.configuration import DeclaredConfig as DeclaredConfig  # re-exported
from catalog_es.errors import (
    SHOWN_LENGTH,
    UNSAFE_TEXT,
    ConfigError,
    DeclaredModelError,
    InputError,
    Refused,
    cut_short,
    shown,
)
from catalog_es.spec import (
    DEFAULT_ENGINES,
    NAME_PATTERN,
    Adapter,
    ModelSpec,
    Origin,
    Profile,
    check_name,
    effective_class,
    profiles_missing_memory,
)
from catalog_es.views import definition_warnings

# A model definition is a few hundred bytes; a megabyte is a mistake or an attack.
MAX_INPUT_BYTES = 1 << 20
# The declared config: a hundred thousand models take about a third of this.
MAX_CONFIG_BYTES = 64 << 20
MAX_ACTOR_LENGTH = 128
MAX_REASON_LENGTH = 1000
# A model's name, as the API's schema says it (check_name refuses others, in
# its own words): a client generated from the schema, or a fuzzer, sent any
# text, told nothing until it was refused.
NAME_REGEX = f"^{NAME_PATTERN.pattern}$"
NAME_SCHEMA: dict[str, JsonValue] = {"type": "string", "pattern": NAME_REGEX}


# Letters that show nothing: Hangul fillers, the blank Braille pattern, the
# combining grapheme joiner.
_BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800\u034f")


def _seen(c: str) -> bool:
    """Whether a character shows as something: not a space, a format
    character (a zero-width space, a joiner), a combining mark on its own,
    nor a letter that is blank."""
    return not (c.isspace() or unicodedata.category(c) in ("Cf", "Mn", "Me") or c in _BLANK_LETTERS)


def check_actor(by: str) -> None:
    """An actor's name, as commands record it and tokens stand for it: text,
    as cli.md has it (an emoji's joiners were refused, as Python does not
    call them printable), with nothing a terminal would act on, and
    something to see (zero-width spaces alone named no one; review)."""
    if len(by) > MAX_ACTOR_LENGTH or UNSAFE_TEXT.search(by) or not any(map(_seen, by)):
        raise InputError(
            f"actor {by[:40]!r}: must be 1-{MAX_ACTOR_LENGTH} characters, some of them "
            "visible, and no control or bidi characters"
        )
    # Kept as given, ' alice ' is another actor than the 'alice' an audit
    # filter names: refused rather than trimmed, which would record a name
    # other than the one given.
    if by[0].isspace() or by[-1].isspace():
        raise InputError(
            f"actor {by[:40]!r}: begins or ends with a space, which no one filtering by "
            "the name would match: leave the spaces out"
        )


def check_meta(by: str, reason: str) -> None:
    """Who makes a change and why, as a command records them."""
    check_actor(by)
    # A line break is text in a reason; what else a terminal would act on is not.
    if len(reason) > MAX_REASON_LENGTH or UNSAFE_TEXT.search(reason.replace("\n", " ")):
        raise InputError(
            f"reason: must be at most {MAX_REASON_LENGTH} characters, "
            "and no control or bidi characters but line breaks"
        )
    # None is no reason; one given says something, as an actor must: spaces
    # alone ("$WHY" of a template, blank) were recorded as a reason no one reads.
    if reason and not any(map(_seen, reason)):
        raise InputError("reason: nothing visible in it: say why, or give no reason")


def check_actor_filter(by: str | None) -> None:
    """An actor to look for (``--by`` of the queries): any a log may hold, as
    written (one recorded before :func:`check_actor` held it to its rules
    still reads), but not an empty one, which is no one's: it matched nothing,
    said as if nothing had been done (hostile test)."""
    if by == "":
        raise InputError("by: the actor is empty; give an actor, or no actor filter")


class _Input(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


Item = TypeVar("Item")
# A list is checked up to its first bad item, the one a refusal names: one
# change holding millions of bad profiles made as many error records first
# (60 MB of them took two minutes and 18 GB to refuse).
Items = Annotated[list[Item], FailFast()]


class ProfileInput(_Input):
    name: str
    gpus: int = 0
    gpu_memory_gb: int = 0
    min_memory_gb: int = 0
    cpu_cores: int = 0


class ScalingInput(_Input):
    min: int = 1
    max: int = 1


class AdapterInput(_Input):
    name: str
    source: str


class OriginInput(_Input):
    # null is a field left out, as `model show` prints one (stored as empty
    # text); one given empty is refused at runtime (_recorded), so the schema
    # a client follows says a string has a character.
    repository: str | None = Field(None, json_schema_extra={"minLength": 1})
    revision: str | None = Field(None, json_schema_extra={"minLength": 1})
    files: dict[str, str] = {}

    @field_serializer("repository", "revision")
    def _stored(self, value: str | None) -> str:
        return value or ""  # as the stored form keeps a field left out


# What each of an origin's text fields gives, as `model source` words it.
_ORIGIN_FIELDS = {"repository": "a registry repository (org/name)", "revision": "a commit"}


def _recorded(origin: OriginInput | None) -> OriginInput | None:
    # A field given empty (a template's variable unset: `revision: "$REV"`)
    # is refused, as `model source --revision ''` is: beside another field it
    # recorded an origin in part, and alone no origin, without a word. An
    # origin that says nothing (`origin: {}`) is none: it was stored as one
    # of empty fields, where the CLI's `model source` without them stores none.
    if origin is None:
        return None
    for field, what in _ORIGIN_FIELDS.items():
        if getattr(origin, field) == "":
            raise PydanticCustomError(
                "empty_origin",
                "{field} is empty: give {what}, or leave it out",
                {"field": field, "what": what},
            )
    return None if origin == OriginInput() else origin


MaybeOrigin = Annotated[OriginInput | None, AfterValidator(_recorded)]


# A warning quoted in a refusal: the sentence whole, a profile's name cut short.
WARNING_SHOWN = 160


class ModelInput(_Input):
    name: str = Field(json_schema_extra=NAME_SCHEMA)
    engine: str
    source: str
    profiles: Items[ProfileInput]
    scaling: ScalingInput = ScalingInput()
    capacity_class: str = Field("", alias="class")
    owner: str = ""
    adapters: Items[AdapterInput] = []
    fallbacks: Items[str] = []
    origin: OriginInput | None = None
    # What `model show --json` prints beside the definition, taken back when
    # it says what the definition does: a model shown can be edited and
    # added again (it was refused as unknown fields).
    effective_class: str | None = None
    declared: bool = False
    warnings: list[str] | None = None
    # Whether given warnings must be those this release works out.
    warnings_checked: ClassVar[bool] = True

    @field_validator("effective_class")
    @classmethod
    def _as_worked_out(cls, value: str | None, info: ValidationInfo) -> str | None:
        scaling, set_class = info.data.get("scaling"), info.data.get("capacity_class")
        if value is None or scaling is None or set_class is None:
            return value  # not given, or what it is checked against was refused
        worked_out = effective_class(set_class, scaling.min)
        if value != worked_out:
            raise PydanticCustomError(
                "shown_only",
                "is worked out, not set: this definition's is {worked_out} (class sets it)",
                {"worked_out": repr(worked_out)},
            )
        return value

    @field_validator("declared")
    @classmethod
    def _not_declared(cls, value: bool) -> bool:
        if value:
            raise PydanticCustomError(
                "shown_only",
                "true is what model show says of a model the config declares, which is "
                "changed there; leave declared out",
            )
        return value

    @field_validator("warnings")
    @classmethod
    def _warned_of(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        name, profiles = info.data.get("name"), info.data.get("profiles")
        if value is None or name is None or profiles is None or not cls.warnings_checked:
            return value  # not given, or what it is checked against was refused
        missing = profiles_missing_memory(
            msgspec.convert([p.model_dump() for p in profiles], list[Profile])
        )
        worked_out = definition_warnings(missing, name, _origin(info.data.get("origin")))
        if value != worked_out:
            # One warning a CPU-only profile: quoted the first of them, not
            # each of a definition's thousands; whole, but for a long name.
            first = cut_short(worked_out[0], WARNING_SHOWN) if worked_out else ""
            has = {0: "none", 1: f"1: {first}"}.get(len(worked_out))
            raise PydanticCustomError(
                "shown_only",
                "are worked out, not set: this definition has {has}",
                {"has": has or f"{len(worked_out):,}, the first: {first}"},
            )
        return value

    def to_spec(self) -> ModelSpec:
        shown_only = {"effective_class", "declared", "warnings"}
        return msgspec.convert(self.model_dump(by_alias=True, exclude=shown_only), ModelSpec)


class RuntimeModelInput(ModelInput):
    """A model added at runtime. Only there is an origin that says nothing
    none: a declared one is kept as written, or an unchanged config would
    have a new fingerprint, and nodes of two releases would take turns
    recording it."""

    origin: MaybeOrigin = None


class DeclaredModelInput(ModelInput):
    """A model of the config file, whose ``warnings``, pasted from ``model
    show``, are not held to this release's: another release words them
    otherwise, or warns of more (a branch as a declared origin's revision,
    since 0.3.0), and a config that loaded must not stop every node after an
    upgrade. A model added at runtime is refused with what they should be."""

    warnings_checked = False


class ConfigInput(_Input):
    engines: list[str] | None = None
    # Said even when empty: a file cut short after its engines declared
    # nothing, and every declared model went out of force.
    models: Items[DeclaredModelInput]


def _checked_engines(engines: list[str] | None) -> tuple[str, ...]:
    """The config's engines (the defaults when it names none), or why not: at
    least one (with none, every runtime model would be skipped on load), each
    a name a model can give (no space, nothing a terminal acts on), once (as
    a model's profile and adapter names are: a name twice is a slip, a merge
    gone wrong, that the reviewers should see)."""
    if engines is None:
        return DEFAULT_ENGINES
    if not engines:
        raise InputError("engines: at least one is needed (leave it out for the defaults)")
    seen: set[str] = set()
    for i, engine in enumerate(engines):
        if not (0 < len(engine) <= 128 and engine.isprintable()) or " " in engine:
            raise InputError(
                f"engines[{i}]: {shown(engine)} is not an engine name "
                "(1-128 printable characters, no space)"
            )
        if engine in seen:
            raise InputError(f"engines[{i}]: {shown(engine)} appears more than once")
        seen.add(engine)
    return tuple(engines)


def _location(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and len(part) <= SHOWN_LENGTH:
            out += f".{part}" if out else part
        else:
            # An unknown key is the sender's text: quoted and cut short, so a
            # line break or a terminal escape in it cannot break the one line,
            # nor a key like "a[0].b" pass for a path.
            out += f"[{shown(part)}]"
    return out


def _got(value: Any) -> str:
    """A value refused, as a YAML or JSON file spells it (``null``, not
    Python's ``None``; a list or a mapping by its kind, not all of it)."""
    if isinstance(value, dict | list):
        return type(value).__name__
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return cut_short(repr(value), 40)


def expected(what: str, value: Any) -> str:
    """``value`` refused for not being ``what``, as every input says it: a
    definition, a list of changes, the config, the tokens file, a body."""
    return f"expected {what} (got {_got(value)})"


def empty_document(where: str, content: str, instead: str) -> InputError:
    """A document with nothing in it (no byte, only whitespace, only
    comments or bare document markers, ``---`` and ``...``), as every input
    says it: which one, and what to give ``instead``. YAML reads it as null,
    and each input told that otherwise, a definition as a null it was never
    given ("got null")."""
    if not content:
        held = ""
    elif content.isspace():
        held = " but for whitespace"
    elif "#" in content:
        held = " but for comments"
    else:
        held = " but for " + " and ".join(f"`{m}`" for m in _DOCUMENT_MARKERS if m in content)
    return InputError(f"{where}: empty{held}: {instead}")


# A document's start and end, all an empty document may hold but comments.
_DOCUMENT_MARKERS = ("---", "...")


def _problem(error: ErrorDetails) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown field"
    if error["type"] == "missing":
        return "required field is missing"
    if error["type"] == "empty_origin":
        return error["msg"]  # names the field given empty: "(got dict)" says nothing more
    value = error.get("input")
    if isinstance(value, date):  # a datetime too
        # As written, not datetime.date(2026, 1, 1): YAML took unquoted text for one.
        quote = ": quote it" if error["type"] == "string_type" else ""
        return f"{error['msg']} (got {value.isoformat()}, which YAML reads as a date{quote})"
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and error["type"] == "string_type":
        # A short commit id or a numeric name, unquoted: YAML and JSON read a number.
        return f'{error["msg"]} (got {value!r}, a number: write it quoted, "{value!r}")'
    if error["type"] == "model_type":
        # pydantic's message names this module's class, which says nothing to an operator.
        return expected("a mapping of fields", value)
    return f"{error['msg']} (got {_got(value)})"


def one_of(what: str) -> WrapValidator:
    """For a field of several types (``int | str``): a value of none is one
    problem, saying ``what`` the field takes. pydantic has one for each type,
    placed under the type's name (``to.int``), and a line tells the first."""

    def checked(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("one_of", "expected {what}", {"what": what}) from None

    return WrapValidator(checked)


def describe(error: ValidationError, prefix: tuple[int | str, ...] = (), *, at: str = "") -> str:
    """A pydantic error as one line: the first problem (``at``: where it is in
    the text, ``(line L, column C)``) and how many more there are."""
    return describe_problems(error.errors(), prefix, at=at)


def describe_problems(
    problems: Sequence[ErrorDetails], prefix: tuple[int | str, ...] = (), *, at: str = ""
) -> str:
    """``describe`` for a list of pydantic error dicts (what a web framework
    hands over once it has validated a query string)."""
    first = problems[0]
    # The whole document of the wrong kind is said as every input says it, no place named.
    location = _location(prefix + tuple(first["loc"]))
    line = f"{location}: {_problem(first)}" if location else _problem(first)
    if at:
        line += f" {at}"
    if len(problems) > 1:
        line += f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
    return line


# -- YAML and JSON ---------------------------------------------------------------


class _StrictLoader(
    yaml.composer.Composer, CParser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver
):
    """YAML that refuses duplicate keys rather than keeping the last silently.

    Scanned and parsed by libyaml: an ``apply`` file of 70,000 changes (5 MB)
    is read in 10.7 s rather than 23.4 s with PyYAML's own scanner (JSON:
    2 s). Composed in Python, so that input is held to what
    :class:`_InputLoader` allows while its nodes are made."""

    def __init__(self, stream: str) -> None:
        CParser.__init__(self, stream)
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # One of YAML's own tags on another kind of node (`!!map abc`) was
        # told in Python's words (not enough values to unpack), or as a
        # traceback's last line: said here, with the tag and where it is.
        wanted = _NODE_KIND.get(node.tag)
        if wanted is not None and not isinstance(node, wanted):
            tag = node.tag.replace(_CORE_TAG, "!!")
            problem = f"{tag} is for a {_KIND_NAME[wanted]}, not a {_KIND_NAME[type(node)]}"
            raise _NotAccepted(None, None, problem, node.start_mark)
        return super().construct_object(node, deep)


class _NotAccepted(yaml.MarkedYAMLError):
    """YAML that parses, refused by what this reader takes (a duplicate key, a
    number two YAML versions read differently, an alias in runtime input):
    said as it is, and never as a JSON error, though the text looked like JSON."""


_CORE_TAG = "tag:yaml.org,2002:"
_NULL_TAG = f"{_CORE_TAG}null"
_MERGE_TAG = f"{_CORE_TAG}merge"
_KIND_NAME = {yaml.ScalarNode: "scalar", yaml.SequenceNode: "sequence", yaml.MappingNode: "mapping"}
# The kind of node each tag the loader makes is for.
_NODE_KIND = {
    _CORE_TAG + name: kind
    for kind, names in (
        (yaml.ScalarNode, ("str", "int", "float", "bool", "null", "binary", "timestamp")),
        (yaml.SequenceNode, ("seq", "omap", "pairs")),
        (yaml.MappingNode, ("map", "set")),
    )
    for name in names
}


def _mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    # Merged keys (``<<: *shared``) come first once flattened, and the
    # mapping's own keys override them, as YAML has it: only a key written
    # twice in the mapping itself is a duplicate.
    own = sum(1 for key_node, _ in node.value if key_node.tag != _MERGE_TAG)
    loader.flatten_mapping(node)
    first_own = len(node.value) - own
    result: dict[Any, Any] = {}
    own_keys: set[Any] = set()
    for position, (key_node, value_node) in enumerate(node.value):
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str | int | float | bool) and key is not None:
            raise _NotAccepted(
                None, None, "a mapping key must be a plain value", key_node.start_mark
            )
        if position >= first_own:
            if key in own_keys:
                raise _NotAccepted(None, None, f"duplicate key {shown(key)}", key_node.start_mark)
            own_keys.add(key)
        result[key] = loader.construct_object(value_node, deep=True)
    return result


# YAML 1.1, which PyYAML reads, takes 010 for eight (octal), 1:30 for ninety
# (base 60), 1_0 for ten and 0b11 for three, where YAML 1.2 and a reviewer take
# 010 for ten and the others for text: eight GPUs read from a file that says
# ten look right to everyone.
# Neither reading is guessed; such a number is refused, saying how to write it.
_LEADING_ZERO = re.compile(r"[-+]?0[0-9_]+")
_BASE_60 = re.compile(r"[-+]?[1-9][0-9_]*(:[0-5]?[0-9])+")
_BINARY = re.compile(r"[-+]?0b[01_]+")
_WRITE_IT = "write a number in decimal, or quote text"


def _int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    limit = sys.get_int_max_str_digits()
    too_long = f"{shown(text)} is a number of more than {limit} digits"
    try:
        # ASCII only: int() reads any script's digits (an explicit !!int "١٢").
        if not text.isascii():
            raise ValueError(text)
        problem = _ambiguity(text)
        if problem is not None:
            raise _NotAccepted(None, None, f"{shown(text)} {problem}: {_WRITE_IT}", node.start_mark)
        value: int = loader.construct_yaml_int(node)
    except (ValueError, IndexError) as error:  # !!int "", !!int abc: PyYAML's own
        said = (
            too_long
            if _TOO_MANY_DIGITS.search(str(error))
            else f"{shown(text)} is not a whole number"
        )
        raise _NotAccepted(None, None, said, node.start_mark) from None
    # Hexadecimal and binary are read at any length, and such a number could
    # not be printed, nor quoted back in a refusal.
    if limit and abs(value) >= _smallest_too_long(limit):
        raise _NotAccepted(None, None, too_long, node.start_mark)
    return value


def _ambiguity(text: str) -> str | None:
    """How YAML 1.1 reads ``text`` otherwise than YAML 1.2 and a reviewer, if it does."""
    if _BASE_60.fullmatch(text):
        return "is a base-60 number in YAML 1.1 (1:30 is 90)"
    if "_" in text:
        # A slip (max: 1_0) as often as a separator, and text to YAML 1.2.
        return "has an underscore, which YAML 1.1 reads past (1_0 is 10)"
    if _BINARY.fullmatch(text):
        return "is a binary number in YAML 1.1 (0b11 is 3)"
    if not _LEADING_ZERO.fullmatch(text):
        return None
    digits = text.replace("_", "").lstrip("+-")
    decimal = int(digits, 10)
    try:
        octal = int(digits, 8)
    except ValueError:  # 08, 09: no octal number, and not the decimal one either
        return "has a leading zero, which YAML 1.1 reads as octal"
    if octal == decimal:
        return None
    return f"has a leading zero, which YAML 1.1 reads as octal ({digits} is {octal})"


@lru_cache(maxsize=4)
def _smallest_too_long(limit: int) -> int:
    """The smallest number of more than ``limit`` digits."""
    smallest: int = 10**limit
    return smallest


_StrictLoader.add_constructor(  # type: ignore[type-var]  # the stubs know only PyYAML's loaders
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping
)
_StrictLoader.add_constructor(f"{_CORE_TAG}int", _int)  # type: ignore[type-var]

_NULLS = ("", "~", "null", "Null", "NULL")


def _scalar_read_as(
    what: str, construct: Callable[[Any, yaml.ScalarNode], Any], *, plain: tuple[str, ...] = ()
) -> Callable[[_StrictLoader, yaml.ScalarNode], Any]:
    """A constructor of YAML's that refuses text its tag cannot read, saying
    so and where: ``!!bool maybe`` and ``!!timestamp abc`` were Python's own
    errors (a KeyError, an AttributeError), ``!!float x`` said no place, and
    ``!!null abc`` was read as null, its text dropped. ``plain``: the only
    texts the tag takes, where its constructor reads any. (``!!float`` of
    no text at all raised an IndexError of its own.)"""

    def checked(loader: _StrictLoader, node: yaml.ScalarNode) -> Any:
        text = loader.construct_scalar(node)
        if not plain or text in plain:
            with suppress(ValueError, KeyError, AttributeError, IndexError):
                return construct(loader, node)
        raise _NotAccepted(None, None, f"{shown(text)} is not {what}", node.start_mark)

    return checked


_YAML_OWN = yaml.constructor.SafeConstructor
_SCALARS_READ_AS = {
    "bool": _scalar_read_as("true or false", _YAML_OWN.construct_yaml_bool),
    "float": _scalar_read_as("a number", _YAML_OWN.construct_yaml_float),
    "timestamp": _scalar_read_as("a date or a time", _YAML_OWN.construct_yaml_timestamp),
    "null": _scalar_read_as("null", _YAML_OWN.construct_yaml_null, plain=_NULLS),
}
for _name, _constructor in _SCALARS_READ_AS.items():
    _StrictLoader.add_constructor(_CORE_TAG + _name, _constructor)  # type: ignore[type-var]


# Far deeper than a definition or a list of changes goes (seven levels or so),
# and shallow enough that composing, which recurses in Python, stays far from
# the recursion limit. (PyYAML's own scanner also slowed with the square of
# the depth of ``[[[…``: half a second for a few kilobytes of it.)
MAX_DEPTH = 64
# No list in runtime input is longer than an apply's list of changes may be:
# a longer one is refused as it is read, not after gigabytes of it are built
# (60 MB of "- remove: a" took 214 s and 7 GB before its count was checked).
MAX_ITEMS = 100_000


# The tag of a node already made into its value (:class:`_InputLoader`).
_BUILT_TAG = "tag:catalog-es,2026:built"
# A key (or list item) with nothing after it: YAML reads it as null, a field
# left out, so `revision: $REV` with REV unset recorded an origin in part, and
# `owner: $OWNER` would have shared a model, without a word. The surprising
# reading is the dangerous one: it is refused, `null` and `~` leave a field out.
_BLANK_TAG = "tag:catalog-es,2026:blank"


class _InputLoader(_StrictLoader):
    """For runtime input: no aliases either, so nothing can expand into a bomb,
    no deeper than ``MAX_DEPTH`` and no list longer than ``MAX_ITEMS``.

    Each list and mapping is made into its value as soon as it is read, and
    its nodes let go: PyYAML reads a whole document into nodes before it
    makes any of it, a few hundred bytes a value (two marks each), and an
    ``apply`` of short lists (``- [0,0,0,…]``), within every bound above,
    took 175 MB a megabyte, 14 GB for the 64 MiB an ``apply`` may send
    (hostile test). With nothing shared (no aliases), nothing is lost."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.AliasEvent):
            self._refuse("aliases (*name) are not accepted in a definition or a list of changes")
        if self._depth >= MAX_DEPTH:
            self._refuse(f"nested too deeply (more than {MAX_DEPTH} levels)")
        if isinstance(index, int) and index >= MAX_ITEMS:  # an item of a list
            self._refuse(f"a list of more than {MAX_ITEMS} items")
        if isinstance(index, yaml.ScalarNode) and index.tag == _MERGE_TAG:
            # Merged from what? Without aliases, only a mapping written in place.
            self._refuse("merge keys (<<) are not accepted in a definition or a list of changes")
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if parent is None and node is not None and node.tag == _BLANK_TAG:
            node.tag = _NULL_TAG  # a document of nothing: as an empty file
        if not isinstance(node, yaml.CollectionNode) or _made_by_its_parent(parent):
            return node
        return yaml.ScalarNode(
            _BUILT_TAG, self.construct_document(node), node.start_mark, node.end_mark
        )

    def _refuse(self, problem: str) -> NoReturn:
        mark = getattr(self.peek_event(), "start_mark", None)
        raise _NotAccepted(None, None, problem, mark)

    def resolve(self, kind: type[yaml.Node], value: str, implicit: tuple[bool, bool]) -> str:
        if kind is yaml.ScalarNode and value == "" and implicit[0]:
            return _BLANK_TAG
        tag: str = super().resolve(kind, value, implicit)  # type: ignore[no-untyped-call]
        return tag


# An ordered map's or a list of pairs' items, each a mapping of one key, are
# made by their list from their nodes: made already, they would be refused
# as "expected a mapping of length 1, but found scalar".
_MADE_FROM_NODES = ("tag:yaml.org,2002:omap", "tag:yaml.org,2002:pairs")


def _made_by_its_parent(parent: Any) -> bool:
    return isinstance(parent, yaml.SequenceNode) and parent.tag in _MADE_FROM_NODES


def _built(_loader: _InputLoader, node: yaml.ScalarNode) -> Any:
    return node.value  # made as it was read


_InputLoader.add_constructor(_BUILT_TAG, _built)  # type: ignore[type-var]  # as above


def _blank(_loader: _InputLoader, node: yaml.ScalarNode) -> NoReturn:
    problem = "nothing is written where a value goes: give one, or null to leave it out"
    raise _NotAccepted(None, None, problem, node.start_mark)


_InputLoader.add_constructor(_BLANK_TAG, _blank)  # type: ignore[type-var]  # as above


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {shown(key)}")
        result[key] = value
    return result


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a number")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_surrogates(data: Any, where: str) -> None:
    """Refuse text that is not Unicode: JSON's and YAML's ``\\ud800`` escapes make
    lone surrogates, which no UTF-8 encodes, so they could never be stored."""
    stack, seen = [data], set()
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise InputError(
                    f"{where}: {shown(item)} holds a lone surrogate, which is not Unicode text"
                )
        elif isinstance(item, dict | list) and id(item) not in seen:
            # By identity: a trusted config's aliases share, or even contain, themselves.
            seen.add(id(item))
            stack.extend([*item.keys(), *item.values()] if isinstance(item, dict) else item)


class _NoDocument(Exception):
    """YAML that holds no document: comments alone, or document markers and
    nothing."""


# A line of a document that holds none: blank, a comment (after spaces or
# tabs), or a document's start or end marker (a comment may follow it).
_NOTHING_WRITTEN = re.compile(r"(?:---|\.\.\.)(?:[ \t]+(?:#.*)?)?|[ \t]*(?:#.*)?")
# What YAML breaks lines at.
_LINE_BREAK = re.compile(r"\r\n|[\r\n\x85\u2028\u2029]")


def _nothing_written(text: str) -> bool:
    """Whether ``text`` holds no document, only blank lines, comments and
    document markers: asked of YAML libyaml refused, which refuses a tab
    before a comment, or on a blank line, where a token could start (YAML
    allows it there, as white space), and a document end before any
    document (``...`` alone), a stream YAML 1.2 reads as holding no document."""
    return all(_NOTHING_WRITTEN.fullmatch(line) for line in _LINE_BREAK.split(text))


def _load(text: str, loader_class: type[_StrictLoader]) -> Any:
    loader = loader_class(text)
    try:
        try:
            node = loader.get_single_node()
        except (yaml.parser.ParserError, yaml.scanner.ScannerError):
            if _nothing_written(text):
                raise _NoDocument from None
            raise
        # Nothing written where the document is: a null given with a tag
        # (`!!null`) or an anchor alone (`&a`) spans what was written, and
        # is a null, as `~` is.
        blank = node is not None and node.start_mark.index == node.end_mark.index
        if node is None or (blank and node.tag == _NULL_TAG):
            raise _NoDocument
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_document(
    text: str, where: str, *, instead: str, untrusted: bool = True, limit: int = MAX_INPUT_BYTES
) -> Any:
    """YAML or JSON to plain data. Text that starts like JSON is read as JSON
    (stricter: no NaN); if it is not JSON, as YAML, whose flow style looks the
    same (``{name: m, …}``), and a failure then is worded as JSON's. A
    document with nothing in it is refused, saying what to give ``instead``."""
    if untrusted and len(text.encode("utf-8", "surrogatepass")) > limit:
        raise InputError(f"{where}: larger than {limit // 1024} KiB")
    loader = _InputLoader if untrusted else _StrictLoader
    # A byte order mark says nothing about the format: JSON with one is JSON.
    # Nor do two (a tool adding one to a file that had one).
    text = text.lstrip("\ufeff")
    stripped = text.lstrip()
    if not stripped:
        # Before YAML, which refuses some of Python's white space as text (a
        # no-break space) or as a control character (a form feed).
        raise empty_document(where, text, instead)
    try:
        if stripped[:1] in ("{", "["):
            try:
                data = json.loads(
                    stripped, object_pairs_hook=_no_duplicates, parse_constant=_no_constant
                )
            except json.JSONDecodeError as not_json:
                try:
                    data = _load(text, loader)
                except _NotAccepted:
                    raise
                except yaml.YAMLError:
                    raise not_json from None
        else:
            data = _load(text, loader)
    except json.JSONDecodeError as error:
        raise InputError(
            f"{where}: not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})"
        ) from None
    except yaml.YAMLError as error:
        said = "" if isinstance(error, _NotAccepted) else "not valid YAML: "
        raise InputError(f"{where}: {said}{_yaml_problem(error)}") from None
    except (ValueError, RecursionError) as error:
        problem = "nested too deeply" if isinstance(error, RecursionError) else _worded(error)
        raise InputError(f"{where}: {problem}") from None
    except _NoDocument:
        raise empty_document(where, text, instead) from None
    _refuse_surrogates(data, where)
    return data


def _yaml_problem(error: yaml.YAMLError) -> str:
    """What went wrong and where, on one line: libyaml says some of it as a
    context (``expected a single document in the stream``) and the rest as
    the problem (``but found another document``), each with its own place."""
    if not isinstance(error, yaml.MarkedYAMLError):
        return str(error).splitlines()[0]
    parts = []
    for text, mark in ((error.context, error.context_mark), (error.problem, error.problem_mark)):
        if text:
            at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            parts.append(f"{text}{at}")
    return ", ".join(parts) or str(error).splitlines()[0]


# Python's own refusal of a huge number names the call that lifts its limit,
# which is no advice for someone writing a file.
_TOO_MANY_DIGITS = re.compile(r"Exceeds the limit \((\d+) digits\).*value has (\d+) digits")


def _worded(error: ValueError) -> str:
    found = _TOO_MANY_DIGITS.search(str(error))
    if found is None:
        return str(error)
    limit, digits = found.groups()
    return f"holds a number of {digits} digits; a number may have at most {limit} digits"


def read_at_most(file: BinaryIO, limit: int) -> bytes | None:
    """What ``file`` holds, or ``None`` if that is more than ``limit`` bytes:
    read a megabyte at a time, since one ``read(limit)`` takes ``limit`` of
    memory at once, and a path to a device or a runaway file has no end."""
    chunks, size = [], 0
    while chunk := file.read(min(1 << 20, limit + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return None
    return b"".join(chunks)


def open_to_read(path: str) -> BinaryIO:
    """``path`` opened to read without waiting for a writer: opening a pipe
    (a FIFO) waits for one, and with none every command waited for good.
    Read, a pipe nothing writes to is empty; one with a writer (``<(…)``) is
    read as it comes."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except OSError:
        # A folder opens, and is refused here: Python closes only the
        # descriptors it opened itself (review).
        os.close(descriptor)
        raise


def read_text(path: str, limit: int = MAX_INPUT_BYTES) -> tuple[str, str]:
    """The text of a file, or of standard input for ``-``, and how to name it."""
    if not path:  # a variable left unset ("$FILE"): not the working directory
        raise InputError("FILE is empty: give a file's path, or - for standard input")
    if path == "-":
        where = "standard input"
        if sys.stdin is None:  # started with it closed (`<&-`)
            raise InputError(f"{where}: closed, there is nothing to read")
        data = read_at_most(sys.stdin.buffer, limit)
    else:
        # Named as given, unless that would break the message's one line.
        where = path if path.isprintable() else shown(path)
        try:
            with open_to_read(path) as f:
                data = read_at_most(f, limit)
        except OSError as error:
            raise InputError(f"{where}: {error.strerror or error}") from None
        except (ValueError, UnicodeEncodeError):
            # A NUL, or a lone surrogate no file name can hold.
            raise InputError(f"{where}: not a file name") from None
    if data is None:
        raise InputError(f"{where}: larger than {limit // 1024} KiB")
    try:
        return data.decode("utf-8"), where
    except UnicodeDecodeError:
        raise InputError(f"{where}: not UTF-8 text") from None


def model_from_data(data: Any, where: str) -> ModelSpec:
    try:
        return RuntimeModelInput.model_validate(data).to_spec()
    except ValidationError as error:
        raise InputError(f"{where}: {describe(error)}") from None


# What to give in place of an empty file.
GIVE_A_DEFINITION = "give a model definition (YAML or JSON)"
GIVE_CHANGES = "give a list of changes (YAML or JSON)"
DECLARE_NONE = "to declare no models, write `models: []`"


def read_model(path: str) -> ModelSpec:
    """A model definition from a YAML or JSON file, or ``-`` for standard input."""
    text, where = read_text(path)
    return model_from_data(parse_document(text, where, instead=GIVE_A_DEFINITION), where)


# -- the declared config -----------------------------------------------------------


def _named(data: Any, error: ValidationError) -> str:
    """``model 'x': `` when the first problem is inside a model that has a name."""
    loc = error.errors()[0]["loc"]
    if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int) and isinstance(data, dict):
        models = data.get("models")
        entry = models[loc[1]] if isinstance(models, list) and loc[1] < len(models) else None
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            return f"model {entry['name'][:40]!r}: "
    return ""


class _PlacingLoader(_StrictLoader):
    """:class:`_StrictLoader`, noting where each list item written as an
    alias (``- *base``) stands: YAML composes an alias into the node it
    names, whose place is its anchor's, so a second declaration of a name
    written so was told at the first's line (review)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        # (id of the list's node, the item's index) -> the alias written there.
        self.aliases: dict[tuple[int, int], yaml.Event] = {}

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        alias = self.peek_event() if self.check_event(yaml.AliasEvent) else None
        node = super().compose_node(parent, index)
        if alias is not None and isinstance(index, int):
            self.aliases[id(parent), index] = alias
        return node


def _place(text: str, loc: tuple[int | str, ...]) -> str:
    """``(line L, column C)`` of what ``loc`` names in the YAML ``text``: a
    field's key, a list's item; as far as the text holds its path (a field
    missing, or merged in with ``<<``: the mapping that lacks it), "" for
    none of it. Composed again, only for a refusal: the data kept no places."""
    loader = _PlacingLoader(text)
    try:
        node = loader.get_single_node()
    finally:
        loader.dispose()
    mark = None
    for part in loc:
        if isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                break
            alias = loader.aliases.get((id(node), part))
            node = node.value[part]
            mark = node.start_mark if alias is None else alias.start_mark
        elif isinstance(node, yaml.MappingNode):
            found = next(((k, v) for k, v in node.value if k.value == part), None)
            if found is None:
                # A field missing is told where the mapping that lacks it begins.
                mark = node.start_mark
                break
            mark, node = found[0].start_mark, found[1]
        else:
            break
    return "" if mark is None else f"(line {mark.line + 1}, column {mark.column + 1})"


def load_config(path: str | None) -> DeclaredConfig:
    """The declared config from a YAML file; no file means nothing declared,
    and none given."""
    if path is None:
        return DeclaredConfig(given=False)
    try:
        # Reviewed YAML, trusted but not unbounded.
        with open_to_read(path) as file:
            raw = read_at_most(file, MAX_CONFIG_BYTES)
        if raw is None:
            raise ConfigError(f"{path}: the config is larger than {MAX_CONFIG_BYTES >> 20} MiB")
        text = raw.decode("utf-8")
    except OSError as error:
        # In the words a definition's file is refused in, not Python's
        # ("[Errno 21] Is a directory: 'conf'").
        raise ConfigError(f"{path}: cannot read the config: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: cannot read the config: not UTF-8 text") from None
    try:
        # An empty file is more often a deploy cut short than a decision: read
        # as declaring nothing, it took every declared model out of force.
        data = parse_document(text, path, instead=DECLARE_NONE, untrusted=False)
    except InputError as error:
        raise ConfigError(str(error)) from None
    if isinstance(data, dict) and "models" not in data:
        # Optional before 0.2.0: a config of engines alone declared nothing.
        raise ConfigError(f"{path}: no `models:`; {DECLARE_NONE}")
    try:
        parsed = ConfigInput.model_validate(data)
    except ValidationError as error:
        at = _place(text, error.errors()[0]["loc"])
        raise ConfigError(f"{path}: {_named(data, error)}{describe(error, at=at)}") from None
    try:
        engines = _checked_engines(parsed.engines)
    except InputError as error:
        raise ConfigError(f"{path}: {error}") from None
    config = DeclaredConfig(
        models=tuple(m.to_spec() for m in parsed.models), engines=engines, path=path
    )
    try:
        # Checked here, where the text tells where a refusal is; the service
        # starts from the layer checked, not checking it again.
        config.check()
    except DeclaredModelError as error:
        named = [i for i, model in enumerate(config.models) if model.name == error.model]
        loc = ("models", named[error.place], *_field_path(error.field))
        raise ConfigError(f"{path}: {error} {_place(text, loc)}".rstrip()) from None
    return config


def _field_path(field: str) -> list[int | str]:
    """``profiles[0].gpus`` as the parts of a path: ``["profiles", 0, "gpus"]``."""
    return [int(part[1:-1]) if part[0] == "[" else part for part in _FIELD_PARTS.findall(field)]


_FIELD_PARTS = re.compile(r"\[\d+\]|[^.\[\]]+")


# -- a list of changes (``catalog-es apply``) ------------------------------------------


# What each change sets (also the HTTP request bodies, where the name is in
# the path), and the same with the model's name, as an ``apply`` file lists it.


class _Named(_Input):
    name: str = Field(json_schema_extra=NAME_SCHEMA)


class ScaleFields(_Input):
    min: int | None = None
    max: int | None = None


class ResourcesFields(_Input):
    profile: str | None = None
    memory_gb: int | None = None
    cpu_cores: int | None = None


class ClassFields(_Input):
    capacity_class: str = Field(alias="class")


class OwnerFields(_Input):
    owner: str


class AdaptersFields(_Input):
    adapters: Items[AdapterInput]

    def to_adapters(self) -> tuple[Adapter, ...]:
        return tuple(Adapter(a.name, a.source) for a in self.adapters)


class SourceFields(_Input):
    source: str
    origin: MaybeOrigin = None

    def to_origin(self) -> Origin | None:
        return _origin(self.origin)


# The name first, so a change without one says so before anything else.
class ScaleChange(ScaleFields, _Named):
    pass


class ResourcesChange(ResourcesFields, _Named):
    pass


class ClassChange(ClassFields, _Named):
    pass


class OwnerChange(OwnerFields, _Named):
    pass


class AdaptersChange(AdaptersFields, _Named):
    pass


class SourceChange(SourceFields, _Named):
    pass


def _origin(value: OriginInput | None) -> Origin | None:
    return None if value is None else msgspec.convert(value.model_dump(), Origin)


def _step(kind: str, value: Any) -> commands.Step:
    if kind == "add":
        return commands.add(RuntimeModelInput.model_validate(value).to_spec())
    if kind == "remove":
        # The name alone, or named as every other change names its model.
        if isinstance(value, dict):
            return commands.remove(_Named.model_validate(value).name)
        if not isinstance(value, str):
            raise InputError("remove: give the model's name, or {name: NAME}")
        return commands.remove(value)
    if kind == "scale":
        s = ScaleChange.model_validate(value)
        return commands.scale(s.name, s.min, s.max)
    if kind == "resources":
        r = ResourcesChange.model_validate(value)
        return commands.resources(r.name, r.profile, r.memory_gb, r.cpu_cores)
    if kind == "class":
        c = ClassChange.model_validate(value)
        return commands.capacity_class(c.name, c.capacity_class)
    if kind == "owner":
        o = OwnerChange.model_validate(value)
        return commands.owner(o.name, o.owner)
    if kind == "adapters":
        a = AdaptersChange.model_validate(value)
        return commands.adapters(a.name, a.to_adapters())
    s2 = SourceChange.model_validate(value)
    return commands.source(s2.name, s2.source, s2.to_origin())


CHANGE_KINDS = ("add", "remove", "scale", "resources", "class", "owner", "adapters", "source")
MAX_CHANGES = MAX_ITEMS
MAX_CHANGES_BYTES = 64 * MAX_INPUT_BYTES
_TOO_MANY_CHANGES = f"more than {MAX_CHANGES} changes in one apply"


def read_changes(path: str) -> list[commands.Step]:
    """A list of changes from YAML or JSON: each item one key, the kind of
    change (``add``, ``remove``, ``scale``…), holding what it takes."""
    text, where = read_text(path, limit=MAX_CHANGES_BYTES)
    return changes_from_data(parse_changes(text, where, instead=GIVE_CHANGES), where)


# A JSON list of changes, counted before it is parsed: json.loads, which can
# refuse a duplicate key, took 12 s and 1.2 GB to build 60 MB of changes only
# for the count to refuse them; counting them as they stand takes 0.2 s.
# (YAML is refused at the item past the limit, as it is read.)
_JSON_CHANGES = msgspec.json.Decoder(list[msgspec.Raw] | dict[str, list[msgspec.Raw]])


def parse_changes(text: str, where: str, *, instead: str, limit: int = MAX_CHANGES_BYTES) -> Any:
    """``parse_document`` for a list of changes, or ``{"changes": [...]}``."""
    try:
        found = _JSON_CHANGES.decode(text.removeprefix("\ufeff"))
    except (msgspec.MsgspecError, RecursionError):
        pass  # YAML, not a list of changes, or nested too deeply: parsing says which
    else:
        changes = found.get("changes", ()) if isinstance(found, dict) else found
        if len(changes) > MAX_CHANGES:
            raise InputError(f"{where}: {_TOO_MANY_CHANGES}")
    return parse_document(text, where, instead=instead, limit=limit)


def changes_from_data(data: Any, where: str) -> list[commands.Step]:
    """``read_changes`` on data already parsed (an HTTP request body)."""
    if isinstance(data, dict) and "changes" in data:
        others = sorted(map(str, set(data) - {"changes"}))
        if others:
            raise InputError(
                f"{where}: {shown(others[0])} beside 'changes': the list of changes comes alone"
            )
        data = data["changes"]
    if not isinstance(data, list):
        raise InputError(f"{where}: {expected('a list of changes', data)}")
    if not data:
        raise InputError(f"{where}: the list of changes is empty: give at least one change")
    if len(data) > MAX_CHANGES:
        raise InputError(f"{where}: {_TOO_MANY_CHANGES}")
    steps = []
    for number, item in enumerate(data, start=1):
        if not isinstance(item, dict) or len(item) != 1 or next(iter(item)) not in CHANGE_KINDS:
            raise InputError(
                f"{where}: change {number}: expected one of {', '.join(CHANGE_KINDS)} "
                "as its only key"
            )
        ((kind, value),) = item.items()
        try:
            step = _step(kind, value)
            # A list of changes is read whole before any is decided: a name no
            # model can have makes it unreadable, not a change refused.
            check_name(step.name)
            steps.append(step)
        except ValidationError as error:
            raise InputError(f"{where}: change {number} ({kind}): {describe(error)}") from None
        except Refused as error:
            raise InputError(f"{where}: change {number} ({kind}): {error}") from None
    return steps
