"""Weights provenance (issue 8): a registry mirror, upstream changes, update and rollback.

Every test builds its own mirror in a temporary folder: repositories of a few
small files, commits published and branches moved as an upstream would.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner
from eventsourcing.persistence import StoredEvent

from catalog_es import commands
from catalog_es import registry as registry_module
from catalog_es.application import SYSTEM_ACTOR, Models
from catalog_es.bootstrap import MIRROR_ENV
from catalog_es.cli import cli
from catalog_es.errors import DeclaredInConfig, NoConfigGiven, Refused
from catalog_es.inputs import load_config
from catalog_es.mapper import encode_event, topic_of
from catalog_es.model import Model, model_id, utc_now
from catalog_es.ports import Applier, JsonFileApplier, NoApplier
from catalog_es.registry import (
    MirrorRegistry,
    Registry,
    RegistryError,
    checksums,
    relative_file,
    verify,
)
from catalog_es.spec import ModelSpec, Origin
from catalog_es.storage.waits import LOCK_WAIT_ENV
from catalog_es.weights import VerificationFailed, Weights, WeightsStore
from tests.helpers import parsed as spec

V1 = {
    "config.json": b'{"layers": 2}',
    "model.safetensors": b"weights, first cut",
    "tokenizer.json": b'{"vocab": 10}',
}
# Re-quantised upstream: the weights change, the tokenizer goes, a file is added.
V2 = {
    "config.json": b'{"layers": 2}',
    "model.safetensors": b"weights, re-quantised",
    "generation_config.json": b'{"top_p": 0.9}',
}
BASE = {"model.safetensors": b"declared weights"}

DECLARED_YAML = """
models:
  - name: base
    engine: vllm
    source: hf://org/base
    origin: {{repository: org/base, revision: {revision}}}
    profiles: [{{name: gpu, gpus: 1}}]
  - name: follows-main
    engine: vllm
    source: hf://org/base
    profiles: [{{name: gpu, gpus: 1}}]
"""


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def origin_of(repository: str, commit: str, files: dict[str, bytes]) -> Origin:
    return Origin(
        repository=repository, revision=commit, files={p: sha(d) for p, d in sorted(files.items())}
    )


class Mirror:
    """An offline registry being written to, as upstream would."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.refs: dict[str, dict[str, str]] = {}

    def folder(self, repository: str, commit: str) -> Path:
        return self.root / repository / commit

    def publish(self, repository: str, files: dict[str, bytes], branch: str = "main") -> str:
        """A new commit holding ``files``, with ``branch`` moved to it."""
        commit = hashlib.sha1(f"{repository}:{sorted(files.items())}".encode()).hexdigest()
        for path, data in files.items():
            target = self.folder(repository, commit) / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        self.point(repository, branch, commit)
        return commit

    def point(self, repository: str, branch: str, commit: str) -> None:
        self.refs.setdefault(repository, {})[branch] = commit
        lines = ["# branch commit"] + [f"{b} {c}" for b, c in self.refs[repository].items()]
        (self.root / repository / "refs").write_text("\n".join(lines) + "\n")


class RecordingApplier(Applier):
    """A controller stand-in: replicas per model, replaced one at a time, each step recorded."""

    def __init__(self) -> None:
        self.steps: list[tuple[Any, ...]] = []
        self.replicas: dict[str, list[str]] = {}

    def replace_catalog(self, models: Sequence[ModelSpec], revision: int) -> None:
        self.steps.append(("catalog", revision, {m.name: m.source for m in models}))
        for m in models:
            self.replicas.setdefault(m.name, [m.source] * m.scaling.min)

    def replace_replicas(self, model: ModelSpec, revision: int) -> None:
        running = self.replicas[model.name]
        for i, old in enumerate(running):
            # The new replica is up before the old one goes: never fewer serving.
            self.steps.append(("start", model.name, i, model.source))
            self.steps.append(("stop", model.name, i, old))
            running[i] = model.source


class TamperingRegistry(MirrorRegistry):
    """Delivers one fetched file with other bytes than the commit holds."""

    def fetch(self, repository: str, revision: str, files: Mapping[str, str], into: Path) -> None:
        super().fetch(repository, revision, files, into)
        (into / "model.safetensors").write_bytes(b"not what was published")


class LosingRegistry(MirrorRegistry):
    """Delivers every file of a commit but one."""

    def fetch(self, repository: str, revision: str, files: Mapping[str, str], into: Path) -> None:
        kept = {path: digest for path, digest in files.items() if path != "config.json"}
        super().fetch(repository, revision, kept, into)


class World:
    """A mirror, a declared config pinned to one of its commits, a database, a weights store."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mirror = Mirror(root / "mirror")
        self.store = root / "weights"
        self.db = root / "catalog.db"
        self.c1 = self.mirror.publish("org/m", V1)
        self.base1 = self.mirror.publish("org/base", BASE)
        self.config = root / "catalog.yaml"
        self.config.write_text(DECLARED_YAML.format(revision=self.base1))
        self.applier = RecordingApplier()
        self._opened: list[Models] = []

    def open(
        self,
        registry: Registry | None = None,
        applier: Applier | None = None,
        *,
        declared: bool = True,
    ) -> Weights:
        """``declared``: over the config, else given none."""
        models = Models(
            load_config(str(self.config) if declared else None),
            applier=applier or self.applier,
            env={"CATALOG_ES_DB": f"sqlite:///{self.db}"},
        )
        self._opened.append(models)
        return Weights(
            models, registry or MirrorRegistry(self.mirror.root), WeightsStore(self.store)
        )

    def rows(self) -> int:
        with sqlite3.connect(self.db) as conn:
            return int(conn.execute("SELECT count(*) FROM catalog_events").fetchone()[0])

    def close(self) -> None:
        for models in self._opened:
            models.close()


def events(weights: Weights, name: str) -> list[dict[str, Any]]:
    return list(weights.models.log_events(model=name))


def stored_before_the_rules(weights: Weights, definition: ModelSpec) -> None:
    """``definition`` added as an older release stored it, a source or an
    origin today's input rules refuse included: straight into the log, as
    tests/test_upgrade.py plants its records."""
    store = weights.models.store
    stream = model_id(definition.name)
    with store.write() as conn:
        version = store.stream_version(conn, stream) + 1
        added = Model.Added(
            originator_id=stream,
            originator_version=version,
            timestamp=utc_now(),
            by="older-release",
            model=definition.name,
            spec=definition,
        )
        stored = StoredEvent(stream, version, topic_of(Model.Added), encode_event(added))
        store.insert_events([stored], conn=conn)


# File names an older release took in an origin, which today's input rule refuses.
OLD_FILE_NAMES = [
    pytest.param("x" * 300, "is longer than a weights folder holds", id="long"),
    pytest.param("sub//w", "is not a plain path inside a revision", id="empty-part"),
    pytest.param("a\x1b[2Jb", "holds U+001B, which a terminal acts on", id="escape"),
]


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    made = World(tmp_path)
    yield made
    made.close()


@pytest.fixture
def tracked(world: World) -> Weights:
    """Runtime model ``m`` (three replicas) with its origin recorded: commit c1 of org/m."""
    weights = world.open()
    weights.models.add(spec("m", scaling={"min": 3, "max": 3}), by="alice")
    weights.check_updates(by="cron")
    return weights


# -- the mirror ------------------------------------------------------------------------


def test_the_mirror_resolves_branches_lists_checksums_and_fetches(world: World) -> None:
    registry = MirrorRegistry(world.mirror.root)
    nested = world.mirror.publish("org/n", {"a.bin": b"a", "onnx/model.onnx": b"b"}, "dev")
    assert registry.repository_for("hf://org/n") == "org/n"
    assert registry.repository_for("s3://bucket/n") is None
    assert registry.resolve("org/n", "dev") == nested
    assert registry.resolve("org/n", nested) == nested
    assert registry.files("org/n", nested) == {"a.bin": sha(b"a"), "onnx/model.onnx": sha(b"b")}
    wanted = {"onnx/model.onnx": sha(b"b"), "absent.bin": sha(b"c")}
    registry.fetch("org/n", nested, wanted, world.root / "out")
    assert checksums(world.root / "out", world.root) == {"onnx/model.onnx": sha(b"b")}
    files = registry.files("org/n", nested)
    assert verify(world.root / "out", files, world.root) == ["a.bin: missing"]


def test_a_folder_linked_to_one_above_it_or_in_a_loop_is_refused(world: World) -> None:
    """A link up to the mirror's root walked and hashed all of it before it
    was refused, naming another folder; a loop of links was an unexpected
    error (review)."""
    c2 = world.mirror.publish("org/m", V2)
    up = world.mirror.folder("org/m", c2) / "up"
    up.symlink_to(world.mirror.root, target_is_directory=True)
    with pytest.raises(RegistryError, match=r"/up links to a folder above it: refused"):
        MirrorRegistry(world.mirror.root).files("org/m", c2)
    up.unlink()
    loop = world.mirror.folder("org/m", c2) / "loop"
    loop.symlink_to(loop)
    with pytest.raises(RegistryError, match="refused"):
        MirrorRegistry(world.mirror.root).files("org/m", c2)


def test_refs_linked_out_of_the_mirror_are_refused(world: World) -> None:
    """They were read and believed (hostile test)."""
    elsewhere = world.root / "elsewhere-refs"
    elsewhere.write_text(f"main {world.c1}\n")
    refs = world.mirror.root / "org/m/refs"
    refs.unlink()
    refs.symlink_to(elsewhere)
    with pytest.raises(RegistryError, match=r"outside .*: refused"):
        MirrorRegistry(world.mirror.root).resolve("org/m", "main")


@pytest.mark.parametrize("where", ["in the mirror", "linked out of it"])
def test_refs_that_are_a_pipe_are_refused_not_waited_on(world: World, where: str) -> None:
    """Opening a pipe to read waits for a writer: every weights command hung
    for good, a cron job's piling up (hostile test)."""
    refs = world.mirror.root / "org/m/refs"
    refs.unlink()
    pipe = refs if where == "in the mirror" else world.root / "elsewhere-refs"
    os.mkfifo(pipe)
    if pipe != refs:
        refs.symlink_to(pipe)
    refused: list[BaseException] = []

    def resolve() -> None:
        try:
            MirrorRegistry(world.mirror.root).resolve("org/m", "main")
        except RegistryError as error:
            refused.append(error)

    reading = threading.Thread(target=resolve, daemon=True)
    reading.start()
    reading.join(timeout=10)
    if reading.is_alive():
        with pipe.open("wb"):  # the writer the open waits for: the thread ends
            pass
        reading.join()
        pytest.fail("the refs were waited on")
    (error,) = refused
    assert "refused" in str(error)


def test_refs_saved_with_a_byte_order_mark_are_read(world: World) -> None:
    """The mark was taken for part of the first branch's name, and the
    model listed as unchecked (`refs line 1: expected '<branch> <commit>'`;
    hostile test)."""
    refs = world.mirror.root / "org/m/refs"
    refs.write_bytes(f"main {world.c1}\n".encode("utf-8-sig"))
    assert MirrorRegistry(world.mirror.root).resolve("org/m", "main") == world.c1
    weights = world.open()
    weights.models.add(spec("m"), by="alice")
    report = weights.check_updates(by="cron")
    assert report["unchecked"] == [] and [o["model"] for o in report["origins"]] == ["m"]
    # Anywhere else, it is what it was: not a refs line.
    refs.write_bytes(f"main {world.c1}\n\ufeffdev {world.c1}\n".encode())
    with pytest.raises(RegistryError, match="refs line 2: expected"):
        MirrorRegistry(world.mirror.root).resolve("org/m", "main")


def test_a_branch_named_as_a_commit_is_refused_as_ambiguous(world: World) -> None:
    """The branch won, and an update asked for one commit moved to another
    (hostile test)."""
    c2 = world.mirror.publish("org/m", V2)
    refs = world.mirror.root / "org/m/refs"
    refs.write_text(refs.read_text() + f"{world.c1} {c2}\n")
    with pytest.raises(RegistryError, match=f"'{world.c1}' is both a branch"):
        MirrorRegistry(world.mirror.root).resolve("org/m", world.c1)


@pytest.mark.parametrize(
    ("refs", "ask", "message"),
    [
        ("main\n", "main", "line 1: expected '<branch> <commit>'"),
        ("main abc1234\nmain abc1234\n", "main", "branch main is listed twice"),
        ("main abc1234\n", "dev", "has no branch 'dev' (branches: main)"),
        ("main abc1234\n", "main", "has no commit abc1234 in the mirror"),
    ],
)
def test_the_mirror_refuses_bad_refs_and_unknown_names(
    world: World, refs: str, ask: str, message: str
) -> None:
    (world.mirror.root / "org/m/refs").write_text(refs)
    with pytest.raises(RegistryError, match=re.escape(message)):
        MirrorRegistry(world.mirror.root).resolve("org/m", ask)


@pytest.mark.parametrize(
    ("repository", "path"), [("../org", "x"), ("org/m/extra", "x"), ("org/m", "../../etc")]
)
def test_names_that_could_leave_the_mirror_are_refused(
    world: World, repository: str, path: str
) -> None:
    registry = MirrorRegistry(world.mirror.root)
    with pytest.raises(RegistryError, match="is not"):
        registry.fetch(repository, world.c1, {path: sha(b"x")}, world.root / "out")


@pytest.mark.parametrize("linked", ["a file", "the commit's folder", "the repository's folder"])
def test_a_link_out_of_the_mirror_is_refused_and_nothing_is_written(
    world: World, tracked: Weights, linked: str
) -> None:
    """A hub cache's snapshots link to its blobs, so links are followed, but
    only within the mirror: one leading out of it would copy whatever file
    this process can read into the weights, and its checksum into the log."""
    secret = world.root / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_bytes(b"not the mirror's")
    c2 = world.mirror.publish("org/m", V2)
    commit = world.mirror.folder("org/m", c2)
    if linked == "a file":
        (commit / "leak.txt").symlink_to(secret)
    else:
        moved = world.root / "outside" / linked.replace(" ", "-")
        linked_folder = commit if linked == "the commit's folder" else commit.parent
        shutil.move(linked_folder, moved)
        linked_folder.symlink_to(moved, target_is_directory=True)
    rows = world.rows()
    with pytest.raises(RegistryError, match=r"outside .*mirror: refused"):
        tracked.update("m", by="bob")
    assert world.rows() == rows
    assert not (world.store / "org/m" / c2).exists()


@pytest.mark.parametrize(
    ("linked", "refusal"),
    [("", r"outside .*weights: refused"), ("onnx", r"outside .*/org/m/\w+: refused")],
    ids=["the copy's folder", "a folder in the copy"],
)
def test_a_weights_folder_linked_elsewhere_is_not_written_through(
    world: World, tracked: Weights, linked: str, refusal: str
) -> None:
    c2 = world.mirror.publish("org/m", {**V2, "onnx/model.onnx": b"graph"})
    elsewhere = world.root / "elsewhere"
    elsewhere.mkdir()
    link = world.store / "org/m" / c2 / linked
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(elsewhere, target_is_directory=True)
    rows = world.rows()
    with pytest.raises(RegistryError, match=refusal):
        tracked.update("m", by="bob")
    assert list(elsewhere.iterdir()) == []
    assert world.rows() == rows


def test_a_file_linked_out_of_the_mirror_after_it_was_listed_is_not_copied(
    world: World,
) -> None:
    """The listing refuses such a link; so does the fetch, which reads the
    file again, maybe after it was swapped."""
    registry = MirrorRegistry(world.mirror.root)
    files = registry.files("org/m", world.c1)
    secret = world.root / "secret.txt"
    secret.write_bytes(b"not the mirror's")
    (path,) = list(files)[:1]
    listed = world.mirror.folder("org/m", world.c1) / path
    listed.unlink()
    listed.symlink_to(secret)
    with pytest.raises(RegistryError, match=r"outside .*mirror: refused"):
        registry.fetch("org/m", world.c1, {path: files[path]}, world.root / "out")
    assert not (world.root / "out" / path).exists()


def test_a_link_swapped_while_the_mirror_is_read_never_yields_an_outside_file(
    world: World,
) -> None:
    """Checked on the file opened, not on its name: a link switched back and
    forth between a blob and a file outside, as the listing reads it, is
    either read inside or refused, never read outside (it was, 188 times in
    3,000, while the name was checked apart from the open)."""
    blob = world.mirror.root / "blobs" / "b"
    blob.parent.mkdir()
    blob.write_bytes(b"inside")
    secret = world.root / "secret.txt"
    secret.write_bytes(b"outside")
    commit = world.mirror.folder("org/m", world.c1)
    link = commit / "linked.bin"
    link.symlink_to(blob)
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            for target in (blob, secret):
                swapping = commit / ".linked.tmp"
                swapping.symlink_to(target)
                swapping.replace(link)

    swapper = threading.Thread(target=swap)
    swapper.start()
    read: set[str] = set()
    try:
        for _ in range(1_000):
            with contextlib.suppress(RegistryError, FileNotFoundError):
                read.add(checksums(commit, world.mirror.root).get("linked.bin", ""))
    finally:
        stop.set()
        swapper.join()
    assert sha(b"outside") not in read
    assert sha(b"inside") in read


# -- origins and upstream changes -----------------------------------------------------------


def test_a_model_without_an_origin_gets_one_from_the_mirror_once(world: World) -> None:
    weights = world.open()
    weights.models.add(spec("m"), by="alice")
    assert weights.updates()["updates"] == []
    report = weights.check_updates(by="cron")
    assert [o["model"] for o in report["origins"]] == ["m"]
    origin_set = events(weights, "m")[-1]
    assert (origin_set["event"], origin_set["by"]) == ("OriginSet", SYSTEM_ACTOR)
    assert weights.models.get_model("m")["origin"] == msgspec.to_builtins(
        origin_of("org/m", world.c1, V1)
    )
    # Declared models are left alone: their origin is worked out when needed.
    assert {e["model"] for e in weights.models.log_events()} == {None, "m"}
    rows = world.rows()
    assert weights.check_updates(by="cron")["origins"] == []
    assert world.rows() == rows


def test_a_file_name_holding_a_joiner_does_not_stop_a_check_for_updates(world: World) -> None:
    """A registry's file names are text as a terminal shows them: one with a
    joiner in it stopped the whole check, for every model (review)."""
    joined = {**V1, "read\u200dme.md": b"hello"}
    world.mirror.publish("org/j", joined)
    weights = world.open()
    weights.models.add(spec("j", source="hf://org/j"), by="alice")
    weights.models.add(spec("m"), by="alice")
    report = weights.check_updates(by="cron")
    assert sorted(o["model"] for o in report["origins"]) == ["j", "m"]
    assert "read\u200dme.md" in weights.models.get_model("j")["origin"]["files"]


@pytest.mark.parametrize("given", [{}, {"repository": "org/m"}])
def test_a_runtime_origin_given_in_part_is_completed_from_the_mirror_once(
    world: World, given: dict[str, str]
) -> None:
    """An origin without a commit was taken as recorded: never completed, the
    model followed ``main`` unreported, and a rollback took it for weights to
    go back to (hostile test)."""
    weights = world.open()
    weights.models.add(spec("m", origin=given), by="alice")
    report = weights.check_updates(by="cron")
    assert [o["model"] for o in report["origins"]] == ["m"]
    assert weights.models.get_model("m")["origin"] == msgspec.to_builtins(
        origin_of("org/m", world.c1, V1)
    )
    assert weights.check_updates(by="cron")["origins"] == []
    world.mirror.publish("org/m", V2)
    weights.update("m", by="bob")
    weights.rollback("m", by="carol")
    assert weights.models.get_model("m")["origin"]["revision"] == world.c1


def test_checksums_given_without_their_commit_leave_the_model_unchecked(world: World) -> None:
    """Completed with the head commit, they made an origin saying that
    commit holds files it does not, and a finding of one commit against
    itself (review)."""
    weights = world.open()
    given = {"repository": "org/m", "files": {"config.json": "ab" * 32}}
    weights.models.add(spec("m", origin=given), by="alice")
    rows = world.rows()
    report = weights.check_updates(by="cron")
    assert (report["origins"], report["updates"]) == ([], [])
    [unchecked] = report["unchecked"]
    assert unchecked["model"] == "m"
    assert unchecked["reason"].startswith("its origin gives file checksums but no commit")
    assert world.rows() == rows


def test_a_commit_given_without_its_files_is_no_weights_to_go_back_to(
    world: World, tracked: Weights
) -> None:
    """Taken for the weights the model ran before, a commit named by hand
    without its files (nothing to check a copy against) was the default
    rollback's target, and refused, where complete weights ran before it
    (hostile test)."""
    c2 = world.mirror.publish("org/m", V2)
    partial = Origin(repository="org/m", revision=c2)
    tracked.models.set_source("m", "hf://org/m", partial, by="alice")
    tracked.update("m", by="bob")
    assert tracked.models.get_model("m")["origin"]["files"]  # completed by the update
    tracked.rollback("m", by="carol")
    assert tracked.models.get_model("m")["origin"]["revision"] == world.c1


def test_weights_given_in_part_are_no_weights_to_go_back_to(world: World) -> None:
    weights = world.open()
    weights.models.add(spec("m", origin={"repository": "org/m"}), by="alice")
    weights.update("m", by="bob")
    rows = world.rows()
    with pytest.raises(Refused, match="the log records no earlier weights to go back to"):
        weights.rollback("m", by="carol")
    assert world.rows() == rows


@pytest.mark.parametrize(
    "origin",
    [pytest.param(None, id="none"), pytest.param({"repository": "org/m"}, id="repository-alone")],
)
def test_what_a_move_started_from_says_null_of_an_origin_field_left_out(
    world: World, origin: dict[str, str] | None
) -> None:
    """`from` said "" of a repository or commit the model's origin left out,
    where the model's view (and since 0.3.0 every view) says null: a script
    read a commit that is "" (hostile test)."""
    weights = world.open()
    weights.models.add(spec("m", origin=origin), by="alice")
    shown = weights.models.get_model("m")["origin"] or {"repository": None, "revision": None}
    moved = weights.update("m", by="bob")
    assert moved["from"] == {
        "source": "hf://org/m",
        "repository": shown["repository"],
        "revision": None,
    }


@pytest.mark.parametrize(
    ("name", "why"),
    [
        # Told as holding "a NUL, or a lone surrogate": what its bytes are is what the operator has.
        pytest.param("\udcff.bin", "b'\\xff.bin' is not UTF-8 text", id="not-utf8"),
        pytest.param("a\nb.bin", "holds U+000A, which a terminal acts on", id="newline"),
        pytest.param("a\x1b[2Jb.bin", "holds U+001B, which a terminal acts on", id="escape"),
        pytest.param("evil\u202egpj.exe", "holds U+202E, which a terminal acts on", id="bidi"),
    ],
)
def test_a_file_name_the_log_cannot_hold_leaves_its_model_unchecked_not_the_run_failed(
    world: World, tracked: Weights, name: str, why: str
) -> None:
    """A commit with a file named in bytes that are not UTF-8 failed the whole
    check-updates run after it had written, every run after it too (hostile
    test); one named with what a terminal acts on failed it before it wrote:
    its model is listed as unchecked, the others go on."""
    tracked.models.add(spec("other", source="hf://org/other"), by="alice")
    world.mirror.publish("org/other", V1)
    world.mirror.publish("org/m", {**V2, name: b"odd"})
    report = tracked.check_updates(by="cron")
    [unchecked] = report["unchecked"]
    assert unchecked["model"] == "m" and why in unchecked["reason"]
    assert [o["model"] for o in report["origins"]] == ["other"]


def test_folders_too_deep_to_keep_leave_their_model_unchecked_not_the_run_failed(
    world: World, tracked: Weights
) -> None:
    """A commit holding folders 1,100 deep ended `model updates` and every
    other weights command, for every model, with `error: unexpected
    RecursionError` (hostile test). They are refused as a path too long is:
    its model is listed as unchecked, the others are checked, and an update
    to that commit is refused in one line, writing nothing."""
    tracked.models.add(spec("other", source="hf://org/other"), by="alice")
    world.mirror.publish("org/other", V1)
    c2 = world.mirror.publish("org/m", V2)
    commit = deep = world.mirror.folder("org/m", c2)
    for _ in range(1100):  # one by one: mkdir(parents=True) recurses as deep
        deep /= "d"
        deep.mkdir()
    (deep / "f").write_bytes(b"deep")
    try:
        report = tracked.check_updates(by="cron")
        [unchecked] = report["unchecked"]
        assert unchecked["model"] == "m"
        assert unchecked["reason"].endswith(
            "… is deeper than a weights folder holds (1024 bytes a path): refused"
        )
        assert [o["model"] for o in report["origins"]] == ["other"]
        rows = world.rows()
        with pytest.raises(RegistryError, match="is deeper than a weights folder holds"):
            tracked.update("m", by="bob")
        assert world.rows() == rows
        assert not (world.store / "org/m" / c2).exists()
    finally:
        # Bottom up: shutil.rmtree, and pytest's clean-up of its folders, recurse as deep.
        (deep / "f").unlink()
        while deep != commit:
            deep.rmdir()
            deep = deep.parent


def test_a_deep_tree_is_read_in_work_that_grows_with_its_depth_links_followed(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each folder was resolved from the root, every folder above it looked
    at again: 130,000 lstat() calls, 4 s, for a tree 500 deep. A folder is
    now known from the one above it, a link still resolved (here one halfway
    down, to a folder elsewhere in the mirror): the same checksums."""
    top = below = world.mirror.root / "deep"
    for _ in range(100):
        below /= "d"
        below.mkdir(parents=True)
    elsewhere = linked = world.mirror.root / "elsewhere"
    for _ in range(200):
        linked /= "d"
        linked.mkdir(parents=True)
    (linked / "f").write_bytes(b"deep")
    (below / "l").symlink_to(elsewhere, target_is_directory=True)
    lstat, looked_at = os.lstat, [0]

    def counted(*args: Any, **kwargs: Any) -> os.stat_result:
        looked_at[0] += 1
        return lstat(*args, **kwargs)

    monkeypatch.setattr(os, "lstat", counted)
    listed = checksums(top, world.mirror.root)
    monkeypatch.undo()
    assert listed == {"d/" * 100 + "l/" + "d/" * 200 + "f": sha(b"deep")}
    assert looked_at[0] < 10 * 300


@pytest.mark.parametrize(("name", "why"), OLD_FILE_NAMES)
def test_an_old_origin_todays_rules_refuse_leaves_its_model_unchecked_not_the_run_refused(
    world: World, name: str, why: str
) -> None:
    """An older release recorded a commit and a file, but no repository: the
    origin completed from it was refused as new input, in the one batch of
    every model's origins, so check-updates recorded nothing for any model,
    on every run (hostile test). That model is passed over; the rest are
    recorded."""
    given = Origin(revision=world.c1, files={name: sha(b"old")})
    weights = world.open()
    weights.models.add(spec("m"), by="alice")
    weights.check_updates(by="cron")  # m runs c1
    legacy = msgspec.structs.replace(spec("legacy", source="hf://org/m"), origin=given)
    stored_before_the_rules(weights, legacy)
    weights = world.open()
    weights.models.add(spec("fresh", source="hf://org/base"), by="alice")  # no origin yet
    c2 = world.mirror.publish("org/m", V2)
    [unchecked] = weights.updates()["unchecked"]
    assert unchecked["model"] == "legacy" and why in unchecked["reason"]
    legacy_events = len(events(weights, "legacy"))
    report = weights.check_updates(by="cron")
    assert [u["model"] for u in report["unchecked"]] == ["legacy"]
    assert unchecked["reason"].startswith("its origin, stored before today's rules, cannot be")
    assert [o["model"] for o in report["origins"]] == ["fresh"]
    assert [(u["model"], u["upstream"]) for u in report["updates"]] == [("m", c2)]
    assert report["recorded"] == ["m"]
    assert len(events(weights, "legacy")) == legacy_events
    shown = weights.models.get_model("legacy")["origin"]
    assert shown == {**msgspec.to_builtins(given), "repository": None}  # null: not recorded
    rows = world.rows()
    assert weights.check_updates(by="cron")["recorded"] == []
    assert world.rows() == rows


def test_an_origin_completed_and_an_upstream_change_are_recorded_in_one_run(
    world: World,
) -> None:
    """The change was listed but recorded only by the next run: the model's
    definition had changed since the scan, by this run's own origin record
    (hostile test)."""
    weights = world.open()
    weights.models.add(spec("m", origin={"repository": "org/m", "revision": world.c1}), by="a")
    c2 = world.mirror.publish("org/m", V2)
    report = weights.check_updates(by="cron")
    assert [o["model"] for o in report["origins"]] == ["m"]
    assert [(u["running"], u["upstream"]) for u in report["updates"]] == [(world.c1, c2)]
    assert report["recorded"] == ["m"]
    assert weights.check_updates(by="cron")["recorded"] == []


def test_an_upstream_change_is_listed_once_and_recorded_once(
    world: World, tracked: Weights
) -> None:
    c2 = world.mirror.publish("org/m", V2)
    rows = world.rows()
    report = tracked.updates()
    assert world.rows() == rows  # a read writes nothing
    [finding] = [u for u in report["updates"] if u["model"] == "m"]
    assert finding == {
        "model": "m",
        "declared": False,
        "repository": "org/m",
        "ref": "main",
        "running": world.c1,
        "upstream": c2,
        "running_in_registry": True,
        "added": ["generation_config.json"],
        "removed": ["tokenizer.json"],
        "changed": ["model.safetensors"],
        "first_seen": None,
    }
    first = tracked.check_updates(by="cron")
    second = tracked.check_updates(by="cron")
    assert "m" in first["recorded"] and second["recorded"] == []
    seen = [e for e in events(tracked, "m") if e["event"] == "UpstreamChanged"]
    assert len(seen) == 1
    assert seen[0]["fields"]["upstream"]["revision"] == c2
    [again] = [u for u in second["updates"] if u["model"] == "m"]
    assert again["first_seen"] == {
        "revision": seen[0]["revision"],
        "time": seen[0]["time"],
        "by": "cron",
    }
    # Another node, its own process, finds it recorded in the log.
    assert world.open().check_updates(by="cron")["recorded"] == []
    # A newer commit is a finding of its own, recorded once: what a check
    # compares with is the model's newest finding, not its first.
    c3 = world.mirror.publish("org/m", {**V2, "README.md": b"newer"})
    assert "m" in tracked.check_updates(by="cron")["recorded"]
    assert tracked.check_updates(by="cron")["recorded"] == []
    seen = [e for e in events(tracked, "m") if e["event"] == "UpstreamChanged"]
    assert [e["fields"]["upstream"]["revision"] for e in seen] == [c2, c3]


def test_an_upstream_change_on_a_runtime_model_moves_its_version_in_force(
    world: World, tracked: Weights
) -> None:
    """The change recorded on a runtime model is a version of its stream:
    the catalog in force moves to it, as a restart's replay does (a write
    checks that the catalog's version of a stream is not past the log's)."""
    world.mirror.publish("org/m", V2)
    assert tracked.check_updates(by="cron")["recorded"] == ["m"]
    store = tracked.models.store
    with store.read() as conn:
        logged = store.stream_version(conn, model_id("m"))
    restarted = world.open().models
    assert tracked.models.catalog.aggregate("m").version == logged
    assert restarted.catalog.aggregate("m").version == logged
    assert [e["event"] for e in events(tracked, "m")][-1] == "UpstreamChanged"


@pytest.mark.parametrize("removed", [True, False], ids=["removed-and-added", "replaced"])
def test_a_finding_about_an_earlier_model_of_the_name_is_not_a_new_ones_first_sighting(
    world: World, tracked: Weights, removed: bool
) -> None:
    """A new model of a name was told its finding was first seen when one
    about the model removed before was recorded, and it was never recorded
    for it (hostile test): a model added again starts afresh."""
    c2 = world.mirror.publish("org/m", V2)
    assert tracked.check_updates(by="cron")["recorded"] == ["m"]
    if removed:
        tracked.models.remove("m", by="alice")
    tracked.models.add(spec("m", origin={"repository": "org/m", "revision": world.c1}), by="al")
    [finding] = [u for u in tracked.updates()["updates"] if u["model"] == "m"]
    assert (finding["running"], finding["upstream"], finding["first_seen"]) == (
        world.c1,
        c2,
        None,
    )
    report = tracked.check_updates(by="cron")
    assert report["recorded"] == ["m"]
    seen = [e for e in events(tracked, "m") if e["event"] == "UpstreamChanged"]
    assert len(seen) == 2
    [again] = [u for u in report["updates"] if u["model"] == "m"]
    assert again["first_seen"]["revision"] == seen[-1]["revision"]
    assert tracked.check_updates(by="cron")["recorded"] == []


def test_checksums_changed_under_the_same_commit_are_an_upstream_change(
    world: World, tracked: Weights
) -> None:
    (world.mirror.folder("org/m", world.c1) / "model.safetensors").write_bytes(b"rewritten")
    [finding] = [u for u in tracked.updates()["updates"] if u["model"] == "m"]
    assert (finding["running"], finding["upstream"]) == (world.c1, world.c1)
    assert finding["changed"] == ["model.safetensors"]


def test_files_an_origin_does_not_list_are_no_upstream_change_on_its_commit(
    world: World,
) -> None:
    """An origin given with some of a commit's files (`model source --file
    model.safetensors=…`) was reported as "0 changed, 1 added" against its
    own commit, and an UpstreamChanged recorded, though nothing upstream
    changed (hostile test). The files it lists still count."""
    weights = world.open()
    listed = {p: sha(V1[p]) for p in ("model.safetensors", "tokenizer.json")}
    given = {"repository": "org/m", "revision": world.c1, "files": listed}
    weights.models.add(spec("m", origin=given), by="alice")
    rows = world.rows()
    report = weights.check_updates(by="cron")
    assert (report["updates"], report["origins"], report["recorded"]) == ([], [], [])
    assert world.rows() == rows
    # A listed file changed in place, or gone, is one.
    commit = world.mirror.folder("org/m", world.c1)
    (commit / "model.safetensors").write_bytes(b"rewritten")
    (commit / "tokenizer.json").unlink()
    report = weights.check_updates(by="cron")
    [finding] = report["updates"]
    assert (finding["running"], finding["upstream"]) == (world.c1, world.c1)
    assert (finding["added"], finding["removed"], finding["changed"]) == (
        [],
        ["tokenizer.json"],
        ["model.safetensors"],
    )
    assert report["recorded"] == ["m"]
    assert weights.check_updates(by="cron")["recorded"] == []
    # Another commit on main: every file of it is compared.
    c2 = world.mirror.publish("org/m", V2)
    [finding] = weights.updates()["updates"]
    assert (finding["upstream"], finding["added"], finding["changed"]) == (
        c2,
        ["config.json", "generation_config.json"],
        ["model.safetensors"],
    )


def test_a_record_of_an_upstream_change_leaves_the_catalog_as_it_is(
    world: World, tracked: Weights
) -> None:
    before = tracked.models.list_models()
    world.mirror.publish("org/m", V2)
    world.mirror.publish("org/base", {"model.safetensors": b"declared, new"})
    assert set(tracked.check_updates(by="cron")["recorded"]) == {"m", "base"}
    assert tracked.models.list_models() == before
    reopened = world.open().models
    assert reopened.list_models() == before
    assert reopened.skipped() == []
    # A rollback of the log does not take the declared model's record for history.
    assert reopened.rollback(reopened.revision, by="ops")["notes"] == []


# -- update -------------------------------------------------------------------------------


def test_update_verifies_then_moves_source_and_origin_and_replaces_replicas_in_order(
    world: World, tracked: Weights
) -> None:
    c2 = world.mirror.publish("org/m", V2)
    world.applier.steps.clear()
    result = tracked.update("m", by="bob", reason="re-quantised upstream")
    new_folder = world.store / "org/m" / c2
    assert result["written"] and result["to"]["source"] == new_folder.as_uri()
    assert result["model"]["origin"] == msgspec.to_builtins(origin_of("org/m", c2, V2))
    assert checksums(new_folder, world.store) == origin_of("org/m", c2, V2).files
    m = tracked.models.get_model("m")
    assert (m["source"], m["origin"]["revision"]) == (new_folder.as_uri(), c2)
    old, new = "hf://org/m", new_folder.as_uri()
    sources = {"base": "hf://org/base", "follows-main": "hf://org/base", "m": new}
    assert world.applier.steps == [
        ("catalog", result["revision"], sources),
        ("start", "m", 0, new),
        ("stop", "m", 0, old),
        ("start", "m", 1, new),
        ("stop", "m", 1, old),
        ("start", "m", 2, new),
        ("stop", "m", 2, old),
    ]
    rows = world.rows()
    assert not tracked.update("m", by="bob")["written"]  # already there
    assert world.rows() == rows
    assert tracked.updates()["updates"] == []


def test_update_given_no_config_is_refused_before_it_fetches_anything(
    world: World, tracked: Weights
) -> None:
    """A move by a run given no declared config, on a log that recorded one,
    would record none over it (:class:`NoConfigGiven`): refused before
    gigabytes are fetched for it, as the write's other refusals are."""
    c2 = world.mirror.publish("org/m", V2)
    weights = world.open(declared=False)
    rows = world.rows()
    with pytest.raises(NoConfigGiven):
        weights.update("m", by="bob")
    assert not (world.store / "org/m" / c2).exists()
    assert world.rows() == rows


def test_check_updates_given_no_config_is_refused_before_the_registry_is_asked(
    world: World, tracked: Weights
) -> None:
    """A run given no declared config, on a log that recorded one, would
    record none over it (:class:`NoConfigGiven`): check-updates asked the
    registry of every model first, then was refused only if it found
    something to record, and said "nothing new" (exit 0) otherwise. Refused
    before the registry is asked, as a move is, whatever it would find."""

    class Unasked(MirrorRegistry):
        def resolve(self, repository: str, ref: str) -> str:
            raise AssertionError(f"the registry was asked for {repository}")

    weights = world.open(Unasked(world.mirror.root), declared=False)
    rows = world.rows()
    with pytest.raises(NoConfigGiven):
        weights.check_updates(by="cron")
    assert world.rows() == rows
    assert [r["event"] for r in weights.models.refusals()] == ["CheckUpdates"]


def test_update_to_a_named_commit_fetches_it_beside_the_running_one(
    world: World, tracked: Weights
) -> None:
    c2 = world.mirror.publish("org/m", V2)
    tracked.update("m", by="bob")
    tracked.update("m", world.c1, by="bob")
    assert tracked.models.get_model("m")["origin"]["revision"] == world.c1
    assert sorted(p.name for p in (world.store / "org/m").iterdir()) == sorted([world.c1, c2])


@pytest.mark.parametrize(
    ("registry", "problem"),
    [
        (TamperingRegistry, r"model\.safetensors: sha256 [0-9a-f]{12}…, expected"),
        (LosingRegistry, r"config\.json: missing"),
    ],
)
def test_update_is_refused_when_a_fetched_file_differs_or_is_missing(
    world: World, tracked: Weights, registry: type[MirrorRegistry], problem: str
) -> None:
    world.mirror.publish("org/m", V2)
    weights = world.open(registry(world.mirror.root))
    before = weights.models.get_model("m")
    rows = world.rows()
    world.applier.steps.clear()
    with pytest.raises(VerificationFailed, match=problem):
        weights.update("m", by="bob")
    assert weights.models.get_model("m") == before
    assert world.rows() == rows
    assert world.applier.steps == []


def test_a_file_missing_after_a_fetch_is_fetched_by_the_next_run(
    world: World, tracked: Weights
) -> None:
    """A file the registry did not deliver was refused with the advice to
    delete the folder once no model ran from it, though the next run
    fetches it anyway (review)."""
    c2 = world.mirror.publish("org/m", V2)
    losing = world.open(LosingRegistry(world.mirror.root))
    with pytest.raises(VerificationFailed) as refused:
        losing.update("m", by="bob")
    assert str(refused.value).endswith(
        "config.json: missing; nothing was written (the next run fetches what is missing, "
        "once the registry holds it)"
    )
    assert tracked.update("m", by="bob")["fetched"] == ["config.json"]
    assert tracked.models.get_model("m")["origin"]["revision"] == c2


def test_a_tampered_copy_in_the_store_is_reported_not_replaced(
    world: World, tracked: Weights
) -> None:
    c2 = world.mirror.publish("org/m", V2)
    planted = world.store / "org/m" / c2 / "model.safetensors"
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"planted")
    rows = world.rows()
    with pytest.raises(VerificationFailed, match="delete it to fetch it again"):
        tracked.update("m", by="bob")
    assert planted.read_bytes() == b"planted"
    assert world.rows() == rows


def test_a_copy_that_does_not_verify_is_not_kept_and_is_fetched_again(
    world: World, tracked: Weights
) -> None:
    """Renamed into the commit's folder before it was checked, a copy that
    differed (the mirror's file changed in place, or while it was read) was
    found there by every later fetch and refused each time, the mirror put
    right or not (hostile test)."""
    world.mirror.publish("org/m", V2)
    tracked.update("m", by="bob")
    published = world.mirror.folder("org/m", world.c1) / "model.safetensors"
    published.write_bytes(b"re-quantised in place")
    rows = world.rows()
    with pytest.raises(RegistryError, match=r"model.safetensors was copied with sha256 .*not kept"):
        tracked.rollback("m", by="carol")
    assert not (world.store / "org/m" / world.c1 / "model.safetensors").exists()
    assert world.rows() == rows
    published.write_bytes(V1["model.safetensors"])  # upstream puts it back
    assert tracked.rollback("m", by="carol")["written"]
    assert tracked.models.get_model("m")["origin"]["revision"] == world.c1


def test_a_refused_fetch_leaves_the_store_as_it_found_it(world: World, tracked: Weights) -> None:
    """A fetch refused before any file was kept left an empty commit folder,
    and the record of its list, in the store (review)."""
    world.mirror.publish("org/m", V2)
    tracked.update("m", by="bob")
    store_before = sorted(world.store.rglob("*"))
    (world.mirror.folder("org/m", world.c1) / "config.json").write_bytes(b"edited in place")
    with pytest.raises(RegistryError, match=r"config.json was copied with sha256 .*not kept"):
        tracked.rollback("m", by="carol")
    assert sorted(world.store.rglob("*")) == store_before


def test_a_refused_staging_leaves_the_folder_another_is_fetching_into(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two stagings at once of one commit, each finding no folder: the one
    refused took away the folder, empty while the other copied its first
    file, and the other's copy then had nowhere to go (review)."""
    store = WeightsStore(world.store)
    origin = origin_of("org/m", world.c1, V1)
    folder = store.folder(origin, [])
    copying, refused = threading.Event(), threading.Event()

    class Waiting(registry_module._Reading):
        def read(self, size: int = -1) -> bytes:
            if threading.current_thread().name == "other" and not copying.is_set():
                copying.set()
                refused.wait(timeout=30)
            return super().read(size)

    monkeypatch.setattr(registry_module, "_Reading", Waiting)
    mirror = MirrorRegistry(world.mirror.root)
    outcome: list[BaseException | list[str]] = []

    def stage_meanwhile() -> None:
        try:
            outcome.append(store.stage(mirror, origin, folder, []))
        except BaseException as error:
            outcome.append(error)

    other = threading.Thread(target=stage_meanwhile, name="other")

    class Refusing(MirrorRegistry):
        def fetch(
            self, repository: str, revision: str, files: Mapping[str, str], into: Path
        ) -> None:
            other.start()  # the other staging begins, and copies its first file
            assert copying.wait(timeout=30)
            raise RegistryError("the copy differs")

    try:
        with pytest.raises(RegistryError, match="the copy differs"):
            store.stage(Refusing(world.mirror.root), origin, folder, [])
    finally:
        refused.set()
        other.join(timeout=30)
    assert outcome == [sorted(V1)]
    assert checksums(folder, world.store) == origin.files


def test_a_source_the_write_would_refuse_is_refused_before_anything_is_fetched(
    world: World, tracked: Weights
) -> None:
    """Refused only once every file was fetched (gigabytes, for weights), and
    those left in the store: a store path long enough that the model's new
    source is longer than a source may be (hostile test)."""
    world.mirror.publish("org/m", V2)
    deep = world.root.joinpath(*["d" * 200] * 10)
    weights = Weights(tracked.models, MirrorRegistry(world.mirror.root), WeightsStore(deep))
    rows = world.rows()
    with pytest.raises(Refused, match="source: is longer than 2048 characters"):
        weights.update("m", by="bob")
    assert not deep.exists()
    assert world.rows() == rows


def test_the_source_is_the_store_folder_itself_however_the_store_was_named(
    world: World, tracked: Weights
) -> None:
    """Named through a link, or with `..`, the store gave the model a source
    of that spelling: the link pointed elsewhere later, the source named other
    files than those checked; another spelling moved the model to the same
    folder again (hostile test)."""
    c2 = world.mirror.publish("org/m", V2)
    world.store.mkdir()
    link = world.root / "store-link"
    link.symlink_to(world.store)
    registry = MirrorRegistry(world.mirror.root)
    linked = Weights(tracked.models, registry, WeightsStore(link))
    assert linked.update("m", by="bob")["written"]
    folder = (world.store / "org/m" / c2).resolve()
    assert tracked.models.get_model("m")["source"] == folder.as_uri()
    spelled = Weights(tracked.models, registry, WeightsStore(world.root / "x" / ".." / "weights"))
    assert not spelled.update("m", by="bob")["written"]


def test_a_model_changed_while_its_weights_were_fetched_is_not_moved(
    world: World, tracked: Weights
) -> None:
    world.mirror.publish("org/m", V2)
    operator = world.open().models

    class SlowRegistry(MirrorRegistry):
        def fetch(
            self, repository: str, revision: str, files: Mapping[str, str], into: Path
        ) -> None:
            super().fetch(repository, revision, files, into)
            operator.set_source("m", "hf://org/m", None, by="dave")  # meanwhile, elsewhere

    weights = world.open(SlowRegistry(world.mirror.root))
    with pytest.raises(Refused, match="changed while its weights were being fetched"):
        weights.update("m", by="bob")
    assert weights.models.get_model("m")["origin"] is None  # dave's change stands
    assert events(weights, "m")[-1]["by"] == "dave"


def test_an_origin_worked_out_while_the_weights_were_fetched_does_not_refuse_the_move(
    world: World,
) -> None:
    """A check for updates (a cron job) that recorded the origin of a model
    whose update was fetching refused that update, once the download was
    done, as a model changed meanwhile (hostile test): the origin says what
    it ran, and it still ran it."""
    c2 = world.mirror.publish("org/m", V2, branch="dev")
    weights = world.open()
    weights.models.add(spec("m"), by="alice")
    cron = world.open()

    class CheckedMeanwhile(MirrorRegistry):
        def fetch(
            self, repository: str, revision: str, files: Mapping[str, str], into: Path
        ) -> None:
            cron.check_updates(by="cron")
            super().fetch(repository, revision, files, into)

    moved = world.open(CheckedMeanwhile(world.mirror.root)).update("m", c2, by="bob")
    assert moved["written"]
    assert [(e["event"], e["by"]) for e in events(weights, "m")] == [
        ("Added", "alice"),
        ("OriginSet", SYSTEM_ACTOR),
        ("SourceSet", "bob"),
    ]
    assert weights.models.get_model("m")["origin"]["revision"] == c2


def test_another_repository_named_while_the_weights_were_fetched_refuses_the_move(
    world: World,
) -> None:
    """An origin recorded meanwhile is let through as what the model ran,
    completed (a check for updates from cron): one naming another repository
    is an operator's change, which the move wrote over with the repository
    it had read (review)."""
    world.mirror.publish("org/m", V2, branch="dev")
    other = world.mirror.publish("org/other", V1)
    weights = world.open()
    weights.models.add(spec("m"), by="alice")  # no origin: its source names org/m
    operator = world.open()
    named = Origin(
        repository="org/other",
        revision=other,
        files=MirrorRegistry(world.mirror.root).files("org/other", other),
    )

    class NamedMeanwhile(MirrorRegistry):
        def fetch(
            self, repository: str, revision: str, files: Mapping[str, str], into: Path
        ) -> None:
            operator.models.set_source("m", "hf://org/m", named, by="dave")
            super().fetch(repository, revision, files, into)

    with pytest.raises(Refused, match="changed while its weights were being fetched"):
        world.open(NamedMeanwhile(world.mirror.root)).update("m", "dev", by="bob")
    assert weights.models.get_model("m")["origin"]["repository"] == "org/other"
    assert events(weights, "m")[-1]["by"] == "dave"  # dave's change stands


def test_a_fetch_under_way_elsewhere_is_not_taken_for_part_of_the_revision(
    world: World, tracked: Weights, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two updates of one commit at once (two processes, or one killed
    mid-copy and run again): the copy one has under way is never in the
    revision's folder, so the other's check of that folder passes. The one
    that finds the model moved there meanwhile writes nothing and says it
    runs those weights already (it was refused, to be run again for that;
    hostile test)."""
    c2 = world.mirror.publish("org/m", V2)
    other = world.open()
    copy = shutil.copyfileobj
    meanwhile: list[Any] = []

    def copy_while_another_updates(source: Any, target: Any, length: int = 0) -> None:
        if not meanwhile:
            meanwhile.append("under way")
            meanwhile.append(other.update("m", by="carol"))
        copy(source, target, length)

    monkeypatch.setattr(shutil, "copyfileobj", copy_while_another_updates)
    second = tracked.update("m", by="bob")
    assert not second["written"] and second["to"]["revision"] == c2
    assert second["model"]["source"] == (world.store / "org/m" / c2).resolve().as_uri()
    assert tracked.models.get_model("m")["origin"]["revision"] == c2
    assert events(tracked, "m")[-1]["by"] == "carol"
    folder = world.store / "org/m" / c2
    assert sorted(p.name for p in folder.iterdir()) == sorted(V2)
    assert verify(folder, origin_of("org/m", c2, V2).files, world.store) == []


# A fetch of the mirror, in a process of its own, that stops for good in the
# middle of its second file's copy: the test kills it there.
_STUCK_FETCH = """
import shutil, sys, time
from pathlib import Path
from catalog_es.registry import MirrorRegistry
copy = shutil.copyfileobj
copied = []
def copy_then_stick(source, target, length=0):
    copy(source, target, length)
    copied.append(target)
    if len(copied) == 2:
        target.flush()
        print("stuck", flush=True)
        time.sleep(60)
shutil.copyfileobj = copy_then_stick
mirror, repository, commit, into = sys.argv[1:]
registry = MirrorRegistry(Path(mirror))
registry.fetch(repository, commit, registry.files(repository, commit), Path(into))
"""


def test_the_partial_copies_of_a_killed_fetch_are_deleted_by_the_next(
    world: World, tracked: Weights
) -> None:
    """Killed outright, a fetch cannot clean up after itself: the next fetch
    into the same repository's folder deletes its partial copies (weights run
    to gigabytes), and leaves alone those of fetches still running."""
    c2 = world.mirror.publish("org/m", V2)
    repository = world.store / "org/m"
    stuck = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _STUCK_FETCH,
            str(world.mirror.root),
            "org/m",
            c2,
            str(repository / c2),
        ],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parent.parent,
    )
    try:
        assert stuck.stdout is not None
        assert stuck.stdout.readline() == b"stuck\n"
        running = [p.name for p in repository.iterdir() if ".partial." in p.name]
        assert len(running) == 1
        tracked.update("m", world.c1, by="bob")  # a fetch beside the running one
        assert [p.name for p in repository.iterdir() if ".partial." in p.name] == running
    finally:
        stuck.kill()
        stuck.wait()
    assert any((repository / running[0]).iterdir())  # the kill left a partial copy

    tracked.update("m", by="bob")
    assert sorted(p.name for p in repository.iterdir()) == sorted([world.c1, c2])
    assert verify(repository / c2, origin_of("org/m", c2, V2).files, world.store) == []


def test_the_folder_of_a_fetch_killed_as_it_started_is_deleted_by_the_next(
    world: World, tracked: Weights
) -> None:
    """A fetch makes its partial folder under a name of its own
    (``.COMMIT.starting.*``) and renames it once locked: killed in between,
    it left that folder for good, as the next fetches looked only for partial
    ones. They delete it now, unless a fetch is making one as they look
    (which holds a shared lock on the repository's folder meanwhile)."""
    c2 = world.mirror.publish("org/m", V2)
    repository = world.store / "org/m"
    killed = [repository / f".{c2}.starting.{which}" for which in ("empty", "unlocked")]
    for folder in killed:
        folder.mkdir(parents=True)
    (killed[1] / ".fetching").touch()
    descriptor = os.open(repository, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH)  # as a fetch making one holds it
        tracked.update("m", world.c1, by="bob")
    finally:
        os.close(descriptor)
    assert sorted(p.name for p in repository.iterdir()) == sorted(
        [world.c1, *(f.name for f in killed)]
    )
    tracked.update("m", by="bob")
    assert sorted(p.name for p in repository.iterdir()) == sorted([world.c1, c2])


def test_a_partial_folder_whose_fetch_cannot_be_told_ended_is_kept(
    world: World, tracked: Weights, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older release's fetch takes no lock, and where the file system has
    none to give (some NFS mounts: flock fails), no fetch can tell a running
    one from a killed one: nothing is deleted, and fetches still work."""
    c2 = world.mirror.publish("org/m", V2)
    repository = world.store / "org/m"
    older = repository / f".{c2}.partial.older"
    older.mkdir(parents=True)
    (older / "copy").write_bytes(b"an older release's copy under way")
    unlocked = repository / f".{c2}.partial.unlocked"
    unlocked.mkdir()
    (unlocked / ".fetching").touch()

    def no_locks_here(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks_here)
    tracked.update("m", by="bob")
    assert tracked.models.get_model("m")["origin"]["revision"] == c2
    assert sorted(p.name for p in repository.iterdir()) == sorted([c2, older.name, unlocked.name])
    assert (older / "copy").read_bytes() == b"an older release's copy under way"


@pytest.mark.parametrize("move", ["update", "rollback"])
@pytest.mark.parametrize(
    ("source", "origin"),
    [
        pytest.param("file:///srv/w\x1b[2Jy", {"repository": "org/m"}, id="source-escape"),
        pytest.param("hf://org/m", {"files": {"x" * 300: sha(b"old")}}, id="origin-long-file"),
    ],
)
def test_a_model_is_moved_off_an_old_source_or_origin_todays_rules_refuse(
    world: World, tracked: Weights, move: str, source: str, origin: dict[str, Any]
) -> None:
    """The early dry run wrote the model's current source and origin back as
    new input: the command meant to replace weights an older release stored
    was refused because of them (`model 'm': source: holds U+001B`), naming
    what the operator never typed (hostile test)."""
    given = Origin(**{"revision": world.c1, **origin}) if "files" in origin else Origin(**origin)
    old = msgspec.structs.replace(spec("m"), source=source, origin=given)
    stored_before_the_rules(tracked, old)
    weights = world.open()
    c2 = world.mirror.publish("org/m", V2)
    if move == "update":
        result = weights.update("m", by="bob")
        assert result["to"]["revision"] == c2
    else:
        result = weights.rollback("m", by="bob")  # to c1, as check-updates recorded it
        assert result["to"]["revision"] == world.c1
    assert result["written"] and result["from"]["source"] == source
    # A field the origin left out is null, as `model show` prints it (it was "").
    left_out = {"repository": given.repository or None, "revision": given.revision or None}
    assert result["from"] == {"source": source, **left_out} and None in left_out.values()
    moved = weights.models.get_model("m")
    assert moved["source"] == result["to"]["source"] and moved["source"].startswith("file://")
    assert weights.models.refusals() == []


def test_a_move_is_still_refused_before_anything_is_fetched_when_its_write_would_be(
    world: World, tracked: Weights
) -> None:
    world.mirror.publish("org/m", V2)
    head = tracked.models.revision
    tracked.models.scale("m", 3, 4, by="alice")
    rows = world.rows()
    for move in (tracked.update, tracked.rollback):
        with pytest.raises(Refused, match=f"revision {head + 1}, not {head}"):
            move("m", by="bob", expected_revision=head)
    assert world.rows() == rows
    tracked.models.remove("m", by="alice")
    rows = world.rows()
    for move in (tracked.update, tracked.rollback):
        with pytest.raises(Refused, match="model 'm' is not in the catalog"):
            move("m", by="bob")
    assert world.rows() == rows
    assert not world.store.exists()


def test_a_commit_the_mirror_does_not_have_is_refused(world: World, tracked: Weights) -> None:
    rows = world.rows()
    with pytest.raises(RegistryError, match="has no commit 0000000 in the mirror"):
        tracked.update("m", "0000000", by="bob")
    assert world.rows() == rows


# -- rollback -----------------------------------------------------------------------------


def test_rollback_brings_the_previous_origin_back_verified(world: World, tracked: Weights) -> None:
    origin_recorded_at = events(tracked, "m")[-1]["revision"]
    world.mirror.publish("org/m", V2)
    tracked.update("m", by="bob")
    world.applier.steps.clear()
    result = tracked.rollback("m", by="carol", reason="answers got worse")
    m = tracked.models.get_model("m")
    assert m["origin"] == msgspec.to_builtins(origin_of("org/m", world.c1, V1))
    assert m["source"] == (world.store / "org/m" / world.c1).as_uri()
    assert result["rollback_to"] == origin_recorded_at
    assert events(tracked, "m")[-1]["rollback_to"] == origin_recorded_at
    assert [s[0] for s in world.applier.steps] == ["catalog"] + ["start", "stop"] * 3


def test_rollback_names_the_end_of_the_write_that_recorded_the_weights(
    world: World, tracked: Weights
) -> None:
    """Weights recorded by the first of an apply's changes were marked with
    that change's revision, which a read reads as the state before the
    apply: the model was not there (review)."""
    tracked.models.remove("m", by="alice")
    m = spec("m", origin=msgspec.to_builtins(origin_of("org/m", world.c1, V1)))
    applied = tracked.models.apply_changes([commands.add(m), commands.add(spec("n"))], by="alice")
    world.mirror.publish("org/m", V2)
    tracked.update("m", by="bob")
    result = tracked.rollback("m", by="carol")
    assert result["rollback_to"] == applied["revision"]
    then = tracked.models.get_model("m", at=result["rollback_to"])
    assert then["origin"] == msgspec.to_builtins(origin_of("org/m", world.c1, V1))


@pytest.mark.parametrize("extra", ["a link out of the store", "a link to nothing", "a pipe"])
def test_a_copy_holding_more_than_files_is_refused(
    world: World, tracked: Weights, extra: str
) -> None:
    """Whatever was not a file was passed over, so a copy with a link to /etc
    in it verified, and its model was moved onto it (hostile test)."""
    tracked.update("m", by="bob")  # c1, copied into the store
    world.mirror.publish("org/m", V2)
    tracked.update("m", by="bob")
    planted = world.store / "org/m" / world.c1 / "planted"
    if extra == "a link out of the store":
        (world.root / "outside").mkdir()
        planted.symlink_to(world.root / "outside", target_is_directory=True)
    elif extra == "a link to nothing":
        planted.symlink_to(world.root / "nothing")
    else:
        os.mkfifo(planted)
    rows = world.rows()
    with pytest.raises(Refused, match="refused"):
        tracked.rollback("m", by="carol")
    assert world.rows() == rows


def test_files_not_part_of_a_revision_are_told_in_the_order_of_their_paths(
    world: World,
) -> None:
    """Told in the order of a set of their paths, the refusal of a copy
    holding files too many named another of them first on each run (hostile
    test): it names them in the order of their paths, as it does the others."""
    folder = world.root / "copy"
    folder.mkdir()
    planted = [f"planted-{n}" for n in "hgfedcba"]
    for name in planted:
        (folder / name).write_bytes(b"planted")
    told = verify(folder, {}, world.root)
    assert told == [f"{name}: not part of the revision" for name in sorted(planted)]


def test_a_folder_linked_inside_the_mirror_is_copied_whole(world: World, tracked: Weights) -> None:
    """A commit's folder linked to another in the mirror (as a hub cache does)
    was passed over: the copy, and the origin recorded, left its files out
    (hostile test)."""
    c2 = world.mirror.publish("org/m", V2)
    shared = world.mirror.root / "shared-onnx"
    shared.mkdir()
    (shared / "model.onnx").write_bytes(b"onnx")
    (world.mirror.folder("org/m", c2) / "onnx").symlink_to(shared, target_is_directory=True)
    tracked.update("m", by="bob")
    files = tracked.models.get_model("m")["origin"]["files"]
    assert files["onnx/model.onnx"] == sha(b"onnx")
    assert (world.store / "org/m" / c2 / "onnx" / "model.onnx").read_bytes() == b"onnx"


def test_an_applier_that_fails_to_replace_replicas_leaves_the_move_written_and_told(
    world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The caller got the applier's bare error, no word that the move was
    written (hostile test). As with a catalog it fails on: logged, and the
    answer is the write's."""
    (tmp_path / "a-file").write_text("")  # so catalog.json cannot be written
    weights = world.open(applier=JsonFileApplier(tmp_path / "a-file" / "catalog.json"))
    weights.models.add(spec("m"), by="alice")
    weights.check_updates(by="cron")
    c2 = world.mirror.publish("org/m", V2)
    moved = weights.update("m", by="bob")
    assert moved["written"] and moved["to"]["revision"] == c2
    assert events(weights, "m")[-1]["event"] == "SourceSet"
    assert "the applier failed to replace the replicas of 'm'" in caplog.text


def test_rollback_never_goes_back_past_a_removal(world: World, tracked: Weights) -> None:
    """Removed and added again, from another repository, a model was rolled
    back to weights of the one removed (hostile test)."""
    world.mirror.publish("org/m", V2)
    tracked.update("m", by="bob")
    tracked.models.remove("m", by="alice")
    tracked.models.add(spec("m", source="s3://bucket/m"), by="alice")
    rows = world.rows()
    with pytest.raises(Refused, match="no earlier weights"):
        tracked.rollback("m", by="carol")
    assert world.rows() == rows


def test_rollback_works_from_the_local_copy_after_upstream_drops_the_commit(
    world: World, tracked: Weights
) -> None:
    tracked.update("m", by="bob")  # c1, fetched into the store
    c2 = world.mirror.publish("org/m", V2)
    tracked.update("m", by="bob")
    for path in world.mirror.folder("org/m", world.c1).iterdir():
        path.unlink()
    world.mirror.folder("org/m", world.c1).rmdir()  # force-pushed away
    tracked.rollback("m", world.c1[:8], by="carol")
    [finding] = [u for u in tracked.updates()["updates"] if u["model"] == "m"]
    assert (finding["running"], finding["upstream"]) == (world.c1, c2)
    assert finding["running_in_registry"] is False


def test_rollback_is_refused_when_the_old_weights_are_gone_everywhere(
    world: World, tracked: Weights
) -> None:
    world.mirror.publish("org/m", V2)
    tracked.update("m", by="bob")
    (world.mirror.folder("org/m", world.c1) / "tokenizer.json").unlink()
    rows = world.rows()
    with pytest.raises(VerificationFailed, match=r"tokenizer\.json: missing"):
        tracked.rollback("m", by="carol")
    assert world.rows() == rows
    # Weights that failed verification are worth knowing someone asked for.
    [kept] = tracked.models.refusals()
    assert (kept["by"], kept["model"], kept["event"], kept["fields"]) == (
        "carol",
        "m",
        "SourceSet",
        {"to": None},
    )
    assert "tokenizer.json: missing" in kept["refusal"]


def test_rollback_passes_over_a_record_that_cannot_be_decoded(
    world: World, tracked: Weights
) -> None:
    first_added = events(tracked, "m")[0]["revision"]
    tracked.models.add(spec("m", scaling={"min": 3, "max": 3}), by="alice")  # no origin again
    tracked.check_updates(by="cron")
    world.mirror.publish("org/m", V2)
    tracked.update("m", by="bob")
    with sqlite3.connect(world.db) as conn:
        conn.execute("UPDATE catalog_events SET state = x'00ff' WHERE revision = ?", (first_added,))
    reopened = world.open()
    assert reopened.rollback("m", by="carol")["to"]["revision"] == world.c1


def test_rollback_to_the_commit_the_model_runs_writes_nothing(
    world: World, tracked: Weights
) -> None:
    """It was refused as a commit the model had never run (docs review)."""
    c2 = world.mirror.publish("org/m", V2)
    tracked.update("m", by="bob")  # c2, from its verified folder
    rows = world.rows()
    result = tracked.rollback("m", c2[:7], by="carol")
    assert not result["written"] and result["to"]["revision"] == c2
    assert world.rows() == rows and tracked.models.refusals() == []


def test_rollback_to_a_commit_the_model_never_ran_is_refused(
    world: World, tracked: Weights
) -> None:
    c2 = world.mirror.publish("org/m", V2)
    with pytest.raises(Refused, match=f"has not run commit {c2} before"):
        tracked.rollback("m", c2, by="carol")
    assert [(r["event"], r["fields"]) for r in tracked.models.refusals()] == [
        ("SourceSet", {"to": c2})
    ]
    fresh = world.open()
    fresh.models.add(spec("n", source="s3://bucket/n"), by="alice")
    with pytest.raises(Refused, match="no earlier weights"):
        fresh.rollback("n", by="carol")


def test_the_log_shows_the_whole_provenance_timeline(world: World, tracked: Weights) -> None:
    c2 = world.mirror.publish("org/m", V2)
    tracked.check_updates(by="cron")
    tracked.update("m", by="bob")
    tracked.rollback("m", by="carol")
    timeline = [
        (e["event"], e["by"], (e["fields"].get("origin") or {}).get("revision"), e["rollback_to"])
        for e in events(tracked, "m")
    ]
    origin_at = events(tracked, "m")[1]["revision"]
    assert timeline == [
        ("Added", "alice", None, None),
        ("OriginSet", SYSTEM_ACTOR, world.c1, None),
        ("UpstreamChanged", "cron", None, None),
        ("SourceSet", "bob", c2, None),
        ("SourceSet", "carol", world.c1, origin_at),
    ]


def _n_on_the_weights_file_alone(world: World, tracked: Weights) -> tuple[Origin, str]:
    """Model ``n`` given an origin of ``c1`` that lists the weights file alone,
    and moved onto its copy in the store: that origin and n's source."""
    world.mirror.point("org/m", "main", world.c1)
    tracked.models.add(spec("n", source="hf://org/m"), by="alice")
    weights_only = origin_of("org/m", world.c1, {"model.safetensors": V1["model.safetensors"]})
    tracked.models.set_source("n", "hf://org/m", weights_only, by="alice")
    tracked.rollback("n", world.c1, by="bob")
    return weights_only, tracked.models.get_model("n")["source"]


def test_models_of_one_commit_with_other_file_lists_run_from_folders_of_their_own(
    world: World, tracked: Weights
) -> None:
    """An origin given with the weights file alone, and the registry's list of
    the same commit, were staged into the one folder: the update of one added
    a file into the folder the other ran from, and that one's rollback there
    was refused, the folder in use by the first (hostile test). Each list
    has a folder holding exactly its files, found again by a rollback."""
    c2 = world.mirror.publish("org/m", V2)
    weights_only, n_source = _n_on_the_weights_file_alone(world, tracked)
    tracked.update("m", world.c1, by="bob")
    m_source = tracked.models.get_model("m")["source"]
    assert m_source != n_source
    for source, origin in ((n_source, weights_only), (m_source, origin_of("org/m", world.c1, V1))):
        assert checksums(Path(source.removeprefix("file://")), world.store) == origin.files
    tracked.update("n", c2, by="bob")
    back = tracked.rollback("n", world.c1, by="bob")
    assert (back["model"]["source"], back["fetched"]) == (n_source, [])
    assert tracked.update("m", world.c1, by="bob")["written"] is False


def test_a_store_an_older_release_made_serves_its_models_with_no_download(
    world: World, tracked: Weights
) -> None:
    """An older release recorded no list beside a commit's folder: the
    models running from it tell which list it holds. Files it holds do not
    (a killed fetch leaves some of its list)."""
    world.mirror.publish("org/m", V2)
    weights_only, n_source = _n_on_the_weights_file_alone(world, tracked)
    shutil.rmtree(world.store / ".lists")  # as an older release left the store
    again = tracked.rollback("n", world.c1, by="bob")
    assert (again["written"], again["fetched"]) == (False, [])
    shutil.rmtree(world.store / ".lists")
    tracked.update("m", world.c1, by="bob")
    assert tracked.models.get_model("m")["source"] != n_source
    assert checksums(Path(n_source.removeprefix("file://")), world.store) == weights_only.files


def test_a_folder_with_no_record_holding_files_of_another_list_is_not_taken_for_one(
    world: World, tracked: Weights
) -> None:
    """A commit's folder an older release made (no record of its list), that
    no model ran from, was taken by the first list staged there: a rollback
    onto another list of the commit was refused for the files of the copy it
    held, and recorded its list for that folder, so that the model of that
    copy, rolled back, was sent to a folder of its own and refused once
    upstream had dropped the commit (hostile test). A file of another list
    tells that folder is not this one's."""
    tracked.update("m", by="bob")  # c1, fetched into the store
    world.mirror.publish("org/m", V2)
    tracked.update("m", by="bob")
    shutil.rmtree(world.store / ".lists")  # as an older release left the store
    tracked.models.add(spec("n", source="hf://org/m"), by="alice")
    weights_only = origin_of("org/m", world.c1, {"model.safetensors": V1["model.safetensors"]})
    tracked.models.set_source("n", "hf://org/m", weights_only, by="alice")
    n_moved = tracked.rollback("n", world.c1, by="bob")
    copy = world.store / "org/m" / world.c1
    assert n_moved["model"]["source"] != copy.resolve().as_uri()
    assert n_moved["fetched"] == ["model.safetensors"]
    assert checksums(copy, world.store) == origin_of("org/m", world.c1, V1).files
    shutil.rmtree(world.mirror.folder("org/m", world.c1))  # force-pushed away
    back = tracked.rollback("m", world.c1, by="carol")
    assert back["written"] and back["fetched"] == []
    assert back["model"]["source"] == copy.resolve().as_uri()


def test_a_list_record_edited_by_hand_moves_no_files_under_a_running_model(
    world: World, tracked: Weights
) -> None:
    """The record of a folder's list was believed over the models running
    from it: edited to another list's digest, the update of another model
    added files into the folder a model ran from; cut short, a model asked
    for the weights it ran was moved off them, with a download (hostile
    test). The models running from a folder tell its list."""
    world.mirror.publish("org/m", V2)
    weights_only, n_source = _n_on_the_weights_file_alone(world, tracked)
    record = world.store / ".lists" / "org" / "m" / world.c1
    record.write_text(hashlib.sha256(msgspec.json.encode(sorted(V1))).hexdigest())
    tracked.update("m", world.c1, by="bob")
    assert tracked.models.get_model("m")["source"] != n_source
    assert checksums(Path(n_source.removeprefix("file://")), world.store) == weights_only.files
    record.write_text(record.read_text()[:10])
    again = tracked.rollback("n", world.c1, by="bob")
    assert (again["written"], again["model"]["source"], again["fetched"]) == (False, n_source, [])


# -- declared models ------------------------------------------------------------------------


def test_a_declared_model_is_reported_but_update_and_rollback_say_edit_the_config(
    world: World, tracked: Weights
) -> None:
    base2 = world.mirror.publish("org/base", {"model.safetensors": b"declared, new"})
    [finding] = [u for u in tracked.updates()["updates"] if u["model"] == "base"]
    assert finding["declared"] and (finding["running"], finding["upstream"]) == (
        world.base1,
        base2,
    )
    # follows-main pins no revision: it runs what main points to, so nothing is reported.
    assert [u["model"] for u in tracked.updates()["updates"]] == ["base"]
    rows = world.rows()
    for move in (tracked.update, tracked.rollback):
        with pytest.raises(DeclaredInConfig, match="change its source there"):
            move("base", by="bob")
    assert world.rows() == rows
    assert not (world.store / "org/base").exists()
    assert [(r["model"], r["event"], r["fields"]) for r in tracked.models.refusals()] == [
        ("base", "SourceSet", {"revision": "main"}),
        ("base", "SourceSet", {"to": None}),
    ]


# -- appliers ---------------------------------------------------------------------------------


def test_the_json_file_applier_queues_replica_replacements_in_order(tmp_path: Path) -> None:
    applier = JsonFileApplier(tmp_path / "catalog.json")
    applier.replace_replicas(spec("a"), 7)
    applier.replace_replicas(spec("b"), 8)
    lines = [json.loads(line) for line in applier.replicas_path.read_text().splitlines()]
    assert [(r["revision"], r["model"]["name"], r["strategy"]) for r in lines] == [
        (7, "a", "one-at-a-time"),
        (8, "b", "one-at-a-time"),
    ]
    NoApplier().replace_replicas(spec("a"), 7)  # nothing to replace: no error either


# -- the CLI ----------------------------------------------------------------------------------


def test_cli_updates_check_update_rollback_and_refusals(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    base = ["--db", f"sqlite:///{world.db}", "--config", str(world.config)]
    where = ["--mirror", str(world.mirror.root), "--weights", str(world.store)]
    runner = CliRunner()
    definition = world.root / "m.yaml"
    definition.write_text(
        "name: m\nengine: vllm\nsource: hf://org/m\nprofiles: [{name: g, gpus: 1}]\n"
    )
    assert runner.invoke(cli, [*base, "model", "add", str(definition)]).exit_code == 0

    checked = runner.invoke(cli, [*base, "model", "check-updates", *where])
    assert checked.exit_code == 0, checked.stderr
    assert f"recorded the origin of m: org/m@{world.c1[:12]}" in checked.stdout
    c2 = world.mirror.publish("org/m", V2)

    listed = runner.invoke(cli, [*base, "--json", "model", "updates", *where])
    assert listed.exit_code == 0
    report = json.loads(listed.stdout)
    assert [(u["model"], u["upstream"]) for u in report["updates"]] == [("m", c2)]
    assert runner.invoke(cli, [*base, "model", "check-updates", *where]).exit_code == 0
    human = runner.invoke(cli, [*base, "model", "updates", *where])
    assert "1 changed, 1 added, 1 removed" in human.stdout

    rows = world.rows()
    declared = runner.invoke(cli, [*base, "model", "update", "base", "--by", "bob", *where])
    assert declared.exit_code == 1
    assert declared.stderr.splitlines() == [
        "error: model 'base' is declared in configuration; "
        "change its source there, or it reverts on the next restart"
    ]
    unknown = runner.invoke(cli, [*base, "model", "update", "m", "--revision", "dev", *where])
    assert unknown.exit_code == 1
    assert unknown.stderr.splitlines() == ["error: org/m has no branch 'dev' (branches: main)"]
    # Said empty, it is not taken for main (it was, and moved the model; hostile test).
    empty = runner.invoke(cli, [*base, "model", "update", "m", "--revision", "", *where])
    assert (empty.exit_code, empty.stderr) == (
        1,
        "error: the revision: give a branch or a commit (default: main)\n",
    )
    # A weights store that is a file: one line, recorded as refused (it was "unexpected").
    (world.root / "not-a-store").write_text("a file")
    a_file = ["--mirror", str(world.mirror.root), "--weights", str(world.root / "not-a-store")]
    filed = runner.invoke(cli, [*base, "model", "update", "m", *a_file])
    assert filed.exit_code == 1 and filed.stderr.startswith("error: the weights store ")
    assert "unexpected" not in filed.stderr
    nowhere = runner.invoke(cli, [*base, "model", "updates"])
    assert nowhere.exit_code == 1
    assert nowhere.stderr.splitlines() == [
        f"error: no registry to compare with: give --mirror DIR or set {MIRROR_ENV}"
    ]
    assert world.rows() == rows

    updated = runner.invoke(cli, [*base, "model", "update", "m", "--by", "bob", *where])
    assert updated.exit_code == 0, updated.stderr
    assert f"to org/m@{c2[:12]}" in updated.stdout and "one at a time" in updated.stdout
    back = runner.invoke(
        cli, [*base, "--json", "model", "rollback", "m", "--to", world.c1, "--by", "carol", *where]
    )
    assert back.exit_code == 0, back.stderr
    moved = json.loads(back.stdout)
    assert (moved["from"]["revision"], moved["to"]["revision"]) == (c2, world.c1)
    assert moved["written"] and moved["changed"] == ["model.safetensors"]

    log = runner.invoke(cli, [*base, "--json", "log", "--model", "m"])
    assert [json.loads(line)["event"] for line in log.stdout.splitlines()] == [
        "Added",
        "OriginSet",
        "UpstreamChanged",
        "SourceSet",
        "SourceSet",
    ]


def test_cli_rollback_to_a_commit_given_empty_is_refused_as_input_and_not_recorded(
    world: World, tracked: Weights
) -> None:
    """`--to ''` (`--to "$COMMIT"`, the variable unset) was told as no commit
    id and kept among the refusals, where `update --revision ''`, as every
    value given empty, is refused as input and kept nowhere (hostile test)."""
    base = ["--db", f"sqlite:///{world.db}", "--config", str(world.config)]
    where = ["--mirror", str(world.mirror.root), "--weights", str(world.store)]
    runner = CliRunner()
    logged = runner.invoke(cli, [*base, "--json", "log"]).stdout
    empty = runner.invoke(cli, [*base, "model", "rollback", "m", "--to", "", *where])
    assert (empty.exit_code, empty.stderr) == (
        1,
        "error: the commit to go back to: give one the model ran "
        "(default: the weights before the current ones)\n",
    )
    assert runner.invoke(cli, [*base, "--json", "log"]).stdout == logged
    assert list(tracked.models.refusals()) == []


def test_cli_updates_says_how_many_models_went_unchecked_not_that_nothing_changed(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a broken refs file every model was left unchecked, and stdout
    still said "no upstream changes" (operator's docs walk)."""
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    base = ["--db", f"sqlite:///{world.db}", "--config", str(world.config)]
    where = ["model", "updates", "--mirror", str(world.mirror.root)]
    runner = CliRunner()
    fine = runner.invoke(cli, [*base, *where])
    assert (fine.exit_code, fine.stdout) == (0, "no upstream changes at revision 0\n")

    (world.mirror.root / "org/base/refs").write_text(f"main {world.base1}\nmain {world.base1}\n")
    broken = runner.invoke(cli, [*base, *where])
    assert broken.exit_code == 0
    assert broken.stdout == (
        "no upstream changes found at revision 0; 2 models not checked (see the notes)\n"
    )
    assert broken.stderr.count("not checked: ") == 2 and "listed twice" in broken.stderr


@pytest.mark.parametrize("where", ["root", "command"])
def test_check_updates_given_an_expected_revision_is_refused_past_it(
    world: World, where: str
) -> None:
    """It recorded what it found whatever the revision given (hostile test):
    given one, it is a compare-and-set like every other write, refused past
    it with nothing written, also when it has nothing new to record."""
    base = ["--db", f"sqlite:///{world.db}", "--config", str(world.config)]
    mirror = ["--mirror", str(world.mirror.root), "--weights", str(world.store)]
    runner = CliRunner()

    def check(expected: int) -> Any:
        option = ["--expected-revision", str(expected)]
        if where == "root":
            return runner.invoke(cli, [*base, *option, "model", "check-updates", *mirror])
        return runner.invoke(cli, [*base, "model", "check-updates", *mirror, *option])

    world.open().models.add(spec("m"), by="alice")  # m has no origin yet: one to record
    rows = world.rows()
    refused = check(1)
    assert (refused.exit_code, refused.stdout) == (1, "")
    assert refused.stderr.splitlines() == [
        f"error: the log is at revision {rows}, not 1: someone changed the catalog since "
        "you read it; read it again and retry"
    ]
    assert world.rows() == rows
    written = check(rows)
    assert written.exit_code == 0, written.stderr
    assert "recorded the origin of m" in written.stdout
    assert world.rows() == rows + 1
    # Nothing new to record: refused all the same.
    assert check(rows).exit_code == 1
    assert world.rows() == rows + 1
    kept = runner.invoke(cli, [*base, "refusals", "--type", "checkupdates", "--json"])
    assert [(r["event"], r["model"]) for r in json.loads(kept.stdout)] == [
        ("CheckUpdates", None),
        ("CheckUpdates", None),
    ]
    # Without it, what it finds is recorded whatever the log's revision, as before.
    world.mirror.publish("org/m", V2)
    assert runner.invoke(cli, [*base, "model", "check-updates", *mirror]).exit_code == 0
    assert events(world.open(), "m")[-1]["event"] == "UpstreamChanged"


def test_check_updates_refuses_a_log_moved_while_the_registry_was_read(world: World) -> None:
    """The revision is checked again by the run's write, not only before the
    registry is read, which can take a while."""
    weights = world.open()
    weights.models.add(spec("m"), by="alice")
    expected = weights.models.revision
    other = world.open().models

    class MovedMeanwhile(MirrorRegistry):
        def refs(self, repository: str) -> dict[str, str]:
            if other.revision == expected:
                other.scale("m", maximum=2, by="bob")
            return super().refs(repository)

    moved = Weights(weights.models, MovedMeanwhile(world.mirror.root), weights.store)
    rows = world.rows()
    with pytest.raises(Refused, match=f"the log is at revision {expected + 1}, not {expected}"):
        moved.check_updates(by="cron", expected_revision=expected)
    assert world.rows() == rows + 1  # bob's change, nothing of the run's


# -- what cannot be read, a store in the wrong place, a store changed since (hostile test) ---


def test_check_updates_whose_findings_are_refused_after_its_origins_tells_what_stands(
    world: World, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its second write (the findings) refused, the log locked by another
    writer, once the first had recorded an origin: the run said "nothing was
    written", exit 1, over a log that held it (hostile test). The origins
    stand and are answered; the findings are left to the next run, told on
    stderr and in the answer's ``not_recorded``, which is null when nothing
    went unrecorded (nothing new, or all of it recorded)."""
    world.mirror.publish("org/base", {"model.safetensors": b"declared, new"})
    # Read as the database is opened: SQLite's busy timeout is set from it
    # (set on the store after, it bounded nothing, and the write waited 10 s).
    monkeypatch.setenv(LOCK_WAIT_ENV, "0.2")
    models = world.open().models
    models.add(spec("m"), by="alice")

    class LockedBetweenItsWrites(Weights):
        def _record_findings(self, *args: Any, **kwargs: Any) -> list[str]:
            other = sqlite3.connect(world.db, isolation_level=None)
            try:
                other.execute("BEGIN IMMEDIATE")  # another writer, meanwhile
                return super()._record_findings(*args, **kwargs)
            finally:
                other.close()

    registry, store = MirrorRegistry(world.mirror.root), WeightsStore(world.store)
    weights = LockedBetweenItsWrites(models, registry, store)
    report = weights.check_updates(by="cron")
    assert ([o["model"] for o in report["origins"]], report["recorded"]) == (["m"], [])
    assert report["revision"] == models.revision
    assert [e["event"] for e in events(weights, "m")] == ["Added", "OriginSet"]
    assert "the upstream changes found were not recorded" in caplog.text
    # Told in the answer too: `recorded: []` alone read as nothing new (review).
    assert report["not_recorded"]["models"] == [u["model"] for u in report["updates"]] == ["base"]
    assert report["not_recorded"]["reason"] in caplog.text
    assert "locked" in report["not_recorded"]["reason"]
    again = Weights(models, registry, store).check_updates(by="cron")
    assert (again["recorded"], again["not_recorded"]) == (["base"], None)
    assert Weights(models, registry, store).check_updates(by="cron")["not_recorded"] is None


def _denied(monkeypatch: pytest.MonkeyPatch, denied: Path) -> None:
    """Opening ``denied`` fails as a file this process may not read does (its
    mode): tests run as root, whom a mode does not stop."""
    real_open = os.open

    def open_unless_denied(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if Path(os.fsdecode(path)) == denied:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_unless_denied)


def test_a_mirror_file_that_cannot_be_read_leaves_its_model_unchecked_not_every_model(
    world: World, tracked: Weights, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One file of one repository this process could not read ended every
    check of every model with `error: unexpected PermissionError`, and an
    update with it (hostile test): its model is listed as unchecked, the
    others are checked, and the update is refused in one line naming it."""
    tracked.models.add(spec("other", source="hf://org/other"), by="alice")
    world.mirror.publish("org/other", V1)
    c2 = world.mirror.publish("org/m", V2)
    denied = world.mirror.folder("org/m", c2) / "model.safetensors"
    _denied(monkeypatch, denied)
    report = tracked.check_updates(by="cron")
    [unchecked] = report["unchecked"]
    assert unchecked["model"] == "m"
    assert unchecked["reason"] == f"{denied}: cannot be read: Permission denied; refused"
    assert [o["model"] for o in report["origins"]] == ["other"]
    rows = world.rows()
    with pytest.raises(RegistryError, match=f"^{re.escape(str(denied))}: cannot be read"):
        tracked.update("m", by="bob")
    assert world.rows() == rows
    assert not (world.store / "org/m" / c2).exists()


def test_a_mirror_file_unreadable_once_listed_is_told_as_the_mirrors_not_the_stores(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was told as a copy the weights store could not take."""
    registry = MirrorRegistry(world.mirror.root)
    files = registry.files("org/m", world.c1)
    denied = world.mirror.folder("org/m", world.c1) / "model.safetensors"
    _denied(monkeypatch, denied)
    with pytest.raises(RegistryError) as refused:
        registry.fetch("org/m", world.c1, files, world.root / "out")
    assert str(refused.value) == f"{denied}: cannot be read: Permission denied; refused"
    assert not (world.root / "out" / "model.safetensors").exists()
    assert [p.name for p in world.root.iterdir() if ".partial." in p.name] == []


def test_refs_that_are_a_folder_or_missing_are_told_in_words(world: World) -> None:
    """A folder was told as `[Errno 21] Is a directory: 6`; a missing file
    named its path twice (hostile test)."""
    refs = world.mirror.root / "org/m/refs"
    refs.unlink()
    registry = MirrorRegistry(world.mirror.root)
    with pytest.raises(RegistryError) as missing:
        registry.resolve("org/m", "main")
    assert str(missing.value) == f"{refs}: cannot be read: No such file or directory; refused"
    refs.mkdir()
    with pytest.raises(RegistryError) as folder:
        registry.resolve("org/m", "main")
    assert str(folder.value) == f"{refs} is not a file (a folder, a pipe?): refused"


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("main {upper}", "'{upper}' is no commit id (7-64 lower-case hex digits)"),
        ("main {short}", "'{short}' is no commit id (7-64 lower-case hex digits)"),
        ("ma!n {commit}", "'ma!n' is no branch name"),
    ],
    ids=["capitals", "too short", "branch"],
)
def test_a_malformed_refs_line_says_what_is_wrong_with_it(
    world: World, line: str, why: str
) -> None:
    """It said `expected '<branch> <commit>'` of a line of that shape, whose
    commit id was in capitals or a digit short (hostile test)."""
    values = {"upper": world.c1.upper(), "short": world.c1[:6], "commit": world.c1}
    (world.mirror.root / "org/m/refs").write_text("\r\n".join(["# a", line.format(**values)]))
    with pytest.raises(RegistryError) as refused:
        MirrorRegistry(world.mirror.root).resolve("org/m", "main")
    assert str(refused.value).endswith(
        f"refs line 2: expected '<branch> <commit>': {why.format(**values)}"
    )


def test_a_weights_store_that_is_a_loop_of_links_is_refused_in_one_line(
    world: World, tracked: Weights
) -> None:
    """It was `error: unexpected RuntimeError: Symlink loop from …` (hostile test)."""
    world.mirror.publish("org/m", V2)
    world.store.symlink_to(world.store)
    rows = world.rows()
    with pytest.raises(RegistryError, match="is a loop of links: refused"):
        tracked.update("m", by="bob")
    assert world.rows() == rows


@pytest.mark.parametrize("store", ["", "org/m", "elsewhere"], ids=["mirror", "a repo", "under"])
def test_a_weights_store_inside_the_mirror_is_refused_before_anything_is_fetched(
    world: World, store: str
) -> None:
    """Given the mirror's folder, the store was the mirror: the model ran from
    the mirror's commit folder, and a file changed there in place changed
    what it loads under the checksums the log recorded (hostile test)."""
    weights = world.open()
    weights.models.add(spec("m"), by="alice")
    c2 = world.mirror.publish("org/m", V2)
    root = world.mirror.root / store
    inside = Weights(
        weights.models,
        MirrorRegistry(world.mirror.root),
        WeightsStore(root, apart_from=world.mirror.root),
    )
    before = sorted(p for p in world.mirror.root.rglob("*"))
    rows = world.rows()
    with pytest.raises(RegistryError, match=r"is inside the mirror .*: give --weights a folder"):
        inside.update("m", by="bob")
    assert world.rows() == rows
    assert sorted(p for p in world.mirror.root.rglob("*")) == before
    assert weights.models.get_model("m")["source"] == "hf://org/m"
    assert c2


def test_already_running_weights_whose_folder_was_emptied_or_changed_are_checked_again(
    world: World, tracked: Weights
) -> None:
    """A model run from its folder was told it `already runs` those weights,
    exit 0, once the store was wiped (a node rebuilt) or a file in it
    changed: no replica could load them, and the command that fetches and
    checks them said all was well (hostile test). What is missing is fetched
    again, what differs is refused; the log is left as it is either way."""
    c2 = world.mirror.publish("org/m", V2)
    tracked.update("m", by="bob")
    rows = world.rows()
    shutil.rmtree(world.store)
    again = tracked.update("m", by="bob")
    assert not again["written"] and again["fetched"] == sorted(V2)
    folder = world.store / "org/m" / c2
    assert verify(folder, origin_of("org/m", c2, V2).files, world.store) == []
    assert tracked.rollback("m", c2, by="bob")["fetched"] == []
    (folder / "model.safetensors").write_bytes(b"changed in the store")
    for move in (partial(tracked.update, "m"), partial(tracked.rollback, "m", c2)):
        with pytest.raises(VerificationFailed, match=r"model\.safetensors: sha256"):
            move(by="bob")
    assert world.rows() == rows


def test_the_cli_says_what_an_already_running_model_had_fetched(
    world: World, tracked: Weights, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    c2 = world.mirror.publish("org/m", V2)
    tracked.update("m", by="bob")
    shutil.rmtree(world.store / "org/m" / c2)
    base = ["--db", f"sqlite:///{world.db}", "--config", str(world.config)]
    where = ["--mirror", str(world.mirror.root), "--weights", str(world.store)]
    told = CliRunner().invoke(cli, [*base, "model", "update", "m", *where])
    assert (told.exit_code, told.stdout) == (
        0,
        f"m already runs org/m@{c2[:12]}: nothing written (3 files fetched into its folder)\n",
    )
    told = CliRunner().invoke(cli, [*base, "model", "update", "m", *where])
    assert told.stdout == f"m already runs org/m@{c2[:12]}: nothing written\n"


def test_update_takes_the_first_digits_of_a_commit_as_updates_shows_them(
    world: World, tracked: Weights
) -> None:
    """`updates` and `update` show 12 digits of a commit: given them,
    `--revision` was refused as a commit the mirror has not (hostile test)."""
    c2 = world.mirror.publish("org/m", V2)
    moved = tracked.update("m", c2[:12], by="bob")
    assert moved["written"] and moved["to"]["revision"] == c2
    # Digits that begin two commits name neither.
    (world.mirror.root / "org/m" / (world.c1[:8] + "0000")).mkdir()
    with pytest.raises(RegistryError, match=f"commit {world.c1[:7]} is ambiguous"):
        tracked.update("m", world.c1[:7], by="bob")
    assert tracked.update("m", world.c1[:9], by="bob")["to"]["revision"] == world.c1
    # The commit a model runs is in the mirror when that one is, not one its id begins.
    tracked.update("m", c2, by="bob")
    shutil.move(world.mirror.folder("org/m", c2), world.mirror.root / "org/m" / f"{c2}00")
    world.mirror.publish("org/m", {"model.safetensors": b"third"})
    [finding] = tracked.updates()["updates"]
    assert (finding["running"], finding["running_in_registry"]) == (c2, False)


def test_a_full_disk_is_refused_in_one_line_and_leaves_no_copy_under_way(
    world: World, tracked: Weights, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills on a file's copy: one line naming the file and the
    folder, nothing written to the log, no partial copy left anywhere a
    later run looks; the run after it, with room again, completes."""
    c2 = world.mirror.publish("org/m", V2)
    write = registry_module._Hashing.write

    def full(self: Any, data: bytes) -> int:
        if data == V2["model.safetensors"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, data)

    monkeypatch.setattr(registry_module._Hashing, "write", full)
    rows = world.rows()
    folder = world.store / "org/m" / c2
    with pytest.raises(RegistryError) as refused:
        tracked.update("m", by="bob")
    assert str(refused.value) == (
        f"model.safetensors: cannot be copied into {folder}: No space left on device"
    )
    assert world.rows() == rows
    assert [p.name for p in folder.parent.iterdir()] == [c2]  # no partial folder
    assert "model.safetensors" not in [p.name for p in folder.iterdir()]
    monkeypatch.setattr(registry_module._Hashing, "write", write)
    assert tracked.update("m", by="bob")["written"]


def _refuse_opening(
    monkeypatch: pytest.MonkeyPatch, code: int, refused: Callable[[Path, int], bool]
) -> None:
    """``os.open`` refusing with ``code`` the paths (and flags) ``refused``
    picks, as a file system out of room, or mounted read-only, does."""
    real_open = os.open

    def refusing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if refused(Path(os.fsdecode(path)), flags):
            raise OSError(code, os.strerror(code), os.fsdecode(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)


def test_a_store_out_of_inodes_leaves_no_folder_of_the_fetch_behind(
    world: World, tracked: Weights, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a store with no inode left for a fetch's lock file (a tmpfs of
    nr_inodes=5), the refusal said nothing was written, named the lock file
    in a folder of a random name, and left that folder in the store (hostile
    test). The repository's folder is named, and nothing is left in it."""
    c2 = world.mirror.publish("org/m", V2)
    real_open = os.open
    _refuse_opening(
        monkeypatch, errno.ENOSPC, lambda path, _flags: path.name == registry_module._LOCK_FILE
    )
    rows = world.rows()
    with pytest.raises(RegistryError) as refused:
        tracked.update("m", by="bob")
    repository = world.store / "org/m"
    assert str(refused.value) == (
        f"the weights store {world.store}: {repository}: No space left on device; "
        "nothing was written"
    )
    assert world.rows() == rows
    assert list(repository.iterdir()) == []
    monkeypatch.setattr(os, "open", real_open)
    assert tracked.update("m", by="bob")["to"]["revision"] == c2


def test_a_read_only_store_is_named_not_a_file_of_a_random_name(
    world: World, tracked: Weights, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a store mounted read-only, the refusal named the file the record
    of a commit's list is first written to, of a random name no one could
    find (hostile test): the folder it was to be made in is named."""
    world.mirror.publish("org/m", V2)
    records = world.store / ".lists" / "org" / "m"
    _refuse_opening(
        monkeypatch,
        errno.EROFS,
        lambda path, flags: bool(flags & os.O_CREAT) and path.parent == records,
    )
    rows = world.rows()
    with pytest.raises(RegistryError) as refused:
        tracked.update("m", by="bob")
    assert str(refused.value) == (
        f"the weights store {world.store}: {records}: Read-only file system; nothing was written"
    )
    assert world.rows() == rows


def test_a_folder_where_a_file_goes_in_the_store_is_named_not_the_partial_copy(
    world: World, tracked: Weights
) -> None:
    """A folder in the store where a file of the commit goes was told as
    `the weights store …: …/.C.partial.x7k2/copy: Is a directory`, a name
    of the fetch's own, gone once it ended (hostile test). The folder in the
    way is named; nothing is written, no partial copy is left."""
    c2 = world.mirror.publish("org/m", V2)
    folder = world.store / "org/m" / c2
    (folder / "model.safetensors").mkdir(parents=True)
    rows = world.rows()
    with pytest.raises(RegistryError) as refused:
        tracked.update("m", by="bob")
    assert str(refused.value) == (
        f"model.safetensors: cannot be copied into {folder}: "
        f"{folder / 'model.safetensors'}: Is a directory"
    )
    assert world.rows() == rows
    assert [p.name for p in folder.parent.iterdir()] == [c2]


def test_a_branch_the_mirror_has_not_is_quoted_cut_short_with_the_branches_it_has(
    world: World,
) -> None:
    """A --revision of 100,000 characters was said back whole, and every
    branch of the refs listed (hostile test)."""
    refs = world.mirror.root / "org/m/refs"
    refs.write_text("".join(f"b{i} {world.c1}\n" for i in range(30)))
    with pytest.raises(RegistryError) as refused:
        MirrorRegistry(world.mirror.root).resolve("org/m", "x" * 100_000)
    told = str(refused.value)
    assert len(told) < 300 and told.endswith("b16, b17, … (30 in all))")


@pytest.mark.parametrize(("count", "suffix"), [(10, ""), (11, ", … (11 in all)")])
def test_up_to_ten_branches_are_all_listed_and_past_ten_their_count_is_told(
    world: World, count: int, suffix: str
) -> None:
    """Ten branches are listed whole; an eleventh is told by the count."""
    refs = world.mirror.root / "org/m/refs"
    refs.write_text("".join(f"b{i:02} {world.c1}\n" for i in range(count)))
    with pytest.raises(RegistryError) as refused:
        MirrorRegistry(world.mirror.root).resolve("org/m", "dev")
    listed = ", ".join(f"b{i:02}" for i in range(10))
    assert str(refused.value) == f"org/m has no branch 'dev' (branches: {listed}{suffix})"


def test_a_file_that_differs_is_told_with_both_checksums_cut_to_twelve_digits(
    world: World,
) -> None:
    folder = world.root / "out"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"found")
    told = verify(folder, {"a.bin": sha(b"wanted")}, world.root)
    assert told == [f"a.bin: sha256 {sha(b'found')[:12]}…, expected {sha(b'wanted')[:12]}…"]


@pytest.mark.parametrize(("count", "suffix"), [(3, ""), (4, ", …")])
def test_an_ambiguous_commit_names_three_commits_it_begins_and_marks_more(
    world: World, count: int, suffix: str
) -> None:
    commits = [f"abcdef1{i}" for i in range(count)]
    for commit in commits:
        (world.mirror.root / "org/m" / commit).mkdir()
    with pytest.raises(RegistryError) as refused:
        MirrorRegistry(world.mirror.root).resolve("org/m", "abcdef1")
    assert str(refused.value) == (
        f"org/m: commit abcdef1 is ambiguous in the mirror ({', '.join(commits[:3])}{suffix}):"
        " give more of it"
    )


def test_a_file_path_is_kept_up_to_255_bytes_a_name_and_1024_in_all() -> None:
    longest_path = "/".join(["d" * 254] * 4) + "/" + "f" * 4  # 1,024 bytes
    for kept in ("n" * 255, longest_path):
        assert relative_file(kept).as_posix() == kept
    for refused in ("n" * 256, longest_path + "f"):
        with pytest.raises(RegistryError, match="is longer than a weights folder holds"):
            relative_file(refused)
