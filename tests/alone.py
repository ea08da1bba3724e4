"""Tests marked ``alone`` under pytest-xdist: run once, together, in a pytest of
their own.

They fork (a split replay), which the code refuses to do while another thread
runs, rightly, and an xdist worker takes its messages on a thread of its own.
So in a worker, the first of them to run starts one pytest without workers
(``-n 0``) for all the ``alone`` tests selected, under a lock the workers
share; the others read what it told. Each test's outcome comes back through
a file of reports, one line per phase; a test that the child did not report
through to its call (the child crashed, hung, or never got to it) fails with
what the child printed.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest

# How long the pytest of their own may take, at most: they take seconds.
CHILD_SECONDS = 900
# Where the workers of one run share it: made by the controller, given to each.
PLACE = "catalog_es_alone_place"
_place_key = pytest.StashKey[Path]()

# How long an ``alone`` test waits for the threads of the tests before it to end.
THREADS_END_SECONDS = 15

_told: dict[str, dict[str, str]] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--alone-reports", help="(internal) where a pytest of their own tells")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "alone: the test forks, which a process may do only with no other thread running; "
        "under pytest-xdist, whose workers take messages on a thread of their own, these "
        "run together in one pytest of their own",
    )
    reports = config.getoption("alone_reports")
    if reports:
        config.pluginmanager.register(_Reporter(Path(reports)))
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        config.stash[_place_key] = Path(tempfile.mkdtemp(prefix="catalog-es-alone-"))


def pytest_runtest_call(item: pytest.Item) -> None:
    """Where an ``alone`` test runs (not a worker, which only reads what it
    told): once the threads the tests before it started have ended. A
    server's, a proxy's end soon after their test, later on a loaded
    machine: one still running made a split replay run whole, and its test
    fail (once, in a run of many test files in one process)."""
    if item.get_closest_marker("alone") is None or hasattr(item.config, "workerinput"):
        return
    deadline = time.monotonic() + THREADS_END_SECONDS
    while _threads() > 1:
        if time.monotonic() > deadline:
            running = ", ".join(thread.name for thread in threading.enumerate())
            pytest.fail(f"threads of earlier tests still run ({running})", pytrace=False)
        time.sleep(0.05)


def _threads() -> int:
    """This process's threads, as the system counts them (:func:`projections.catalog._alone`)."""
    return sum(1 for _ in Path("/proc/self/task").iterdir())


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """On the controller: where this run's workers share the outcomes."""
    node.workerinput[PLACE] = str(node.config.stash[_place_key])


def pytest_unconfigure(config: pytest.Config) -> None:
    place = config.stash.get(_place_key, None)
    if place is not None:
        shutil.rmtree(place, ignore_errors=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    """In a worker, once deselection is done: the ``alone`` tests told, not run."""
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput is None:
        return
    alone = [
        item
        for item in session.items
        if isinstance(item, pytest.Function) and item.get_closest_marker("alone")
    ]
    ids = [item.nodeid for item in alone]
    place = Path(workerinput[PLACE])
    for item in alone:
        told = partial(_as_told, item.nodeid, ids, session.config.rootpath, place)
        item.runtest = told  # type: ignore[method-assign]


def _as_told(nodeid: str, ids: list[str], root: Path, place: Path) -> None:
    if not _told:
        _told.update(_once_for_the_run(ids, root, place))
    told = _told.get(nodeid) or {"outcome": "failed", "text": ""}
    if told["outcome"] == "skipped":
        pytest.skip(told["text"])
    if told["outcome"] != "passed":
        said = told["text"] or f"it did not run to its end there:\n{_told['']['text']}"
        pytest.fail(f"in a pytest of its own: {said}", pytrace=False)


def _once_for_the_run(ids: list[str], root: Path, place: Path) -> dict[str, dict[str, str]]:
    """The outcomes, from the first worker to ask, which runs them; a later
    one waits for it under the lock, then reads them."""
    with (place / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        outcomes = place / "outcomes.json"
        if outcomes.exists():
            told: dict[str, dict[str, str]] = json.loads(outcomes.read_text())
            return told
        told = _run(ids, root, place / "reports.jsonl")
        outcomes.write_text(json.dumps(told))
        return told


def _run(ids: list[str], root: Path, reports: Path) -> dict[str, dict[str, str]]:
    # Not a worker, and not this run's test: the rest of the environment is the run's.
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("PYTEST_XDIST_") and key != "PYTEST_CURRENT_TEST"
    }
    command = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider"]
    try:
        done = subprocess.run(
            [*command, f"--alone-reports={reports}", *ids],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=CHILD_SECONDS,
        )
        printed = f"{done.stdout}{done.stderr}"
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout  # text, as asked, though typed as bytes too
        shown = out.decode(errors="replace") if isinstance(out, bytes) else out or ""
        printed = f"it did not end within {CHILD_SECONDS} s:\n{shown}"
    told: dict[str, dict[str, str]] = {"": {"outcome": "", "text": printed}}
    for line in reports.read_text().splitlines() if reports.exists() else []:
        report = json.loads(line)
        kept = told.setdefault(report["nodeid"], {"outcome": "", "text": ""})
        if kept["outcome"] in ("failed", "skipped"):
            continue  # the first phase that did not pass says it
        if report["outcome"] != "passed" or report["when"] == "call":
            kept.update(outcome=report["outcome"], text=report["text"])
    return told


class _Reporter:
    """In the pytest of their own: each phase's outcome, for the workers to tell."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        text = report.longreprtext
        if report.skipped and isinstance(report.longrepr, tuple):
            text = report.longrepr[2].removeprefix("Skipped: ")
        told = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}
        with self.path.open("a") as out:
            out.write(json.dumps({**told, "text": text}) + "\n")
