"""The scripts' own command lines: what they are given is what they use."""

from __future__ import annotations

import os
import shlex
import shutil
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


def test_the_demo_runs_on_its_own_config_and_shows_commands_as_typed(tmp_path: Path) -> None:
    """The README's first command, on a copy of the repository whose .venv
    runs this code. Each command was shown with its arguments joined by
    spaces, ``--reason trying Qwen for search``: typed again as shown, a
    usage error (unexpected extra arguments). A shell whose environment names
    another config (a node's, or one gone) ran the demo over that config,
    or ended it at its first command."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "demo.sh", repo / "scripts")
    shutil.copy(ROOT / "catalog.yaml", repo)
    command = repo / ".venv" / "bin" / "catalog-es"
    command.parent.mkdir(parents=True)
    command.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m catalog_es "$@"\n')
    command.chmod(0o755)
    ran = subprocess.run(
        ["bash", str(repo / "scripts" / "demo.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={
            **os.environ,
            "TMPDIR": str(tmp_path),
            "PYTHONPATH": str(ROOT),
            "CATALOG_ES_CONFIG": str(tmp_path / "gone.yaml"),
        },
    )
    assert ran.returncode == 0, ran.stderr
    shown = [shlex.split(line[2:]) for line in ran.stderr.splitlines() if line.startswith("$ ")]
    add = ["catalog-es", "model", "add", "qwen.yaml", "--reason", "trying Qwen for search"]
    assert add in shown
    assert "rolled back to revision 2: 2 events, now at revision 6" in ran.stdout


def test_the_processes_a_test_starts_run_this_checkout_s_code() -> None:
    # The editable install may name another worktree of the repository: a
    # test of a fix there ran the code without it in its subprocesses.
    checkout = Path(__file__).resolve().parents[1]
    found = subprocess.run(
        [sys.executable, "-c", "import catalog_es; print(catalog_es.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(found).resolve().is_relative_to(checkout)
