"""The scripts' own command lines: what they are given is what they use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("script", "given", "told"),
    [
        # Each with sizes that end it at once if it takes the URL for none.
        (
            "bench.py",
            ["--postgres", ""],
            "--postgres is empty: give a PostgreSQL URL, or leave --postgres out",
        ),
        (
            "bench_audit.py",
            ["--db", "", "--events", "0", "--runs", "0"],
            "--db is empty: give a database URL, or leave --db out",
        ),
        (
            "bench_new_log.py",
            ["--db", "", "-n", "0"],
            "--db is empty: give 'sqlite' or a PostgreSQL URL, or leave --db out",
        ),
        (
            "rolling_deploy.py",
            ["", "--nodes", "0", "--log", "0", "--seconds", "0"],
            "DATABASE_URL is empty: give a database URL, or leave it out",
        ),
    ],
)
def test_a_script_given_its_database_url_empty_refuses_it(
    tmp_path: Path, script: str, given: list[str], told: str
) -> None:
    """A URL given empty (``--db "$URL"``, the variable unset) was taken
    for none: the script measured, or wrote to, a new SQLite file instead
    of the database named (or, without one to default to, failed in a
    traceback). Refused as a usage error, in one line, before anything is
    made."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    ran = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *given],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
        # Where the scripts make their files; BENCH_DIR missing ends bench.py at once.
        env={**os.environ, "TMPDIR": str(scratch), "BENCH_DIR": str(tmp_path / "missing")},
    )
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.splitlines()[-1] == f"{script}: error: {told}"
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize("script", ["bench.py", "bench_audit.py"])
def test_a_script_runs_with_another_apps_time_zone_in_the_environment(script: str) -> None:
    """catalog_es hides $TZINFO_TOPIC from the event library's import, for
    scripts as for the command line: these two imported the library first,
    and another app's time zone, not importable here, ended them in a
    traceback before they read their options (review)."""
    ran = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "TZINFO_TOPIC": "elsewhere.clock:LOCAL"},
    )
    assert (ran.returncode, ran.stderr) == (0, "")
    assert ran.stdout.startswith("usage: ")
