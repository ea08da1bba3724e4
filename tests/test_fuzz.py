"""Fuzzing the inputs (issue 7): whatever an operator or a script hands the CLI.

Model definitions (YAML and JSON: mutated good ones, random data, random
bytes, duplicated keys, alias bombs, deep nesting, huge strings, unicode with
surrogates and NUL, NaN and infinities, wrong types), ``model scale`` with odd
arguments, ``apply`` lists and random command lines, all through the real CLI
(``click.testing.CliRunner`` on ``catalog_es.cli.cli``) on one database per
test. The oracle for every example:

- success (exit 0): what was written decodes and replays without a skip, and
  for a command that answers a model, the replayed model is what it answered;
- refusal (exit 1): one line on stderr, ``error: …``, and not the last-guard
  ``error: unexpected …`` (an exception nobody expected is a bug); nothing written;
- usage error (exit 2): click's usage text with one ``Error: …`` line; nothing written;
- never a traceback, every example in under two seconds, memory bounded.
"""

from __future__ import annotations

import json
import resource
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from catalog_es.application import Models
from catalog_es.catalog import Catalog
from catalog_es.cli import cli
from catalog_es.inputs import MAX_CHANGES, MAX_INPUT_BYTES, load_config
from catalog_es.mapper import EVENT_CLASSES, UndecodableEvent, decode_event, topic_of
from catalog_es.model import DomainEvent, Model, model_id, utc_now
from catalog_es.persistence import SQLRecorder
from catalog_es.spec import Adapter, Origin, Scaling, check_spec
from catalog_es.storage.engines import create_engine
from catalog_es.views import model_view
from projections.catalog import catch_up
from tests.helpers import model_data, model_spec

CONFIG = """
models:
  - name: base
    engine: vllm
    source: hf://org/base
    profiles: [{name: gpu, gpus: 1}]
"""
GOOD = model_data("ok")
# Per example, start-up of the command included. CPU time of this process (the
# CLI runs in it), not the wall clock: a pathological input spends CPU, while a
# stalled machine (seen once in CI, the suite taking 450 s) is no slow command.
MAX_SECONDS = 2.0
# And per MiB of input on top: what is asked is linear time, and PyYAML's
# pure-Python scanner reads a MiB of escapes in 1.3 s on a slow machine here.
SECONDS_PER_MIB = 4.0
# One line, and a short one: a message quotes what it refuses, not all of it.
MAX_MESSAGE = 400
# How much the fuzzing may grow the process's peak memory.
MAX_GROWTH_MB = 300
FUZZ = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str


class Harness:
    """One database for all a test's examples, the CLI run on it, and the oracle."""

    def __init__(self, folder: Path) -> None:
        self.config = folder / "catalog.yaml"
        self.config.write_text(CONFIG)
        self.url = f"sqlite:///{folder}/fuzz.db"
        declared = load_config(str(self.config))
        self.recorder = SQLRecorder(create_engine(self.url))
        self.follower = Catalog(declared.models, declared.engines)
        self.examples = 0
        self.outcomes = {0: 0, 1: 0, 2: 0}
        self.slowest = 0.0
        self.ensure_models()

    def ensure_models(self) -> None:
        """The runtime models the commands aim at, put back if an example took them away."""
        missing = [name for name in ("m", "n") if self.current().get(name) is None]
        if missing:
            models = Models(load_config(str(self.config)), env={"CATALOG_ES_DB": self.url})
            for name in missing:
                models.add(model_spec(name), by="setup")
            models.close()
        self.follow()

    def current(self) -> Catalog:
        self.follow()
        return self.follower

    def head(self) -> int:
        """The log's last revision: unchanged, nothing was written."""
        with self.recorder.read() as conn:
            return self.recorder.head(conn)

    def follow(self) -> None:
        """Replay what was written since last time: it must all decode and apply."""
        with self.recorder.read() as conn:
            skipped = catch_up(self.follower, self.recorder, conn)
        assert skipped == [], f"a command wrote what replay skips: {skipped}"

    def run(self, args: list[str], stdin: bytes | None = None, *, timed: bool = True) -> Outcome:
        before = self.head()
        started = time.process_time()
        result = CliRunner().invoke(
            cli, ["--db", self.url, "--config", str(self.config), *args], input=stdin
        )
        took = time.process_time() - started
        self.examples += 1
        if timed:
            self.slowest = max(self.slowest, took)
        outcome = self.check(result, before, args, stdin)
        bound = MAX_SECONDS + SECONDS_PER_MIB * len(stdin or b"") / 2**20
        assert took < bound or not timed, f"took {took:.2f} s: {args!r} {shorten(stdin)}"
        return outcome

    def check(self, result: Result, before: int, args: list[str], stdin: bytes | None) -> Outcome:
        what = f"{args!r} {shorten(stdin)}"
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise AssertionError(f"escaped the CLI: {what}") from result.exception
        code, stderr = result.exit_code, result.stderr
        # Lines as a terminal shows them: a stray carriage return in a quoted
        # argument does not start one.
        lines = stderr.rstrip("\n").split("\n") if stderr else []
        assert "Traceback" not in stderr, what
        if code == 0:
            # Warnings and progress may go to stderr; errors may not.
            assert not any(line.startswith(("error", "Error")) for line in lines), (what, stderr)
            self.follow()
        elif code == 1:
            assert len(lines) == 1 and lines[0].startswith("error: "), (what, stderr)
            assert not lines[0].startswith("error: unexpected"), (what, stderr)
            assert len(lines[0]) <= MAX_MESSAGE, (what, len(lines[0]), lines[0][:200])
            assert self.head() == before, f"a refused command wrote: {what}"
        elif code == 2:
            # click's own text: the usage, perhaps, and one error line (which quotes
            # the argument as given, a newline in it too).
            assert sum(line.startswith("Error: ") for line in lines) == 1, (what, stderr)
            assert self.head() == before, f"a usage error wrote: {what}"
        else:
            raise AssertionError(f"exit code {code}: {what} {stderr}")
        self.outcomes[code] += 1
        return Outcome(code, result.stdout, stderr)

    def close(self) -> None:
        self.recorder.engine.dispose()


def shorten(data: bytes | None) -> str:
    if data is None:
        return ""
    return repr(data[:300]) + (f"… ({len(data)} bytes)" if len(data) > 300 else "")


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    h = Harness(tmp_path)
    yield h
    h.close()
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert grown < MAX_GROWTH_MB, f"peak memory grew by {grown:.0f} MB"
    print(f"fuzz: {h.examples} examples {h.outcomes}, slowest {h.slowest:.2f} s")


# -- strategies ---------------------------------------------------------------------

# Any code point, surrogates and NUL included (hypothesis leaves surrogates out by default).
ANY_CHARACTER = st.characters(exclude_categories=[])
NASTY_PIECES = ["a", "é", "\x00", "\ud800", "\udcff", " ", "\n", "💥", "\u202e", "\ufeff"]
texts = st.one_of(
    st.text(max_size=30),
    st.text(ANY_CHARACTER, max_size=30),
    # Huge strings (past the size limits, and past a megabyte).
    st.builds(lambda piece, n: piece * n, st.sampled_from(NASTY_PIECES), st.integers(1, 300_000)),
)
numbers = st.one_of(
    st.integers(),
    st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, -(10**30)]),
    st.floats(),  # NaN and the infinities included
    st.booleans(),
    st.none(),
)
junk = st.recursive(
    st.one_of(numbers, texts),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=12,
)
names = st.one_of(
    st.sampled_from(
        ["m", "n", "base", "fresh", "x" * 128, "x" * 129, "", " m", "m\n", "-m", "a/b"]
    ),
    st.text(max_size=12),
    st.text(ANY_CHARACTER, max_size=12),
)


# Names a command can aim at: the runtime models there, new ones, the declared one.
model_names = st.one_of(
    st.sampled_from(["fresh-1", "fresh-2", "m", "n", "base"]),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,20}", fullmatch=True),
)


@st.composite
def valid_definitions(draw: st.DrawFn) -> dict[str, Any]:
    """A model definition that validates on its own (the catalog may still refuse it)."""
    gpus = draw(st.integers(0, 4))
    data: dict[str, Any] = {
        "name": draw(model_names),
        "engine": draw(st.sampled_from(["vllm", "sglang", "llamacpp", "tgi"])),
        "source": draw(st.sampled_from(["hf://org/x", "s3://b/k", "file:///w", "hf://o/é"])),
        "profiles": [{"name": "p", "gpus": gpus, "min_memory_gb": draw(st.integers(1, 64))}],
    }
    low = draw(st.integers(0, 3))
    optional: dict[str, Any] = {
        "scaling": {"min": low, "max": max(1, low + draw(st.integers(0, 3)))},
        "class": draw(st.sampled_from(["", "critical", "standard", "opportunistic"])),
        "owner": draw(st.sampled_from(["", "team:a", "org:b", "project:c"])),
        "adapters": [{"name": "l", "source": "s3://l"}] * draw(st.integers(0, 1)),
        "fallbacks": draw(st.lists(st.sampled_from(["m", "n", "base"]), max_size=2, unique=True)),
        "origin": {"repository": "org/x", "revision": "a" * 40, "files": {"w": "0" * 64}},
    }
    for key in draw(st.lists(st.sampled_from(sorted(optional)), unique=True)):
        data[key] = optional[key]
    return data


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[Any]) -> Any:
    """Valid data, half the time; else one to three mutations away from it."""
    data = draw(valid)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2, 3]))):
        mutate(draw, data)
    return data


def mutate(draw: st.DrawFn, data: Any) -> None:
    """Somewhere in the structure: a value replaced by junk, a key deleted or added."""
    while True:
        children = [
            (k, v) for k, v in (data.items() if isinstance(data, dict) else enumerate(data))
        ]
        containers = [(k, v) for k, v in children if isinstance(v, dict | list) and v]
        if not containers or draw(st.booleans()):
            break
        _, data = draw(st.sampled_from(containers))
    if isinstance(data, dict):
        keys = sorted(data, key=str)
        action = draw(st.sampled_from(["replace", "delete", "add"] if keys else ["add"]))
        if action == "delete":
            del data[draw(st.sampled_from(keys))]
        else:
            key = draw(st.sampled_from(keys)) if action == "replace" else draw(st.text(max_size=8))
            data[key] = draw(junk)
    elif data:
        data[draw(st.integers(0, len(data) - 1))] = draw(junk)


def serialise(data: Any, form: str) -> str:
    if form.startswith("yaml"):
        try:
            return yaml.safe_dump(data, allow_unicode=True, default_flow_style=form == "yaml-flow")
        except (yaml.YAMLError, UnicodeEncodeError, ValueError):
            form = "json-ascii"
    return json.dumps(data, ensure_ascii=form == "json-ascii")


@st.composite
def documents(draw: st.DrawFn, content: st.SearchStrategy[Any]) -> bytes:
    """Data as a YAML or JSON document, sometimes spoiled on the way."""
    text = serialise(
        draw(content), draw(st.sampled_from(["json", "json-ascii", "yaml", "yaml-flow"]))
    )
    spoil = draw(st.sampled_from(["none"] * 5 + ["duplicate key", "truncate", "bom", "garbage"]))
    if spoil == "duplicate key":
        text = (
            ('{"name": "dup", ' + text[1:]) if text.startswith("{") else f"name: a\nname: b\n{text}"
        )
    elif spoil == "truncate":
        text = text[: draw(st.integers(0, len(text)))]
    elif spoil == "bom":
        text = "\ufeff" + text
    elif spoil == "garbage":
        text += draw(st.text(ANY_CHARACTER, max_size=5))
    # Lone surrogates in the bytes themselves: what a broken encoder writes.
    return text.encode("utf-8", "surrogatepass")


def billion_laughs(levels: int, width: int) -> str:
    lines = ['l0: &l0 "lol"']
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join([*lines, f"name: *l{levels - 1}"]) + "\n"


def deep(depth: int, form: str) -> str:
    if form == "json":
        return "[" * depth + "]" * depth
    if form == "json-object":
        return '{"a": ' * depth + "1" + "}" * depth
    if form == "yaml-flow":
        return "a: " + "[" * depth + "]" * depth
    # Block nesting costs its depth in indentation: as deep as fits in the size limit.
    return "".join(" " * i + "- \n" for i in range(min(depth, 1400)))


model_documents = st.one_of(
    # Definitions weigh most: every way a good one can go wrong, and the good ones.
    documents(mutated(valid_definitions())),
    documents(mutated(valid_definitions())),
    documents(mutated(valid_definitions())),
    documents(junk),
    st.binary(max_size=200),
    st.builds(billion_laughs, st.integers(2, 12), st.integers(2, 12)).map(str.encode),
    st.builds(
        deep,
        st.integers(10, 300_000),
        st.sampled_from(["json", "json-object", "yaml-flow", "yaml"]),
    ).map(str.encode),
)


# -- model add ----------------------------------------------------------------------


@FUZZ
@given(document=model_documents, as_json=st.booleans())
def test_fuzzed_definitions_are_added_validly_or_refused_in_one_line(
    harness: Harness, document: bytes, as_json: bool
) -> None:
    harness.ensure_models()
    outcome = harness.run(
        ["--json", "model", "add", "-"] if as_json else ["model", "add", "-"], document
    )
    if outcome.code == 0 and as_json:
        answered = json.loads(outcome.stdout)["model"]
        replayed = harness.current().get(answered["name"])
        assert replayed is not None
        assert model_view(replayed, declared=False) == answered, "what came back is not what runs"


# -- model scale --------------------------------------------------------------------

counts = st.one_of(
    st.integers(-1, 6).map(str),
    st.integers(0, 6).map(str),
    st.integers().map(str),
    st.sampled_from(
        ["", " 1", "1 ", "+3", "-0", "0x10", "1e3", "1.0", "nan", "inf", "١٢", "1_000", "9" * 30]
    ),
    st.just("9" * 5000),
    st.text(ANY_CHARACTER, max_size=6),
)
EXTRAS = [
    ["--json"],
    ["--by", "fuzz"],
    ["--by", ""],
    ["--by", "\x00"],
    ["--by", "x" * 129],
    ["--reason", "because"],
    ["--reason", "x" * 1001],
    ["--reason", "\ud800"],
    ["--expected-revision", "0"],
    ["--expected-revision", "-1"],
    ["--expected-revision", str(2**70)],
    ["--frobnicate"],
    ["--min"],
    ["surplus"],
]


ScaleArguments = tuple[str, str | None, str | None, list[list[str]]]
# Plausible ones (the models there, small bounds, the usual options) as often as odd ones.
scale_arguments: st.SearchStrategy[ScaleArguments] = st.one_of(
    st.tuples(
        st.sampled_from(["m", "n"]),
        st.none() | st.integers(0, 6).map(str),
        st.none() | st.integers(1, 6).map(str),
        st.lists(st.sampled_from(EXTRAS[:2]), max_size=1),
    ),
    st.tuples(
        st.sampled_from(["m", "n", "base", "ghost"]) | names,
        st.none() | counts,
        st.none() | counts,
        st.lists(st.sampled_from(EXTRAS), max_size=2),
    ),
)


@FUZZ
@given(arguments=scale_arguments)
def test_fuzzed_scale_arguments_scale_validly_or_are_refused_in_one_line(
    harness: Harness, arguments: ScaleArguments
) -> None:
    name, minimum, maximum, extras = arguments
    harness.ensure_models()
    before = harness.current().get(name)
    args = ["--json", "model", "scale"]
    args += ["--min", minimum] if minimum is not None else []
    args += ["--max", maximum] if maximum is not None else []
    # The name after "--": a name such as "--help" is then a name, not the
    # option (which answers its help, exit 0, as it should).
    args += [token for extra in extras for token in extra] + ["--", name]
    outcome = harness.run(args)
    if outcome.code == 0:
        answered = json.loads(outcome.stdout)["model"]
        replayed = harness.current().get(name)
        assert before is not None and replayed is not None
        assert model_view(replayed, declared=False) == answered
        expected_min = before.scaling.min if minimum is None else int(minimum)
        expected_max = before.scaling.max if maximum is None else int(maximum)
        assert (replayed.scaling.min, replayed.scaling.max) == (expected_min, expected_max)


# -- apply --------------------------------------------------------------------------

# The models a change aims at, when it does not add one.
present = st.sampled_from(["m", "n", "fresh-1", "fresh-2", "base"])
valid_changes = st.one_of(
    st.builds(lambda d: {"add": d}, valid_definitions()),
    st.builds(lambda n: {"remove": n}, present),
    st.builds(
        lambda n, low, high: {"scale": {"name": n, "min": low, "max": high}},
        present,
        st.integers(0, 2),
        st.integers(1, 5),
    ),
    st.builds(
        lambda n, memory: {"resources": {"name": n, "memory_gb": memory}},
        present,
        st.integers(1, 64),
    ),
    st.builds(
        lambda n, c: {"class": {"name": n, "class": c}},
        present,
        st.sampled_from(["", "critical", "standard", "opportunistic"]),
    ),
    st.builds(
        lambda n, o: {"owner": {"name": n, "owner": o}},
        present,
        st.sampled_from(["", "team:a", "org:b"]),
    ),
    st.builds(
        lambda n: {"adapters": {"name": n, "adapters": [{"name": "l", "source": "s3://l"}]}},
        present,
    ),
    st.builds(lambda n: {"source": {"name": n, "source": "hf://org/moved"}}, present),
)
apply_documents = st.one_of(
    documents(mutated(st.lists(valid_changes, min_size=1, max_size=4))),
    documents(mutated(st.lists(valid_changes, min_size=1, max_size=4))),
    documents(mutated(st.builds(lambda c: {"changes": c}, st.lists(valid_changes, max_size=4)))),
    documents(junk),
    st.builds(billion_laughs, st.integers(2, 12), st.integers(2, 12)).map(str.encode),
)


@FUZZ
@given(document=apply_documents)
# Found here: a name of line separators, each written out as "\u2028",
# quoted twice, made a 466-character line.
@example(document=b'[{"remove": "\\u001f' + "\u2028".encode() * 20 + b'"}, {"remove": "m"}]')
def test_fuzzed_apply_lists_apply_whole_or_are_refused_in_one_line(
    harness: Harness, document: bytes
) -> None:
    harness.ensure_models()
    before = harness.head()
    outcome = harness.run(["--json", "apply", "-"], document)
    if outcome.code == 0:
        result = json.loads(outcome.stdout)
        # All of it: every change is a row (and perhaps the declared config's record).
        assert harness.head() - before in (result["changes"], result["changes"] + 1)


@pytest.mark.parametrize("form", ["json", "json-object"])
def test_a_list_of_changes_nested_too_deeply_is_refused_as_such(
    harness: Harness, form: str
) -> None:
    # msgspec counts the changes before they are parsed, and gave up on the
    # depth with a RecursionError, which reached the user as "unexpected".
    document = ('[{"scale": ' + deep(5_000, form) + "}]").encode()
    outcome = harness.run(["apply", "-"], document)
    assert (outcome.code, outcome.stderr.strip()) == (1, "error: standard input: nested too deeply")


# -- any command line ---------------------------------------------------------------

COMMANDS = [
    ["model", "list"],
    ["model", "show"],
    ["model", "add"],
    ["model", "remove"],
    ["model", "scale"],
    ["model", "resources"],
    ["model", "class"],
    ["model", "owner"],
    ["model", "adapters"],
    ["model", "source"],
    ["model", "updates"],
    ["model", "check-updates"],
    ["model", "update"],
    ["model", "rollback"],
    ["sources"],
    ["log"],
    ["apply"],
    ["diff"],
    ["rollback"],
    ["replay"],
]
tokens = st.one_of(
    st.sampled_from(
        [
            "--json", "--by", "--reason", "--expected-revision", "--at", "--min", "--max",
            "--profile", "--memory-gb", "--cpu-cores", "--adapter", "--none", "--repository",
            "--revision", "--file", "--to", "--model", "--only", "--dry-run", "--after",
            "--limit", "--mirror", "m", "n", "base", "0", "1", "-1", "2", "99999",
            "2026-01-01T00:00:00Z", "2999-01-01T00:00:00Z", "yesterday", "a=b", "=", "-", "",
        ]
    ),
    st.text(max_size=12),
    st.text(ANY_CHARACTER, max_size=12),
)  # fmt: skip


@FUZZ
@given(command=st.sampled_from(COMMANDS), arguments=st.lists(tokens, max_size=6))
def test_fuzzed_command_lines_never_escape_the_cli(
    harness: Harness, command: list[str], arguments: list[str]
) -> None:
    harness.ensure_models()
    harness.run([*command, *arguments], b"")


# -- stored records ------------------------------------------------------------------

POOL = ["m", "n", "o"]


def stored_samples(name: str) -> list[tuple[type[DomainEvent], dict[str, Any]]]:
    """One well-formed record of every kind, about ``name``, as stored data."""
    envelope: dict[str, Any] = {
        "originator_id": model_id(name),
        "originator_version": 1,
        "timestamp": utc_now(),
        "by": "fuzz",
        "model": name,
    }
    origin = Origin("org/x", "a" * 40, {"w": "0" * 64})
    events: list[DomainEvent] = [
        Model.Added(**envelope, spec=model_spec(name, fallbacks=[f for f in POOL if f < name])),
        Model.Removed(**envelope),
        Model.Scaled(**envelope, scaling=Scaling(0, 2)),
        Model.ResourcesSet(**envelope, memory_gb=8, cpu_cores=2),
        Model.ClassSet(**envelope, capacity_class="critical"),
        Model.OwnerSet(**envelope, owner="team:a"),
        Model.AdaptersSet(**envelope, adapters=(Adapter("l", "s3://l"),)),
        Model.SourceSet(**envelope, source="hf://org/y", origin=origin),
        Model.OriginSet(**envelope, origin=origin),
        Model.UpstreamChanged(**envelope, ref="main", revision="a" * 40, upstream=origin),
    ]
    return [(type(e), msgspec.to_builtins(e)) for e in events]


@st.composite
def stored_records(draw: st.DrawFn) -> tuple[str, bytes]:
    """A record as a bug, an old build or a hand with SQL might leave it:
    well-formed, or mutated, sometimes under another kind's topic."""
    samples = stored_samples(draw(st.sampled_from(POOL)))
    # Added weighs more: the other kinds only apply to a model that is there.
    cls, data = draw(st.sampled_from(samples[:1] * 4 + samples))
    data = draw(mutated(st.just(data)))
    swapped = draw(st.integers(0, 3)) == 0
    topic = draw(st.sampled_from(sorted(EVENT_CLASSES))) if swapped else topic_of(cls)
    return topic, json.dumps(data, allow_nan=True).encode("utf-8", "surrogatepass")


@settings(FUZZ, max_examples=400)
@given(records=st.lists(stored_records(), max_size=15))
def test_fuzzed_stored_records_are_applied_or_skipped_and_the_catalog_stays_valid(
    records: list[tuple[str, bytes]],
) -> None:
    """Replay never raises, whatever the log holds, and what it leaves in force
    is a valid catalog: every model passes every rule, every fallback exists."""
    declared = load_config(None)
    catalog = Catalog(declared.models, declared.engines)
    for revision, (topic, state) in enumerate(records, start=1):
        try:
            event = decode_event(topic, state)
        except UndecodableEvent:
            continue
        catalog.apply(event, revision)
    for spec in catalog.runtime():
        check_spec(spec, catalog.engines)
        assert all(catalog.get(target) is not None for target in spec.fallbacks), spec
        catalog.check(spec.name, spec)


# -- the nastiest inputs, every run -------------------------------------------------


def good(**fields: Any) -> bytes:
    return json.dumps(GOOD | fields).encode()


NASTY = {
    "billion laughs": (billion_laughs(10, 10).encode(), "aliases (*name) are not accepted"),
    "an alias to itself": (b"name: &a [*a]\n", "aliases (*name) are not accepted"),
    # Of a mapping written in place: with no aliases, there is nothing to share.
    "a merge key": (
        b"<<: {name: ok, engine: vllm}\nsource: hf://o/ok\n",
        "merge keys (<<) are not accepted",
    ),
    # Lists of one-key mappings, told as the lists they make, not as YAML
    # that "expected a mapping of length 1, but found scalar" (review).
    "a YAML ordered map": (
        b"name: m\nengine: vllm\nsource: hf://o/m\nprofiles: [{name: g, gpus: 1}]\n"
        b"scaling: !!omap [min: 0, max: 2]\n",
        "scaling: expected a mapping of fields (got list)",
    ),
    "YAML pairs": (b"!!pairs [name: m, engine: vllm]\n", "expected a mapping of fields (got list)"),
    "JSON nested 300,000 deep": (deep(300_000, "json").encode(), "nested too deeply"),
    "YAML nested 1,400 deep": (deep(1_400, "yaml").encode(), "nested too deeply"),
    "over the size limit": (good(source="s" * MAX_INPUT_BYTES), "larger than 1024 KiB"),
    "not UTF-8": (b"name: \xff\xfe", "not UTF-8 text"),
    "a JSON surrogate escape": (good(source="\ud800"), "holds a lone surrogate"),
    # libyaml refuses the escape as it scans; JSON's is caught after parsing.
    "a YAML surrogate escape": (b'name: "\\udcff"\n', "invalid Unicode character escape"),
    "NaN": (b'{"name": NaN}', "NaN is not a number"),
    "a YAML infinity": (
        b"name: ok\nengine: vllm\nsource: hf://o/ok\nprofiles: [{name: g, gpus: 1}]\n"
        b"scaling: {min: .inf}\n",
        "scaling.min: Input should be a valid integer (got inf)",
    ),
    "a duplicated JSON key": (b'{"name": "a", "name": "b"}', "duplicate key 'name'"),
    "a duplicated YAML key": (b"name: a\nname: b\n", "duplicate key 'name'"),
    "a duplicated huge key": (
        json.dumps({"k" * 100_000: 1}).replace("{", '{"' + "k" * 100_000 + '": 0, ').encode(),
        "duplicate key 'kkkk",
    ),
    "replicas past 64 bits": (good(scaling={"min": 0, "max": 2**64}), "larger than 2^63 - 1"),
    "GPUs past 64 bits": (
        good(profiles=[{"name": "g", "gpus": 10**30}]),
        "profiles[0].gpus: is larger than 2^63 - 1",
    ),
    # Python refuses to read it and names the call that would lift its limit.
    "a 5,000-digit JSON number": (
        b'{"name": "m", "scaling": {"max": ' + b"9" * 5000 + b"}}",
        "holds a number of 5000 digits; a number may have at most 4300",
    ),
    "a 5,000-digit YAML number": (
        b"name: m\nscaling: {max: " + b"9" * 5000 + b"}\n",
        "… is a number of more than 4300 digits (line 2, column 16)",
    ),
    "a YAML !!int with a leading zero and no octal reading": (
        b'name: m\nscaling: {max: !!int "08"}\n',
        "'08' has a leading zero, which YAML 1.1 reads as octal: write a number in decimal",
    ),
    "an empty YAML !!int": (b'name: m\nscaling: {max: !!int ""}\n', "'' is not a whole number"),
    # int() reads any script's digits: these would have been 12 replicas.
    "Arabic-Indic digits as a YAML !!int": (
        'name: m\nscaling: {max: !!int "١٢"}\n'.encode(),
        "'١٢' is not a whole number (line 2, column 16)",
    ),
    # YAML 1.1 reads these as 8 and 90, where a reviewer reads 10 and text.
    "a YAML count with a leading zero": (
        b"name: m\nengine: vllm\nsource: hf://o/m\nprofiles: [{name: g, gpus: 010}]\n",
        "'010' has a leading zero, which YAML 1.1 reads as octal",
    ),
    "a leading zero in JSON (read as YAML flow style)": (
        good(profiles=[{"name": "g", "gpus": 1}]).replace(b'"gpus": 1', b'"gpus": 010'),
        "'010' has a leading zero, which YAML 1.1 reads as octal (010 is 8)",
    ),
    "a 5,000-digit YAML hexadecimal number": (
        b"name: m\nscaling: {max: 0x" + b"f" * 5000 + b"}\n",
        "is a number of more than 4300 digits (line 2, column 16)",
    ),
    # The boundary: 10**4300 is the smallest number Python will not print.
    "the smallest YAML hexadecimal number of 4,301 digits": (
        b"name: m\nscaling: {max: " + hex(10**4300).encode() + b"}\n",
        "is a number of more than 4300 digits (line 2, column 16)",
    ),
    "a YAML base-60 count": (
        b"name: m\nscaling: {max: 1:30}\n",
        "'1:30' is a base-60 number in YAML 1.1 (1:30 is 90)",
    ),
    # Read as 10 and 3 by YAML 1.1, as the CLI's int() read --max 1_0 (review).
    "a YAML count with an underscore": (
        b"name: m\nscaling: {max: 1_0}\n",
        "'1_0' has an underscore, which YAML 1.1 reads past (1_0 is 10): write a number",
    ),
    "a YAML binary count": (
        b"name: m\nscaling: {max: 0b11}\n",
        "'0b11' is a binary number in YAML 1.1 (0b11 is 3): write a number in decimal",
    ),
    "a megabyte engine name": (good(engine="e" * 1_000_000), "is not a known engine"),
    "a python tag": (
        b"!!python/object/apply:os.system [echo]\n",
        "could not determine a constructor",
    ),
    "100,000 fallbacks": (good(fallbacks=["m"] * 100_000), "'m' appears more than once"),
}


@pytest.mark.parametrize(("document", "message"), NASTY.values(), ids=NASTY.keys())
def test_a_nasty_definition_is_refused_quickly_in_bounded_memory(
    harness: Harness, document: bytes, message: str
) -> None:
    outcome = harness.run(["model", "add", "-"], document)
    assert outcome.code == 1
    assert message in outcome.stderr, outcome.stderr
    # Again, its memory traced (which slows it down too much to time it).
    tracemalloc.start()
    try:
        assert harness.run(["model", "add", "-"], document, timed=False) == outcome
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Ten times the input at most: nothing expands.
    assert peak < 10 * len(document) + 20_000_000, f"peak {peak / 1e6:.0f} MB"


BAD_ARGUMENTS = {
    "a NUL in a file name": (["model", "add", "a\x00b"], "'a\\x00b': not a file name"),
    "a surrogate in a file name": (["model", "add", "\ud800"], "'\\ud800': not a file name"),
    "a source that is not UTF-8": (
        ["model", "source", "m", "hf://\udcff"],
        "'hf://\\udcff' is not Unicode text",
    ),
    "a repository that is not UTF-8": (
        ["model", "source", "m", "hf://x", "--repository", "org/\udcff"],
        "repository 'org/\\udcff' is not org/name",  # refused before it is encoded
    ),
    "a memory size past 64 bits": (
        ["model", "resources", "m", "--memory-gb", str(2**63)],
        "profiles[0].min_memory_gb: is larger than 2^63 - 1",
    ),
    "a huge minimum": (["model", "scale", "m", "--min", str(10**40)], "scaling.min: is larger"),
    "a megabyte owner": (["model", "owner", "m", "o" * 1_000_000], "is not org:ID, team:ID"),
    "a megabyte profile name": (
        ["model", "resources", "m", "--profile", "p" * 1_000_000, "--cpu-cores", "1"],
        "has no profile 'pppp",
    ),
}


@pytest.mark.parametrize(("args", "message"), BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_a_bad_argument_is_refused_in_one_short_line(
    harness: Harness, args: list[str], message: str
) -> None:
    outcome = harness.run(args)
    assert outcome.code == 1
    assert message in outcome.stderr, outcome.stderr


def test_an_apply_of_many_short_lists_is_refused_in_memory_near_its_size(
    harness: Harness,
) -> None:
    """Within every bound a list has, 1 MB of ``- [0,0,0,…]`` lines took
    175 MB to refuse: PyYAML read the whole document into nodes (two marks
    a value) before any of it was made (hostile test). Each list is made
    as it is read now, its nodes let go."""
    document = ("- [" + ",".join(["0"] * 10_000) + "]\n").encode() * 5
    before = harness.head()
    tracemalloc.start()
    try:
        outcome = harness.run(["apply", "-"], document, timed=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert outcome.code == 1 and len(outcome.stderr.splitlines()) == 1, outcome.stderr
    assert harness.head() == before
    # 100 KB: the values made (400 KB of lists) and one list's nodes at a time.
    assert peak < 10 * len(document) + 5_000_000, f"peak {peak / 1e6:.0f} MB"


def test_a_long_apply_is_all_or_nothing_and_too_long_a_one_is_refused(harness: Harness) -> None:
    before = harness.head()
    scales = [{"scale": {"name": "m", "max": 2 + i % 5}} for i in range(2_000)]
    outcome = harness.run(["--json", "apply", "-"], json.dumps(scales).encode())
    assert outcome.code == 0
    assert harness.head() - before in (2_000, 2_001)
    too_many = json.dumps([{"remove": "m"}] * (MAX_CHANGES + 1)).encode()
    outcome = harness.run(["apply", "-"], too_many)
    assert outcome.code == 1 and f"more than {MAX_CHANGES} changes" in outcome.stderr


@pytest.mark.parametrize(
    ("far_too_many", "message", "seconds"),  # built in the test: tens of megabytes
    [
        # 34 MB: counted as it stands before it is parsed (parsing it all, in
        # Python so that a duplicate key is refused, took seconds and gigabytes).
        pytest.param(
            lambda: b"[" + b",".join([b'{"remove": "m"}'] * (20 * MAX_CHANGES)) + b"]",
            f"more than {MAX_CHANGES} changes in one apply",
            1.5,
            id="json",
        ),
        # 24 MB: refused at the item past the limit as it is read (building
        # them all first took minutes and gigabytes).
        pytest.param(
            lambda: b"- remove: m\n" * (20 * MAX_CHANGES),
            f"a list of more than {MAX_CHANGES} items (line {MAX_CHANGES + 1},",
            15,
            id="yaml",
        ),
    ],
)
def test_a_list_of_changes_twenty_times_too_long_is_refused_early(
    harness: Harness, far_too_many: Callable[[], bytes], message: str, seconds: float
) -> None:
    document = far_too_many()
    started = time.process_time()
    outcome = harness.run(["apply", "-"], document, timed=False)
    took = time.process_time() - started
    assert outcome.code == 1
    assert message in outcome.stderr
    assert took < seconds, f"took {took:.1f} s"


def test_a_config_with_an_alias_bomb_is_refused_quickly(harness: Harness, tmp_path: Path) -> None:
    """The declared config may use aliases (it is reviewed), but a bomb in it
    must not expand: the service refuses to start on it, quickly."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(billion_laughs(12, 12).replace("name:", "engines:") + "models: []\n")
    started = time.process_time()
    result = CliRunner().invoke(cli, ["--db", harness.url, "--config", str(bomb), "model", "list"])
    assert time.process_time() - started < MAX_SECONDS
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1
