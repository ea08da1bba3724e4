"""A lock held for good by a test's thread: the test that leaves logging's
fails, the tests after it in the process still start servers, and a test
server that cannot start says where it waits."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from fastapi import FastAPI

from tests import serving as serving_module
from tests.serving import serving

# A run of the suite's configuration (its conftest), in a pytest of its own:
# the first test leaves logging's lock held, the second serves.
INTERRUPTED_THEN_SERVED = """
import logging
import threading

from fastapi import FastAPI

from tests.serving import serving


def test_interrupted() -> None:
    logging._lock.acquire()  # as Ctrl-C landing just after logging took it leaves it


def test_served_after_it() -> None:
    app = FastAPI()
    app.state.closing = threading.Event()
    with serving(app):
        pass
"""


def test_a_test_leaving_loggings_lock_held_fails_and_the_next_server_starts(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """An interrupt as logging took its lock (a test's SIGALRM) left it held
    by the test's thread for good: every test server the process started
    after it waited for it, and every console test after it failed with
    "the test server did not start" (a CI run), naming no culprit. The test
    that leaves it fails now, saying so, and the lock is let go."""
    tests = tmp_path / "test_interrupted.py"
    tests.write_text(INTERRUPTED_THEN_SERVED)
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, "-q", "-rA", f"--rootdir={tmp_path}", tests.name],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(request.config.rootpath)},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    # Each test's outcomes, without the reason the summary cuts to its width.
    lines = done.stdout.splitlines()
    summary = [line.split(" - ")[0] for line in lines if "test_interrupted.py::" in line]
    assert summary == [
        "PASSED test_interrupted.py::test_interrupted",
        "PASSED test_interrupted.py::test_served_after_it",
        "ERROR test_interrupted.py::test_interrupted",
    ], done.stdout
    assert "the test left logging's module lock held by its thread" in done.stdout


def test_a_test_server_that_does_not_start_says_where_it_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It said only that it had not started in 10 s: where its thread waited
    (for logging's lock, held for good) was not told, and it was left to
    start whenever that lock came free, and serve on for the rest of the run."""
    monkeypatch.setattr(serving_module, "START_SECONDS", 1)
    app = FastAPI()
    app.state.closing = threading.Event()
    before = set(threading.enumerate())
    logging._lock.acquire()  # type: ignore[attr-defined]  # as an interrupt leaves it
    try:
        with pytest.raises(RuntimeError) as failed, serving(app):
            pass
    finally:
        logging._lock.release()  # type: ignore[attr-defined]
    said = str(failed.value)
    assert said.startswith("the test server did not start in 1 s; its thread waits at:\n"), said
    assert f'File "{logging.__file__}"' in said, said
    # Let go, it starts, and ends.
    (server,) = set(threading.enumerate()) - before
    server.join(timeout=10)
    assert not server.is_alive()
