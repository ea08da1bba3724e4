"""The ``catalog-es`` command line: exit codes, the shared options, bad input.

Every refusal is one ``error:`` line on stderr, exit code 1, and the log is
exactly as long as before (counted in the file, not through the code).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import os
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from datetime import date
from pathlib import Path
from types import FrameType
from typing import Any

import click
import hypothesis
import msgspec
import pytest
import sqlalchemy as sa
import yaml
from click.testing import CliRunner, Result
from eventsourcing.application import Application
from eventsourcing.domain import Aggregate
from eventsourcing.persistence import StoredEvent
from eventsourcing.sqlite import SQLiteApplicationRecorder, SQLiteDatastore
from hypothesis import strategies as st

from catalog_es import (
    application,
    bootstrap,
    commands,
    early_stop,
    names,
    persistence,
    rollback,
)
from catalog_es.application import Models
from catalog_es.cli import cli
from catalog_es.cli.base import (
    EXIT_OUTPUT_FAILED,
    EXIT_PIPE_CLOSED,
    StoppedWhenAsked,
    VisibleWarnings,
    stopped_when_asked,
    warnings_to,
)
from catalog_es.errors import (
    PIECE_LENGTH,
    ConfigError,
    DamagedLog,
    InputError,
    Refused,
    json_in_pieces,
    json_line,
)
from catalog_es.inputs import DeclaredConfig, load_config, read_text
from catalog_es.mapper import decode_event, spelling_marks
from catalog_es.persistence import PullingSubscription, SQLRecorder
from catalog_es.spec import Adapter, Origin
from catalog_es.storage.engines import database_unusable
from catalog_es.storage.schema import events_table
from tests.helpers import (
    CPU_NO_MEMORY,
    EVERY_STOP,
    STOPS_BLOCKED_OR_NOT,
    STOPS_TOLD,
    CountedOutput,
    config_yaml,
    count_events,
    definition,
    following,
    log_rows,
    model_data,
    schema_of,
    spec,
    stops_blocked,
)

LOG_KEYS = {
    "revision",
    "time",
    "by",
    "reason",
    "model",
    "event",
    "class_version",
    "fields",
    "rollback_to",
}

Run = Callable[..., Result]


class _StandardErrorNow(io.StringIO):
    """Writes to ``sys.stderr`` as it is at each write: CliRunner swaps in
    its own for each command it runs."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def invoke_told(args: list[str], input: str | bytes | None = None) -> Result:
    """The CLI run in this process, its log lines (the load's warnings, held
    until the command ends) on its stderr as :func:`catalog_es.cli.main`
    sends them: a subprocess cost each run half a second of imports."""
    handler = warnings_to(_StandardErrorNow())
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        return CliRunner().invoke(cli, args, input=input)
    finally:
        root.removeHandler(handler)


@pytest.fixture
def run(db_url: str) -> Run:
    """``run(*args, input=None)``: the CLI on this test's database."""

    def invoke(*args: str, input: str | bytes | None = None) -> Result:
        return CliRunner().invoke(cli, ["--db", db_url, *args], input=input)

    return invoke


@pytest.fixture
def run_told(db_url: str) -> Run:
    """``run`` with the log lines a terminal is told on its stderr (:func:`invoke_told`)."""

    def invoke(*args: str, input: str | bytes | None = None) -> Result:
        return invoke_told(["--db", db_url, *args], input=input)

    return invoke


@pytest.fixture
def write(tmp_path: Path) -> Callable[[str, bytes], str]:
    def write_file(name: str, content: bytes) -> str:
        path = tmp_path / name
        path.write_bytes(content)
        return str(path)

    return write_file


def as_json(data: Any) -> bytes:
    return json.dumps(data).encode()


def as_yaml(data: Any) -> bytes:
    return yaml.safe_dump(data).encode()


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result


def refused_in_one_line(result: Result) -> str:
    assert result.exit_code == 1, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    return lines[0]


# -- exit codes -------------------------------------------------------------------


def test_success_exits_0_and_prints_the_revision(run: Run, write: Any) -> None:
    result = ok(run("model", "add", write("m.yaml", as_yaml(definition("m")))))
    assert result.stdout.startswith("added m at revision 1\n")
    listed = ok(run("model", "list")).stdout
    assert "m" in listed and "runtime" in listed and "hf://org/m" in listed
    shown = ok(run("model", "show", "m")).stdout
    assert "standard (from scaling)" in shown


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["no-such-command"], id="unknown-command"),
        pytest.param(["model", "show"], id="missing-argument"),
        pytest.param(["model", "scale", "m", "--min", "two"], id="not-an-int"),
        pytest.param(["model", "scale", "m", "--min", "1.5"], id="float-option"),
        pytest.param(["model", "adapters", "m"], id="adapters-neither"),
        pytest.param(["model", "scale", "m"], id="scale-nothing"),
        pytest.param(["model", "resources", "m", "--profile", "gpu"], id="resources-nothing"),
        pytest.param(["model", "adapters", "m", "--none", "--adapter", "a=s3://x"], id="both"),
        pytest.param(["--expected-revision", "-1", "model", "list"], id="negative-revision"),
        pytest.param(["log", "--limit", "0"], id="limit-zero"),
        pytest.param(["model", "list", "--no-such-option"], id="unknown-option"),
    ],
)
def test_usage_errors_exit_2(run: Run, rows: Callable[[], int], args: list[str]) -> None:
    result = run(*args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert rows() == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            ["model", "adapters", "m", "--adapter", "x"],
            "--adapter 'x': expected NAME=SOURCE",
            id="pair",
        ),
        pytest.param(
            ["model", "source", "m", "s3://w", "--file", f"w.bin={'a' * 64}", "--file", "w.bin=b"],
            "--file 'w.bin' is given more than once",
            id="file-twice",
        ),
        pytest.param(
            ["model", "source", "m", "s3://w", "--file", "w.bin"],
            "--file 'w.bin': expected PATH=SHA256",
            id="file-no-digest",
        ),
    ],
)
def test_an_option_value_the_command_cannot_read_is_a_usage_error(
    run: Run, write: Any, rows: Callable[[], int], args: list[str], message: str
) -> None:
    """DESIGN: exit 2 on usage errors. These values are read by the command,
    not by a click type, and exited 1 as refusals (hostile test)."""
    _seeded(run, write)
    before = rows()
    result = run(*args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stderr.splitlines()[-1] == f"Error: {message}"
    assert rows() == before


# -- shared options, before and after the command ------------------------------------


def _seeded(run: Run, write: Any) -> None:
    ok(run("model", "add", write("m.yaml", as_yaml(definition("m")))))


def every_command(
    group: click.Group = cli, path: tuple[str, ...] = ()
) -> Iterator[tuple[list[str], click.Command]]:
    """The words of each command and group under ``group``, and it, the root's first."""
    yield list(path), group
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from every_command(command, (*path, name))
        else:
            yield [*path, name], command


def test_every_group_and_command_takes_the_shared_options() -> None:
    """As the root does: an operator puts them where the command line has room."""
    for path, command in every_command():
        names = {opt for param in command.params for opt in param.opts}
        assert {"--json", "--by", "--reason", "--expected-revision"} <= names, path
    assert ["token", "list"] in [path for path, _ in every_command()]


@pytest.mark.parametrize("count", [0, 1, 2, 40])
def test_json_in_pieces_is_the_document_encoded_whole(count: int) -> None:
    """A list written in pieces (``audit --json``'s rows, ``apply --json``'s
    models) is byte for byte the list encoded at once, on its own or as a
    document's last key; what a terminal would act on escaped as ever. A
    piece is about as long as it may be, an item longer than that its own."""
    padding = [(i * 37_813) % (2 * PIECE_LENGTH) for i in range(count)]
    items = [{"n": i, "text": f"row {i}\u202e\x1b[2J é" + "x" * padding[i]} for i in range(count)]
    pieces = list(json_in_pieces(json_line, ", ", iter(items)))
    assert "".join(pieces) == json_line(items)
    assert all(len(piece) < 2 * PIECE_LENGTH + 1000 for piece in pieces)
    if count == 40:
        assert len(pieces) > 20
    head = {"revision": 7, "changes": count}
    whole = json_line({**head, "models": items})
    assert "".join(json_in_pieces(json_line, ", ", iter(items), head, "models")) == whole

    def compact(data: Any) -> bytes:  # as the server encodes
        return json.dumps(data, separators=(",", ":")).encode()

    assert b"".join(json_in_pieces(compact, b",", items)) == compact(items)


def test_json_before_and_after_the_command_is_the_same(run: Run, write: Any) -> None:
    _seeded(run, write)
    for command in (["model", "list"], ["model", "show", "m"], ["sources"], ["log"]):
        before = ok(run("--json", *command)).stdout
        after = ok(run(*command, "--json")).stdout
        assert before == after, command
        for line in before.splitlines():
            json.loads(line)


@pytest.mark.parametrize("where", ["root", "command"])
def test_by_and_reason_work_before_and_after_the_command(run: Run, write: Any, where: str) -> None:
    _seeded(run, write)
    options = ["--by", "alice", "--reason", "load test"]
    args = ["model", "scale", "m", "--max", "3"]
    ok(run(*options, *args) if where == "root" else run(*args, *options))
    (line,) = ok(run("log", "--json", "--after", "1")).stdout.splitlines()
    assert (json.loads(line)["by"], json.loads(line)["reason"]) == ("alice", "load test")


def test_a_model_shown_can_be_edited_and_added_again(
    run: Run, write: Any, rows: Callable[[], int]
) -> None:
    """`model show --json`, edited, fed back to `model add`: what show prints
    beside the definition was refused as unknown fields (hostile test). It
    is taken back where it says what the definition does, and refused where
    it says otherwise, as one line with nothing written."""
    _seeded(run, write)
    shown = json.loads(ok(run("model", "show", "m", "--json")).stdout)
    assert (shown["effective_class"], shown["declared"]) == ("standard", False)
    edited = {**shown, "scaling": {"min": 1, "max": 5}}
    ok(run("model", "add", write("edited.json", as_json(edited))))
    assert json.loads(ok(run("model", "show", "m", "--json")).stdout) == edited
    before = rows()
    for field, value, told in (
        ("effective_class", "critical", "effective_class: is worked out, not set: this"),
        ("declared", True, "declared: true is what model show says of a model the config"),
        ("warnings", ["bogus"], "warnings: are worked out, not set: this definition has none"),
        # What they are checked against refused: that is the one problem told.
        ("scaling", {"min": "1", "max": 5}, "scaling.min: Input should be a valid integer"),
        ("class", 5, "class: Input should be a valid string"),
        ("name", 5, "name: Input should be a valid string"),
        ("profiles", [{"name": "gpu", "gpus": "1"}], "profiles[0].gpus: Input should be a"),
    ):
        wrong = write("wrong.json", as_json({**shown, field: value}))
        assert told in refused_in_one_line(run("model", "add", wrong))
    assert rows() == before


def test_a_definition_s_fields_left_out_are_shown_as_their_defaults(run: Run, write: Any) -> None:
    """What comes back is what will run: a profile's numbers left out are 0,
    scaling 1 to 1, and the rest empty (DESIGN.md's table)."""
    ok(run("model", "add", write("m.json", as_json(model_data("m")))))
    assert json.loads(ok(run("model", "show", "m", "--json")).stdout) == {
        **model_data("m"),
        "profiles": [
            {"name": "gpu", "gpus": 1, "gpu_memory_gb": 0, "min_memory_gb": 0, "cpu_cores": 0}
        ],
        "scaling": {"min": 1, "max": 1},
        "class": "",
        "owner": "",
        "adapters": [],
        "fallbacks": [],
        "origin": None,
        "effective_class": "standard",
        "declared": False,
    }


def test_an_origin_given_in_part_is_shown_with_null_and_a_field_given_empty_is_refused(
    run: Run, write: Any, rows: Callable[[], int]
) -> None:
    """`revision: "$REV"` with REV unset beside a repository recorded an
    origin in part, without a word, because `model show --json` printed a
    field left out as `""` and had to be taken back (review). It prints
    null, which is taken back as left out, and a field given empty is
    refused in one line naming it, nothing written."""
    _seeded(run, write)
    ok(run("model", "source", "m", "hf://org/x", "--repository", "org/x"))
    shown = json.loads(ok(run("model", "show", "m", "--json")).stdout)
    assert shown["origin"] == {"repository": "org/x", "revision": None, "files": {}}
    assert "org/x@ (0 files)" in ok(run("model", "show", "m")).stdout
    edited = {**shown, "scaling": {"min": 1, "max": 5}}
    ok(run("model", "add", write("edited.json", as_json(edited))))
    assert json.loads(ok(run("model", "show", "m", "--json")).stdout) == edited
    change = {"name": "m", "source": "hf://org/y", "origin": shown["origin"]}
    ok(run("apply", write("source.json", as_json([{"source": change}]))))
    assert json.loads(ok(run("model", "show", "m", "--json")).stdout)["origin"] == shown["origin"]
    before = rows()
    no_revision = "origin: revision is empty: give a commit, or leave it out"
    no_repository = (
        "origin: repository is empty: give a registry repository (org/name), or leave it out"
    )
    for command, given, told in (
        ("model add", {**shown, "origin": {"repository": "org/x", "revision": ""}}, no_revision),
        ("model add", {**shown, "origin": {"repository": "", "revision": "a" * 40}}, no_repository),
        (
            "apply",
            [{"source": {**change, "origin": {"repository": "org/x", "revision": ""}}}],
            f"change 1 (source): {no_revision}",
        ),
    ):
        path = write("given.json", as_json(given))
        result = run(*command.split(), path)
        assert (result.exit_code, result.stderr) == (1, f"error: {path}: {told}\n"), given
    assert rows() == before
    # The config takes a shown origin back too, and still loads one it
    # loaded before (a field empty), which every node must.
    declared = [
        definition(name, origin={"repository": "org/x", "revision": revision})
        for name, revision in (("pasted", None), ("older", ""))
    ]
    config = write("declared.yaml", as_yaml({"models": declared}))
    for name in ("pasted", "older"):
        model = json.loads(ok(run("--config", config, "model", "show", name, "--json")).stdout)
        assert model["origin"] == shown["origin"], name


def test_a_refused_origin_given_in_part_is_shown_with_null_as_every_output_shows_it(
    run: Run, write: Any, rows: Callable[[], int]
) -> None:
    """`refusals --json` showed an origin field left out of a refused `model
    add` or `model source` as `""`, where history, audit and log show null,
    so what it showed could not be given back to `model add` (last
    session's notes). The refusal's stored fields are shown as the log's
    are; kept as they were stored."""
    _seeded(run, write)
    before = rows()
    added = definition("n", origin={"repository": "org/x"}, fallbacks=["gone"])
    refused_in_one_line(run("model", "add", write("n.json", as_json(added))))
    refused_in_one_line(
        run(
            "model",
            "source",
            "m",
            "hf://org/y",
            "--repository",
            "org/y",
            "--expected-revision",
            "0",
        )
    )
    assert rows() == before
    add, source = (row["fields"] for row in json.loads(ok(run("refusals", "--json")).stdout))
    assert add["spec"]["origin"] == {"repository": "org/x", "revision": None, "files": {}}
    assert source["origin"] == {"repository": "org/y", "revision": None, "files": {}}
    # What is shown is taken back, the fallback aside.
    ok(run("model", "add", write("again.json", as_json({**add["spec"], "fallbacks": []}))))


def test_a_key_with_nothing_after_it_is_refused_not_left_out(
    run: Run, write: Any, rows: Callable[[], int]
) -> None:
    """YAML reads `revision:` (or `revision: $REV`, the variable unset) as
    null, which is a field left out: a partial origin was recorded, or every
    profile changed, without a word, where `revision: ""` is refused. A key
    (or list item) with nothing after it is refused where it stands, whatever
    the field (`owner:` would otherwise share the model); `null` and `~`
    still leave a field out."""
    _seeded(run, write)
    model = "{name: m, engine: vllm, source: hf://org/m, profiles: [{name: gpu, gpus: 1}]"
    blank = "nothing is written where a value goes: give one, or null to leave it out"
    before = rows()
    for command, text, place in (
        ("model add", f"{model}, origin: {{repository: org/x, revision: }}}}", "1, column 117"),
        (
            "model add",
            "name: m\nengine: vllm\nsource: hf://org/m\nprofiles: [{name: gpu, gpus: 1}]\n"
            "origin:\n  repository: org/x\n  revision:\n",
            "7, column 12",
        ),
        ("model add", f"{model}, owner: }}", "1, column 86"),
        (
            "apply",
            "- source: {name: m, source: hf://org/y, origin: {repository: org/x, revision: }}",
            "1, column 79",
        ),
        ("apply", "- resources: {name: m, profile: , memory_gb: 8}", "1, column 33"),
        ("apply", "- scale: {name: m, min: 0, max: }", "1, column 33"),
        ("apply", "- owner: {name: m, owner: }", "1, column 27"),
        ("apply", "- \n", "1, column 2"),
    ):
        path = write("given.yaml", text.encode())
        line = refused_in_one_line(run(*command.split(), path))
        assert line == f"error: {path}: {blank} (line {place})", text
    # A document of nothing is told as an empty file is, not as a blank value.
    for command, given in (("apply", "a list of changes"), ("model add", "a model definition")):
        for text, said in (("", "empty"), ("---\n", "empty but for `---`")):
            line = refused_in_one_line(run(*command.split(), write("given.yaml", text.encode())))
            assert line.endswith(f": {said}: give {given} (YAML or JSON)"), (command, text)
    assert rows() == before
    # Written null, a field is left out, as before.
    for null in ("null", "~"):
        ok(
            run(
                "model",
                "add",
                write(
                    "m.yaml", f"{model}, origin: {{repository: org/x, revision: {null}}}}}".encode()
                ),
            )
        )
        shown = json.loads(ok(run("model", "show", "m", "--json")).stdout)
        assert shown["origin"] == {"repository": "org/x", "revision": None, "files": {}}
        ok(
            run(
                "apply",
                write(
                    "r.yaml", f"- resources: {{name: m, profile: {null}, memory_gb: 8}}".encode()
                ),
            )
        )
    # The config, which loads a field given empty, loads one with nothing after it.
    config = write(
        "declared.yaml",
        b"models:\n- name: d\n  engine: vllm\n  source: hf://org/d\n"
        b"  profiles: [{name: gpu, gpus: 1}]\n  origin: {repository: org/x, revision: }\n",
    )
    shown = json.loads(ok(run("--config", config, "model", "show", "d", "--json")).stdout)
    assert shown["origin"] == {"repository": "org/x", "revision": None, "files": {}}


def test_a_past_state_with_an_origin_given_in_part_is_copied_from_history_back_into_the_catalog(
    run: Run, write: Any
) -> None:
    """`history` and `audit` (before, after, changes), `log --json` and
    `watch --json` printed an origin's field left out as `""`, which `model
    add` and `apply` refuse: the state `history` showed could not be given
    back (review). They print null, as `model show` does."""
    _seeded(run, write)
    ok(run("model", "source", "m", "hf://org/x", "--repository", "org/x"))
    partial: dict[str, Any] = {"repository": "org/x", "revision": None, "files": {}}
    ok(run("model", "source", "m", "hf://org/y"))  # no origin since
    rows = json.loads(ok(run("history", "m", "--json")).stdout)
    sourced = rows[-2]
    assert sourced["event"] == "SourceSet" and sourced["fields"]["origin"] == partial
    assert {"field": "origin", "before": None, "after": partial} in sourced["changes"]
    assert rows[-1]["before"]["origin"] == partial
    logged = [json.loads(line) for line in ok(run("log", "--json")).stdout.splitlines()]
    assert logged[-2]["fields"]["origin"] == partial
    assert "origin: null → " + json_line(partial) in ok(run("history", "m")).stdout
    for command, given in (
        ("model add", sourced["after"]),
        ("apply", [{"add": {**sourced["after"], "scaling": {"min": 1, "max": 2}}}]),
    ):
        ok(run(*command.split(), write("given.json", as_json(given))))
        back = json.loads(ok(run("model", "show", "m", "--json")).stdout)
        assert back["origin"] == partial and back["source"] == "hf://org/x", command
    # A declared origin given in part (the config loads "" too), in a config record.
    declared = definition("pasted", origin={"repository": "org/x", "revision": ""})
    config = write("declared.yaml", as_yaml({"models": [declared]}))
    ok(run("--config", config, "model", "scale", "m", "--max", "3"))
    record = json.loads(ok(run("--config", config, "log", "--json")).stdout.splitlines()[-2])
    assert record["event"] == "ConfigDeclared"
    assert record["fields"]["models"][0]["origin"] == partial
    rows = json.loads(ok(run("--config", config, "history", "pasted", "--json")).stdout)
    assert [(r["event"], r["after"]["origin"]) for r in rows] == [("Declared", partial)]


@pytest.mark.parametrize("encode", [as_json, as_yaml], ids=["json", "yaml"])
def test_a_value_refused_is_quoted_as_the_file_spells_it(
    run: Run, write: Any, rows: Callable[[], int], encode: Callable[[Any], bytes]
) -> None:
    """`declared: true` was quoted back as Python's `True` (operator's docs walk)."""
    before = rows()
    given = write("m.txt", encode(definition("m", declared=True)))
    line = refused_in_one_line(run("model", "add", given))
    assert line.startswith(f"error: {given}: declared: true is what model show says")
    assert line.endswith("leave declared out (got true)")
    assert rows() == before


@pytest.mark.parametrize("cpu_profiles", [1, 2000])
def test_warnings_given_back_wrong_are_refused_quoting_the_first(
    run: Run, write: Any, rows: Callable[[], int], cpu_profiles: int
) -> None:
    """The refusal quoted every worked-out warning: 2,000 CPU-only profiles
    made a 157 KB line (review)."""
    profiles = [{"name": f"cpu{i}"} for i in range(cpu_profiles)]
    given = definition("m", profiles=profiles) | {"warnings": ["bogus"]}
    before = rows()
    line = refused_in_one_line(run("model", "add", write("m.json", as_json(given))))
    first = "profile 'cpu0' runs without a GPU and declares no memory (min_memory_gb)"
    has = f"1: {first}" if cpu_profiles == 1 else f"2,000, the first: {first}"
    assert f"warnings: are worked out, not set: this definition has {has} (got list)" in line
    assert len(line) < 300
    assert rows() == before


def test_the_list_says_which_models_have_warnings_the_table_cannot_show(
    run: Run, write: Any
) -> None:
    """KubeAI's catalog declares eight CPU-only models without host memory:
    loaded with a warning each, which only ``model show`` and ``--json`` told
    (operator's walk)."""
    declared = [spec(f"cpu-{i}", profiles=(CPU_NO_MEMORY,)) for i in range(7)]
    config = write("declared.yaml", config_yaml(spec("gpu"), *declared).encode())
    listed = ok(run("--config", config, "model", "list"))
    assert "cpu-6" in listed.stdout and "warning" not in listed.stdout
    assert listed.stderr == (
        "warning: 7 models with warnings (cpu-0, cpu-1, cpu-2, cpu-3, cpu-4, …);"
        " model show NAME, or --json, says what\n"
    )
    assert ok(run("--config", config, "model", "list", "--json")).stderr == ""
    assert ok(run("model", "list")).stderr == ""


def test_a_declared_origin_on_a_branch_loads_and_says_it_is_no_commit(
    run: Run, write: Any, rows: Callable[[], int]
) -> None:
    """A branch as a declared origin's revision loads (declared models always
    load), and says what is wrong, as one short of memory does: a runtime
    change is refused one, and the weights commands cannot read it."""
    on_branch = {"repository": "org/d", "revision": "main"}
    declared = spec("d", origin=Origin(repository="org/d", revision="main"))
    config = write("declared.yaml", config_yaml(declared).encode())
    listed = ok(run("--config", config, "model", "list"))
    assert listed.stderr == (
        "warning: 1 model with warnings (d); model show NAME, or --json, says what\n"
    )
    told = (
        "origin.revision: revision 'main' is not a commit id (7-64 lower-case hex digits), "
        "which a runtime change must give and the weights commands need"
    )
    assert ok(run("--config", config, "model", "show", "d")).stderr == f"warning: {told}\n"
    # What show prints can be put back in the config: the warning is worked out.
    shown = json.loads(ok(run("--config", config, "model", "show", "d", "--json")).stdout)
    assert shown.pop("declared") and shown["warnings"] == [told]
    pasted = write("pasted.yaml", as_yaml({"models": [shown]}))
    assert ok(run("--config", pasted, "model", "show", "d", "--json")).stdout.startswith("{")
    before = rows()
    added = write("r.json", as_json(definition("r", origin=on_branch)))
    assert "origin.revision: revision 'main' is not a commit id" in refused_in_one_line(
        run("--config", config, "model", "add", added)
    )
    assert rows() == before


def test_a_config_pasted_from_another_release_s_show_loads_whatever_its_warnings_say(
    run: Run, write: Any
) -> None:
    """Warnings are worked out, and each release works out its own: one more
    (the declared origin's, since 0.3.0) had every command refuse a config
    that 0.2.0 loaded. A model added at runtime is still held to them."""
    shown = definition("d", warnings=["a warning another release gave"])
    config = write("pasted.yaml", as_yaml({"models": [shown]}))
    listed = json.loads(ok(run("--config", config, "model", "list", "--json")).stdout)
    assert [m["name"] for m in listed] == ["d"]
    added = write("r.json", as_json({**shown, "name": "r"}))
    assert "warnings: are worked out, not set" in refused_in_one_line(
        run("--config", config, "model", "add", added)
    )


def test_a_name_that_is_no_utf_8_is_refused_in_one_line_and_its_refusal_kept(run: Run) -> None:
    """A lone surrogate (what Python makes of bytes that are not UTF-8 in an
    argument) as a model's name: the refusal's own record failed to encode
    it, and the command said "unexpected UnicodeEncodeError" (fuzz test)."""
    line = refused_in_one_line(run("model", "scale", "--max", "0", "--", "\ud800"))
    assert line.startswith("error: model '\\ud800': name: '\\ud800' is not a valid name")
    kept = json.loads(ok(run("refusals", "--json")).stdout)
    assert [(r["model"], r["event"]) for r in kept] == [("\\ud800", "Scaled")]


def test_a_filter_that_is_no_utf_8_is_matched_as_the_refusals_keep_it(run: Run, write: Any) -> None:
    """`refusals --model`, `audit --by`, `history --by`... given a lone
    surrogate (bytes that are not UTF-8 in an argument) said "unexpected
    UnicodeEncodeError" (review; `log --by` answered). A filter is matched
    as the columns keep text: the refusal kept of that name is found, and an
    actor no one can have matches nothing."""
    _seeded(run, write)
    refused_in_one_line(run("model", "scale", "--max", "0", "--", "\ud800"))
    kept = json.loads(ok(run("refusals", "--json", "--model", "\ud800")).stdout)
    assert [(r["model"], r["event"]) for r in kept] == [("\\ud800", "Scaled")]
    for args in (
        ["refusals", "--by", "\udcff"],
        ["audit", "--by", "\udcff"],
        ["audit", "--model", "\udcff"],
        ["history", "m", "--by", "\udcff"],
        ["log", "--by", "\udcff"],
    ):
        assert ok(run(*args, "--json")).stdout.strip() in ("", "[]"), args


def test_a_name_no_model_can_have_is_kept_in_the_refusals_by_every_command(
    run: Run, write: Any, rows: Callable[[], int]
) -> None:
    """Refused as a model add of it was, and written nothing, but kept in the
    refusals only by the add: the others checked the name before the write
    that keeps refusals (model-based test)."""
    _seeded(run, write)
    before = rows()
    for args in (
        ["model", "scale", "sp ace", "--max", "2"],
        ["model", "owner", "sp ace", "team:x"],
        ["model", "remove", "sp ace"],
    ):
        assert "'sp ace' is not a valid name" in refused_in_one_line(run(*args))
    assert rows() == before
    kept = json.loads(ok(run("refusals", "--json")).stdout)
    assert [(r["model"], r["event"]) for r in kept] == [
        ("sp ace", "Scaled"),
        ("sp ace", "OwnerSet"),
        ("sp ace", "Removed"),
    ]


def test_a_command_option_wins_over_the_root_one(run: Run, write: Any) -> None:
    _seeded(run, write)
    ok(run("--by", "root-actor", "model", "scale", "m", "--max", "3", "--by", "command-actor"))
    (line,) = ok(run("log", "--json", "--after", "1")).stdout.splitlines()
    assert json.loads(line)["by"] == "command-actor"


@pytest.mark.parametrize(
    ("option", "value", "command"),
    [
        ("--max", "1_0", ["model", "scale", "m"]),  # ten replicas, to Python
        ("--min", " 0", ["model", "scale", "m", "--max", "3"]),
        ("--memory-gb", "+8", ["model", "resources", "m"]),
        ("--expected-revision", "0_2", ["model", "scale", "m", "--max", "3"]),
        ("--limit", "5\n", ["log"]),
        ("--after", "１", ["log"]),  # a full-width 1
    ],
)
def test_a_whole_number_option_is_written_in_digits(
    run: Run, write: Any, rows: Callable[[], int], option: str, value: str, command: list[str]
) -> None:
    """Python's int() reads ``1_0`` as 10 and `` 0``, ``+8`` as 0 and 8: a slip
    in --max or --expected-revision changed what was asked (hostile test)."""
    _seeded(run, write)
    ok(run("model", "scale", "m", "--max", "2"))  # the log is at revision 2
    before = rows()
    refused = run(*command, option, value)
    assert refused.exit_code == 2, refused.stderr
    assert refused.stderr.splitlines()[-1] == (
        f"Error: Invalid value for '{option}': {value!r} is not a whole number in digits"
    )
    assert rows() == before


def test_a_whole_number_option_with_no_bounds_says_none_in_its_help(run: Run) -> None:
    """Made a range with no bounds, --min and --max showed ``[x<=None]`` (review)."""
    for command in (["model", "scale"], ["model", "resources"]):
        shown = run(*command, "--help")
        assert shown.exit_code == 0 and "None" not in shown.output, shown.output


@pytest.mark.parametrize(
    "options",
    [
        (["--expected-revision", "1"], ["--expected-revision", "2"]),
        ([], ["--expected-revision", "2", "--expected-revision", "1"]),
        (["--expected-revision", "2", "--expected-revision", "1"], []),
    ],
    ids=["root-and-command", "twice-on-the-command", "twice-on-the-root"],
)
def test_an_expected_revision_given_twice_must_be_one(
    run: Run, write: Any, rows: Callable[[], int], options: tuple[list[str], list[str]]
) -> None:
    """Unlike `--by`, a condition: the command's value won, and a stale one a
    wrapper gave on the root was dropped without a word (hostile test)."""
    _seeded(run, write)
    ok(run("model", "scale", "m", "--max", "2"))  # the log is at revision 2
    before = rows()
    root, command = options
    refused = run(*root, "model", "scale", "m", "--max", "3", *command)
    assert refused.exit_code == 2, refused.stderr
    assert refused.stderr.splitlines()[-1] == (
        "Error: Invalid value for '--expected-revision': given as 1 and as 2: the log cannot"
        " be at both; give it once"
    )
    assert rows() == before
    ok(
        run(
            "--expected-revision",
            "2",
            "model",
            "scale",
            "m",
            "--max",
            "3",
            "--expected-revision",
            "2",
        )
    )
    assert rows() == before + 1


def test_the_actor_comes_from_the_environment_without_by(
    run: Run, write: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CATALOG_ES_ACTOR", "ci-bot")
    _seeded(run, write)
    (line,) = ok(run("log", "--json")).stdout.splitlines()
    assert json.loads(line)["by"] == "ci-bot"


@pytest.mark.parametrize("where", ["root", "command"])
def test_expected_revision_works_before_and_after_the_command(
    run: Run, write: Any, rows: Callable[[], int], where: str
) -> None:
    _seeded(run, write)

    def scale(revision: int) -> Result:
        option = ["--expected-revision", str(revision)]
        args = ["model", "scale", "m", "--max", "4"]
        return run(*option, *args) if where == "root" else run(*args, *option)

    assert "the log is at revision 1, not 0" in refused_in_one_line(scale(0))
    # Past the head, it said "read it again and retry": with it, no retry can succeed.
    assert refused_in_one_line(scale(100)) == (
        "error: the log is at revision 1, not 100: revision 100 was never written"
    )
    assert rows() == 1
    assert ok(scale(1)).stdout.startswith("scaled m at revision 2")


def test_db_and_config_come_from_the_environment(
    tmp_path: Path, write: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CATALOG_ES_DB", f"sqlite:///{tmp_path}/from-env.db")
    monkeypatch.setenv(
        "CATALOG_ES_CONFIG", write("declared.yaml", config_yaml(spec("declared")).encode())
    )
    listed = json.loads(ok(CliRunner().invoke(cli, ["model", "list", "--json"])).stdout)
    assert [(m["name"], m["declared"]) for m in listed] == [("declared", True)]
    ok(CliRunner().invoke(cli, ["model", "add", write("m.yaml", as_yaml(definition("m")))]))
    assert (tmp_path / "from-env.db").exists()


@pytest.mark.parametrize(
    ("args", "told"),
    [
        (["--db", "", "model", "list"], "error: --db is empty: give a database URL"),
        (["--config", "", "model", "list"], "error: --config is empty: give a config file"),
        (["token", "list", "--tokens", ""], "error: --tokens is empty: give a tokens file"),
        (["model", "updates", "--mirror", ""], "error: --mirror is empty: give a mirror"),
        (["model", "add", ""], "error: FILE is empty: give a file's path, or - for standard"),
        (["apply", ""], "error: FILE is empty: give a file's path, or - for standard input"),
    ],
)
def test_an_option_given_empty_is_refused_not_taken_for_its_default(
    tmp_path: Path, write: Any, monkeypatch: pytest.MonkeyPatch, args: list[str], told: str
) -> None:
    """`--db "$URL"` with the variable unset wrote to ./catalog.db, and
    `--config ''` read ./catalog.yaml: another log, or another declared
    layer, than the one meant (hostile test). A FILE given empty was told
    as `error: : Is a directory` (the working one)."""
    monkeypatch.chdir(tmp_path)
    write("catalog.yaml", config_yaml(spec("declared")).encode())
    monkeypatch.setenv("CATALOG_ES_DB", f"sqlite:///{tmp_path}/from-env.db")
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert result.stderr.startswith(told) and result.stderr.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["catalog.yaml"]  # nothing made


@pytest.mark.parametrize(
    ("variable", "args", "what"),
    [
        ("CATALOG_ES_DB", ["model", "list"], "a database URL"),
        ("CATALOG_ES_CONFIG", ["model", "list"], "a config file"),
        ("CATALOG_ES_TOKENS", ["token", "list"], "a tokens file"),
        ("CATALOG_ES_MIRROR", ["model", "updates"], "a mirror directory"),
        ("CATALOG_ES_WEIGHTS", ["model", "updates", "--mirror", "."], "a weights directory"),
        ("CATALOG_ES_ACTOR", ["model", "scale", "runtime", "--max", "2"], "an actor"),
    ],
)
def test_a_variable_set_empty_is_refused_as_its_option_given_empty_is(
    tmp_path: Path,
    write: Any,
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    args: list[str],
    what: str,
) -> None:
    """`CATALOG_ES_DB=$URL` with the variable unset was taken as unset: a
    read made ./catalog.db and listed it, and the config, tokens and weights
    fell back to the working directory's, where `--db ''` and the others are
    refused (hostile test); the actor fell back to the OS user, recorded
    as who made the change."""
    monkeypatch.chdir(tmp_path)
    write("catalog.yaml", config_yaml(spec("declared")).encode())
    monkeypatch.setenv("CATALOG_ES_DB", f"sqlite:///{tmp_path}/from-env.db")
    monkeypatch.setenv(variable, "")
    result = CliRunner().invoke(cli, args)
    assert refused_in_one_line(result) == (
        f"error: ${variable} is set but empty: give {what}, or unset it"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["catalog.yaml"]  # nothing made


@pytest.mark.parametrize(
    "setting",
    [
        "COMPRESSOR_TOPIC=zlib",
        "CATALOG_COMPRESSOR_TOPIC=zlib",
        "TRANSCODER_TOPIC=elsewhere:Transcoder",
        "MAPPER_TOPIC=eventsourcing.persistence:Mapper",
        "CATALOG_MAPPER_TOPIC=eventsourcing.persistence:Mapper",
        "PERSISTENCE_MODULE=eventsourcing.popo",
        "CATALOG_PERSISTENCE_MODULE=eventsourcing.sqlite",
        "IS_SNAPSHOTTING_ENABLED=maybe",
        "AGGREGATE_CACHE_MAXSIZE=many",
        "AGGREGATE_CACHE_FASTFORWARD=maybe",
        "AGGREGATE_CACHE_FASTFORWARD_SKIPPING=maybe",
        "DEEPCOPY_FROM_AGGREGATE_CACHE=maybe",
        "CATALOG_CATALOG_ES_DB=sqlite:///elsewhere.db",
    ],
)
def test_the_event_librarys_settings_in_the_environment_are_not_taken(
    tmp_path: Path, write: Any, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    """eventsourcing merges the process environment into its settings: an
    operator's shell holding another app's COMPRESSOR_TOPIC had each new
    event stored compressed, which every reader here took for corrupt (the
    catalog lost them); PERSISTENCE_MODULE, MAPPER_TOPIC and bad cache
    settings failed every command with a traceback's last line, and
    CATALOG_CATALOG_ES_DB wrote to another log than --db (hostile test)."""
    monkeypatch.chdir(tmp_path)
    variable, _, value = setting.partition("=")
    monkeypatch.setenv(variable, value)
    db = tmp_path / "catalog.db"
    added = ["--db", f"sqlite:///{db}", "model", "add", write("m.yaml", as_yaml(definition("m")))]
    ok(CliRunner().invoke(cli, added))
    shown = ok(CliRunner().invoke(cli, ["--db", f"sqlite:///{db}", "log", "--json"]))
    assert shown.stderr == ""
    assert [json.loads(line)["model"] for line in shown.stdout.splitlines()] == ["m"]
    with closing(sqlite3.connect(db)) as conn:
        stored = conn.execute("SELECT topic, state FROM catalog_events ORDER BY revision")
        events = [decode_event(topic, state) for topic, state in stored]
    assert [type(e).__qualname__ for e in events] == ["Model.Added"]
    assert not (tmp_path / "elsewhere.db").exists()


@pytest.mark.parametrize(
    "variable", ["CIPHER_TOPIC", "CIPHER_KEY", "CATALOG_CIPHER_TOPIC", "CATALOG_CIPHER_KEY"]
)
def test_the_event_librarys_cipher_settings_are_refused_not_ignored(
    tmp_path: Path, write: Any, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    """The library's other settings are ignored, but one who set CIPHER_KEY
    believes the log is encrypted at rest, which catalog-es does not do:
    every command that opens the log is refused, a read too, before
    anything is made or written."""
    monkeypatch.chdir(tmp_path)
    db = f"sqlite:///{tmp_path / 'catalog.db'}"
    added = ["--db", db, "model", "add", write("m.yaml", as_yaml(definition("m")))]
    told = (
        f"error: ${variable} is set, but catalog-es does not encrypt its log: events would be "
        "stored unencrypted; unset it for catalog-es (encrypt the database's storage instead)"
    )
    monkeypatch.setenv(variable, "eventsourcing.cipher:AESCipher")
    assert refused_in_one_line(CliRunner().invoke(cli, added)) == told
    assert not (tmp_path / "catalog.db").exists()
    monkeypatch.delenv(variable)
    ok(CliRunner().invoke(cli, added))
    before = log_rows(db)
    monkeypatch.setenv(variable, "eventsourcing.cipher:AESCipher")
    assert refused_in_one_line(CliRunner().invoke(cli, added)) == told
    assert refused_in_one_line(CliRunner().invoke(cli, ["--db", db, "log"])) == told
    assert log_rows(db) == before
    monkeypatch.setenv(variable, "")  # empty is unset, as the library reads it
    ok(CliRunner().invoke(cli, ["--db", db, "log"]))


def test_the_token_commands_open_no_log_and_are_not_refused_for_a_cipher_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokens file is not the log: an operator who set CIPHER_KEY for
    another app still manages the HTTP API's tokens."""
    monkeypatch.setenv("CIPHER_KEY", "x")
    tokens = str(tmp_path / "tokens.json")
    ok(CliRunner().invoke(cli, ["token", "add", "alice", "--tokens", tokens]))
    listed = ok(CliRunner().invoke(cli, ["--json", "token", "list", "--tokens", tokens]))
    assert [entry["actor"] for entry in json.loads(listed.stdout)] == ["alice"]


def test_the_event_librarys_time_zone_in_the_environment_is_not_taken(tmp_path: Path) -> None:
    """eventsourcing resolves $TZINFO_TOPIC as it is imported, for
    timestamps catalog-es does not take: another app's, not importable
    here, failed every command that loads the log (`error: unexpected
    TopicError`; hostile test)."""
    db = f"sqlite:///{tmp_path}/catalog.db"
    definition_file = tmp_path / "m.yaml"
    definition_file.write_bytes(as_yaml(definition("m")))
    runs = [
        subprocess.run(
            [sys.executable, "-m", "catalog_es", "--db", db, *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "TZINFO_TOPIC": "elsewhere.clock:LOCAL"},
        )
        for args in (["model", "add", str(definition_file)], ["log", "--json"])
    ]
    assert [run.returncode for run in runs] == [0, 0], [run.stderr for run in runs]
    assert [json.loads(line)["model"] for line in runs[1].stdout.splitlines()] == ["m"]


def test_counts_in_a_shown_model_are_singular_or_plural_as_they_read(run: Run, write: Any) -> None:
    """It printed "1 cores", "(1 files)" and "(4 GPU)" (operator walkthrough)."""
    profiles = [
        {"name": "big", "gpus": 4, "min_memory_gb": 256, "cpu_cores": 1},
        {"name": "small", "gpus": 1, "min_memory_gb": 32, "cpu_cores": 2},
    ]
    origin = {"repository": "org/m", "revision": "a" * 40, "files": {"w.bin": "b" * 64}}
    shown = ok(
        run(
            "model",
            "add",
            write("m.yaml", as_yaml(definition("m", profiles=profiles, origin=origin))),
        )
    ).stdout
    assert "big (4 GPUs, 256 GB, 1 core); small (1 GPU, 32 GB, 2 cores)" in shown
    assert f"org/m@{'a' * 40} (1 file)" in shown


def test_a_shown_origin_leaves_out_the_parts_it_lacks(run: Run, write: Any) -> None:
    """An origin of files alone showed as `@ (1 file)`, and a declared
    `origin: {}`, which holds nothing, as `@ (0 files)` (hostile test)."""
    files = {"w.bin": "b" * 64}
    declared = (
        spec("files-only", origin=Origin(files=files)),
        spec("empty", origin=Origin()),
        spec("repository-only", origin=Origin(repository="org/x")),
    )
    config = write("declared.yaml", config_yaml(*declared).encode())

    def origin_line(name: str) -> list[str]:
        shown = ok(run("--config", config, "model", "show", name)).stdout
        return [line.split(None, 1)[1] for line in shown.splitlines() if line.startswith("origin")]

    assert origin_line("files-only") == ["1 file"]
    assert origin_line("empty") == []
    assert origin_line("repository-only") == ["org/x@ (0 files)"]  # as cli.md shows it


def test_an_empty_profile_is_refused_not_taken_for_every_profile(
    run: Run, write: Any, db_url: str
) -> None:
    """`--profile "$P"` with the variable unset changed every profile, a
    large one's memory cut to a small one's (hostile test)."""
    profiles = [
        {"name": "big", "gpus": 4, "min_memory_gb": 256},
        {"name": "small", "gpus": 1, "min_memory_gb": 32},
    ]
    ok(run("model", "add", write("m.yaml", as_yaml(definition("m", profiles=profiles)))))
    before = count_events(db_url)
    line = refused_in_one_line(run("model", "resources", "m", "--profile", "", "--memory-gb", "8"))
    assert line == "error: --profile is empty: give a profile's name, or leave --profile out"
    assert count_events(db_url) == before
    shown = json.loads(ok(run("model", "show", "m", "--json")).stdout)
    assert [p["min_memory_gb"] for p in shown["profiles"]] == [256, 32]
    # Left out, it still means every profile.
    ok(run("model", "resources", "m", "--memory-gb", "8"))
    shown = json.loads(ok(run("model", "show", "m", "--json")).stdout)
    assert [p["min_memory_gb"] for p in shown["profiles"]] == [8, 8]


def test_removing_a_fallback_says_how_to_change_the_models_that_name_it(
    run: Run, write: Any, db_url: str
) -> None:
    """It said "change their fallbacks first", and no command does: a model
    is added again with new ones (operator's docs walk). What it says works."""
    ok(run("model", "add", write("small.yaml", as_yaml(definition("small")))))
    ok(run("model", "add", write("big.yaml", as_yaml(definition("big", fallbacks=["small"])))))
    before = count_events(db_url)
    line = refused_in_one_line(run("model", "remove", "small"))
    assert line == (
        "error: model 'small': fallbacks: is a fallback of 'big'; add that model again "
        "without 'small' in its fallbacks first "
        "(model show 'big' --json > FILE, edit it, model add FILE)"
    )
    assert count_events(db_url) == before
    shown = json.loads(ok(run("model", "show", "big", "--json")).stdout)
    ok(run("model", "add", write("FILE", as_json({**shown, "fallbacks": []}))))
    ok(run("model", "remove", "small"))


# -- reading a definition -------------------------------------------------------------


@pytest.mark.parametrize("encode", [as_json, as_yaml], ids=["json", "yaml"])
def test_model_add_dash_reads_standard_input(run: Run, encode: Callable[[Any], bytes]) -> None:
    result = ok(run("--json", "model", "add", "-", input=encode(definition("piped"))))
    out = json.loads(result.stdout)
    assert (out["revision"], out["model"]["name"], out["replaced"]) == (1, "piped", False)


def in_a_shell(db: str, command: str, redirection: str) -> subprocess.CompletedProcess[str]:
    """The CLI on ``db`` run by a shell, with ``redirection`` (`<&-`, `>/dev/full`)."""
    return subprocess.run(
        f'exec "{sys.executable}" -m catalog_es --db {db} {command} {redirection}',
        shell=True,
        cwd=Path(__file__).parent.parent,  # the code under test, not an installed copy
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def python(*args: str, preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen[str]:
    """Python running ``args`` on the code under test, its input and output
    piped; ``preexec_fn`` run in the child first."""
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=Path(__file__).parent.parent,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
    )


def _an_older_python_3_11() -> str | None:
    """A Python 3.11 on this machine older than 3.11.7, whose RLock has no
    ``_recursion_count`` (Debian 12's is 3.11.2), or None."""
    for found in sorted({shutil.which("python3.11") or "", "/usr/bin/python3.11"} - {""}):
        asked = subprocess.run(
            [found, "-c", "import sys; print((3, 11) <= sys.version_info[:3] < (3, 11, 7))"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if asked.stdout.strip() == "True":
            return found
    return None


def test_a_write_runs_on_a_python_3_11_older_than_3_11_7(tmp_path: Path) -> None:
    """pyproject takes any 3.11, but a write asked the write lock's RLock for
    ``_recursion_count``, which came in 3.11.7: on 3.11.2 (Debian 12's) every
    write was `error: unexpected AttributeError` (hostile test). Run there,
    on this checkout and the packages of the Python running the tests."""
    older = _an_older_python_3_11()
    if older is None:
        pytest.skip("no Python 3.11 older than 3.11.7 on this machine")
    (tmp_path / "changes.yaml").write_bytes(
        as_yaml([{"add": definition("a")}, {"scale": {"name": "a", "max": 2}}])
    )
    packages = [entry for entry in sys.path if entry.endswith("site-packages")]
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), *packages]),
    }
    db = f"sqlite:///{tmp_path / 'catalog.db'}"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [older, "-m", "catalog_es", "--db", db, *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env=environment,
            check=False,
        )

    applied = run("apply", "changes.yaml")
    assert (applied.returncode, applied.stdout) == (0, "applied 2 changes, now at revision 2\n")
    assert "error" not in applied.stderr
    assert run("revision").stdout == "2\n"


def test_ctrl_c_while_the_command_line_loads_is_no_traceback(tmp_path: Path) -> None:
    """The service's imports, once a command opens the log, take most of a
    second: a Ctrl-C in them printed a traceback through SQLAlchemy's
    (hostile test). Sent once SQLAlchemy's are under way, told by ``-X
    importtime`` as each one ends."""
    loading = python(
        "-X", "importtime", "-m", "catalog_es", "--db", f"sqlite:///{tmp_path}/c.db", "revision"
    )
    try:
        assert loading.stderr is not None
        for line in loading.stderr:
            if "sqlalchemy" in line:
                break
        else:
            pytest.fail("the command ended before it imported sqlalchemy")
        loading.send_signal(signal.SIGINT)
        out, err = loading.communicate(timeout=30)
    finally:
        loading.kill()
    assert (loading.returncode, out) == (1, "")
    assert err.endswith("\nAborted!\n") and "Traceback" not in err, err[-2000:]


def test_ctrl_c_in_an_exec_as_the_service_loads_leaves_1_not_death_by_sigint(
    tmp_path: Path,
) -> None:
    """dataclasses and SQLAlchemy build functions from source text with
    ``exec`` as the service loads. A Ctrl-C in one was told ``Aborted!``,
    but ``python -m catalog_es`` then killed itself with SIGINT as it
    exited (status 130, which says a write stands), one Ctrl-C in six as a
    command loaded (hostile test). Landed there at once: an ``exec`` of
    text that sends it, as the command opens the log."""
    (tmp_path / "interrupted_in_exec.py").write_text(
        "import os, signal\n"
        "from catalog_es import bootstrap\n"
        "from catalog_es.__main__ import main\n"
        "opened = bootstrap.open_models\n"
        "def open_models(*args, **kwargs):\n"
        "    exec('os.kill(os.getpid(), signal.SIGINT)\\nimport time\\ntime.sleep(5)')\n"
        "    return opened(*args, **kwargs)\n"
        "bootstrap.open_models = open_models\n"
        "main()\n"
    )
    code, db = Path(__file__).parent.parent, f"sqlite:///{tmp_path}/c.db"
    told = subprocess.run(
        [sys.executable, "-m", "interrupted_in_exec", "--db", db, "revision"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(tmp_path)])},
        check=False,
    )
    assert (told.returncode, told.stdout) == (1, ""), told.stderr[-2000:]
    assert told.stderr.endswith("\nAborted!\n") and "Traceback" not in told.stderr


# A stop (Ctrl-C, SIGTERM, SIGHUP; ``STOP``) sent as the commit begins or
# returns, as the answer is written, as the log is closed (an engine
# disposed, a WAL checkpoint), and once the command line has returned (in
# the interpreter's shutdown).
STOP_WHEN = {
    # SQLite's COMMIT about to be sent: the write is rolled back.
    "as-the-commit-begins": (
        "from catalog_es.storage import engines\n"
        "end = engines.end_transaction\n"
        "def interrupted(conn, driver, *, commit):\n"
        "    if commit:\n"
        "        os.kill(os.getpid(), STOP)\n"
        "        time.sleep(5)\n"
        "    end(conn, driver, commit=commit)\n"
        "engines.end_transaction = interrupted\n"
        "main()\n"
    ),
    # SQLite's COMMIT returned, the write not yet told done.
    "as-the-commit-returns": (
        "from catalog_es.storage import engines\n"
        "end = engines.end_transaction\n"
        "def interrupted(conn, driver, *, commit):\n"
        "    end(conn, driver, commit=commit)\n"
        "    if commit:\n"
        "        os.kill(os.getpid(), STOP)\n"
        "        time.sleep(5)\n"
        "engines.end_transaction = interrupted\n"
        "main()\n"
    ),
    "writing-the-answer": (
        "from catalog_es.cli import base\n"
        "def interrupted(lines):\n"
        "    os.kill(os.getpid(), STOP)\n"
        "    time.sleep(5)\n"
        "base.write_out = interrupted\n"
        "main()\n"
    ),
    "closing-the-log": (
        "from catalog_es.application import Models\n"
        "close = Models.close\n"
        "def interrupted(models):\n"
        "    os.kill(os.getpid(), STOP)\n"
        "    time.sleep(0.2)\n"
        "    close(models)\n"
        "Models.close = interrupted\n"
        "main()\n"
    ),
    "shutting-down": (
        "try:\n    main()\nfinally:\n    os.kill(os.getpid(), STOP)\n    time.sleep(0.2)\n"
    ),
}


def with_a_stop(argv: list[str], when: str, stop: signal.Signals = signal.SIGINT) -> list[str]:
    """Python's arguments to run the command line ``argv`` with ``stop``
    sent ``when``."""
    return [
        "-c",
        f"import os, signal, sys, time\nfrom catalog_es.__main__ import main\nsys.argv = {argv!r}\n"
        f"STOP = signal.{stop.name}\n" + STOP_WHEN[when],
    ]


def adding_with_a_stop(
    db_url: str, tmp_path: Path, when: str, *options: str, stop: signal.Signals = signal.SIGINT
) -> list[str]:
    """Python's arguments to run the command line adding a model, ``options``
    before the command, with ``stop`` sent ``when``."""
    config = tmp_path / "catalog.yaml"
    config.write_text("models: []\n")
    argv = ["catalog-es", "--db", db_url, "--config", str(config), *options, "model", "add", "-"]
    return with_a_stop(argv, when, stop)


# The status of a command a stop ended: 130 for Ctrl-C, as documented; death
# by SIGTERM or SIGHUP, as a supervisor expects of the stop it sent.
STOPPED_STATUS = {signal.SIGINT: 130, **{stop: -stop for stop in (signal.SIGTERM, signal.SIGHUP)}}


@EVERY_STOP
@pytest.mark.parametrize("when", ["closing-the-log", "shutting-down"])
def test_a_stop_once_a_write_is_told_leaves_its_exit_status_0(
    db_url: str, tmp_path: Path, when: str, stop: signal.Signals
) -> None:
    """The answer printed, the change committed, a Ctrl-C that followed
    killed the process in its shutdown (status 130, in a fifth of the runs
    of a hostile test), or said `Aborted!` and 1 as it closed the log
    (review): a script would make the change again. It is let be, and so
    are a SIGTERM and a SIGHUP, which killed it (143, 129)."""
    told = python(*adding_with_a_stop(db_url, tmp_path, when, stop=stop))
    out, err = told.communicate(yaml.safe_dump(definition("m")), timeout=60)
    assert told.returncode == 0
    assert "KeyboardInterrupt" not in err and "Aborted" not in err
    assert out.startswith("added m at revision 1\n")
    assert count_events(db_url) == 1


@EVERY_STOP
@pytest.mark.parametrize("when", ["as-the-commit-returns", "writing-the-answer"])
def test_a_stop_after_the_commit_before_the_answer_is_told_says_the_change_stands(
    tmp_path: Path, when: str, stop: signal.Signals
) -> None:
    """Cut off as its commit returned, or as its answer was made or written
    (a large apply's, a rollback's), a command said `Aborted!` and 1, which
    says nothing was written, of a change committed (hostile tests). A
    SIGTERM (a supervisor's, a script's timeout, a CI job cancelled), or a
    SIGHUP, killed it without a word (143, 129): each says what stands, as
    Ctrl-C does, and the process then ends by it."""
    db_url = f"sqlite:///{tmp_path}/catalog.db"
    told = python(*adding_with_a_stop(db_url, tmp_path, when, "--json", stop=stop))
    out, err = told.communicate(yaml.safe_dump(definition("m")), timeout=60)
    stopped = "stopped: what it wrote stands, up to revision 1\n"
    assert (told.returncode, out, err) == (STOPPED_STATUS[stop], "", stopped)
    assert count_events(db_url) == 1


@EVERY_STOP
def test_a_stop_before_the_commit_rolls_the_write_back_and_says_aborted(
    tmp_path: Path, stop: signal.Signals
) -> None:
    """Cut off as it was about to commit, a write is rolled back and the
    command says `Aborted!`: with 1 of a Ctrl-C; a SIGTERM or a SIGHUP
    still ends the process by it, as it did without a word."""
    db_url = f"sqlite:///{tmp_path}/catalog.db"
    told = python(*adding_with_a_stop(db_url, tmp_path, "as-the-commit-begins", stop=stop))
    out, err = told.communicate(yaml.safe_dump(definition("m")), timeout=60)
    status = 1 if stop == signal.SIGINT else -stop
    assert (told.returncode, out, err) == (status, "", "\nAborted!\n")
    assert count_events(db_url) == 0


@pytest.mark.parametrize(
    "stop", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=["sigterm", "sighup", "sigkill"]
)
def test_a_read_stopped_on_a_path_with_no_log_leaves_no_empty_log_behind(
    tmp_path: Path, stop: signal.Signals
) -> None:
    """A read on a path with no log answered from an empty log made in a
    folder of the system's temporary folder: a SIGTERM or a SIGHUP as it
    answered killed it, and that folder stayed (hostile test), as it still
    would of a SIGKILL, which no process can act on. The empty log is in
    memory: nothing of it outlives the process."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    argv = ["catalog-es", "--db", f"sqlite:///{tmp_path}/typo.db", "model", "list"]
    told = subprocess.run(
        [sys.executable, *with_a_stop(argv, "writing-the-answer", stop)],
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert list(scratch.iterdir()) == []
    said = "" if stop == signal.SIGKILL else "\nAborted!\n"
    assert (told.returncode, told.stdout, told.stderr) == (-stop, "", said)
    assert list(tmp_path.iterdir()) == [scratch]


def test_ctrl_c_as_the_log_closes_after_an_answer_that_could_not_be_written_leaves_74(
    db_url: str, tmp_path: Path
) -> None:
    """The answer's own status stands too: 74 (the write stands, its answer
    could not be written out) became `Aborted!` and 1 (review)."""
    with Path("/dev/full").open("w") as full:
        told = subprocess.run(
            [sys.executable, *adding_with_a_stop(db_url, tmp_path, "closing-the-log")],
            cwd=Path(__file__).parent.parent,
            input=yaml.safe_dump(definition("m")),
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    assert told.returncode == 74
    assert "Aborted" not in told.stderr and "could not be written out" in told.stderr
    assert count_events(db_url) == 1


@EVERY_STOP
@STOPS_BLOCKED_OR_NOT
def test_watch_stopped_as_asked_says_stopped_and_exits_0(
    run: Run, write: Any, db_url: str, stop: signal.Signals, blocked: bool
) -> None:
    """A follower runs until stopped, by hand or by its supervisor's SIGTERM,
    which killed it (review), or by a hang-up, which killed it too. On
    another config than the log recorded, it says so of no read once it
    stops: it followed the log over its own config, as it was told to.
    Started with the stops blocked, it stopped on none of them (hostile test)."""
    recorded = write("recorded.yaml", as_yaml({"models": [definition("c")]}))
    ok(run("--config", recorded, "model", "add", write("m.yaml", as_yaml(definition("m")))))
    other = write("other.yaml", as_yaml({"models": [definition("d")]}))
    watch = python(
        *("-m", "catalog_es", "--db", db_url, "--config", other, "watch", "--json"),
        preexec_fn=stops_blocked if blocked else None,
    )
    try:
        assert watch.stdout is not None
        assert select.select([watch.stdout], [], [], 30)[0], "watch gave nothing in 30 s"
        assert json.loads(watch.stdout.readline())["model"] is None  # the config's record
        assert json.loads(watch.stdout.readline())["model"] == "m"  # following now
        watch.send_signal(stop)
        _, err = watch.communicate(timeout=30)
    finally:
        watch.kill()
    assert (watch.returncode, err) == (0, STOPS_TOLD[stop])


@EVERY_STOP
def test_watch_stopped_while_the_command_line_loads_says_stopped_and_exits_0(
    db_url: str, stop: signal.Signals
) -> None:
    """Stopped in its first half second, a watch said `Aborted!` and 1, or
    was killed by SIGTERM (hostile tester): its imports came before it took
    the signals over. Sent once an import is under way (``-X importtime``)."""
    watch = python("-X", "importtime", "-m", "catalog_es", "--db", db_url, "watch")
    try:
        assert watch.stderr is not None
        for line in watch.stderr:
            if "catalog_es.errors" in line:
                break
        else:
            pytest.fail("the command line ended before it imported catalog_es.errors")
        watch.send_signal(stop)
        out, err = watch.communicate(timeout=30)
    finally:
        watch.kill()
    assert (watch.returncode, out) == (0, "")
    assert err.endswith(f"\n{STOPS_TOLD[stop]}") and "Aborted" not in err, err[-2000:]


def test_a_second_stop_while_the_command_line_loads_is_acted_on_at_once() -> None:
    """The first is noted, for the command to say ``stopped``; loading may hang
    (a slow file system), and then only SIGKILL ended it (review)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        early_stop.note_stops(["watch"])
        signal.raise_signal(signal.SIGINT)  # noted
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert early_stop.take_over()  # the first is still told
        assert not early_stop.take_over()
    finally:
        early_stop.take_over()
        signal.signal(signal.SIGINT, previous)


def _stopped_at_line(line: int) -> tuple[bool, list[int]]:
    """A ``watch``'s taking over of the stops, with a SIGTERM raised at the
    ``line``-th line it runs (of ``__enter__`` and ``take_over``), if it runs
    that many: whether it was raised, and the signals the handler found got
    (a test's stand-in for the default, death)."""
    taking_over = {StoppedWhenAsked.__enter__.__code__, early_stop.take_over.__code__}
    found: list[int] = []
    raised = started = False
    lines = 0

    def each_line(frame: FrameType, event: str, _arg: object) -> Any:
        nonlocal lines, raised
        if event == "line" and not started:
            lines += 1
            if lines == line:
                raised = True
                signal.raise_signal(signal.SIGTERM)
        return each_line

    def tracer(frame: FrameType, _event: str, _arg: object) -> Any:
        return each_line if frame.f_code in taking_over else None

    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: found.append(signum))
    tracing = sys.gettrace()
    try:
        early_stop.note_stops(["watch"])
        sys.settrace(tracer)
        with pytest.raises(click.exceptions.Exit) as ended, stopped_when_asked():
            started = True
            raise click.exceptions.Exit(0)  # not asked to stop: it ends as a stop would
    finally:
        sys.settrace(tracing)
        early_stop.take_over()
        signal.signal(signal.SIGTERM, previous)
    assert ended.value.exit_code == 0
    return raised, found


def test_a_stop_as_the_command_takes_the_stops_over_is_told(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Between early_stop putting back the handlers it found and the command
    installing its own, a SIGTERM went to the one found, the default: death,
    with no ``stopped`` (review). Raised at each line of the hand-over in
    turn."""
    for line in itertools.count(1):
        raised, found = _stopped_at_line(line)
        if not raised:
            break
        assert (found, capsys.readouterr().err) == ([], "stopped\n"), f"line {line}"
    assert line > 5  # the hand-over was gone through


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["watch"], "watch"),
        (["--db", "watch", "log"], "log"),
        (["--json", "--by=ops", "--reason", "r", "serve", "--port", "1"], "serve"),
        (["--", "watch"], "watch"),
        (["--help"], None),
    ],
)
def test_the_command_an_early_stop_is_noted_for_is_the_one_the_root_runs(
    argv: list[str], named: str | None
) -> None:
    """Read before click is imported: the root's options that take a value
    are those early_stop passes over."""
    assert early_stop.command_named(argv) == named
    valued = {
        name
        for param in cli.params
        if isinstance(param, click.Option) and not param.is_flag
        for name in param.opts
    }
    assert valued == early_stop.ROOT_VALUED_OPTIONS


def test_what_a_stop_brings_about_as_it_unwinds_is_the_stop(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """psycopg cancels the query a Ctrl-C cuts off; handing its connection back
    then failed ("can't change 'autocommit' now"), and a `watch` on PostgreSQL
    exited 1 with that error once in forty stops. An error of its own is
    still told."""
    with stopped_when_asked():
        try:
            raise KeyboardInterrupt
        finally:
            raise sa.exc.ProgrammingError("SET", None, Exception("can't change 'autocommit' now"))
    assert capsys.readouterr().err == "stopped\n"
    with pytest.raises(ValueError), stopped_when_asked():
        raise ValueError("not a stop")


@pytest.mark.parametrize(
    ("first", "then"),
    [
        (signal.SIGTERM, signal.SIGHUP),
        (signal.SIGINT, signal.SIGHUP),
        (signal.SIGHUP, signal.SIGTERM),
    ],
    ids=["sigterm-then-sighup", "ctrl-c-then-sighup", "sighup-then-sigterm"],
)
def test_the_stop_told_is_the_first_of_two(
    capsys: pytest.CaptureFixture[str], first: signal.Signals, then: signal.Signals
) -> None:
    """A supervisor's SIGTERM, then a hang-up as the terminal closed while
    the command stopped, was told ``stopped (SIGHUP: ...)``: named the
    hang-up, not the stop that stopped it (review)."""
    with stopped_when_asked():
        try:
            signal.raise_signal(first)
        finally:
            signal.raise_signal(then)
    assert capsys.readouterr().err == STOPS_TOLD[first]


def test_a_dash_with_standard_input_closed_is_one_line(tmp_path: Path) -> None:
    """Started with standard input closed (`<&-`), Python has none at all."""
    db = f"sqlite:///{tmp_path}/catalog.db"
    for command in ("model add", "apply"):
        done = in_a_shell(db, f"{command} -", "<&-")
        assert done.returncode == 1, command
        # The log the run opened is new, and said to be (the path may be mistyped).
        assert done.stderr.startswith("error: standard input: closed, there is nothing to read")
        assert len(done.stderr.splitlines()) == 1, command
    assert not (tmp_path / "catalog.db").exists() or count_events(db) == 0


def test_re_adding_says_it_replaced(run: Run, write: Any) -> None:
    _seeded(run, write)
    path = write("m2.json", as_json(definition("m", source="s3://w/m-v2")))
    assert ok(run("model", "add", path)).stdout.startswith("replaced m at revision 2")
    assert json.loads(ok(run("--json", "model", "add", path)).stdout)["replaced"] is True


def test_re_adding_a_model_load_skipped_says_it_replaced(run: Run, write: Any) -> None:
    """Its stored definition is replaced (which heals it), in either output."""
    for name in ("m", "n"):
        ok(run("model", "add", write(f"{name}.yaml", as_yaml(definition(name, engine="tgi")))))
    config = write("c.yaml", config_yaml(engines=["vllm"]).encode())
    added = ok(run("--config", config, "model", "add", write("m2.yaml", as_yaml(definition("m")))))
    # Revision 3 records the new declared config.
    assert added.stdout.startswith("replaced m at revision 4")
    again = ok(
        run(
            "--config", config, "--json", "model", "add", write("n2.yaml", as_yaml(definition("n")))
        )
    )
    assert json.loads(again.stdout)["replaced"] is True


# -- bad input: one line, exit 1, nothing written --------------------------------------

TEN_KB_NAME = "n" * 10_240


def _with(**fields: Any) -> dict[str, Any]:
    return {**definition("new"), **fields}


def _profile(**fields: Any) -> list[dict[str, Any]]:
    return [{"name": "gpu", "gpus": 1, **fields}]


BAD_FILES = [
    pytest.param(b"name: [unclosed\nengine: vllm\n", "not valid YAML", id="malformed-yaml"),
    # libyaml says half of these as a context, each half with its own place.
    pytest.param(
        b"name: a\n---\nname: b\n",
        "not valid YAML: expected a single document in the stream (line 1, column 1), "
        "but found another document (line 2, column 1)",
        id="two-documents",
    ),
    pytest.param(
        b"name: &n a\nowner: &n b\n",
        "found duplicate anchor 'n'; first occurrence (line 1, column 7), "
        "second occurrence (line 2, column 8)",
        id="anchor-twice",
    ),
    pytest.param(b'{"name": "new", "engine": ', "not valid JSON", id="malformed-json"),
    pytest.param(as_yaml(_with(colour="red")), "colour: unknown field", id="unknown-field"),
    pytest.param(
        as_yaml(_with(profiles=_profile(surprise=1))),
        "profiles[0].surprise: unknown field",
        id="unknown-nested-field",
    ),
    pytest.param(
        as_json(_with(profiles=_profile(**{"line\nbreak": 1}))),
        "profiles[0]['line\\nbreak']: unknown field",
        id="unknown-field-with-a-line-break",
    ),
    pytest.param(as_json(_with(**{"k" * 10_240: 1})), "['kkkk", id="10kb-unknown-field"),
    # A key as long as a quoted one is shown is still a field's name, unquoted.
    pytest.param(
        as_json(_with(**{"k" * 60: 1})), f": {'k' * 60}: unknown field", id="60-character-field"
    ),
    pytest.param(
        as_json(_with(colour=1, size=2, shape=3)),
        ": colour: unknown field (and 2 more problems)",
        id="three-unknown-fields",
    ),
    # Checked up to the first bad item, not into 100,000 error records.
    pytest.param(
        as_json(_with(profiles=[{"gpus": "x"}] * 50_000)),
        "profiles[0].name: required field is missing (and 1 more problem)",
        id="50000-bad-profiles",
    ),
    pytest.param(
        as_json(_with(**{"profiles[0].gpus": 1})),
        "['profiles[0].gpus']: unknown field",
        id="unknown-field-like-a-path",
    ),
    pytest.param(
        as_json(_with(profiles=_profile(gpus="1"))), "profiles[0].gpus", id="string-for-int"
    ),
    # Told as written, not as Python's datetime.date(2026, 1, 1).
    pytest.param(
        b"name: 2026-01-01\n",
        "name: Input should be a valid string (got 2026-01-01, which YAML reads as a date: "
        "quote it)",
        id="date-for-string",
    ),
    # A short commit id of digits alone, unquoted: told how to write it.
    pytest.param(
        as_yaml(_with(origin={"repository": "org/m", "revision": 1234567})),
        "origin.revision: Input should be a valid string "
        '(got 1234567, a number: write it quoted, "1234567")',
        id="int-for-commit",
    ),
    pytest.param(
        as_json(_with(owner=1.5)),
        'owner: Input should be a valid string (got 1.5, a number: write it quoted, "1.5")',
        id="float-for-owner",
    ),
    # Only a number is told to be quoted: not a list, nor a null.
    pytest.param(
        as_json(_with(owner=["org:a"])),
        "owner: Input should be a valid string (got list)",
        id="list-for-owner",
    ),
    pytest.param(
        as_json(_with(owner=None)),
        "owner: Input should be a valid string (got null)",
        id="null-for-owner",
    ),
    pytest.param(
        as_yaml(_with(profiles=_profile(gpus=date(2026, 1, 1)))),
        "profiles[0].gpus: Input should be a valid integer (got 2026-01-01, which YAML reads "
        "as a date)",
        id="date-for-int",
    ),
    pytest.param(
        as_json(_with(profiles=_profile(gpus=True))), "profiles[0].gpus", id="bool-for-int"
    ),
    pytest.param(
        as_yaml(_with(profiles=_profile(gpus=1.5))), "profiles[0].gpus", id="float-for-int"
    ),
    pytest.param(
        as_json(_with(profiles=_profile(gpus=2.0))), "profiles[0].gpus", id="integral-float"
    ),
    pytest.param(as_yaml(_with(scaling={"min": "1"})), "scaling.min", id="string-scaling"),
    pytest.param(as_yaml(_with(name=123)), "name", id="int-for-name"),
    pytest.param(as_yaml(_with(name="has spaces")), "is not a valid name", id="name-spaces"),
    pytest.param(as_json(_with(name=TEN_KB_NAME)), "is not a valid name", id="10kb-name"),
    pytest.param(
        as_json(_with(profiles=_profile(gpus=-1))), "profiles[0].gpus: cannot be negative", id="neg"
    ),
    pytest.param(
        as_yaml(_with(scaling={"min": -1, "max": 2})), "scaling: min -1", id="negative-scaling"
    ),
    pytest.param(as_yaml(_with(profiles=[])), "at least one profile", id="empty-profiles"),
    pytest.param(as_yaml(_with(name="declared")), "is declared in configuration", id="declared"),
    pytest.param(b"name: new\nname: other\n", "duplicate key 'name'", id="duplicate-key-yaml"),
    pytest.param(b'{"name": "new", "name": "x"}', "duplicate key 'name'", id="duplicate-key-json"),
    pytest.param(
        b"name: &n new\nengine: vllm\nsource: *n\nprofiles: [{name: g, gpus: 1}]\n",
        "aliases (*name) are not accepted",
        id="yaml-alias",
    ),
    pytest.param(as_json(_with(profiles=_profile())).replace(b"1}", b"NaN}"), "NaN", id="json-nan"),
    pytest.param(
        as_json(_with(profiles=_profile())).replace(b"1}", b"Infinity}"), "Infinity", id="json-inf"
    ),
    pytest.param(
        as_yaml(_with(profiles=_profile())).replace(b"gpus: 1", b"gpus: .nan"),
        "profiles[0].gpus",
        id="yaml-nan",
    ),
    pytest.param("name: ünïcode\n".encode("latin-1"), "not UTF-8 text", id="not-utf8"),
    pytest.param(b"", ": empty: give a model definition", id="empty-file"),
    pytest.param(
        b"- just\n- a list\n", ": expected a mapping of fields (got list)", id="not-a-mapping"
    ),
    pytest.param(
        as_yaml(_with(profiles=[{"name": "cpu", "gpus": 0, "cpu_cores": 4}])),
        "declares no memory",
        id="cpu-without-memory",
    ),
    pytest.param(as_yaml(_with(fallbacks=["ghost"])), "names 'ghost'", id="fallback-ghost"),
    pytest.param(as_yaml(_with(engine="triton")), "not a known engine", id="unknown-engine"),
    pytest.param(b"name: !!python/object:os.system x\n", "not valid YAML", id="python-tag"),
    pytest.param(b"#" * (1 << 20) + b"\n", "larger than 1024 KiB", id="oversized"),
]


@pytest.fixture
def seeded(run: Run, write: Any, rows: Callable[[], int]) -> Callable[..., Result]:
    """A catalog with a declared model and a runtime one; returns ``run`` with
    that config, after checking the log length."""
    config = write("declared.yaml", config_yaml(spec("declared")).encode())
    ok(run("--config", config, "model", "add", write("m.yaml", as_yaml(definition("m")))))
    assert rows() == 2  # the declared config's record, and the add
    return lambda *args, **kw: run("--config", config, *args, **kw)


@pytest.mark.parametrize(("content", "message"), BAD_FILES)
def test_a_bad_definition_file_is_refused_in_one_line(
    seeded: Run, write: Any, rows: Callable[[], int], content: bytes, message: str
) -> None:
    line = refused_in_one_line(seeded("model", "add", write("bad-definition", content)))
    assert message in line
    assert len(line) < 500  # a 10 kB name is not echoed back whole
    assert rows() == 2


@pytest.mark.parametrize(("content", "message"), BAD_FILES[:3])
def test_a_bad_definition_on_standard_input_is_refused(
    seeded: Run, rows: Callable[[], int], content: bytes, message: str
) -> None:
    line = refused_in_one_line(seeded("model", "add", "-", input=content))
    assert "standard input" in line and message in line
    assert rows() == 2


# One file named twice with two digests: which one would be recorded?
@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["model", "add", "missing.yaml"], "missing.yaml: No such file", id="no-file"),
        pytest.param(["model", "add", "."], "Is a directory", id="directory"),
        pytest.param(
            ["model", "remove", "ghost"],
            "error: model 'ghost' is not in the catalog",
            id="remove-unknown",
        ),
        pytest.param(["model", "remove", "declared"], "remove it there", id="remove-declared"),
        pytest.param(
            ["model", "scale", "declared", "--max", "2"], "change its scaling there", id="d"
        ),
        pytest.param(["model", "scale", "m", "--min", "-1"], "scaling: min -1", id="scale-neg"),
        pytest.param(["model", "scale", "m", "--min", "3"], "min 3, max 1", id="scale-min>max"),
        pytest.param(
            ["model", "resources", "m", "--memory-gb", "-2"],
            "cannot be negative",
            id="resources-neg",
        ),
        pytest.param(
            ["model", "resources", "m", "--profile", "tpu", "--cpu-cores", "2"],
            "has no profile 'tpu'",
            id="resources-profile",
        ),
        pytest.param(["model", "class", "m", "gold"], "'gold' is not one of", id="class"),
        pytest.param(["model", "owner", "m", "alice"], "is not org:ID", id="owner"),
        pytest.param(["model", "source", "m", "hf://a b"], "white space", id="source-space"),
        pytest.param(
            ["model", "source", "m", "s3://w", "--file", "w.bin=nothex"], "sha256", id="sha"
        ),
        # Given empty (a variable unset), it wrote the source with no origin,
        # exit 0 (hostile test).
        pytest.param(
            ["model", "source", "m", "hf://org/b", "--repository", ""],
            "error: --repository is empty: give a registry repository (org/name), or leave",
            id="empty-repository",
        ),
        pytest.param(
            ["model", "source", "m", "hf://org/b", "--revision", ""],
            "error: --revision is empty: give a commit, or leave --revision out",
            id="empty-revision",
        ),
        pytest.param(["model", "show", TEN_KB_NAME[:200]], "is not a valid name", id="show"),
        pytest.param(
            ["rollback", "--to", "1", "--model", TEN_KB_NAME],
            f"error: model '{TEN_KB_NAME[:40]}…': name: '{TEN_KB_NAME[:39]}… is not a valid name",
            id="rollback-long-name",
        ),
        pytest.param(
            ["model", "scale", "nope", "--max", "2"],
            "error: model 'nope' is not in the catalog",
            id="scale-absent",
        ),
        pytest.param(["--by", "x" * 200, "model", "remove", "m"], "actor", id="long-actor"),
        pytest.param(["--by", "", "model", "remove", "m"], "actor '': must be", id="no-actor"),
        pytest.param(["--by", "a\x1b[2Jb", "model", "remove", "m"], "actor", id="escape-actor"),
        pytest.param(["--by", "\u200b\u2060 ", "model", "remove", "m"], "actor", id="unseen-actor"),
        pytest.param(
            ["--by", "\u3164\u2800\u0301", "model", "remove", "m"], "actor", id="blank-actor"
        ),
        # Stored as given, `audit --by alice` missed its changes (hostile test).
        pytest.param(
            ["--by", " alice", "model", "remove", "m"],
            "error: actor ' alice': begins or ends with a space",
            id="actor-leading-space",
        ),
        pytest.param(
            ["--by", "alice\u00a0", "model", "remove", "m"],
            "error: actor 'alice\\xa0': begins or ends with a space",
            id="actor-trailing-space",
        ),
        pytest.param(
            ["model", "remove", "m", "--reason", "x\u202ey"], "reason: must be", id="bidi-reason"
        ),
    ],
)
def test_a_refused_command_is_one_line_and_writes_nothing(
    seeded: Run, rows: Callable[[], int], args: list[str], message: str
) -> None:
    assert message in refused_in_one_line(seeded(*args))
    assert rows() == 2


def test_a_blank_reason_is_refused_and_none_is_no_reason(
    seeded: Run, rows: Callable[[], int]
) -> None:
    """A reason of spaces (`--reason "$WHY"`, WHY blank) was recorded, as
    an actor of spaces is not: given, a reason holds something to see."""
    for blank in ("   ", "\n \n", "\u200b\u3164"):
        line = refused_in_one_line(seeded("model", "scale", "m", "--max", "3", "--reason", blank))
        assert line == "error: reason: nothing visible in it: say why, or give no reason"
    assert rows() == 2
    ok(seeded("model", "scale", "m", "--max", "3", "--reason", ""))
    assert rows() == 3


def test_a_long_fallback_cycle_is_refused_in_one_short_line(
    run: Run, write: Any, rows: Callable[[], int]
) -> None:
    """A cycle through 1,000 models was told whole: one line of 9 KB. It
    names its first models now, how many more, and the way back."""
    depth = 200
    # Each model falls back to the next, added before it.
    chain = [definition(f"m{depth - 1}")] + [
        definition(f"m{i}", fallbacks=[f"m{i + 1}"]) for i in reversed(range(depth - 1))
    ]
    ok(run("apply", write("chain.yaml", as_yaml([{"add": d} for d in chain]))))
    written = rows()
    closing = write("closing.yaml", as_yaml(definition(f"m{depth - 1}", fallbacks=["m0"])))
    line = refused_in_one_line(run("model", "add", closing))
    assert line.endswith(
        f"form a cycle: m{depth - 1} -> m0 -> m1 -> m2 -> m3 -> … ({depth - 5:,} more)"
        f" -> m{depth - 1}"
    )
    assert rows() == written
    # A declared cycle, refused as the config loads, is told as shortly.
    declared = [spec(f"d{i}", fallbacks=(f"d{(i + 1) % depth}",)) for i in range(depth)]
    config = write("cycle.yaml", config_yaml(*declared).encode())
    line = refused_in_one_line(run("--config", config, "model", "scale", "m0", "--max", "2"))
    assert f"form a cycle: d0 -> d1 -> d2 -> d3 -> d4 -> … ({depth - 5:,} more) -> d0" in line
    assert rows() == written


def test_a_file_path_holding_an_equals_sign_is_split_from_its_digest_at_the_last(
    seeded: Run,
) -> None:
    """`--file x=y.bin=<sha>` was split at the first `=`, and refused: `'y.bin=…'
    is not a lower-case hex sha256 digest` (hostile test). A sha256 holds none."""
    digest = "ab" * 32
    args = ["model", "source", "m", "hf://org/b", "--repository", "org/b"]
    ok(seeded(*args, "--revision", "1111111", "--file", f"x=y.bin={digest}"))
    shown = json.loads(ok(seeded("model", "show", "m", "--json")).stdout)
    assert shown["origin"]["files"] == {"x=y.bin": digest}


def test_an_actor_or_reason_of_emoji_with_joiners_is_text(seeded: Run) -> None:
    """cli.md has emoji and the joiners inside them print as they are; as
    an actor they were refused, Python not calling a joiner printable
    (operator walkthrough)."""
    actor, reason = (
        "\U0001f469\u200d\U0001f4bb dev",
        "na\u00efve \u2014 \u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645",
    )
    ok(seeded("--by", actor, "model", "scale", "m", "--max", "3", "--reason", reason))
    assert _last_by_and_reason(seeded) == (actor, reason)


def _last_by_and_reason(seeded: Run) -> tuple[str, str]:
    """Who made the log's last change, and why, as ``log --json`` tells them."""
    last = json.loads(ok(seeded("log", "--json")).stdout.splitlines()[-1])
    return last["by"], last["reason"]


def test_an_actor_and_a_reason_are_taken_up_to_their_limits_and_quoted_cut_short_past_them(
    seeded: Run, rows: Callable[[], int]
) -> None:
    """128 characters of actor and 1,000 of reason are recorded; one more is
    refused, the actor quoted by its first 40 characters."""
    actor, reason = "a" * 128, "r" * 1000
    ok(seeded("--by", actor, "model", "scale", "m", "--max", "3", "--reason", reason))
    assert _last_by_and_reason(seeded) == (actor, reason)
    written = rows()
    scale = ("model", "scale", "m", "--max", "4")
    assert refused_in_one_line(seeded("--by", actor + "a", *scale)) == (
        f"error: actor '{'a' * 40}': must be 1-128 characters, some of them visible, "
        "and no control or bidi characters"
    )
    assert refused_in_one_line(seeded("--by", "b" * 50 + " ", *scale)) == (
        f"error: actor '{'b' * 40}': begins or ends with a space, which no one filtering by "
        "the name would match: leave the spaces out"
    )
    assert refused_in_one_line(seeded(*scale, "--reason", reason + "r")) == (
        "error: reason: must be at most 1000 characters, "
        "and no control or bidi characters but line breaks"
    )
    assert rows() == written


def test_a_bad_config_file_is_refused_in_one_line_naming_it(run: Run, write: Any) -> None:
    config = write("broken.yaml", b"models: [{name: x, engine: vllm, source: s, profiles: []}]\n")
    line = refused_in_one_line(run("--config", config, "model", "list"))
    assert config in line and "'x'" in line and "profiles" in line


def test_a_config_number_yaml_versions_read_differently_is_refused(run: Run, write: Any) -> None:
    # YAML 1.1 reads 010 as eight: a reviewer reads ten.
    config = write(
        "octal.yaml",
        b"models: [{name: x, engine: vllm, source: hf://o/x, profiles: [{name: g, gpus: 010}]}]\n",
    )
    line = refused_in_one_line(run("--config", config, "model", "list"))
    assert line == (
        f"error: {config}: '010' has a leading zero, which YAML 1.1 reads as octal (010 is 8): "
        "write a number in decimal, or quote text (line 1, column 79)"
    )


@pytest.mark.parametrize(
    ("tagged", "problem"),
    [
        ("!!map abc", "!!map is for a mapping, not a scalar"),
        ("!<tag:yaml.org,2002:map> abc", "!!map is for a mapping, not a scalar"),
        ("!!seq abc", "!!seq is for a sequence, not a scalar"),
        ("!!str [1]", "!!str is for a scalar, not a sequence"),
        ("!!set [a]", "!!set is for a mapping, not a sequence"),
        ("!!omap abc", "!!omap is for a sequence, not a scalar"),
        ("!!bool maybe", "'maybe' is not true or false"),
        ("!!float x", "'x' is not a number"),
        ("!!float", "'' is not a number"),
        ("!!timestamp abc", "'abc' is not a date or a time"),
        ("!!null abc", "'abc' is not null"),
    ],
)
def test_a_yaml_tag_on_what_it_cannot_read_is_refused_saying_where(
    run: Run, write: Any, rows: Callable[[], int], tagged: str, problem: str
) -> None:
    """`!!map abc` was refused as "not enough values to unpack", `!!bool maybe`
    and `!!timestamp abc` as an unexpected KeyError and AttributeError,
    `!!float x` with no place, and `!!null abc` read as null, its text dropped:
    in a definition, an apply and the declared config alike. Each is now one
    line saying what the tag cannot read, and where."""
    _seeded(run, write)
    before = rows()
    for given, after, content, place in (
        ("model add", "", f"name: {tagged}\n", "line 1, column 7"),
        ("apply", "", f"- remove: {tagged}\n", "line 1, column 11"),
        ("--config", "model list", f"models:\n  - name: {tagged}\n", "line 2, column 11"),
    ):
        path = write("tagged.yaml", content.encode())
        line = refused_in_one_line(run(*given.split(), path, *after.split()))
        assert line == f"error: {path}: {problem} ({place})", given
    assert rows() == before


def test_a_leading_zero_both_yaml_versions_read_alike_is_a_number(run: Run, write: Any) -> None:
    definition = write(
        "zeros.yaml",
        b"name: z\nengine: vllm\nsource: hf://o/z\nprofiles: [{name: g, gpus: 01}]\n"
        b"scaling: {min: 00, max: 07}\n",
    )
    ok(run("model", "add", definition))
    shown = json.loads(ok(run("--json", "model", "show", "z")).stdout)
    assert (shown["profiles"][0]["gpus"], shown["scaling"]) == (1, {"min": 0, "max": 7})


@pytest.mark.parametrize(
    "content", [b"", b"# models: moved to another file\n", b"---\n", b"engines: [vllm]\n", b"{}"]
)
def test_an_empty_config_is_refused_not_read_as_declaring_nothing(
    seeded: Run, run: Run, write: Any, rows: Callable[[], int], content: bytes
) -> None:
    """A deploy cut short left the file empty: every declared model went out of
    force with no word (operator walkthrough). Declaring none is said so."""
    empty = write("empty.yaml", content)
    line = refused_in_one_line(run("--config", empty, "model", "scale", "m", "--max", "3"))
    told = {
        b"": "empty:",
        b"# models: moved to another file\n": "empty but for comments:",
        b"---\n": "empty but for `---`:",
    }.get(content, "no `models:`;")
    assert line == f"error: {empty}: {told} to declare no models, write `models: []`"
    assert rows() == 2
    none = write("none.yaml", b"models: []\n")
    ok(run("--config", none, "model", "scale", "m", "--max", "3"))
    assert rows() == 4  # the new config's record, and the change


def test_input_that_is_not_a_mapping_is_told_in_the_operators_words(
    seeded: Run, run: Run, write: Any, rows: Callable[[], int]
) -> None:
    """pydantic's message named this project's classes ("a valid dictionary
    or instance of ConfigInput"), which say nothing to an operator (hostile test)."""
    listed = write("listed.yaml", b"- a\n")
    line = refused_in_one_line(run("--config", listed, "model", "scale", "m", "--max", "3"))
    assert line == f"error: {listed}: expected a mapping of fields (got list)"
    line = refused_in_one_line(run("model", "add", "-", input=b"null\n"))
    assert line == "error: standard input: expected a mapping of fields (got null)"
    profile = write("p.yaml", as_yaml(definition("p", profiles=[3])))
    line = refused_in_one_line(run("model", "add", profile))
    assert line == f"error: {profile}: profiles[0]: expected a mapping of fields (got 3)"
    assert rows() == 2


def test_every_input_says_an_empty_or_misshapen_document_alike(
    seeded: Run, run: Run, write: Any, rows: Callable[[], int]
) -> None:
    """An empty definition was told as a null it was never given ("got null"),
    an empty list of changes "expected a non-empty list", a null config "the
    config is empty", a tokens file of blank lines "Input data was
    truncated", one blank line holding a tab, or a comment after a tab, a
    YAML scanner's error, and a document end (`...`) alone its parser's. Each
    input, a file or standard input, now says it one way, and what to give."""
    definition = "give a model definition (YAML or JSON)"
    changes = "give a list of changes (YAML or JSON)"
    no_models = "to declare no models, write `models: []`"
    for content, said in (
        (b"", "empty"),
        (b"  \n\t\n", "empty but for whitespace"),
        # Python's white space that YAML reads as text or refuses as a control
        # character (review).
        ("\u00a0\n".encode(), "empty but for whitespace"),
        (b"\x0c\n", "empty but for whitespace"),
        (b"# to be written\n\n", "empty but for comments"),
        # A tab before a comment, or on a blank line, is white space to YAML
        # (libyaml refused it: "found character that cannot start any token").
        (b"\t# c", "empty but for comments"),
        (b"# c\n\t\n", "empty but for comments"),
        (b"---\n\t# c\n", "empty but for comments"),
        # A document end alone, which YAML 1.2 reads as no document (libyaml
        # refused it: "did not find expected node content").
        (b"...\n", "empty but for `...`"),
        (b"---\n...\n", "empty but for `---` and `...`"),
    ):
        path = write("given.yaml", content)
        for args, instead in (
            (["model", "add", path], definition),
            (["apply", path], changes),
            (["--config", path, "model", "scale", "m", "--max", "3"], no_models),
            (["model", "add", "-"], definition),
            (["apply", "-"], changes),
        ):
            where = "standard input" if "-" in args else path
            line = refused_in_one_line(run(*args, input=content))
            assert line == f"error: {where}: {said}: {instead}", args
    tokens = write("tokens.json", b"  \n\t\n")
    line = refused_in_one_line(run("token", "list", "--tokens", tokens))
    assert line == f"error: {tokens}: empty but for whitespace: remove it, and token add makes one"
    # A document there, of the wrong kind: the kind wanted, and the kind given.
    for content, got in ((b"null\n", "null"), (b'"text"\n', "'text'"), (b"[1]\n", "list")):
        path = write("given.yaml", content)
        for args, wanted in (
            (["model", "add", path], f"{path}: expected a mapping of fields"),
            (["--config", path, "model", "list"], f"{path}: expected a mapping of fields"),
            (
                ["token", "list", "--tokens", path],
                f"{path}: not a tokens file: expected a mapping of fields",
            ),
            (["apply", path], f"{path}: expected a list of changes"),
        ):
            if got == "list" and args[0] == "apply":
                continue  # a list is what apply takes
            assert refused_in_one_line(run(*args)) == f"error: {wanted} (got {got})", args
    path = write("given.yaml", b"{}\n")
    line = refused_in_one_line(run("apply", path))
    assert line == f"error: {path}: expected a list of changes (got dict)"
    assert rows() == 2


def test_a_null_written_or_a_doubled_byte_order_mark_is_not_told_as_a_bare_document_marker(
    seeded: Run, run: Run, write: Any, rows: Callable[[], int]
) -> None:
    """A document of a null written with a tag (`!!null`) or an anchor alone
    (`&a`), and a file of two byte order marks (a tool adding one to a file
    that had one), were told "empty but for `---`", which none of them
    holds. The null is told as `null` and `~` are; the marks say nothing,
    as one does."""
    for content, said in (
        (b"!!null\n", "expected a mapping of fields (got null)"),
        (b"--- &a\n", "expected a mapping of fields (got null)"),
        (b"\xef\xbb\xbf\xef\xbb\xbf", "empty: give a model definition (YAML or JSON)"),
    ):
        path = write("given.yaml", content)
        assert refused_in_one_line(run("model", "add", path)) == f"error: {path}: {said}", content
    line = refused_in_one_line(run("apply", write("given.yaml", b"!!null\n")))
    assert line.endswith(": expected a list of changes (got null)")
    assert rows() == 2


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        pytest.param(
            "    profiles: [{name: g, gpus: one}]\n",
            "models[1].profiles[0].gpus: Input should be a valid integer (got 'one') "
            "(line 8, column 26)",
            id="wrong-type",
        ),
        pytest.param(
            "    profiles: [{name: g, gpus: 1}]\n    colour: red\n",
            "models[1].colour: unknown field (line 9, column 5)",
            id="unknown-field",
        ),
        pytest.param(
            "    profiles: [{gpus: 1}]\n    owner: [x]\n",
            "models[1].profiles[0].name: required field is missing (line 8, column 16) "
            "(and 1 more problem)",
            id="missing-field",
        ),
        pytest.param(
            "    profiles: [{name: g, gpus: -1}]\n",
            "profiles[0].gpus: cannot be negative (line 8, column 26)",
            id="out-of-range",
        ),
        pytest.param(
            "    profiles: [{name: g, gpus: 1}]\n    fallbacks: [gone]\n",
            "fallbacks: names 'gone', which is not declared (line 9, column 5)",
            id="fallback",
        ),
    ],
)
def test_a_config_field_refused_is_told_with_its_line(
    seeded: Run, write: Any, rows: Callable[[], int], entry: str, said: str
) -> None:
    """A wrong type, an unknown or a missing field in `catalog.yaml` named the
    field's path (`models[41].profiles[0].gpus`) but not its line, which a
    reviewer of a long file counts by hand; YAML's own errors had it (hostile
    test). A field missing is told at the mapping that lacks it."""
    config = write(
        "catalog.yaml",
        (
            "models:\n"
            "  - {name: first, engine: vllm, source: hf://org/first,"
            " profiles: [{name: g, gpus: 1}]}\n"
            "\n"
            "  # the reviewed one\n"
            "  - name: second\n"
            "    engine: vllm\n"
            "    source: hf://org/second\n" + entry
        ).encode(),
    )
    line = refused_in_one_line(seeded("--config", config, "model", "scale", "m", "--max", "3"))
    assert line == f"error: {config}: model 'second': {said}"
    assert rows() == 2


def test_a_model_declared_twice_is_told_at_its_second_declaration(
    seeded: Run, write: Any, rows: Callable[[], int]
) -> None:
    twice = config_yaml(spec("first"), spec("again"), spec("again"))
    config = write("catalog.yaml", twice.encode())
    line = refused_in_one_line(seeded("--config", config, "model", "list"))
    # The second of the two, where a reviewer finds the copy to take out.
    assert line == f"error: {config}: model 'again' is declared more than once (line 36, column 3)"
    assert rows() == 2


def test_a_model_declared_again_by_an_alias_is_told_at_the_alias(
    seeded: Run, write: Any, rows: Callable[[], int]
) -> None:
    """A second declaration written as an alias of the first (`- *base`) is
    the first's node to YAML, so it was told at the anchor's line, where the
    declaration to keep is, not at the copy to take out (review)."""
    config = write(
        "catalog.yaml",
        (
            b"models:\n"
            b"  - &base {name: again, engine: vllm, source: hf://o/a,"
            b" profiles: [{name: g, gpus: 1}]}\n"
            b"  - *base\n"
        ),
    )
    line = refused_in_one_line(seeded("--config", config, "model", "list"))
    assert line == f"error: {config}: model 'again' is declared more than once (line 3, column 5)"
    assert rows() == 2


def test_a_field_refused_in_a_second_declaration_is_told_at_that_one(
    seeded: Run, write: Any, rows: Callable[[], int]
) -> None:
    """The second of two declarations of a name, out of range, was told at the
    first's field of that name, which is in range (review)."""
    config = write(
        "catalog.yaml",
        (
            b"models:\n"
            b"  - {name: again, engine: vllm, source: hf://o/a, profiles: [{name: g, gpus: 1}]}\n"
            b"  - {name: again, engine: vllm, source: hf://o/a, profiles: [{name: g, gpus: -1}]}\n"
        ),
    )
    line = refused_in_one_line(seeded("--config", config, "model", "list"))
    assert line == (
        f"error: {config}: model 'again': profiles[0].gpus: cannot be negative (line 3, column 72)"
    )
    assert rows() == 2


def test_a_missing_config_file_is_refused_in_one_line(run: Run) -> None:
    line = refused_in_one_line(run("--config", "absent.yaml", "model", "list"))
    assert "absent.yaml: cannot read the config" in line


@pytest.mark.parametrize(
    ("made", "said"),
    [
        (lambda path: path.mkdir(), "Is a directory"),
        (lambda path: path.write_bytes(b"models: [caf\xe9]\n"), "not UTF-8 text"),
        (lambda path: None, "No such file or directory"),
    ],
    ids=["a-folder", "latin-1", "absent"],
)
def test_a_config_that_cannot_be_read_is_told_as_a_definition_file_is(
    run: Run, tmp_path: Path, made: Callable[[Path], object], said: str
) -> None:
    """`--config conf` on a folder said `cannot read the config: [Errno 21] Is
    a directory: 'conf'`, and on Latin-1 text `'utf-8' codec can't decode byte
    0xe9 in position 13: invalid continuation byte`: Python's words, where
    `model add` on the same files says `Is a directory` and `not UTF-8 text`."""
    path = tmp_path / "conf"
    made(path)
    line = refused_in_one_line(run("--config", str(path), "model", "list"))
    assert line == f"error: {path}: cannot read the config: {said}"


def test_a_folder_refused_as_a_file_leaves_no_descriptor_open(tmp_path: Path) -> None:
    """Opened without waiting for a writer (a pipe's), a folder was refused
    once the descriptor was open, and that descriptor was left open: one more
    for each refusal, in a process that reads many (review)."""
    opened = Path("/proc/self/fd")
    before = len(list(opened.iterdir()))
    for _ in range(3):
        with pytest.raises(ConfigError, match="Is a directory"):
            load_config(str(tmp_path))
        with pytest.raises(InputError, match="Is a directory"):
            read_text(str(tmp_path))
    assert len(list(opened.iterdir())) == before


def run_in_bash(db_url: str, config: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The command line on ``db_url`` with ``--config config`` as bash reads
    it (``<(…)``: a pipe that is read once)."""
    command = f"exec {sys.executable} -m catalog_es --db '{db_url}' --config {config} "
    return subprocess.run(
        ["bash", "-c", command + " ".join(args)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd=Path(__file__).parents[1],  # this checkout's code, for `-m catalog_es`
    )


def test_a_config_that_is_a_pipe_nothing_writes_to_is_refused_not_waited_on(
    db_url: str, tmp_path: Path, rows: Callable[[], int]
) -> None:
    """Opening a pipe to read waits for a writer: `--config` on a FIFO that
    nothing writes to (a deploy's leftover, a mistyped path) hung every
    command, and `serve` at start, for good (hostile test). A pipe with a
    writer, as `--config <(…)` gives, is still read."""
    pipe = tmp_path / "catalog.yaml"
    os.mkfifo(pipe)
    for args in (["model", "list"], ["model", "scale", "d", "--max", "2"]):
        refused = run_in_bash(db_url, str(pipe), *args)
        assert (refused.returncode, refused.stdout) == (1, "")
        assert refused.stderr == (
            f"error: {pipe}: empty: to declare no models, write `models: []`\n"
        )
    assert rows() == 0
    declared = tmp_path / "declared.yaml"
    declared.write_text(config_yaml(spec("d")))
    # The log made first, as the run below is not the one to say it makes
    # one (on PostgreSQL it would; the SQLite file is there, left by rows()).
    bootstrap.open_models(db_url, str(declared)).close()
    piped = run_in_bash(db_url, f"<(cat {declared})", "model", "list")
    assert (piped.returncode, piped.stderr) == (0, "")
    assert piped.stdout.splitlines()[1].split()[:2] == ["d", "declared"]


def test_a_read_on_a_path_with_no_log_reads_the_config_once(db_url: str, tmp_path: Path) -> None:
    """A read on a path with no log opens the log, finds none, and answers
    from an empty one: each open read the config again, so one given as a
    pipe (`--config <(…)`, read once) was empty the second time, and the
    read was refused as of an empty config."""
    declared = tmp_path / "declared.yaml"
    declared.write_text(config_yaml(spec("d")))
    piped = run_in_bash(db_url, f"<(cat {declared})", "model", "list")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.splitlines()[1].split()[:2] == ["d", "declared"]
    assert "answered as an empty log; none was made" in piped.stderr
    assert_no_log_made(db_url)


def test_a_declared_cpu_model_without_memory_shows_with_a_warning(run: Run, write: Any) -> None:
    kubeai = "/work/shared/data/kubeai-catalog.yaml"
    result = ok(run("--config", kubeai, "model", "show", "opt-125m-cpu"))
    assert "declared" in result.stdout
    assert result.stderr.startswith("warning: profile 'cpu' runs without a GPU")


# -- log --json -----------------------------------------------------------------------------


def test_revision_is_the_head_of_the_log(run: Run, write: Any) -> None:
    """The API had GET /revision; the CLI had nothing as short (walkthrough)."""
    assert ok(run("revision")).stdout == "0\n"
    ok(run("model", "add", write("m.yaml", as_yaml(definition("m")))))
    ok(run("model", "scale", "m", "--max", "3"))
    assert ok(run("revision")).stdout == "2\n"
    assert json.loads(ok(run("--json", "revision")).stdout) == {"revision": 2}


def test_log_after_a_revision_past_the_head_is_refused_as_watch_from_it_is(
    run: Run, write: Any, rows: Callable[[], int]
) -> None:
    """A follower asking for the events after the revision it last saw, on a
    log since restored from an older backup, got an empty table and exit 0
    from `log --after` (nothing new, it took it), where `watch --from` refuses.
    Now `log` refuses it too, in the same line; the head itself reads empty."""
    _seeded(run, write)
    ok(run("model", "scale", "m", "--max", "2"))  # the log is at revision 2
    before = rows()
    told = "error: revision 3 is beyond the head of the log (2)"
    for args in (
        ["log", "--after", "3"],
        ["log", "--json", "--after", "3"],
        ["log", "--model", "m", "--after", "3"],
        ["watch", "--from", "3"],
    ):
        assert refused_in_one_line(run(*args)) == told, args
    assert rows() == before
    assert ok(run("log", "--json", "--after", "2")).stdout == ""


def test_log_json_prints_one_object_per_event_with_the_documented_keys(
    run: Run, write: Any
) -> None:
    ok(run("--by", "alice", "model", "add", write("m.yaml", as_yaml(definition("m")))))
    ok(run("--by", "bob", "--reason", "peak", "model", "scale", "m", "--min", "0", "--max", "4"))
    ok(run("model", "remove", "m", "--by", "carol"))
    events = [json.loads(line) for line in ok(run("log", "--json")).stdout.splitlines()]
    assert all(set(e) == LOG_KEYS for e in events)
    assert [(e["revision"], e["by"], e["event"], e["model"]) for e in events] == [
        (1, "alice", "Added", "m"),
        (2, "bob", "Scaled", "m"),
        (3, "carol", "Removed", "m"),
    ]
    assert events[0]["fields"]["spec"]["name"] == "m"
    assert events[1]["fields"] == {"scaling": {"min": 0, "max": 4}}
    assert (events[1]["reason"], events[1]["class_version"], events[1]["rollback_to"]) == (
        "peak",
        1,
        None,
    )
    human = ok(run("log")).stdout
    assert "alice" in human and "Scaled" in human and "peak" in human


def _three_actors(run: Run, write: Any) -> None:
    """Revisions 1-6 by alice, bob and carol, with an actor's name where its
    bytes alone would take an event for that actor's: a reason, a model."""
    ok(run("--by", "alice", "model", "add", write("m.yaml", as_yaml(definition("m")))))
    ok(run("--by", "bob", "--reason", "alice", "model", "scale", "m", "--max", "2"))
    ok(run("--by", "alice", "model", "add", write("bob.yaml", as_yaml(definition("bob")))))
    ok(run("--by", "carol", "model", "scale", "m", "--max", "3"))
    ok(run("--by", "alice", "model", "scale", "m", "--max", "4"))
    ok(run("--by", "bob", "model", "scale", "bob", "--max", "5"))


def _logged(result: Result) -> list[int]:
    return [json.loads(line)["revision"] for line in ok(result).stdout.splitlines()]


def test_log_by_shows_that_actors_events_alone_and_writes_nothing(
    run: Run, write: Any, rows: Callable[[], int]
) -> None:
    """`log --by alice` was taken and left unread (the option is the writer's
    actor, and log writes nothing): every event was shown. It is a filter,
    as audit's is, before the command or after it; --limit counts the
    events it keeps, --after is still a revision, and the lines are
    `log --json`'s own."""
    _three_actors(run, write)
    before = rows()
    every = ok(run("log", "--json")).stdout.splitlines()
    for given in (["log", "--by", "alice"], ["--by", "alice", "log"]):
        lines = ok(run(*given, "--json")).stdout.splitlines()
        assert lines == [every[0], every[2], every[4]], given
    assert _logged(run("log", "--json", "--by", "bob")) == [2, 6]
    assert _logged(run("log", "--json", "--by", "alice", "--model", "m")) == [1, 5]
    assert _logged(run("--by", "bob", "log", "--json", "--model", "bob")) == [6]
    assert _logged(run("log", "--json", "--by", "alice", "--after", "1")) == [3, 5]
    assert _logged(run("log", "--json", "--by", "alice", "--limit", "2")) == [1, 3]
    assert _logged(run("log", "--json", "--by", "alice", "--after", "1", "--limit", "1")) == [3]
    shown = ["log", "--json", "--by", "alice", "--model", "m", "--after", "1", "--limit", "1"]
    assert _logged(run(*shown)) == [5]
    for nobody in ("nobody", "ALICE", "alic", "m"):
        assert ok(run("log", "--json", "--by", nobody)).stdout == "", nobody
    table = ok(run("log", "--by", "carol")).stdout.splitlines()
    assert [line.split()[0] for line in table] == ["REV", "4"] and "carol" in table[1]
    assert ok(run("log", "--by", "nobody")).stdout.split()[:2] == ["REV", "TIME"]  # no row
    assert rows() == before


def test_an_empty_actor_filter_of_log_and_watch_is_refused(
    run: Run, write: Any, rows: Callable[[], int], db_url: str
) -> None:
    """As audit refuses it: no actor is empty, and the filter matched
    nothing, as if nothing had been done. (The watch runs apart: taken, it
    would follow on until stopped.)"""
    _seeded(run, write)
    before = rows()
    told = "error: by: the actor is empty; give an actor, or no actor filter"
    for args in (["log", "--by", ""], ["--by", "", "log", "--json"]):
        assert refused_in_one_line(run(*args)) == told, args
    watch = python("-m", "catalog_es", "--db", db_url, "watch", "--by", "")
    try:
        out, err = watch.communicate(timeout=30)
    finally:
        watch.kill()
    assert (watch.returncode, out, err) == (1, "", told + "\n")
    assert rows() == before


def test_log_and_watch_help_say_by_is_a_filter_there(run: Run) -> None:
    for command in ("log", "watch"):
        shown = " ".join(ok(run(command, "--help")).stdout.split())
        assert "--by ACTOR Only this actor's (a filter here, not who is asking)." in shown
        assert "--by names the actor" in shown


def test_check_updates_help_says_it_completes_an_origin_given_in_part(run: Run) -> None:
    """It said it records the origin of a model that has none, where it also
    completes one given in part (a repository alone, no files)."""
    shown = " ".join(ok(run("model", "check-updates", "--help")).stdout.split())
    assert "the origin of each runtime model that has none or only part of one" in shown


def test_token_add_help_says_a_write_token_may_apply(run: Run) -> None:
    """It said a write token may run the model commands, leaving out apply,
    which it may run too (POST /apply)."""
    shown = " ".join(ok(run("token", "add", "--help")).stdout.split())
    assert "write: model commands and apply;" in shown


def test_watch_by_gives_that_actors_changes_alone_then_follows_them_live(
    run: Run, write: Any, db_url: str
) -> None:
    """`watch --by bob` gave everyone's changes: only bob's come, those
    before it started and those it follows."""
    _three_actors(run, write)
    watch = python("-m", "catalog_es", "--db", db_url, "watch", "--by", "bob", "--json")
    try:
        assert watch.stdout is not None
        assert select.select([watch.stdout], [], [], 30)[0], "watch gave nothing in 30 s"
        assert [json.loads(watch.stdout.readline())["revision"] for _ in range(2)] == [2, 6]
        ok(run("--by", "alice", "--reason", "bob", "model", "scale", "m", "--max", "6"))
        ok(run("--by", "bob", "model", "scale", "m", "--max", "7"))  # revision 8
        assert select.select([watch.stdout], [], [], 30)[0], "watch gave nothing in 30 s"
        live = json.loads(watch.stdout.readline())
        assert (live["revision"], live["by"], live["fields"]) == (
            8,
            "bob",
            {"scaling": {"min": 1, "max": 7}},
        )
        watch.send_signal(signal.SIGTERM)
        out, err = watch.communicate(timeout=30)
    finally:
        watch.kill()
    assert (watch.returncode, out, err) == (0, "", "stopped\n")


def _log_of_actors_named_in_other_fields(db_url: str, monkeypatch: pytest.MonkeyPatch) -> Models:
    """A log read three events a page, whose actors (ops, zoé) are also
    models' names and reasons: 32 events, 11 of them zoé's."""
    monkeypatch.setattr(PullingSubscription, "page", 3)
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(spec("a"), by="ops")
    models.add(spec("ops"), by="zoé", reason="ops")
    scales = [commands.scale("ops" if i % 3 == 0 else "a", 0, 2 + i % 7) for i in range(30)]
    models.apply_changes(scales[:10], by="ops", reason="zoé")
    models.apply_changes(scales[10:20], by="zoé", reason='"ops"')
    models.apply_changes(scales[20:], by="ops")
    return models


def _decodes_counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The topics of the events the service decodes from now on, in order."""
    decoded: list[str] = []

    def decode(topic: str, state: bytes) -> Any:
        decoded.append(topic)
        return decode_event(topic, state)

    monkeypatch.setattr(application, "decode_event", decode)
    return decoded


def test_log_by_reads_a_page_at_a_time_what_the_database_finds_the_actor_in(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The actor is in no column, only in each event's stored form: the
    database passes on only the rows whose bytes hold it, a page at a time,
    so an actor no event has decodes none, however long the log. The answer
    is that of the whole log filtered, paged or not (/log's), whatever the
    other fields that hold the name."""
    models = _log_of_actors_named_in_other_fields(db_url, monkeypatch)
    every = list(models.log_events())
    for after in (0, 1, 7, len(every)):
        for limit in (None, 1, 3, 4, 10):
            for model in (None, "a", "ops"):
                for by in ("ops", "zoé", '"ops"', "nobody"):
                    asked = (after, limit, model, by)
                    expected = [
                        e for e in every[after:] if e["by"] == by and model in (None, e["model"])
                    ][:limit]
                    paged = models.log_events(after=after, limit=limit, model=model, by=by)
                    whole = models.log_events(
                        after=after, limit=limit, model=model, by=by, max_bytes=1 << 30
                    )
                    assert list(paged) == list(whole) == expected, asked
    decoded = _decodes_counted(monkeypatch)
    assert list(models.log_events(by="nobody")) == []
    assert decoded == []
    # Those by zoé, and those by ops for a reason of that name: none else.
    assert len(list(models.log_events(by="zoé"))) == 11
    assert len(decoded) == 21
    models.close()


def test_watch_by_reads_what_the_database_finds_the_actor_in_as_log_by_does(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`watch --by` (and /events?by=) decoded every event of the log to keep
    an actor's: catching up on 100,000 events, one of them the actor's, took
    4 s (0.4 s now). It reads what `log --by` reads, the rows whose bytes
    hold the actor, each decoded to tell; with none up to the head, its next
    look starts there rather than reading the log again."""
    models = _log_of_actors_named_in_other_fields(db_url, monkeypatch)
    decoded = _decodes_counted(monkeypatch)
    logged = list(models.log_events(by="zoé"))
    assert (len(logged), len(decoded)) == (11, 21)  # and those by ops for a reason of that name
    decoded.clear()
    watch = models.watch(0, by="zoé")
    changes = iter(watch)
    assert [next(changes) for _ in logged] == logged
    watch.stop()
    assert len(decoded) == 21
    decoded.clear()
    nobody = models.watch(0, by="nobody", poll_interval=0.01)
    thread, seen, ended = following(nobody)
    time.sleep(0.3)
    nobody.stop()
    thread.join(10)
    assert (seen, ended, decoded) == ([], [], [])
    page = models.store.pull_page(0, None, 3, 1 << 20, (), spelling_marks("nobody"))
    assert (page.notifications, page.read_to) == ([], models.revision)
    models.close()


def test_a_watch_by_an_actor_started_on_an_empty_log_gives_its_first_change(
    db_url: str,
) -> None:
    """Having found none of theirs in an empty log, the watch looks again
    after revision 0, not 1: the log's first event is given too."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    watch = models.watch(0, by="ops", poll_interval=0.01)
    thread, seen, ended = following(watch)
    time.sleep(0.3)  # it has looked at the empty log
    models.add(spec("a"), by="ops")
    models.add(spec("b"), by="ops")
    deadline = time.monotonic() + 10
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.stop()
    thread.join(10)
    assert (seen, ended) == ([1, 2], [])
    models.close()


def test_a_watch_by_an_actor_decodes_a_change_it_looked_ahead_at_once(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether an actor's watch has their next change read already (what an
    event stream asks before each change it adds to a batch) decoded the
    changes read ahead, and giving them decoded each again."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(spec("a"), by="ops")  # 1
    models.scale("a", 0, 2, by="ops", reason="zoé")  # 2: her name, not her change
    models.scale("a", 0, 3, by="zoé")  # 3
    models.scale("a", 0, 4, by="ops", reason="zoé")  # 4
    models.scale("a", 0, 5, by="zoé")  # 5
    models.scale("a", 0, 6, by="ops", reason="zoé")  # 6
    decoded = _decodes_counted(monkeypatch)
    watch = models.watch(0, by="zoé")
    changes = iter(watch)
    assert next(changes)["revision"] == 3
    assert watch.ready()  # 5, after 4, another's
    assert next(changes)["revision"] == 5
    assert not watch.ready()  # 6 is another's
    watch.stop()
    assert len(decoded) == 5  # 2 to 6, once each
    models.close()


# The ways JSON spells a character in a string: as this code writes it, as
# a \u escape in lower or upper case (a pair of them past U+FFFF), and "/"
# as "\/" (any other character as this code writes it).
SPELLINGS = ("written", "lower", "upper", "slash")


def _json_spelled(text: str, spellings: list[str]) -> bytes:
    """``text`` as a JSON string, each character spelled its own way."""
    out = []
    for char, spelling in zip(text, spellings, strict=True):
        if spelling in ("lower", "upper"):
            units = char.encode("utf-16-be")
            hexes = (units[i : i + 2].hex() for i in range(0, len(units), 2))
            out.append("".join(f"\\u{h.upper() if spelling == 'upper' else h}" for h in hexes))
        elif spelling == "slash" and char == "/":
            out.append("\\/")
        else:
            out.append(msgspec.json.encode(char).decode()[1:-1])
    return f'"{"".join(out)}"'.encode()


@hypothesis.settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[
        hypothesis.HealthCheck.function_scoped_fixture,
        hypothesis.HealthCheck.too_slow,
    ],
)
@hypothesis.given(
    st.lists(
        st.tuples(st.characters(exclude_categories=["Cs"]), st.sampled_from(SPELLINGS)),
        min_size=1,
        max_size=12,
    )
)
def test_an_actor_filter_finds_the_actor_however_a_record_spells_it(
    db_url: str, spelled: list[tuple[str, str]]
) -> None:
    """The database passed on only rows holding the actor as this code, or
    Python's json, writes it: a record made by hand that spelled it another
    way JSON allows (\\u00C9, \\u0061, \\/) was never shown by `log --by`
    (nor /log's `by`), though it decodes to that actor. A watch by the
    actor (/events's `by`) reads what the log does, and finds it too."""
    actor = "".join(char for char, _ in spelled)
    stored = _json_spelled(actor, [spelling for _, spelling in spelled])
    assert msgspec.json.decode(stored) == actor
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    try:
        # An event of its own each example: the log is the test's, not the example's.
        revision = models.add(spec("a"), by="placeholder").revision
        row = events_table.c.revision == revision
        with models.store.engine.begin() as conn:
            state = conn.execute(sa.select(events_table.c.state).where(row)).scalar_one()
            held = bytes(state).replace(b'"placeholder"', stored)
            conn.execute(sa.update(events_table).where(row).values(state=held))
        found = list(models.log_events(by=actor))
        assert revision in [e["revision"] for e in found]
        assert {e["by"] for e in found} == {actor}
        watch = models.watch(revision - 1, by=actor)
        thread, seen, ended = following(watch)
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        watch.stop()
        thread.join(10)
        assert (seen, ended) == ([revision], [])
    finally:
        models.close()


def test_the_cli_writes_a_large_log_out_as_it_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`log --json` read every event of the log before it wrote its first
    line: of 900,000 events, 1.42 GB and 11 s before `log --json | head -1`
    printed (tester, PostgreSQL). It reads them a page at a time as it
    writes them, as a watch does: these 1,000 changes of a hundred adapters
    each (5.9 MB of JSON lines) took 6 MB; now 0.8 MB."""
    db = f"sqlite:///{tmp_path}/catalog.db"
    # A snapshot at the head: starting, the CLI reads none of the log back.
    models = Models(DeclaredConfig(), snapshot_interval=1_000, env={"CATALOG_ES_DB": db})
    models.add(spec("wide"), by="ops")
    sets = [
        tuple(Adapter(name=f"ad{i}", source=f"s3://adapters/wide/{k}/ad{i}") for i in range(100))
        for k in range(2)
    ]
    models.apply_changes([commands.adapters("wide", sets[i % 2]) for i in range(999)], by="ops")
    expected = "".join(json_line(e) + "\n" for e in models.log_events())
    size, digest = len(expected), hashlib.sha256(expected.encode()).hexdigest()
    del expected
    models.close()
    out = CountedOutput()
    monkeypatch.setattr(sys, "stdout", out)
    tracemalloc.start()
    try:
        cli.main(["--db", db, "--json", "log"], standalone_mode=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (out.size, out.lines, out.digest.hexdigest()) == (size, 1_000, digest)
    assert size > 5_000_000
    assert peak < size / 4, (peak, size)


def test_log_read_a_page_at_a_time_is_the_log_as_it_stood_when_asked(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three events a page: after, limit and a model's events come out as
    one read of them all (/log's) gives them, and an event written while
    the log is read is left to the next read."""
    monkeypatch.setattr(PullingSubscription, "page", 3)
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    models.add(spec("a"), by="ops")
    models.add(spec("b"), by="ops")
    scales = [commands.scale("b" if i % 3 == 0 else "a", 0, 2 + i % 7) for i in range(30)]
    models.apply_changes(scales, by="ops")
    head = len(list(models.log_events()))
    assert head > 20
    for after in (0, 1, 7, head - 1, head):
        for limit in (None, 1, 3, 4, 10):
            for model in (None, "a", "b", "c"):
                asked = (after, limit, model)
                whole = models.log_events(after=after, limit=limit, model=model, max_bytes=1 << 30)
                paged = models.log_events(after=after, limit=limit, model=model)
                assert list(paged) == list(whole), asked
    for max_bytes in (1 << 30, None):  # past the head, both are refused as they are asked
        with pytest.raises(Refused, match=f"revision {head + 5} is beyond the head"):
            models.log_events(after=head + 5, model="a", max_bytes=max_bytes)
    reading = models.log_events()
    first = next(reading)
    models.scale("a", 0, 99, by="ops")
    assert [first["revision"], *(e["revision"] for e in reading)] == list(range(1, head + 1))
    models.close()


def test_a_run_without_the_declared_config_the_nodes_recorded_says_so(
    run_told: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from a folder without the deploy's catalog.yaml, a read left the
    declared models out and a write recorded no config as the one in force,
    both in silence (hostile tester). A read warns, after its answer (a
    write is refused: the test below); a run given the config, or finding
    it in its folder, does not."""
    (tmp_path / "a.yaml").write_bytes(as_yaml(definition("a")))
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    (deploy / "catalog.yaml").write_text(config_yaml(spec("base")))
    ok(run_told("model", "add", "a.yaml"))
    given = ["--config", str(deploy / "catalog.yaml")]
    ok(run_told(*given, "model", "scale", "a", "--max", "2"))

    def listed(*args: str, folder: Path = tmp_path) -> tuple[list[str], str]:
        monkeypatch.chdir(folder)
        done = ok(run_told(*args, "model", "list", "--json"))
        return [m["name"] for m in json.loads(done.stdout)], done.stderr

    assert listed() == (
        ["a"],
        "warning: no declared config given (--config, $CATALOG_ES_CONFIG or ./catalog.yaml): "
        "the log's nodes recorded one at revision 2, and this run goes without its models\n",
    )
    assert listed(*given) == (["a", "base"], "")
    assert listed(folder=deploy) == (["a", "base"], "")


def test_a_read_over_the_config_recorded_then_is_not_told_it_goes_without_it(
    run_told: Run,
    tmp_path: Path,
    write_config: Callable[[str], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read `--declared-then` is over the config the log recorded then,
    whatever this run's: given no config, or another, it was told it "goes
    without its models", or "reads the catalog over its own config", beside
    an answer that showed them (review). Such a read is told neither."""
    (tmp_path / "a.yaml").write_bytes(as_yaml(definition("a")))
    deploy = write_config(config_yaml(spec("base")))
    other = write_config("models: []\n")
    ok(run_told("--config", deploy, "model", "add", "a.yaml"))  # 1 its config, 2
    monkeypatch.chdir(tmp_path)  # no ./catalog.yaml
    for given in ([], ["--config", other]):
        done = ok(run_told(*given, "model", "list", "--at", "2", "--declared-then", "--json"))
        assert ([m["name"] for m in json.loads(done.stdout)], done.stderr) == (["a", "base"], "")
        # Over today's config, as without --declared-then, it is told.
        assert ok(run_told(*given, "model", "list", "--at", "2")).stderr != ""


def test_a_write_given_no_config_on_a_log_whose_nodes_recorded_one_is_refused(
    run_told: Run, db_url: str, tmp_path: Path, write_config: Callable[[str], str]
) -> None:
    """Run from a folder without the deploy's catalog.yaml, a write recorded
    no config over the one the nodes recorded, undeclaring every declared
    model for every node, with a warning alone. Refused, whatever writes,
    and a rollback's dry run, which would show a plan over none of the
    declared models (hostile test): one line, exit 1, the log as it was; a
    read still warns. Given the config, or one of `models: []` on purpose, it
    writes; and once the log's last record declares nothing, a run with no
    config writes on, as on a fresh log."""
    (tmp_path / "a.yaml").write_bytes(as_yaml(definition("a")))
    (tmp_path / "b.yaml").write_bytes(as_yaml(definition("b")))
    (tmp_path / "changes.yaml").write_bytes(as_json([{"scale": {"name": "a", "max": 5}}]))
    base = write_config(config_yaml(spec("base")))
    ok(run_told("--config", base, "model", "add", "a.yaml"))  # 1 base, 2
    ok(run_told("--config", base, "model", "scale", "a", "--max", "2"))  # 3
    where = "(--config, $CATALOG_ES_CONFIG or ./catalog.yaml)"
    refused = (
        f"error: no declared config given {where}: the log's nodes recorded one at "
        "revision 1, and this write would record none over it (no models, the default "
        "engines); give that config, or one declaring what every node should run "
        "(`models: []`: no models)\n"
    )
    logged = ok(run_told("log", "--json")).stdout
    for command in (
        "model add b.yaml",
        "model scale a --max 3",
        "model class a critical",
        "model remove a",
        "apply changes.yaml",
        "rollback --to 2",
    ):
        done = run_told(*command.split())
        assert (done.exit_code, done.stdout, done.stderr) == (1, "", refused), command
        assert run_told("log", "--json").stdout == logged
    assert {r["event"] for r in json.loads(ok(run_told("refusals", "--json")).stdout)} == {
        "Added",
        "Scaled",
        "ClassSet",
        "Removed",
        "Apply",
        "Rollback",
    }
    warned = (
        f"warning: no declared config given {where}: the log's nodes recorded one at "
        "revision 1, and this run goes without its models\n"
    )
    # A rollback's dry run shows the plan over no declared model: refused as its write.
    done = run_told("rollback", "--to", "2", "--dry-run")
    assert (done.exit_code, done.stdout, done.stderr) == (1, "", refused)
    assert ok(run_told("model", "list")).stderr == warned
    assert run_told("log", "--json").stdout == logged
    # Given the config, it writes; one declaring no models undeclares them.
    assert ok(run_told("--config", base, "model", "scale", "a", "--max", "3")).stderr == ""
    nothing = write_config("models: []\n")
    ok(run_told("--config", nothing, "model", "scale", "a", "--max", "4"))  # 5 none, 6
    done = ok(run_told("model", "scale", "a", "--max", "6"))  # 7: nothing to record
    assert done.stderr == ""
    written = [json.loads(line) for line in run_told("log", "--json").stdout.splitlines()]
    assert [(e["revision"], e["event"]) for e in written[3:]] == [
        (4, "Scaled"),
        (5, "ConfigDeclared"),
        (6, "Scaled"),
        (7, "Scaled"),
    ]


def test_a_write_given_no_config_over_one_of_engines_alone_says_what_it_would_record(
    run_told: Run, tmp_path: Path, write_config: Callable[[str], str]
) -> None:
    """Over a recorded config of engines and no models, a write given no
    config was refused as "undeclaring its models" (it has none), and told
    to give one of `models: []` instead: that records the default engines,
    and every node then skips the runtime models on the config's own. The
    line says what the write would record, and to give what the nodes run."""
    engines = write_config("engines: [myeng, vllm]\nmodels: []\n")
    (tmp_path / "m.yaml").write_bytes(as_yaml(definition("m", engine="myeng")))
    ok(run_told("--config", engines, "model", "add", "m.yaml"))  # 1 its config, 2
    logged = ok(run_told("log", "--json")).stdout
    done = run_told("model", "scale", "m", "--max", "2")
    assert (done.exit_code, done.stdout, done.stderr) == (
        1,
        "",
        "error: no declared config given (--config, $CATALOG_ES_CONFIG or ./catalog.yaml): "
        "the log's nodes recorded one at revision 1, and this write would record none over "
        "it (no models, the default engines); give that config, or one declaring what every "
        "node should run (`models: []`: no models)\n",
    )
    assert run_told("log", "--json").stdout == logged


@pytest.mark.parametrize(
    ("config", "gone"),
    [
        ("engines: [myeng, vllm]\nmodels: []\n", "its engines"),
        (config_yaml(spec("base")), "its models"),
        (config_yaml(spec("base"), engines=["myeng", "vllm"]), "its models and engines"),
    ],
)
def test_a_read_given_no_config_says_what_of_the_recorded_one_it_goes_without(
    run_told: Run, tmp_path: Path, write_config: Callable[[str], str], config: str, gone: str
) -> None:
    """A read given no config, over a recorded config of engines alone, was
    told it "goes without its models", of which there are none (review): it
    goes without the engines, and the runtime models on them. The warning
    names what the recorded config declares."""
    given = write_config(config)
    (tmp_path / "m.yaml").write_bytes(as_yaml(definition("m", engine="vllm")))
    ok(run_told("--config", given, "model", "add", "m.yaml"))  # 1 its config, 2
    assert ok(run_told("model", "list")).stderr == (
        "warning: no declared config given (--config, $CATALOG_ES_CONFIG or ./catalog.yaml): "
        f"the log's nodes recorded one at revision 1, and this run goes without {gone}\n"
    )


def test_a_run_on_another_config_than_the_log_recorded_says_so(
    run_told: Run, db_url: str, tmp_path: Path
) -> None:
    """Two shells (or nodes) on two configs took turns recording theirs, and
    each read showed a catalog the other's nodes do not run, in silence
    (review). A read on a config the log has not recorded says so, after its
    answer; a write of a config the log never recorded is a deploy, said
    nothing of; one putting back a config the log had recorded before
    another says so, naming the record that replaced it and, when another
    came since, the last (it named the last alone as when it was replaced:
    review). Warnings only: exit 0, and the log as a run without them
    leaves it."""
    (tmp_path / "a.yaml").write_bytes(as_yaml(definition("a")))
    old, new, newest = (tmp_path / f"{n}.yaml" for n in ("old", "new", "newest"))
    old.write_text(config_yaml(spec("base")))
    new.write_text(config_yaml(spec("base"), spec("extra")))
    newest.write_text(config_yaml(spec("base"), spec("extra"), spec("more")))

    def catalog_es(config: Path, *args: str) -> tuple[int, list[str]]:
        done = run_told("--config", str(config), *args)
        return done.exit_code, done.stderr.splitlines()

    def recorded() -> list[tuple[int, str]]:
        listed = ok(run_told("log", "--json"))
        events = [json.loads(line) for line in listed.stdout.splitlines()]
        return [(e["revision"], e["fields"]["path"]) for e in events if e["model"] is None]

    assert catalog_es(old, "model", "add", "a.yaml")[0] == 0  # 1 old, 2
    read_over_new = (
        f"warning: this run's declared config ({new}) differs from the one the log recorded "
        "at revision 1: this run reads the catalog over its own config, and a write would "
        "record it"
    )
    assert catalog_es(new, "model", "list") == (0, [read_over_new])
    assert catalog_es(new, "rollback", "--to", "2", "--dry-run") == (0, [read_over_new])
    assert catalog_es(new, "model", "scale", "nope", "--max", "2") == (
        1,
        ["error: model 'nope' is not in the catalog"],
    )
    assert count_events(db_url) == 2
    assert catalog_es(new, "model", "scale", "a", "--max", "2") == (0, [])  # 3 new, 4
    assert catalog_es(new, "model", "list") == (0, [])
    assert catalog_es(old, "model", "scale", "a", "--max", "3") == (  # 5 old again, 6
        0,
        [
            f"warning: this node's declared config ({old}), recorded at revision 1, was "
            "replaced by another at revision 3, and is recorded again at revision 5: every "
            "node should run the same one, unless it was put back on purpose"
        ],
    )
    assert recorded() == [(1, str(old)), (3, str(new)), (5, str(old))]
    assert count_events(db_url) == 6
    assert catalog_es(new, "model", "scale", "a", "--max", "4") == (  # 7 new again, 8
        0,
        [
            f"warning: this node's declared config ({new}), recorded at revision 3, was "
            "replaced by another at revision 5, and is recorded again at revision 7: every "
            "node should run the same one, unless it was put back on purpose"
        ],
    )
    assert catalog_es(newest, "model", "scale", "a", "--max", "5") == (0, [])  # 9 newest, 10
    assert catalog_es(old, "model", "scale", "a", "--max", "6") == (  # 11 old again, 12
        0,
        [
            f"warning: this node's declared config ({old}), recorded at revision 5, was "
            "replaced by another at revision 7, last by another at revision 9, and is "
            "recorded again at revision 11: every node should run the same one, unless it "
            "was put back on purpose"
        ],
    )
    assert [path for _, path in recorded()] == [str(c) for c in (old, new, old, new, newest, old)]
    assert count_events(db_url) == 12


def test_a_refusal_another_config_explains_says_so_in_its_line(
    run_told: Run, db_url: str, tmp_path: Path
) -> None:
    """A shell on a stale config was refused a change to a model its config
    declares, or told a model its config lacks is not in the catalog, with
    no word that the log's nodes recorded another config, which declares
    neither so (last session's notes). The line says so, only where the two
    configs differ about the model refused (one without runtime history to
    roll back too), about a model it names as a fallback or is named a
    fallback by, or about its engine (those were told without it: notes of
    the session after); it stays one line, and the log is left as it was."""
    first, stale, deployed = (tmp_path / f"{n}.yaml" for n in ("first", "stale", "deployed"))
    first.write_text(config_yaml(spec("base")))
    stale.write_text(config_yaml(spec("base"), spec("gone"), engines=["vllm", "sglang"]))
    # Declares 'c' too, which ran as a runtime model naming 'a' as its fallback.
    deployed.write_text(config_yaml(spec("base"), spec("new"), spec("c")))
    for config, name, fields in (
        (first, "a", {}),  # 1 first, 2
        (first, "c", {"fallbacks": ["a"]}),  # 3
        (deployed, "b", {}),  # 4 deployed, 5
    ):
        (tmp_path / f"{name}.yaml").write_bytes(as_yaml(definition(name, **fields)))
        ok(run_told("--config", str(config), "model", "add", str(tmp_path / f"{name}.yaml")))
    for name, fallback in (("d", "new"), ("e", "nope")):
        (tmp_path / f"{name}.yaml").write_bytes(as_yaml(definition(name, fallbacks=[fallback])))
    for name, engine in (("t", "tgi"), ("u", "nope")):
        (tmp_path / f"{name}.yaml").write_bytes(as_yaml(definition(name, engine=engine)))
    recorded = "the config the log last recorded, at revision 4"
    changes = tmp_path / "changes.yaml"
    changes.write_text("- scale: {name: a, max: 2}\n- remove: new\n")
    cases: list[tuple[Path | None, tuple[str, ...], str]] = [
        (
            stale,
            ("model", "scale", "gone", "--max", "2"),
            "error: model 'gone' is declared in configuration; change its scaling there, or it"
            f" reverts on the next restart (declared in this run's config ({stale}), but not in"
            f" {recorded})",
        ),
        (
            stale,
            ("model", "remove", "new"),
            f"error: model 'new' is not in the catalog (declared in {recorded}, but not in this"
            f" run's config ({stale}))",
        ),
        # A change of a list says which, and the hint all the same.
        (
            stale,
            ("apply", str(changes)),
            "error: change 2 (remove new) refused, nothing applied: model 'new' is not in the"
            f" catalog (declared in {recorded}, but not in this run's config ({stale}))",
        ),
        (
            None,
            ("model", "show", "new"),
            f"error: model 'new' is not in the catalog (declared in {recorded}, but not in this"
            " run's config (none given))",
        ),
        # A model named as a fallback, or one naming it, is named.
        (
            stale,
            ("model", "add", "d.yaml"),
            "error: model 'd': fallbacks: names 'new', which is not in the catalog (model 'new'"
            f" is declared in {recorded}, but not in this run's config ({stale}))",
        ),
        (
            stale,
            ("model", "remove", "a"),
            "error: model 'a': fallbacks: is a fallback of 'c'; add that model again without 'a'"
            " in its fallbacks first (model show 'c' --json > FILE, edit it, model add FILE)"
            f" (model 'c' is declared in {recorded}, but not in this run's config ({stale}))",
        ),
        (
            stale,
            ("rollback", "--to", "2", "--model", "new"),
            f"error: model 'new' has no runtime history to roll back (declared in {recorded}, but"
            f" not in this run's config ({stale}))",
        ),
        (
            stale,
            ("model", "add", "t.yaml"),
            "error: model 't': engine: 'tgi' is not a known engine (known: sglang, vllm)"
            f" (engine 'tgi' is known in {recorded}, but not in this run's config ({stale}))",
        ),
        # Where both declare it, or neither, the difference explains nothing.
        (
            stale,
            ("model", "scale", "base", "--max", "2"),
            "error: model 'base' is declared in configuration; change its scaling there, or it"
            " reverts on the next restart",
        ),
        (
            stale,
            ("model", "scale", "nope", "--max", "2"),
            "error: model 'nope' is not in the catalog",
        ),
        (
            stale,
            ("model", "add", "e.yaml"),
            "error: model 'e': fallbacks: names 'nope', which is not in the catalog",
        ),
        (
            stale,
            ("rollback", "--to", "2", "--model", "nope", "--dry-run"),
            "error: model 'nope' has no runtime history to roll back",
        ),
        (
            stale,
            ("model", "add", "u.yaml"),
            "error: model 'u': engine: 'nope' is not a known engine (known: sglang, vllm)",
        ),
        # Read over the config recorded then, which lacks it too, not over this run's.
        (
            stale,
            ("model", "show", "new", "--at", "2", "--declared-then"),
            "error: model 'new' is not in the catalog at revision 2",
        ),
    ]
    for given, args, told in cases:
        done = run_told(*(["--config", str(given)] if given else []), *args)
        assert (done.exit_code, done.stderr.splitlines()[-1]) == (1, told), args
    assert count_events(db_url) == 5


@pytest.mark.parametrize(
    ("on_cycle", "declared_there", "hint"),
    [
        pytest.param(2, ("m2",), "model 'm2' is", id="one"),
        pytest.param(2, ("m1", "m2"), "models 'm1', 'm2' are", id="two"),
        pytest.param(
            7,
            ("m1", "m2", "m3", "m4", "m5", "m6", "m7"),
            "models 'm1', 'm2', 'm3', 'm4', 'm5' and 2 more are",
            id="many",
        ),
        # A model off the cycle, or the one refused (refused there as declared), breaks nothing.
        pytest.param(2, ("other",), "", id="off-the-cycle"),
        pytest.param(2, ("a",), "", id="the-model-refused"),
    ],
)
def test_a_fallback_cycle_another_config_breaks_says_so_in_its_line(
    run_told: Run,
    db_url: str,
    tmp_path: Path,
    on_cycle: int,
    declared_there: tuple[str, ...],
    hint: str,
) -> None:
    """A runtime model given a fallback that closed a cycle (a -> m1 -> … ->
    a), on a stale config, was refused with no word that the config the log
    last recorded declares a model on it, which breaks it there (a declared
    model names only declared ones): left open at stop 51. Any one such
    model does, where a model named or naming needs each: the line names
    those it declares (five, and how many more), and says nothing where it
    declares none of them. One line, exit 1, the log left as it was."""
    stale, deployed = tmp_path / "stale.yaml", tmp_path / "deployed.yaml"
    stale.write_text(config_yaml(spec("base")))
    deployed.write_text(config_yaml(spec("base"), *map(spec, declared_there)))
    chain = [f"m{n}" for n in range(1, on_cycle + 1)]
    # a, then each model on the chain from its end, naming the one after it.
    named = zip(reversed(chain), ["a", *reversed(chain[1:])], strict=True)
    adds = [definition("a"), *(definition(m, fallbacks=[f]) for m, f in named)]
    (tmp_path / "chain.yaml").write_bytes(as_yaml([{"add": d} for d in adds]))
    (tmp_path / "a.yaml").write_bytes(as_yaml(definition("a", fallbacks=["m1"])))
    (tmp_path / "z.yaml").write_bytes(as_yaml(definition("z")))
    ok(run_told("--config", str(stale), "apply", "chain.yaml"))  # 1 stale, 2…
    ok(run_told("--config", str(deployed), "model", "add", "z.yaml"))  # deployed, z
    written = count_events(db_url)
    shown_cycle = " -> ".join(
        ["a", *chain, "a"] if on_cycle < 6 else ["a", *chain[:4], "… (3 more)", "a"]
    )
    told = f"error: model 'a': fallbacks: form a cycle: {shown_cycle}"
    if hint:
        told += (
            f" ({hint} declared in the config the log last recorded, at revision {written - 1},"
            f" but not in this run's config ({stale}))"
        )
    done = run_told("--config", str(stale), "model", "add", "a.yaml")
    assert refused_in_one_line(done) == told
    assert count_events(db_url) == written


def test_a_deleted_last_event_is_told_by_every_command_until_a_write_goes_on(
    run_told: Run, db_url: str, tmp_path: Path
) -> None:
    """The head is kept apart so that a deleted last event is noticed, but
    only verify and serve said so: `revision` answered the one before it, a
    read and a write said nothing (hostile test). Each command warns once;
    a write goes on after the head, and verify names the gap it leaves.
    `revision`, whose answer is the head, is refused naming both: it
    answered the revision before with a warning and exit 0, which a script
    took for the head of a log whole, where verify exits 1."""
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_bytes(as_yaml(definition(name)))
        ok(run_told("model", "add", f"{name}.yaml"))
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM catalog_events WHERE revision = 2"))
    engine.dispose()

    told = (
        "warning: revision 2 is missing: the head is at revision 2 but the log ends at 1, so "
        "the last events were deleted (catalog-es verify); the next write is numbered after "
        "revision 2, leaving the gap\n"
    )
    no_head = (
        "error: revision 2 is missing: the head is at revision 2 but the log ends at 1, so the"
        " last events were deleted; revision 1 is not the head (catalog-es verify)"
    )
    for asked in (run_told("revision"), run_told("--json", "revision")):
        assert refused_in_one_line(asked) == no_head
    assert run_told("model", "list", "--json").stderr == told
    refused = run_told("model", "scale", "b", "--max", "2")  # b's Added was the event deleted
    assert (refused.exit_code, refused.stderr) == (1, "error: model 'b' is not in the catalog\n")
    scaled = run_told("model", "scale", "a", "--max", "2")
    assert (scaled.exit_code, scaled.stderr) == (0, told)
    assert scaled.stdout.startswith("scaled a at revision 3\n")
    assert (run_told("revision").stdout, run_told("revision").stderr) == ("3\n", "")
    verified = run_told("verify")
    assert verified.exit_code == 1
    assert verified.stderr.startswith("error: chain broken at revision 2: revision 2 is missing")


def test_a_write_told_in_characters_the_terminal_lacks_still_exits_0(tmp_path: Path) -> None:
    """A committed write whose answer the terminal's encoding cannot write
    exited 1, which says nothing was written (hostile test): it is written
    escaped, and the command exits 0."""
    db = f"sqlite:///{tmp_path}/catalog.db"
    definition_file = tmp_path / "m.yaml"
    definition_file.write_bytes(as_yaml(definition("m", source="hf://org/ｍ")))
    done = subprocess.run(
        [sys.executable, "-m", "catalog_es", "--db", db, "model", "add", str(definition_file)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONIOENCODING": "ascii"},
    )
    assert (done.returncode, done.stdout.splitlines()[0]) == (0, "added m at revision 1")
    assert "hf://org/\\uff4d" in done.stdout
    assert count_events(db) == 1


def said_to_be_made_once(
    db: str, other: str, made_in: Callable[[str], str], definition_file: Path
) -> None:
    """A read at ``db``, with no log there, makes none and says where
    (``made_in``); the first write makes it and says so after its answer,
    and the next run on it nothing; a refusal on ``other``, with no log
    either, stays one line, which says it."""
    listing = ["--db", db, "model", "list", "--json"]
    read = invoke_told(listing)
    assert (read.exit_code, read.stdout) == (0, "[]\n")
    assert read.stderr == (
        f"warning: no log {made_in(db)}: answered as an empty log; none was made\n"
    )
    added = invoke_told(["--db", db, "model", "add", str(definition_file)])  # the read made none
    assert (added.exit_code, added.stdout.splitlines()[0]) == (0, "added m at revision 1")
    assert added.stderr == f"warning: no log {made_in(db)} yet: a new one is made there\n"
    again = invoke_told(listing)
    assert (again.exit_code, again.stderr) == (0, "")
    refused = CliRunner().invoke(cli, ["--db", other, "model", "scale", "m", "--max", "2"])
    assert refused_in_one_line(refused) == (  # it was held with the load's warnings, and left out
        f"error: model 'm' is not in the catalog (no log was {made_in(other)}: a new, "
        "empty one is made there)"
    )


@pytest.mark.parametrize("file", ["missing", "empty"])
def test_a_new_sqlite_log_is_said_to_be_made(tmp_path: Path, file: str) -> None:
    """A path mistyped read as an empty catalog, said nothing, and left a new
    file (operator walkthrough); so did an empty file there (`touch
    typo.db`), with no log in it either (last session's notes)."""
    db = f"sqlite:///{tmp_path}/typo.db"
    if file == "empty":
        (tmp_path / "typo.db").touch()
        (tmp_path / "other.db").touch()
    definition_file = tmp_path / "m.yaml"
    definition_file.write_bytes(as_yaml(definition("m")))
    said_to_be_made_once(
        db,
        f"sqlite:///{tmp_path}/other.db",
        lambda url: f"at {url.removeprefix('sqlite:///')}",
        definition_file,
    )
    uri = f"sqlite:///file:{tmp_path}/typo.db?uri=true"  # the same file, named as a URI
    named = invoke_told(["--db", uri, "model", "list", "--json"])
    assert (named.exit_code, named.stderr) == (0, "")


def test_a_new_postgresql_log_is_said_to_be_made(
    pg_schema_url: Callable[..., str], pg_admin: sa.Engine, tmp_path: Path
) -> None:
    """A node pointed at a schema with no log (a search path, a privilege or
    a database mistaken) made one there, answered an empty catalog and said
    nothing (hostile test): it says which schema of which database."""
    with pg_admin.connect() as conn:
        database = conn.exec_driver_sql("SELECT current_database()").scalar_one()

    def made_in(db: str) -> str:
        url = sa.make_url(db)
        server = f"{url.host}:{url.port}" if url.port else url.host
        return f"in schema {schema_of(db)} of database {database} at {server}"

    definition_file = tmp_path / "m.yaml"
    definition_file.write_bytes(as_yaml(definition("m")))
    said_to_be_made_once(pg_schema_url(), pg_schema_url(), made_in, definition_file)


# Commands refused on their input alone: the log is not needed to judge them.
REFUSED_AS_GIVEN = [
    ("log", "--by", ""),
    ("log", "--model", ""),
    ("log", "--model", "Bad Name!"),
    ("watch", "--by", ""),
    ("diff", "0", "--model", "Bad Name!"),
    ("audit", "--by", ""),
    ("audit", "--model", ""),
    ("refusals", "--by", ""),
    ("refusals", "--model", ""),
    ("history", "m", "--by", ""),
    ("--by", "", "history", "m"),
    ("history", ""),
    ("model", "show", ""),
    ("model", "show", "Bad Name!"),
    # A write's actor and reason, judged by the service's own checks.
    ("model", "scale", "m", "--max", "2", "--by", ""),
    ("model", "remove", "m", "--by", " alice"),
    ("--reason", "rang\a", "model", "owner", "m", "team:a"),
    ("model", "owner", "m", "team:a", "--reason", "  "),
    ("rollback", "--to", "0", "--dry-run", "--by", "\u202ealice"),
    ("model", "check-updates", "--mirror", ".", "--by", ""),
]


@pytest.mark.parametrize("query", REFUSED_AS_GIVEN, ids=" ".join)
def test_a_command_refused_as_given_makes_no_log(db_url: str, run: Run, query: list[str]) -> None:
    """`log --by ''` on a path with no log made the log's tables (a new
    file on SQLite), then refused (review): a mistyped path was left with a
    log nothing asked for; so did a write's blank actor. Input judged
    without the log is refused before it is opened: one line, and nothing
    made."""
    refused = refused_in_one_line(run(*query))
    assert "a new, empty one is made there" not in refused
    assert_no_log_made(db_url)


def assert_no_log_made(db_url: str) -> None:
    """No file at a SQLite URL, no table in a PostgreSQL URL's schema."""
    if db_url.startswith("sqlite"):
        assert not Path(db_url.removeprefix("sqlite:///")).exists()
        return
    engine = sa.create_engine(db_url)
    try:
        assert sa.inspect(engine).get_table_names() == []
    finally:
        engine.dispose()


def no_log_at(db_url: str) -> str:
    """How a line names where ``db_url`` holds no log, up to the database's
    name on PostgreSQL."""
    if db_url.startswith("sqlite"):
        return f"no log at {db_url.removeprefix('sqlite:///')}"
    return f"no log in schema {schema_of(db_url)} of database "


@pytest.fixture
def apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder temporary files are made in, for this test alone."""
    folder = tmp_path / "apart"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


# Commands that write nothing, answered where there is no log as from an empty one.
ANSWERED_AS_AN_EMPTY_LOG = [
    ("model", "list"),
    ("--json", "model", "list"),
    ("model", "list", "--at", "0"),
    ("sources",),
    ("log",),
    ("audit", "--model", "m"),
    ("refusals",),
    ("revision",),
    ("diff", "0"),
    ("rollback", "--to", "0", "--dry-run"),
    ("model", "updates"),
    ("replay",),
]


@pytest.mark.parametrize("query", ANSWERED_AS_AN_EMPTY_LOG, ids=" ".join)
def test_a_read_where_there_is_no_log_answers_and_makes_none(
    db_url: str, query: list[str], apart: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read on a path with no log made one there (a new file on SQLite,
    the tables on PostgreSQL), as did a dry run: a mistyped path or schema
    was left with a log nothing asked for. Reads make nothing: they answer
    as an empty log would, and say so in one warning."""
    monkeypatch.setenv("CATALOG_ES_MIRROR", str(apart.parent))  # model updates: an empty one
    done = invoke_told(["--db", db_url, *query])
    assert done.exit_code == 0, done.stderr
    assert done.stderr.startswith(f"warning: {no_log_at(db_url)}")
    assert done.stderr.endswith(": answered as an empty log; none was made\n")
    assert done.stderr.count("\n") == 1
    assert_no_log_made(db_url)
    assert list(apart.iterdir()) == []


# Reads refused for what the log holds: where there is no log, an empty one.
REFUSED_ON_AN_EMPTY_LOG = [
    ("model", "show", "absent"),
    ("model", "show", "absent", "--at", "0"),
    ("model", "list", "--at", "5"),
    ("sources", "--at", "5"),
    ("log", "--after", "5"),
    ("history", "absent"),
    ("history", "Bad Name!"),
    ("diff", "5"),
    ("diff", "0", "5", "--model", "absent"),
    ("--json", "model", "show", "absent"),
    ("rollback", "--to", "5", "--dry-run"),
    ("watch", "--from", "5"),
    # A check that an empty log passes would pass on a mistyped path for good.
    ("verify",),
]


@pytest.mark.parametrize("query", REFUSED_ON_AN_EMPTY_LOG, ids=" ".join)
def test_a_read_refused_where_there_is_no_log_makes_none(
    db_url: str, run: Run, query: list[str], apart: Path
) -> None:
    """`model show absent`, `log --after 5` and the like, on a path with no
    log, made one (a new file on SQLite, the tables on PostgreSQL), then
    refused (review): a mistyped path was left with a log nothing asked
    for. A read is answered from an empty log, made apart and removed."""
    refused = refused_in_one_line(run(*query))
    assert f" ({no_log_at(db_url).replace('no log', 'no log is')}" in refused
    assert refused.endswith(": none was made)")
    assert_no_log_made(db_url)
    assert list(apart.iterdir()) == []


def test_a_read_by_a_role_that_may_not_make_the_log_answers(
    pg_url: str, read_only_url: Callable[[], str]
) -> None:
    """A read on a schema with no log, by a role that may only read there,
    was refused (permission denied) as it made the log: it makes none, so
    it answers as an empty log would."""
    listed = invoke_told(["--db", read_only_url(), "--json", "model", "list"])
    assert (listed.exit_code, listed.stdout) == (0, "[]\n")
    assert listed.stderr.startswith(f"warning: {no_log_at(pg_url)}")
    assert_no_log_made(pg_url)


def test_a_read_on_an_empty_file_leaves_it_empty(tmp_path: Path) -> None:
    """An empty file (`touch typo.db`) holds no log either: a read, refused
    or answered, leaves it as it was."""
    typo = tmp_path / "typo.db"
    typo.touch()
    db = f"sqlite:///{typo}"
    refused = refused_in_one_line(invoke_told(["--db", db, "log", "--after", "1"]))
    assert refused == (
        f"error: revision 1 is beyond the head of the log (0) (no log is at {typo}: none was made)"
    )
    listed = invoke_told(["--db", db, "log", "--json"])
    assert (listed.exit_code, listed.stdout) == (0, "")
    assert listed.stderr == (
        f"warning: no log at {typo}: answered as an empty log; none was made\n"
    )
    assert typo.stat().st_size == 0


def test_a_read_on_another_apps_sqlite_file_leaves_it_as_it_was(tmp_path: Path) -> None:
    """A read on a SQLite file of another app's (a mistyped path) found no
    log there, and answered as an empty log, but its connection had turned
    the file to WAL mode (review): a setting kept in the file, the other
    app's to choose. The file is looked at read-only first, and left as it was."""
    other = tmp_path / "other.db"
    with closing(sqlite3.connect(other)) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
        conn.commit()
    before = other.read_bytes()
    db = f"sqlite:///{other}"
    refused = refused_in_one_line(invoke_told(["--db", db, "log", "--after", "1"]))
    assert refused.endswith(f"(no log is at {other}: none was made)")
    listed = invoke_told(["--db", db, "model", "list", "--json"])
    assert (listed.exit_code, listed.stdout) == (0, "[]\n")
    assert listed.stderr == (
        f"warning: no log at {other}: answered as an empty log; none was made\n"
    )
    assert other.read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["other.db"]


def test_a_read_leaves_a_head_table_dropped_by_hand_as_it_was(
    db_url: str, run_told: Run, tmp_path: Path
) -> None:
    """A read on a log without its catalog_head table (dropped by hand) made
    the table: a command that writes nothing wrote. Reads leave it so, and
    read the log as where the head's row is deleted (docs/audit.md): they
    answer, and verify names the head missing; a write makes the table,
    and is refused as there, nothing written."""
    (tmp_path / "a.yaml").write_bytes(as_yaml(definition("a")))
    ok(run_told("model", "add", "a.yaml"))
    ok(run_told("model", "scale", "a", "--max", "2"))
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE catalog_head"))

    def tables() -> list[str]:
        return sorted(sa.inspect(engine).get_table_names())

    dropped = tables()
    assert "catalog_head" not in dropped
    assert (run_told("revision").stdout, run_told("log", "--json").stdout.count("\n")) == ("2\n", 2)
    listed = run_told("--json", "model", "show", "a")
    assert (listed.exit_code, json.loads(listed.stdout)["scaling"]["max"]) == (0, 2)
    verified = run_told("verify")
    assert (verified.exit_code, verified.stderr.splitlines()[-1]) == (
        1,
        "error: chain broken at revision 3: the head record (catalog_head) is missing:"
        " events after revision 2 may have been deleted",
    )
    missing = "error: the log's head record (catalog_head) is missing, but the log holds events"
    assert refused_in_one_line(run_told("rollback", "--to", "1", "--dry-run")).startswith(missing)
    assert tables() == dropped
    assert refused_in_one_line(run_told("model", "scale", "a", "--max", "3")).startswith(missing)
    assert tables() == sorted([*dropped, "catalog_head"])
    assert count_events(db_url) == 2
    engine.dispose()


def test_a_watch_leaves_a_head_table_dropped_by_hand_as_it_was(
    db_url: str, run_told: Run, tmp_path: Path
) -> None:
    """A watch from the start made the log's catalog_head table, dropped by
    hand, as every read did before (a command that writes nothing wrote; a
    follower's role that may only read could not start). It follows the log
    and leaves the table missing; on a path with no log it still makes one,
    to follow."""
    (tmp_path / "a.yaml").write_bytes(as_yaml(definition("a")))
    ok(run_told("model", "add", "a.yaml"))
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE catalog_head"))
    dropped = sorted(sa.inspect(engine).get_table_names())
    watch = python("-m", "catalog_es", "--db", db_url, "watch", "--json")
    try:
        assert watch.stdout is not None
        assert select.select([watch.stdout], [], [], 30)[0], "watch gave nothing in 30 s"
        assert json.loads(watch.stdout.readline())["model"] == "a"
        watch.send_signal(signal.SIGTERM)
        _, err = watch.communicate(timeout=30)
    finally:
        watch.kill()
    assert (watch.returncode, err) == (0, "stopped\n")
    assert sorted(sa.inspect(engine).get_table_names()) == dropped
    engine.dispose()


def test_a_view_named_as_a_table_of_the_log_is_refused_before_anything_is_made(
    db_url: str, run: Run
) -> None:
    """A view named catalog_events had a read make the other tables, then
    fail on `no such column: catalog_events.revision`, naming neither the
    view nor what to do (last session's notes). It is refused in one line
    that does both, and the database is left as it was."""
    engine = sa.create_engine(db_url)

    def objects() -> list[str]:
        inspector = sa.inspect(engine)
        return sorted(inspector.get_table_names() + inspector.get_view_names())

    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE VIEW catalog_events AS SELECT 1 AS one"))
        before = objects()
        where = f" in schema {schema_of(db_url)}" if db_url.startswith("postgresql") else ""
        other = "database or schema" if where else "file"
        assert refused_in_one_line(run("model", "list")) == (
            f"error: a view named catalog_events{where} stands where the catalog keeps its"
            " table of that name: nothing was read or made; point --db at another"
            f" {other}, or rename it (it may hold another application's data)"
        )
        assert objects() == before == ["catalog_events"]
    finally:
        engine.dispose()


EVERY_LOG_COLUMN = "revision, originator_id, originator_version, topic, state, hash"


@pytest.mark.parametrize(
    ("made", "lacking"),
    [
        ("CREATE TABLE catalog_events (id integer, body text)", EVERY_LOG_COLUMN),
        (
            "CREATE TABLE catalog_events (id integer, topic text, state text)",
            "revision, originator_id, originator_version, hash",
        ),
        ("CREATE VIRTUAL TABLE catalog_events USING fts5(body)", EVERY_LOG_COLUMN),
        (
            "CREATE FOREIGN TABLE catalog_events (x int) SERVER {server}"
            " OPTIONS (filename '/dev/null')",
            EVERY_LOG_COLUMN,
        ),
    ],
)
def test_a_table_named_as_the_logs_that_is_not_the_log_is_refused_before_anything_is_made(
    db_url: str, run: Run, made: str, lacking: str
) -> None:
    """A table named catalog_events without the log's columns (an operator's
    own, a SQLite virtual table, a PostgreSQL foreign table) had a read make
    the other tables, then fail on `no such column: catalog_events.revision`,
    naming neither the table nor what to do. It is refused in one line that
    does both, as a view in its place is, and the database left as it was.
    One sharing a few of the log's column names is no log either (a log
    lacking fewer is refused as damaged: tests/test_upgrade.py)."""
    postgresql = db_url.startswith("postgresql")
    if ("VIRTUAL" in made and postgresql) or ("FOREIGN" in made and not postgresql):
        pytest.skip("SQLite's or PostgreSQL's own kind of table")
    engine = sa.create_engine(db_url)
    # A foreign table needs a server, one per database: named for this test's schema.
    server = f"files_{schema_of(db_url)}" if postgresql else ""

    def objects() -> list[str]:
        listed = (
            "SELECT relname FROM pg_class WHERE relnamespace = current_schema()::regnamespace"
            if postgresql
            else "SELECT name FROM sqlite_master"
        )
        with engine.connect() as conn:
            return sorted(conn.exec_driver_sql(listed).scalars())

    try:
        with engine.begin() as conn:
            if "FOREIGN" in made:
                # In the test's schema, so that its drop takes the extension too.
                conn.execute(
                    sa.text(f"CREATE EXTENSION IF NOT EXISTS file_fdw SCHEMA {schema_of(db_url)}")
                )
                conn.execute(sa.text(f"CREATE SERVER {server} FOREIGN DATA WRAPPER file_fdw"))
            conn.execute(sa.text(made.format(server=server)))
        before = objects()
        where = f" in schema {schema_of(db_url)}" if postgresql else ""
        other = "database or schema" if postgresql else "file"
        for command in (["model", "list"], ["model", "scale", "m", "--max", "2"]):
            assert refused_in_one_line(run(*command)) == (
                f"error: a table named catalog_events{where}, without the log's columns"
                f" ({lacking}), stands where the catalog keeps its table of that name: nothing"
                f" was read or made; point --db at another {other}, or rename it (it may hold"
                " another application's data)"
            )
            assert objects() == before
    finally:
        if "FOREIGN" in made:
            with engine.begin() as conn:
                conn.execute(sa.text(f"DROP SERVER IF EXISTS {server} CASCADE"))
        engine.dispose()


class Catalog(Application[uuid.UUID]):
    """Another application of the event library, whose name makes its
    events' table the log's: ``catalog_events``."""


def _another_apps_events(db_url: str) -> None:
    """Catalog's events kept in ``db_url`` by eventsourcing_sqlalchemy."""
    other = Catalog(
        env={"PERSISTENCE_MODULE": "eventsourcing_sqlalchemy", "SQLALCHEMY_URL": db_url}
    )
    other.save(Aggregate())
    other.close()


def _another_apps_events_in_sqlite(db_url: str) -> None:
    """The same on SQLite by the library's own recorder (its factory names
    the table stored_events; an application can name it as it likes)."""
    datastore = SQLiteDatastore(sa.make_url(db_url).database or "")
    recorder = SQLiteApplicationRecorder(datastore, events_table_name="catalog_events")
    recorder.create_table()
    recorder.insert_events([StoredEvent(uuid.uuid4(), 1, "other_app:Made", b"{}")])
    datastore.close()


def _made_by(statement: str) -> Callable[[str], None]:
    def make(db_url: str) -> None:
        engine = sa.create_engine(db_url)
        with engine.begin() as conn:
            conn.exec_driver_sql(statement)
        engine.dispose()

    return make


def _a_log_with_a_column_dropped(db_url: str) -> None:
    definition_file = Path("m.yaml")  # in the test's own folder, where it runs
    definition_file.write_bytes(as_yaml(definition("m")))
    ok(invoke_told(["--db", db_url, "model", "add", str(definition_file)]))
    _made_by("ALTER TABLE catalog_events DROP COLUMN state")(db_url)


IN_THE_WAY = (
    "a table named catalog_events{where}, without the log's columns ({lacking}), stands where"
    " the catalog keeps its table of that name: nothing was read or made; point --db at"
    " another {other}, or rename it (it may hold another application's data)"
)


@pytest.mark.parametrize(
    ("make", "told", "only_on"),
    [
        pytest.param(
            _another_apps_events,
            IN_THE_WAY.replace("{lacking}", "revision, hash"),
            "",
            id="eventsourcing-sqlalchemy",
        ),
        pytest.param(
            _another_apps_events_in_sqlite,
            IN_THE_WAY.replace("{lacking}", "revision, hash"),
            "sqlite",
            id="eventsourcing-sqlite",
        ),
        # As eventsourcing.postgres makes it (not imported: it needs
        # psycopg_pool, which this project does not install).
        pytest.param(
            _made_by(
                "CREATE TABLE catalog_events (originator_id uuid NOT NULL, originator_version"
                " bigint NOT NULL, topic text, state bytea, notification_id bigserial,"
                " PRIMARY KEY (originator_id, originator_version))"
            ),
            IN_THE_WAY.replace("{lacking}", "revision, hash"),
            "postgresql",
            id="eventsourcing-postgres",
        ),
        # A column or two only the log has do not make a log.
        pytest.param(
            _made_by("CREATE TABLE catalog_events (id integer, revision integer, hash text)"),
            IN_THE_WAY.replace("{lacking}", "originator_id, originator_version, topic, state"),
            "",
            id="unrelated",
        ),
        # As many of the log's columns as it lacks, one only the log has among
        # them: the boundary at which a table is taken for the log, damaged.
        pytest.param(
            _made_by(
                "CREATE TABLE catalog_events (revision integer, originator_id text, hash text)"
            ),
            "the log's table catalog_events{where} lacks columns every release has made it with"
            " (originator_version, topic, state): it was altered by hand; nothing was read or"
            " made; do not drop it, it may hold the catalog's history: restore the log from a"
            " backup, or point --db at another {other}",
            "",
            id="as-many-kept-as-lacking",
        ),
        pytest.param(
            _a_log_with_a_column_dropped,
            "the log's table catalog_events{where} lacks columns every release has made it with"
            " (state): it was altered by hand; nothing was read or made; do not drop it, it may"
            " hold the catalog's history: restore the log from a backup, or point --db at"
            " another {other}",
            "",
            id="damaged-log",
        ),
    ],
)
def test_another_event_stores_table_named_as_the_log_is_in_the_way_not_a_damaged_log(
    db_url: str, make: Callable[[str], None], told: str, only_on: str
) -> None:
    """Another eventsourcing application's events, in a table named as the
    log's (an application named Catalog: the library's own layout, the
    log's columns but revision and hash), was refused as the log damaged by
    hand, to be restored from a backup: it held as many of the log's
    columns as it lacked. A table is taken for the log only with a column
    that the log alone has, and as many of its columns as it lacks; else
    it is in the way. Each refused in one line, exit 1, the database left
    as it was: a SQLite file not in WAL mode (no log is), too, which was
    turned to it before the refusal."""
    if not db_url.startswith(only_on):
        pytest.skip(f"{only_on}'s own")
    postgresql = db_url.startswith("postgresql")
    make(db_url)
    engine = sa.create_engine(db_url)

    def stored() -> tuple[list[str], list[tuple[Any, ...]], bytes]:
        listed = (
            "SELECT relname FROM pg_class WHERE relnamespace = current_schema()::regnamespace"
            if postgresql
            else "SELECT name FROM sqlite_master"
        )
        with engine.connect() as conn:
            objects = sorted(conn.exec_driver_sql(listed).scalars())
            rows = conn.exec_driver_sql("SELECT * FROM catalog_events ORDER BY 1, 2").all()
        # A SQLite file whole: its journal mode too, another app's to choose.
        file = b"" if postgresql else Path(sa.make_url(db_url).database or "").read_bytes()
        return objects, [tuple(row) for row in rows], file

    before = stored()
    where = f" in schema {schema_of(db_url)}" if postgresql else ""
    other = "database or schema" if postgresql else "file"
    try:
        for command in (["model", "list"], ["model", "scale", "m", "--max", "2"]):
            refused = CliRunner().invoke(cli, ["--db", db_url, *command])
            assert refused_in_one_line(refused) == "error: " + told.format(where=where, other=other)
            assert stored() == before
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("made", "told"),
    [
        ("CREATE VIEW CATALOG_EVENTS AS SELECT 1 AS one", "a view named CATALOG_EVENTS"),
        ("CREATE INDEX Catalog_Head ON other (x)", "an index named Catalog_Head"),
    ],
)
def test_an_object_named_as_a_table_of_the_log_in_another_case_is_refused_too(
    tmp_path: Path, made: str, told: str
) -> None:
    """SQLite's names are the same in any case: a view named CATALOG_EVENTS
    was not found as one, and the table's creation failed on it, in a line
    that named neither it nor what to do (hostile test). The file, another
    app's, is left as it was, in its journal mode too."""
    file = tmp_path / "catalog.db"
    with closing(sqlite3.connect(file)) as conn:
        conn.executescript(f"CREATE TABLE other (x); {made}")

    def objects() -> list[tuple[str, str]]:
        with closing(sqlite3.connect(file)) as conn:
            return sorted(conn.execute("SELECT type, name FROM sqlite_master").fetchall())

    before = objects(), file.read_bytes()
    result = CliRunner().invoke(cli, ["--db", f"sqlite:///{file}", "model", "list"])
    assert refused_in_one_line(result).startswith(f"error: {told} stands where the catalog")
    assert (objects(), file.read_bytes()) == before


@pytest.mark.parametrize(
    "made",
    ["CREATE TYPE catalog_events AS ENUM ('a')", "CREATE DOMAIN catalog_refusals AS int"],
)
def test_a_type_named_as_a_table_of_the_log_is_refused_before_anything_is_made(
    pg_url: str, made: str
) -> None:
    """On PostgreSQL a table's name is its row type's too: a type of that name
    (an enum, a domain) in the schema the log is made in failed its creation
    with `unexpected ProgrammingError: (psycopg.errors.DuplicateObject) type
    "catalog_events" already exists` (hostile test). It is refused as a view
    there is, and the schema is left as it was."""
    schema = schema_of(pg_url)
    name = made.split()[2]
    engine = sa.create_engine(pg_url)

    def objects() -> list[str]:
        with engine.connect() as conn:
            return sorted(
                conn.execute(
                    sa.text(
                        "SELECT relname FROM pg_class WHERE relnamespace = to_regnamespace(:s)"
                        " UNION ALL SELECT typname FROM pg_type"
                        " WHERE typnamespace = to_regnamespace(:s)"
                    ),
                    {"s": schema},
                ).scalars()
            )

    try:
        with engine.begin() as conn:
            conn.execute(sa.text(made))
        before = objects()
        result = CliRunner().invoke(cli, ["--db", pg_url, "model", "list"])
        assert refused_in_one_line(result) == (
            f"error: a type named {name} in schema {schema} stands where the catalog keeps its"
            " table of that name: nothing was read or made; point --db at another"
            " database or schema, or rename it (it may hold another application's data)"
        )
        assert objects() == before
    finally:
        engine.dispose()


def test_a_command_lets_go_of_the_database_when_it_ends(tmp_path: Path) -> None:
    """The service was never closed: its connections stayed open until the
    process ended (review). SQLite's last connection, closing, folds the WAL
    back into the file and deletes it."""
    (tmp_path / "m.yaml").write_bytes(as_yaml(definition("m")))
    db = f"sqlite:///{tmp_path}/catalog.db"
    for command in (["model", "add", str(tmp_path / "m.yaml")], ["model", "list"]):
        assert CliRunner().invoke(cli, ["--db", db, *command]).exit_code == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["catalog.db", "m.yaml"]


def test_python_m_catalog_es_runs(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "catalog_es", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "model" in done.stdout and "log" in done.stdout


# What a read has no use for: loading it was a share of the start-up every
# command pays, and operators run reads in loops (`model show`, `log --json`).
NOT_LOADED_TO_READ = (
    "fastapi",  # the HTTP API and the console: serve's
    "uvicorn",
    "catalog_es.web.app",
    "rich.console",  # the progress bar: replay's
    "rich.progress",
)


def test_a_read_loads_only_what_it_uses(tmp_path: Path) -> None:
    """A read, run in a process of its own, imports none of
    :data:`NOT_LOADED_TO_READ`. What is loaded, not how long it takes:
    timings are the machine's."""
    db = f"sqlite:///{tmp_path}/catalog.db"
    definition_file = tmp_path / "m.yaml"
    definition_file.write_bytes(as_yaml(definition("m")))
    # Its own config: run from the project's folder, it would read the example's.
    config = tmp_path / "catalog.yaml"
    config.write_text("models: []\n")
    shared = ["--db", db, "--config", str(config)]
    ok(CliRunner().invoke(cli, [*shared, "model", "add", str(definition_file)]))
    read = [*shared, "model", "show", "m", "--json"]
    script = (
        "import json, sys\n"
        "from catalog_es.cli import cli\n"
        f"cli.main({read!r}, standalone_mode=False)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).parent.parent,  # the code under test, not an installed copy
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    shown, loaded = done.stdout.splitlines()
    assert json.loads(shown)["name"] == "m"
    assert [name for name in NOT_LOADED_TO_READ if name in json.loads(loaded)] == []


# What a command that reads no log (help, the version, a usage error) loads
# none of: the service and what it stands on were a third of a second of
# every `--help` and every mistyped command.
NOT_LOADED_WITHOUT_A_LOG = ("sqlalchemy", "eventsourcing", "pydantic", "yaml", "msgspec")


@pytest.mark.parametrize(
    ("args", "code", "said"),
    [
        *(
            ([*c, "--help"], 0, f"Usage: {' '.join(['catalog-es', *c])} ")
            for c, _ in every_command()
        ),
        (["model", "--help"], 0, "Read and change the models in the catalog."),
        (["--version"], 0, "catalog-es, version "),
        (["model", "show"], 2, "Error: Missing argument 'NAME'."),
        (["log", "--limit", "0"], 2, "Error: Invalid value for '--limit': 0 is not in the range"),
        (["model", "show", "m", "--at", "noon"], 2, "'noon' is neither a revision nor"),
        (["audit", "--since", "noon"], 2, "Error: --since 'noon': not a UTC time"),
        (["audit", "--type", "Bogus"], 2, "Error: --type 'Bogus': not an event type"),
        (["audit", "--type", "Rollback"], 2, "Error: --type 'Rollback': the audit has none"),
        # A type read, then another option refused: the type loaded the service.
        (["refusals", "--type", "Scaled", "--since", "noon"], 2, "--since 'noon': not a UTC"),
        (["rollback", "--to", "1", "--only", "engine"], 2, "'engine' is not one of 'source'"),
        (["model", "adapters", "m"], 2, "Error: give --adapter NAME=SOURCE (one or more)"),
        # Refused before any log is opened: an exit 1, but no database to read.
        (["--db", "", "model", "list"], 1, "error: --db is empty: give a database URL"),
    ],
)
def test_a_command_that_reads_no_log_loads_no_service(
    args: list[str], code: int, said: str
) -> None:
    """``python -m catalog_es`` in a process of its own imports none of
    :data:`NOT_LOADED_WITHOUT_A_LOG`, as ``-X importtime`` tells each import.
    What is loaded, not how long it takes: timings are the machine's."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "catalog_es", *args],
        cwd=Path(__file__).parent.parent,  # the code under test, not an installed copy
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    imports = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    told = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == code, told
    assert said in done.stdout + "\n".join(told)
    loaded = {line.rpartition("|")[2].strip() for line in imports}
    assert sorted(m for m in loaded if m.partition(".")[0] in NOT_LOADED_WITHOUT_A_LOG) == []


def test_the_command_line_names_the_database_variable_the_service_reads() -> None:
    """The composition root spells ``CATALOG_ES_DB`` out, as naming it must
    load no service; a service made without it reads ``Factory.URL``. Were
    one renamed alone, ``--db`` unset would open ``catalog.db`` here while
    the variable named another database."""
    assert bootstrap.DB_ENV == persistence.Factory.URL


def test_rollback_only_offers_the_dimensions_the_rollback_plans() -> None:
    """``rollback --only`` names them apart from their planners, as reading
    it must load no service: one added to or renamed in either alone was
    refused as a usage error, or offered and then refused by the service."""
    assert tuple(rollback.DIMENSIONS) == names.ROLLBACK_DIMENSIONS


def test_a_database_in_a_folder_that_is_not_there_is_named_and_nothing_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It said "unable to open database file", naming neither the file nor
    its folder (operator's docs walk)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    for url, line in [
        (
            "sqlite:///nodir/x.db",
            "error: the database nodir/x.db: nodir: no such directory; make it first",
        ),
        ("sqlite:///a-file/x.db", "error: the database a-file/x.db: a-file: not a directory"),
        # Not looked into (for root, only a name too long): unexpected OSError (review).
        (
            f"sqlite:///{'d' * 300}/x.db",
            f"error: the database {'d' * 300}/x.db: {'d' * 300}: file name too long",
        ),
    ]:
        for command in (["model", "list"], ["model", "scale", "m", "--max", "2"]):
            assert refused_in_one_line(CliRunner().invoke(cli, ["--db", url, *command])) == line
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_a_database_that_cannot_be_used_is_one_line_naming_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's words name no file: an operator with several nodes or files
    could not tell which "file is not a database" was about. Named in full,
    as a new log's warning names it, however the URL gave it."""
    monkeypatch.chdir(tmp_path)
    not_sqlite = tmp_path / "notes.db"
    not_sqlite.write_text("not a database\n" * 100)
    noise = tmp_path / "noise.db"
    noise.write_bytes(bytes(range(256)) * 16)
    (tmp_path / "folder").mkdir()
    cases = {
        "notes.db": "file is not a database",
        str(noise): "file is not a database",
        "folder": "unable to open database file",
    }
    for path, said in cases.items():
        for command in (["model", "list"], ["verify"], ["model", "scale", "m", "--max", "2"]):
            result = CliRunner().invoke(cli, ["--db", f"sqlite:///{path}", *command])
            line = refused_in_one_line(result)
            assert line == f"error: the database at {tmp_path / path} could not be used: {said}"
    assert not_sqlite.read_text() == "not a database\n" * 100
    assert noise.read_bytes() == bytes(range(256)) * 16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "noise.db", "notes.db"]
    assert list((tmp_path / "folder").iterdir()) == []


def test_sqlite_errors_that_pass_are_told_from_those_an_operator_must_mend(
    tmp_path: Path,
) -> None:
    """Every SQLite error was one that lasts, so a disk full or a file that
    could not be opened (descriptors run out) told API clients not to retry
    (review). By SQLite's own result code."""
    not_a_database = tmp_path / "notes.db"
    not_a_database.write_text("not a database\n" * 100)
    cases = {
        str(tmp_path / "no-such-directory" / "catalog.db"): False,  # SQLITE_CANTOPEN
        str(not_a_database): True,  # SQLITE_NOTADB
        ":memory:": True,  # no such table (SQLITE_ERROR)
    }
    for path, lasting in cases.items():
        with pytest.raises(sqlite3.Error) as raised:
            sqlite3.connect(path).execute("SELECT * FROM catalog_events")
        unusable = database_unusable(raised.value)
        assert unusable is not None and unusable.lasting is lasting, path


def test_a_database_that_cannot_be_written_says_which_files_must_be(tmp_path: Path) -> None:
    """SQLite's "attempt to write a readonly database" named no file: a read
    while the database could not be written leaves a -shm file no later
    writer may write (hostile test), and nothing said to look there."""
    url = f"sqlite:///{tmp_path}/catalog.db"
    bootstrap.open_models(url).close()  # the log made, as a write makes it (a read makes none)
    with pytest.raises(sqlite3.Error) as raised:
        uri = f"file:{tmp_path}/catalog.db?mode=ro"
        sqlite3.connect(uri, uri=True).execute("DELETE FROM catalog_events")
    unusable = database_unusable(raised.value)
    assert unusable is not None and unusable.said == (
        "attempt to write a readonly database (the file, its folder, and its -wal and -shm"
        " files beside it must all be writable)"
    )


@pytest.mark.parametrize(
    ("setting", "there"),
    [
        ("nolock=1", "nothing"),
        ("vfs=unix-dotfile", "nothing"),
        ("vfs=unix-none", "nothing"),
        ("nolock=1", "an empty file"),
        ("immutable=1", "a log"),
    ],
    ids=["nolock", "dotfile", "none", "nolock-on-an-empty-file", "immutable"],
)
def test_a_url_that_keeps_sqlite_out_of_wal_mode_is_refused_at_open(
    tmp_path: Path, setting: str, there: str
) -> None:
    """SQLite keeps a file out of WAL mode when the URL opens it without
    locking or shared memory, and PRAGMA journal_mode=WAL said so unread:
    a new log was then told "empty (truncated while this process ran?)",
    and an immutable read answered a revision behind the log's, reading
    none of the -wal file (review). Writes rely on WAL too: a reader never
    holds off their commit, which waits a slice (0.1 s) at most. The file
    the refused open made is removed (it was left behind, empty); one that
    was there, empty or not, is left as it was."""
    path = tmp_path / "catalog.db"
    plain = f"sqlite:///{path}"
    definition_file = tmp_path / "m.yaml"
    definition_file.write_bytes(as_yaml(definition("m")))
    add = ["model", "add", str(definition_file)]
    if there == "a log":
        ok(CliRunner().invoke(cli, ["--db", plain, *add]))
    elif there == "an empty file":
        path.touch()
    files = sorted(tmp_path.iterdir())
    log = log_rows(plain) if there == "a log" else None
    url = f"sqlite:///file:{path}?uri=true&{setting}"
    command = ["revision"] if there == "a log" else add
    line = refused_in_one_line(CliRunner().invoke(cli, ["--db", url, *command]))
    assert line == (
        f"error: the database at {path}: SQLite keeps it in delete journal mode as the "
        "URL opens it, not in WAL mode, which the log needs (readers that neither hold "
        "off a write nor miss one): give the URL without its vfs, nolock or immutable setting"
    )
    assert sorted(tmp_path.iterdir()) == files
    if there == "a log":
        assert log_rows(plain) == log
    elif there == "an empty file":
        assert path.stat().st_size == 0


@pytest.mark.parametrize(
    ("setting", "command"),
    [
        ("nolock=1", ["revision"]),
        ("vfs=unix-none", ["model", "list"]),
        ("vfs=unix-dotfile", ["model", "scale", "m", "--max", "2"]),
    ],
    ids=["nolock", "none", "dotfile"],
)
def test_a_log_sqlite_cannot_open_as_the_url_does_names_the_setting_to_drop(
    tmp_path: Path, setting: str, command: list[str]
) -> None:
    """A log is in WAL mode, which SQLite opens neither without locks nor
    with a VFS without shared memory: reads and writes alike were told
    SQLite's bare "unable to open database file", which named neither."""
    path = tmp_path / "catalog.db"
    plain = f"sqlite:///{path}"
    definition_file = tmp_path / "m.yaml"
    definition_file.write_bytes(as_yaml(definition("m")))
    ok(CliRunner().invoke(cli, ["--db", plain, "model", "add", str(definition_file)]))
    files = sorted(tmp_path.iterdir())
    log = log_rows(plain)
    url = f"sqlite:///file:{path}?uri=true&{setting}"
    line = refused_in_one_line(CliRunner().invoke(cli, ["--db", url, *command]))
    assert line == (
        f"error: the database at {path}: SQLite cannot open it with the URL's {setting} "
        "setting, as it is in WAL mode, which the log needs (readers that neither hold off "
        "a write nor miss one): give the URL without it"
    )
    assert sorted(tmp_path.iterdir()) == files
    assert log_rows(plain) == log


@pytest.mark.parametrize(
    ("database", "opened"),
    [
        ("file:c.db?uri=false", "file:c.db"),
        # SQLite reads a name as a URI only when it starts "file:", in that case.
        ("c%2541.db?uri=true", "c%2541.db"),
        ("FILE:c.db?uri=true", "FILE:c.db"),
        # Its settings after a "?" in the name: SQLAlchemy puts them there.
        ("c.db?uri=true&nolock=1&timeout=5", "c.db?nolock=1"),
    ],
)
def test_a_sqlite_url_not_read_as_a_uri_keeps_the_log_at_the_path_sqlite_opens(
    database: str, opened: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``uri`` false, SQLAlchemy gives SQLite the database as a path,
    "file:" and all (``file:c.db``, in the working folder), where the file
    was looked after at ``c.db``, read as a URI: a write was refused as if
    its file were gone, leaving ``file:c.db`` made, and a read answered from
    that one while naming the other (review). So too with ``uri`` true and
    a name not starting "file:", which SQLite opens as named, where the file
    was looked after at the name %-unescaped, or past its "FILE:"."""
    monkeypatch.chdir(tmp_path)
    definition_file = tmp_path / "m.yaml"
    definition_file.write_bytes(as_yaml(definition("m")))
    url = f"sqlite:///{database}"
    ok(CliRunner().invoke(cli, ["--db", url, "model", "add", str(definition_file)]))
    assert ok(CliRunner().invoke(cli, ["--db", url, "revision"])).stdout == "1\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([opened, "m.yaml"])


def test_a_setting_sqlite_is_not_given_is_not_named_as_why_a_log_cannot_be_opened(
    tmp_path: Path,
) -> None:
    """Without ``uri`` true, SQLAlchemy gives SQLite the path alone, and the
    URL's other settings go nowhere: a log SQLite could not open (its -wal
    file a folder here) was told as one it cannot open with the URL's
    ``nolock=1``, which it never read, advising to drop it (review). It gets
    SQLite's own line, as the URL without the setting does."""
    path = tmp_path / "catalog.db"
    plain = f"sqlite:///{path}"
    bootstrap.open_models(plain).close()  # the log made, as a write makes it
    (tmp_path / "catalog.db-wal").mkdir()
    files = sorted(tmp_path.iterdir())
    lines = [
        refused_in_one_line(CliRunner().invoke(cli, ["--db", url, "revision"]))
        for url in (plain, f"{plain}?nolock=1")
    ]
    assert (
        lines
        == [f"error: the database at {path} could not be used: unable to open database file"] * 2
    )
    assert sorted(tmp_path.iterdir()) == files


def test_a_disk_with_no_room_for_the_shared_memory_file_is_said_to_be_full_or_failing(
    tmp_path: Path,
) -> None:
    """SQLite says "disk I/O error" when it cannot size its -shm file, which a
    full disk refuses to reads and writes alike (hostile test)."""
    if shutil.which("strace") is None:
        pytest.fail("this test makes the disk fail with strace: `apt-get install -y strace`")
    url = f"sqlite:///{tmp_path}/catalog.db"
    bootstrap.open_models(url).close()  # the log made, as a write makes it (a read makes none)
    (tmp_path / "catalog.db-shm").unlink(missing_ok=True)
    no_room = ["strace", "-f", "-q", "-o", "/dev/null", "-e", "inject=ftruncate:error=ENOSPC"]
    failed = subprocess.run(
        [*no_room, sys.executable, "-m", "catalog_es", "--db", url, "revision"],
        capture_output=True,
        text=True,
    )
    assert (failed.returncode, failed.stdout) == (1, "")
    assert failed.stderr == (
        f"error: the database at {tmp_path}/catalog.db could not be used: disk I/O error"
        " (a full disk, or a failing one?)\n"
    )


# The CLI with a spool that is a file past its first byte, written a row at
# a time, in the folder TMPDIR names: taken as gettempdir would take it, but
# without its probe's write, so that the spool's own writes are the
# process's first.
_SPOOLED_IN_A_FILE = """
import os, tempfile
import catalog_es.audit
from catalog_es.__main__ import main
catalog_es.audit.SPOOLED_IN_MEMORY = catalog_es.audit.SPOOLED_PAGE_BYTES = 1
tempfile.tempdir = os.environ["TMPDIR"]
main()
"""


@pytest.mark.parametrize(
    "query", [["audit", "--json"], ["history", "m", "--json"], ["audit"]], ids=" ".join
)
def test_a_temporary_folder_with_no_room_for_an_answer_says_what_to_do(
    tmp_path: Path, query: list[str]
) -> None:
    """audit and history hold the rows they check in a spool, a file in the
    temporary folder once past what it keeps in memory: a full folder was
    told "unexpected OSError: [Errno 28] No space left on device" (review)."""
    if shutil.which("strace") is None:
        pytest.fail("this test makes the disk fail with strace: `apt-get install -y strace`")
    url = f"sqlite:///{tmp_path}/catalog.db"
    with closing(bootstrap.open_models(url)) as models:
        models.add(spec("m"), by="ops")
        models.apply_changes([commands.scale("m", 0, 2 + i % 3) for i in range(5)], by="ops")
    log = log_rows(url)
    spool = tmp_path / "spool"
    spool.mkdir()
    # The first row is written as the spool becomes a file; the second,
    # smaller than the file's buffer, finds no room.
    no_room = ["strace", "-f", "-q", "-o", "/dev/null", "-e", "inject=write:error=ENOSPC:when=2"]
    failed = subprocess.run(
        [*no_room, sys.executable, "-c", _SPOOLED_IN_A_FILE, "--db", url, *query],
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(spool)},
    )
    assert (failed.returncode, failed.stdout) == (1, ""), failed.stderr
    assert failed.stderr == (
        f"error: the answer could not be held in the temporary folder {spool} while its rows "
        "were checked: No space left on device; free room there, point TMPDIR at a folder "
        "with room, or narrow the query (--limit, the filters)\n"
    )
    assert log_rows(url) == log


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqlite://", "names no file, and a database in memory keeps nothing"),
        ("sqlite:///", "names no file"),
        ("sqlite:///:memory:", "names no file"),
        ("catalog.db", "is not a URL"),
        ("http://x/catalog", "the log is kept in SQLite, or in PostgreSQL through psycopg"),
        ("postgresql+psycopg2://ops:s3cret@db/x", "'postgresql+psycopg2://ops:***@db/x'"),
        # Settings the driver cannot read were "error: unexpected ValueError"
        # (hostile test): no more told than a typo is.
        ("sqlite:///c.db?timeout=abc", "could not convert string to float: 'abc'"),
        ("sqlite:///c.db?check_same_thread=maybe", "String is not true/false: 'maybe'"),
        ("sqlite:///c.db?cached_statements=x", "invalid literal for int()"),
        ("postgresql://ops:s3cret@127.0.0.1/x?connect_timeout=abc", "bad value for connect_"),
        ("postgresql://ops:s3cret@127.0.0.1/x?fo=bar", 'invalid connection option "fo"'),
        # psycopg's own: "false" turned autocommit on, a write no longer one transaction.
        ("postgresql://ops@127.0.0.1/x?autocommit=false", "autocommit is psycopg's own option"),
        ("postgresql://ops@127.0.0.1/x?prepare_threshold=0", "prepare_threshold is psycopg's"),
    ],
)
def test_a_database_url_the_log_cannot_be_kept_at_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, message: str
) -> None:
    """Above all a database in memory: each connection would have its own,
    and a command would answer a revision no later read finds."""
    monkeypatch.chdir(tmp_path)
    Path("m.yaml").write_bytes(as_yaml(definition("m")))
    line = refused_in_one_line(CliRunner().invoke(cli, ["--db", url, "model", "add", "m.yaml"]))
    assert line.startswith("error: the database URL ")
    assert message in line
    assert "s3cret" not in line
    assert [p.name for p in tmp_path.iterdir()] == ["m.yaml"]  # no file made


def test_a_bad_connect_timeout_in_libpqs_environment_is_not_blamed_on_the_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "abc")
    refused = CliRunner().invoke(cli, ["--db", "postgresql://ops@127.0.0.1/x", "revision"])
    line = refused_in_one_line(refused)
    assert line == "error: PGCONNECT_TIMEOUT: bad value for connect_timeout: 'abc'"


def test_a_postgresql_search_path_naming_no_schema_is_said_to_hold_no_log(
    pg_url: str, tmp_path: Path
) -> None:
    """A search_path naming no schema there is was told, to a read as to a
    write, as `the database could not be used: no schema has been selected
    to create in`: neither that no log is there, nor which database, nor
    the path. One line names them, and says nothing was made."""
    url = sa.make_url(pg_url)
    no_schema = url.update_query_dict({"options": "-csearch_path=no_such_schema"})
    told = (
        f"error: no log in database {url.database} at {url.host}:{url.port}: its search path"
        " 'no_such_schema' names no schema there is (or none this role may use), so none can"
        " be found or made there; nothing was made: create the schema, or name one there is"
        " in the search path (the URL's options, or the role's)"
    )
    (tmp_path / "m.yaml").write_bytes(as_yaml(definition("m")))
    for command in (["model", "list"], ["revision"], ["verify"], ["model", "add", "m.yaml"]):
        refused = CliRunner().invoke(cli, ["--db", no_schema.render_as_string(False), *command])
        assert refused_in_one_line(refused) == told, command


def test_a_log_is_not_made_in_the_sessions_temporary_schema(
    pg_schema_url: Callable[..., str], tmp_path: Path
) -> None:
    """A search path naming pg_temp first (`-csearch_path=pg_temp,team_a`)
    made a new log in the session's temporary schema, which the server
    drops as the session ends: the write was told, `added m at revision 1`,
    exit 0, and lost as the command exited, the next command finding no
    log. The log is made in the schema its lock is taken in, the first one
    there is of the path (the session's temporary schema is there once the
    session has made a temporary table): one that is the session's own is
    refused in one line, nothing made."""

    def temporary_first(schema_url: str) -> str:
        url = sa.make_url(schema_url)
        path = f"-csearch_path=pg_temp,{schema_of(schema_url)}"
        return url.update_query_dict({"options": path}).render_as_string(False)

    pg_url = pg_schema_url()
    temporary = temporary_first(pg_url)
    (tmp_path / "m.yaml").write_bytes(as_yaml(definition("m")))
    added = CliRunner().invoke(cli, ["--db", temporary, "model", "add", str(tmp_path / "m.yaml")])
    listed = invoke_told(["--db", pg_url, "model", "list", "--json"])
    # Told written, it is in the log; else refused (the session's temporary
    # schema there, as below), and nothing made.
    names = [model["name"] for model in json.loads(listed.stdout)]
    assert (added.exit_code, names) in ((0, ["m"]), (1, [])), added.output
    # A session whose temporary schema is there: the log would be made in it.
    other_url = pg_schema_url()
    engine = sa.create_engine(temporary_first(other_url), pool_size=1, max_overflow=0)
    with engine.connect() as conn:
        conn.exec_driver_sql("CREATE TEMPORARY TABLE notes (body text)")
        conn.commit()
        own = conn.exec_driver_sql("SELECT current_schema()").scalar()
    assert own is not None and own.startswith("pg_temp_")
    with pytest.raises(ConfigError) as refused:
        SQLRecorder(engine)
    engine.dispose()
    url = sa.make_url(other_url)
    assert str(refused.value) == (
        f"no log in database {url.database} at {url.host}:{url.port}: its search path"
        f" 'pg_temp,{schema_of(other_url)}' names first the session's temporary schema"
        f" ({own}), which the server drops as the session ends, and a log made there with it;"
        " nothing was made: name the log's schema first in the search path (the URL's"
        " options, or the role's)"
    )


def test_a_postgresql_privilege_missing_is_one_line(
    pg_url: str, read_only_url: Callable[[], str], tmp_path: Path
) -> None:
    """A role that may only read asked to write was told as an unexpected
    ProgrammingError (docs review)."""
    (tmp_path / "m.yaml").write_bytes(as_yaml(definition("m")))
    CliRunner().invoke(cli, ["--db", pg_url, "model", "add", str(tmp_path / "m.yaml")])
    as_reader = read_only_url()
    listed = CliRunner().invoke(cli, ["--db", as_reader, "model", "list", "--json"])
    assert [m["name"] for m in json.loads(listed.stdout)] == ["m"]
    scaled = CliRunner().invoke(cli, ["--db", as_reader, "model", "scale", "m", "--max", "2"])
    line = refused_in_one_line(scaled)
    assert line.startswith("error: the database could not be used: permission denied for ")
    assert count_events(pg_url) == 1


def test_a_warning_escapes_its_line_and_leaves_a_traceback_readable() -> None:
    formatter = VisibleWarnings("warning: %(message)s")
    try:
        raise ValueError("inner")
    except ValueError:
        record = logging.LogRecord(
            "catalog_es", logging.WARNING, __file__, 1, "skipped %s", ("\x1b[2J",), sys.exc_info()
        )
    lines = formatter.format(record).splitlines()
    assert lines[0] == "warning: skipped \\x1b[2J"
    assert lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: inner"


def test_a_ctrl_c_a_library_logged_on_its_way_out_adds_no_traceback() -> None:
    """SQLAlchemy's pool, interrupted as it took a connection back, logs the
    KeyboardInterrupt with its traceback, which followed a watch's
    ``stopped`` (a CI run), and once the error its reset raised while the
    stop was being handled; the command tells the stop itself. Other errors
    it logs are told as they were."""
    said = io.StringIO()
    pool = logging.getLogger("sqlalchemy.pool.impl.QueuePool")
    pool.addHandler(warnings_to(said))

    def reset_during_a_stop() -> None:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise sqlite3.ProgrammingError("Cannot operate on a closed database.") from None

    def reset_failing() -> None:
        raise ValueError("the server closed it")

    try:
        for reset in (_raise_a_ctrl_c, reset_during_a_stop, reset_failing):
            try:
                reset()
            except BaseException:
                pool.error("Exception during reset or similar", exc_info=True)
    finally:
        pool.handlers.clear()
    lines = said.getvalue().splitlines()
    assert lines[0] == "warning: Exception during reset or similar"
    assert lines[-1] == "ValueError: the server closed it"
    assert len([line for line in lines if line.startswith("warning:")]) == 1
    assert not any("KeyboardInterrupt" in line or "closed database" in line for line in lines)
    # This code's own warning is told whatever led to it: it says what stands.
    ours, told = logging.getLogger("catalog_es"), warnings_to(said)
    ours.addHandler(told)
    try:
        try:
            reset_during_a_stop()
        except sqlite3.ProgrammingError:
            ours.warning("the applier failed (…); the move is written", exc_info=True)
    finally:
        ours.removeHandler(told)
    assert "warning: the applier failed (…); the move is written" in said.getvalue()


def _raise_a_ctrl_c() -> None:
    raise KeyboardInterrupt


def test_a_stop_that_cut_a_pipeline_short_adds_no_warning(pg_url: str) -> None:
    """A stop (Ctrl-C, SIGTERM) as the audit's catch-up wrote its rows in
    psycopg's pipeline left psycopg to end the pipeline on its way out, and
    what that failed on it logged with no traceback, so that the line was
    told before ``Aborted!`` (1 stop in 9 of a hostile test): `warning: error
    ignored terminating <psycopg.Pipeline [INERROR, pipeline=ON] (host=…) at
    0x…>: canceling statement due to user request`."""
    said = io.StringIO()
    told = warnings_to(said)
    psycopg_log = logging.getLogger("psycopg")
    psycopg_log.addHandler(told)
    engine = sa.create_engine(pg_url)
    try:
        with engine.connect() as conn:
            raw = conn.connection.driver_connection
            assert raw is not None
            with pytest.raises(KeyboardInterrupt), raw.pipeline():
                raw.execute("SELECT 1/0")  # fails as the pipeline ends, as a cancelled one does
                _raise_a_ctrl_c()
            conn.rollback()
    finally:
        psycopg_log.removeHandler(told)
        engine.dispose()
    assert said.getvalue() == ""


def test_a_warning_is_escaped_with_no_descriptor_to_spare() -> None:
    """Escaping needs the ``unicode_escape`` codec, which Python imports on
    first use, from a file: out of descriptors, each warning with a line
    break (asyncio's) was ``--- Logging error ---`` and a stack (hostile test)."""
    script = """
import logging, os, sys
from catalog_es.cli.base import warnings_to
logging.basicConfig(handlers=[warnings_to(sys.stderr)])
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
logging.getLogger("catalog_es").warning("two\\nlines \\x1b[2J")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stderr == "warning: two\\nlines \\x1b[2J\n", done.stderr


def test_a_bare_postgresql_url_means_psycopg(pg_url: str) -> None:
    bare = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    assert bare != pg_url
    result = CliRunner().invoke(cli, ["--db", bare, "model", "list", "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout) == []


@pytest.fixture(scope="module")
def long_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite log of a thousand writes, made once for the module (3-7 s);
    each test reads a copy of its own, which an audit may write to."""
    path = tmp_path_factory.mktemp("long-log") / "catalog.db"
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{path}"})
    models.add(spec("m"), by="ops")
    for maximum in range(2, 1000):  # far more than a pipe's buffer holds
        models.scale("m", 0, maximum, by="ops")
    models.close()  # its write-ahead log checkpointed into the file
    return path


@pytest.mark.parametrize(
    "command",
    [["log", "--json"], ["log"], ["audit", "--json"]],
    ids=["json-lines", "table", "json-document"],
)
def test_a_reader_that_goes_away_ends_the_command_quietly(
    tmp_path: Path, long_log: Path, command: list[str]
) -> None:
    """`catalog-es log | head -c 100`: no error about the closed pipe, and 141.
    A table, or a JSON document, written in one go was cut short without a
    word, and exited 0 (review, hostile test)."""
    db = f"sqlite:///{shutil.copyfile(long_log, tmp_path / 'catalog.db')}"
    log = subprocess.Popen(
        [sys.executable, "-m", "catalog_es", "--db", db, *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert log.stdout is not None and log.stderr is not None
    assert len(log.stdout.read(100)) == 100
    log.stdout.close()  # as head does, having read what it wanted
    assert log.wait(timeout=60) == EXIT_PIPE_CLOSED
    assert log.stderr.read() == b""


@pytest.mark.parametrize(
    ("command", "output", "code"),
    [
        (["model", "scale", "m", "--max", "7"], ">/dev/full", EXIT_OUTPUT_FAILED),
        (["--json", "model", "scale", "m", "--max", "7"], ">/dev/full", EXIT_OUTPUT_FAILED),
        (["model", "list"], ">/dev/full", EXIT_OUTPUT_FAILED),
        # Written in pieces as they are built (review: exit 1, "unexpected OSError").
        (["--json", "apply", "CHANGES"], ">/dev/full", EXIT_OUTPUT_FAILED),
        (["--json", "audit"], ">/dev/full", EXIT_OUTPUT_FAILED),
        (["--json", "log"], ">/dev/full", EXIT_OUTPUT_FAILED),
        (["model", "scale", "m", "--max", "7"], ">&-", 0),
    ],
    ids=["full-disk", "full-disk-json", "full-disk-table", "apply", "audit", "log", "closed"],
)
def test_a_write_whose_answer_cannot_be_written_out_is_not_told_as_refused(
    tmp_path: Path, command: list[str], output: str, code: int
) -> None:
    """A write committed, then told to a full disk or a closed standard
    output, exited 1 ("error: unexpected OSError"), which says nothing was
    written (hostile test): 74, sysexits' I/O error, with one line; and with
    no standard output at all, the answer goes nowhere."""
    db = f"sqlite:///{tmp_path}/catalog.db"
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db})
    models.add(spec("m"), by="ops")
    changes = tmp_path / "changes.yaml"
    changes.write_text("- scale: {name: m, max: 7}\n")
    command = [str(changes) if word == "CHANGES" else word for word in command]
    told = in_a_shell(db, " ".join(command), output)
    assert told.returncode == code, told.stderr
    if code:
        assert (
            told.stderr
            == "error: the answer could not be written out: [Errno 28] No space left on device\n"
        )
    models.refresh()
    wrote = "scale" in command or "apply" in command
    assert models.get_model("m")["scaling"]["max"] == (7 if wrote else 1)
    models.close()


@pytest.mark.parametrize(
    "command", [["model", "scale", "m", "--max", "7"], ["model", "list"]], ids=["write", "table"]
)
def test_a_write_whose_reader_went_away_does_not_say_nothing_was_written(
    tmp_path: Path, command: list[str]
) -> None:
    """`catalog-es model scale … | true`: the change is committed, then
    told to a closed pipe. Exit 1 said it was refused, and a script would
    make it again (hostile test); a table, which rich prints, did so too."""
    db = f"sqlite:///{tmp_path}/catalog.db"
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db})
    models.add(spec("m"), by="ops")
    read, write = os.pipe()
    os.close(read)  # the reader is gone before a word is said
    told = subprocess.run(
        [sys.executable, "-m", "catalog_es", "--db", db, *command],
        stdout=write,
        stderr=subprocess.PIPE,
        timeout=60,
        check=False,
    )
    os.close(write)
    assert (told.returncode, told.stderr) == (EXIT_PIPE_CLOSED, b"")
    models.refresh()
    assert models.get_model("m")["scaling"]["max"] == (7 if "scale" in command else 1)
    models.close()


@pytest.mark.parametrize("output", ["full-disk", "reader-gone"])
def test_a_write_whose_answer_cannot_be_told_still_tells_its_warnings(
    tmp_path: Path, output: str
) -> None:
    """A write that put back a config another had replaced, told to a full
    disk (74) or to a reader gone (141), left its warning out as a refusal
    leaves its warnings out (hostile test): the write stands, and the warning
    that every node should run one config was said nowhere."""
    db = f"sqlite:///{tmp_path}/catalog.db"
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(config_yaml(spec("base")))
    new.write_text(config_yaml(spec("base"), spec("extra")))
    for config, maximum in ((old, 2), (new, 3)):  # old at revision 1, new at 4
        models = Models(load_config(str(config)), env={"CATALOG_ES_DB": db})
        if maximum == 2:
            models.add(spec("m"), by="ops")
        models.scale("m", None, maximum, by="ops")
        models.close()
    command = ["--db", db, "--config", str(old), "model", "scale", "m", "--max", "7"]
    if output == "full-disk":
        told = in_a_shell(db, " ".join(command[2:]), ">/dev/full")
        code, stderr = told.returncode, told.stderr
    else:
        read, write = os.pipe()
        os.close(read)  # the reader is gone before a word is said
        gone = subprocess.run(
            [sys.executable, "-m", "catalog_es", *command],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
        os.close(write)
        code, stderr = gone.returncode, gone.stderr
    assert code == (EXIT_OUTPUT_FAILED if output == "full-disk" else EXIT_PIPE_CLOSED), stderr
    assert (
        f"warning: this node's declared config ({old}), recorded at revision 1, was replaced "
        "by another at revision 4, and is recorded again at revision 6: every node should run "
        "the same one, unless it was put back on purpose"
    ) in stderr.splitlines()


def test_warnings_escape_what_a_terminal_would_act_on(tmp_path: Path) -> None:
    """A skipped record's reason quotes what a hand edit put there; printed
    raw, an escape sequence retitles or clears the terminal."""
    db = tmp_path / "catalog.db"
    spec_file = tmp_path / "m.yaml"
    spec_file.write_bytes(as_yaml(definition("m")))
    added = CliRunner().invoke(cli, ["--db", f"sqlite:///{db}", "model", "add", str(spec_file)])
    assert added.exit_code == 0, added.stderr
    with sqlite3.connect(db) as conn:
        conn.execute(
            "INSERT INTO catalog_events VALUES (100, ?, 1, ?, x'7b7d', ?, 0)",
            (uuid.uuid4().hex, "catalog_es.model:Model.X\x1b]0;PWNED\x07\x1b[2J", "0" * 64),
        )
    done = subprocess.run(
        [sys.executable, "-m", "catalog_es", "--db", f"sqlite:///{db}", "model", "list"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert b"warning: skipped revision 100" in done.stderr
    assert b"X\\x1b]0;PWNED\\x07\\x1b[2J" in done.stderr
    assert b"\x1b" not in done.stderr and b"\x07" not in done.stderr


def test_a_usage_error_escapes_what_a_terminal_would_act_on(tmp_path: Path) -> None:
    """Click tells an extra argument as given: with color on, as on a
    terminal, nothing strips an escape sequence in it."""
    db = f"sqlite:///{tmp_path}/catalog.db"
    done = CliRunner().invoke(cli, ["--db", db, "model", "list", "x\x1b]0;PWNED\x07"], color=True)
    assert done.exit_code == 2
    assert "unexpected extra argument (x\\x1b]0;PWNED\\x07)" in done.stderr
    assert "\x1b" not in done.stderr and "\x07" not in done.stderr


def test_a_refusal_is_one_line_whatever_the_load_warned_of(tmp_path: Path) -> None:
    """Loading a log with skipped events warns of each (ten, then a count), but
    a refused command still prints one line, its error; a command that did
    what it was asked prints the warnings after it."""
    db = f"sqlite:///{tmp_path / 'catalog.db'}"
    spec_file = tmp_path / "m.yaml"
    spec_file.write_bytes(as_yaml(definition("m")))
    assert CliRunner().invoke(cli, ["--db", db, "model", "add", str(spec_file)]).exit_code == 0
    with sqlite3.connect(tmp_path / "catalog.db") as conn:
        conn.executemany(
            "INSERT INTO catalog_events VALUES"
            " (?, ?, 1, 'catalog_es.model:Model.Gone', x'7b7d', ?, 0)",
            [(100 + i, uuid.uuid4().hex, "0" * 64) for i in range(3)],
        )

    refused = invoke_told(["--db", db, "model", "remove", "nope"])
    assert refused_in_one_line(refused) == "error: model 'nope' is not in the catalog"
    listed = ok(invoke_told(["--db", db, "model", "list"]))
    assert listed.stderr.count("warning: skipped revision") == 3


def test_a_runtime_removal_of_a_name_declared_since_is_not_told_on_every_command(
    run_told: Run, tmp_path: Path
) -> None:
    """Runtime x added, then removed, then declared by the config: every
    command warned that load skips the removal, which hides nothing (the
    runtime x was gone). An add or a scale of a declared name, which the
    declared definition hides, is still told; verify lists every skip."""
    for name in ("x", "y"):
        (tmp_path / f"{name}.yaml").write_bytes(as_yaml(definition(name)))

    changes = [("add", "x.yaml"), ("remove", "x"), ("add", "y.yaml"), ("scale", "y", "--max", "2")]
    for change in changes:
        ok(run_told("model", *change))
    (tmp_path / "catalog.yaml").write_text(config_yaml(spec("x", engine="tgi")))
    listed = run_told("model", "list", "--json")
    assert (listed.exit_code, listed.stderr) == (0, "")
    assert [m["name"] for m in json.loads(listed.stdout)] == ["x", "y"]
    (tmp_path / "catalog.yaml").write_text(config_yaml(spec("x"), spec("y")))
    listed = run_told("model", "list", "--json")
    assert (listed.exit_code, listed.stderr.splitlines()) == (
        0,
        [
            "warning: skipped revision 4 (model 'y', Scaled): model 'y' is declared in "
            "configuration, which wins every conflict"
        ],
    )
    verified = ok(run_told("verify", "--json"))
    skipped = json.loads(verified.stdout)["skipped"]
    assert [(s["revision"], s["model"], s["event"]) for s in skipped] == [
        (1, "x", "Added"),
        (2, "x", "Removed"),
        (3, "y", "Added"),
        (4, "y", "Scaled"),
    ]


def test_a_flow_style_yaml_definition_is_accepted(run: Run, write: Any) -> None:
    flow = b"{name: flow, engine: vllm, source: hf://org/flow, profiles: [{name: g, gpus: 1}]}"
    ok(run("model", "add", write("flow.yaml", flow)))


def test_table_cells_are_printed_as_data_not_markup(run: Run, write: Any) -> None:
    definition_file = write("m.yaml", as_yaml(definition("m")))
    ok(run("model", "add", definition_file, "--reason", "[urgent] fix [bold]now[/bold]"))
    shown = ok(run("log"))
    assert "[urgent] fix [bold]now[/bold]" in shown.stdout


# -- what a terminal is shown ---------------------------------------------------------


def test_a_source_that_would_act_on_the_terminal_is_printed_escaped(run: Run, write: Any) -> None:
    # The declared config is reviewed rather than checked for this, and older
    # logs hold sources from before the rule: an escape sequence (clears the
    # screen) or a bidi override (shows "evil.jpg" as "gpj.live") reaches the
    # terminal written out, as repr writes it; JSON reads back as stored.
    source = "hf://org/\x1b[2J\u202egpj.live"
    config = write("declared.yaml", config_yaml(spec("declared", source=source)).encode())
    for args in (["model", "show", "declared"], ["model", "list"]):
        printed = ok(run("--config", config, *args)).stdout
        assert "\x1b" not in printed
        assert "\u202e" not in printed
        assert "hf://org/\\x1b[2J\\u202egpj.live" in printed
    printed = ok(run("--config", config, "model", "show", "declared", "--json")).stdout
    assert "\x1b" not in printed
    assert "\u202e" not in printed
    assert json.loads(printed)["source"] == source


def test_refused_input_is_printed_escaped_and_reads_back_as_given(run: Run, write: Any) -> None:
    ok(run("model", "add", write("m.yaml", as_yaml(definition("m")))))
    refused_in_one_line(run("model", "source", "m", "hf://org/\u202em"))
    printed = ok(run("refusals", "--json")).stdout
    assert "\u202e" not in printed
    assert "\\u202e" in printed
    assert json.loads(printed)[0]["fields"]["source"] == "hf://org/\u202em"


def test_an_origin_file_name_that_would_act_on_the_terminal_is_refused(
    run: Run, write: Any, db_url: str
) -> None:
    """An origin's file names are shown, logged and made paths as sources are
    (hostile test: a bidi override, an escape, a newline were written)."""
    ok(run("model", "add", write("m.yaml", as_yaml(definition("m")))))
    before = count_events(db_url)
    for name in ("evil\u202egpj.exe", "a\x1b[2Jb", "a\nb"):
        line = refused_in_one_line(
            run(
                "model",
                "source",
                "m",
                "hf://o/m2",
                "--repository",
                "o/m",
                "--revision",
                "abcdef0",
                "--file",
                f"{name}={'0' * 64}",
            )
        )
        assert "which a terminal acts on" in line
        assert "\u202e" not in line and "\x1b" not in line
    assert count_events(db_url) == before


def test_text_that_is_only_unusual_is_printed_as_it_is(run: Run, write: Any) -> None:
    # The joiners inside emoji and Persian words are text, not tricks: only
    # what a terminal acts on or reorders is escaped.
    source = "hf://org/می\u200cخواهم/👨\u200d👩\u200d👧"
    config = write("declared.yaml", config_yaml(spec("declared", source=source)).encode())
    assert source in ok(run("--config", config, "model", "show", "declared")).stdout
    assert source in ok(run("--config", config, "model", "show", "declared", "--json")).stdout
    # Every table alike, where a value is written as JSON (a change's fields).
    ok(run("model", "add", write("m.yaml", as_yaml(definition("m")))))
    ok(run("model", "source", "m", "hf://org/日本🤗"))
    for command in (["log"], ["diff", "0"], ["audit"], ["rollback", "--to", "0", "--dry-run"]):
        assert "hf://org/日本🤗" in ok(run(*command)).stdout, command


# -- reading input --------------------------------------------------------------------


def test_a_declared_config_merges_a_shared_definition_and_overrides_keys(
    run: Run, write: Any
) -> None:
    # YAML's merge key: the mapping's own keys win over the merged ones; a key
    # written twice in one mapping is still a duplicate.
    config = write(
        "declared.yaml",
        b"models:\n"
        b'  - &base {name: d1, engine: vllm, source: "hf://o/d1", profiles: [{name: g, gpus: 1}]}\n'
        b"  - <<: *base\n"
        b"    name: d2\n"
        b"    source: hf://o/d2\n",
    )
    listed = json.loads(ok(run("--config", config, "model", "list", "--json")).stdout)
    assert [(m["name"], m["source"]) for m in listed] == [("d1", "hf://o/d1"), ("d2", "hf://o/d2")]
    twice = write("twice.yaml", b"models:\n  - {name: d1, name: d2, engine: vllm}\n")
    assert "duplicate key 'name'" in refused_in_one_line(run("--config", twice, "model", "list"))


def test_json_with_a_byte_order_mark_is_read_as_json(run: Run, write: Any) -> None:
    # A surrogate pair escape is JSON's way to write an emoji; YAML has none.
    document = json.dumps(definition("m", source="hf://o/\ud83d\ude00")).encode()
    assert b"\\ud83d" in document
    ok(run("model", "add", write("m.json", b"\xef\xbb\xbf" + document)))
    shown = json.loads(ok(run("model", "show", "m", "--json")).stdout)
    assert shown["source"] == "hf://o/\U0001f600"


@pytest.mark.parametrize(
    ("link", "cut"),
    [("0", "0"), ("the other model's event", "3"), ("an earlier event of its own", "2")],
)
def test_a_walk_of_a_stream_cut_by_a_hand_edited_link_is_refused(
    db_url: str, tmp_path: Path, link: str, cut: str
) -> None:
    """`log --model` walks a model's events back along their links: a link
    edited by hand (to 0, to another model's event, past its own event
    before) ended the walk there and the read answered part of the history,
    exit 0 (hostile tester). Each read along a walk refuses, naming the
    event and verify: the log, bounded or not, and the declared config then."""
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_bytes(as_yaml(definition(name)))
    given = ["--db", db_url, "--config", str(tmp_path / "catalog.yaml")]
    (tmp_path / "catalog.yaml").write_text(config_yaml(spec("d1")))
    runner = CliRunner()
    assert runner.invoke(cli, [*given, "model", "add", "a.yaml"]).exit_code == 0  # 1, 2
    assert runner.invoke(cli, [*given, "model", "add", "b.yaml"]).exit_code == 0  # 3
    for most in (2, 3, 4):  # 4, 5, 6
        assert (
            runner.invoke(cli, [*given, "model", "scale", "a", "--max", str(most)]).exit_code == 0
        )
    (tmp_path / "catalog.yaml").write_text(config_yaml(spec("d2")))
    assert runner.invoke(cli, [*given, "model", "scale", "b", "--max", "2"]).exit_code == 0  # 7, 8
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        stored = sa.text(
            "SELECT revision, originator_version FROM catalog_events ORDER BY revision"
        )
        assert [tuple(row) for row in conn.execute(stored)] == [
            (1, 1),
            (2, 1),
            (3, 1),
            (4, 2),
            (5, 3),
            (6, 4),
            (7, 2),
            (8, 2),
        ]
        for revision in (6, 7):  # a's last, the config's second record
            conn.execute(
                sa.text(f"UPDATE catalog_events SET stream_previous = {cut} WHERE revision = :r"),
                {"r": revision},
            )
    engine.dispose()
    told = (
        f"error: model 'a': its event at revision 6 links to revision {cut} as the one before it"
        " (stream_previous): edited by hand, so its history would be read cut short"
        " (catalog-es verify tells what else was edited)\n"
    )
    for args in (["log", "--model", "a"], ["--json", "log", "--model", "a", "--after", "3"]):
        logged = runner.invoke(cli, [*given, *args])
        assert (logged.exit_code, logged.stdout, logged.stderr) == (1, "", told), args
    # After the cut, nothing is left out.
    assert runner.invoke(cli, [*given, "log", "--model", "a", "--after", "6"]).exit_code == 0
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    with pytest.raises(DamagedLog, match="at revision 6 links to"):
        models.log_events(model="a", max_bytes=1 << 20)
    models.close()
    then = runner.invoke(cli, [*given, "model", "list", "--at", "6", "--declared-then"])
    assert (then.exit_code, then.stdout, then.stderr) == (
        1,
        "",
        f"error: the declared config's records: its event at revision 7 links to revision {cut}"
        " as the one before it (stream_previous): edited by hand, so its history would be read"
        " cut short (catalog-es verify tells what else was edited)\n",
    )
