"""The CLI's tables: aligned by what a terminal shows, fitted to a terminal
without losing a character, and drawn in time for a large catalog."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import tracemalloc
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.cells import cell_len

from catalog_es.cli.tables import NARROWEST, WHOLE_WORD, render
from tests.helpers import config_yaml, spec


def test_columns_line_up_two_spaces_apart_by_the_width_a_terminal_shows() -> None:
    lines = list(
        render(
            ["NAME", "SOURCE"],
            [
                [["m"], ["hf://a"]],
                [["模型-wide"], ["hf://b/c"]],
                [["two"], ["line one", "line two"]],
            ],
        )
    )
    assert lines == [
        "NAME       SOURCE",
        "m          hf://a",
        "模型-wide  hf://b/c",
        "two        line one",
        "           line two",
    ]


def test_a_listing_without_a_header_and_an_empty_table() -> None:
    assert list(render(None, [[["name"], ["m"]], [["owner"], ["(shared)"]]])) == [
        "name   m",
        "owner  (shared)",
    ]
    assert list(render(["NAME"], [])) == ["NAME"]
    assert list(render(None, [])) == []


def test_on_a_terminal_the_widest_column_is_narrowed_first_and_wrapped_at_spaces() -> None:
    header = ["NAME", "REASON"]
    rows = [[["m-1"], ["rolled back after the canary failed twice"]]]
    lines = list(render(header, rows, width=24))
    assert lines == [
        "NAME  REASON",
        "m-1   rolled back after",
        "      the canary failed",
        "      twice",
    ]


def test_a_short_word_is_not_broken_to_fit_nor_are_long_ones_narrowed_first() -> None:
    """A time, an event's name stay whole where a column of long text can
    give the room (the widest-first narrowing broke them all alike)."""
    header = ["REV", "TIME", "EVENT", "REASON"]
    rows = [
        [["7"], ["2026-12-06T03:16:23.947543Z"], ["ConfigDeclared"], ["the canary failed " * 5]]
    ]
    lines = list(render(header, rows, width=60))
    assert lines[1].split()[:3] == ["7", "2026-12-06T03:16:23.947543Z", "ConfigDeclared"]
    assert all(cell_len(line) <= 60 for line in lines)
    assert len(lines) > 2


# Text as cells hold it: what visible() leaves (no control characters), wide
# characters and long words included.
cell_text = st.text(
    st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Zl", "Zp", "Mn", "Me")), max_size=40
)


@settings(max_examples=200, deadline=None)
@given(text=cell_text, width=st.integers(min_value=2, max_value=60))
def test_a_wrapped_cell_keeps_every_character_and_each_piece_fits(text: str, width: int) -> None:
    pieces = list(render(None, [[[text]]], width=width))
    # A column is kept as wide as its longest word, where that is short.
    longest = max((cell_len(word) for word in text.split(" ")), default=0)
    floor = max(NARROWEST, longest if longest <= WHOLE_WORD else 0)
    assert all(cell_len(piece) <= max(width, floor) for piece in pieces)
    # The spaces at a break go with it: no piece after one starts with a space.
    assert not any(piece.startswith(" ") for piece in pieces[1:])
    # Read back in order, the pieces are the text without the spaces it broke at.
    assert "".join("".join(p.split()) for p in pieces) == "".join(text.split())


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(cell_text, min_size=3, max_size=3), max_size=6),
    width=st.integers(min_value=1, max_value=120),
)
def test_a_fitted_table_fits_when_its_columns_can_narrow_that_far(
    rows: list[list[str]], width: int
) -> None:
    header = ["NAME", "EVENT", "REASON"]
    lines = list(render(header, [[[text] for text in row] for row in rows], width=width))
    natural = [
        max(cell_len(t) for t in [h, *(row[i] for row in rows)]) for i, h in enumerate(header)
    ]
    # At most what a column may be kept at: its header, a whole word, six.
    floors = [
        min(w, max(cell_len(h), WHOLE_WORD, NARROWEST))
        for h, w in zip(header, natural, strict=True)
    ]
    if sum(floors) + 4 <= width:
        assert all(cell_len(line) <= width for line in lines)
    visible = "".join(t for t in [*header, *(t for row in rows for t in row)])
    assert sorted("".join("".join(line.split()) for line in lines)) == sorted(
        "".join(visible.split())
    )


def test_model_list_on_a_terminal_fits_it_and_cuts_no_name(tmp_path: Path) -> None:
    """Through a pseudo-terminal 60 columns wide: rich's tables cut names
    short with an ellipsis there; a name is wrapped instead, whole."""
    long_name = "llama-3.1-405b-instruct-fp8-h100-128k-ctx"  # longer than a word kept whole
    config = tmp_path / "catalog.yaml"
    config.write_text(config_yaml(spec(long_name, source="hf://neuralmagic/Meta-Llama-3.1-405B")))
    db = f"sqlite:///{tmp_path}/catalog.db"
    command = [sys.executable, "-m", "catalog_es", "--db", db, "--config", str(config)]
    out = _on_a_terminal([*command, "model", "list"], columns=60)
    lines = out.replace("\x1b[1m", "").replace("\x1b[0m", "").splitlines()
    assert lines and all(cell_len(line) <= 60 for line in lines), lines
    assert long_name in "".join(line.split("  ")[0] for line in lines[1:])


def _on_a_terminal(command: list[str], columns: int) -> str:
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "dumb"}
    done = subprocess.run(
        command, stdin=follower, stdout=follower, stderr=subprocess.PIPE, env=env, timeout=60
    )
    os.close(follower)
    assert done.returncode == 0, done.stderr
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the follower closed and everything was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_a_long_table_keeps_little_more_than_each_row_s_text_until_it_is_written() -> None:
    """Every row is read before the first line (a column is as wide as its
    widest cell): kept as lists of lists of strings, and then as the lines
    made of them, ``log`` of 1,000,000 events held 1.2 GB before writing
    any, ``audit``'s table 1.4 GB more than its JSON."""
    count = 20_000
    rows = (  # each cell a string of its own, as the log's rows are
        [
            [str(revision)],
            [f"2026-01-01T00:00:{revision % 60:02d}.{revision:06d}Z"],
            [f"user{revision % 50}"],
            [f"model-{revision:06d}"],
            ["Scaled"],
            [f'scaling: {{"min": 1, "max": {revision}}}', f'owner: "" -> "team:{revision}"'],
            [""],
        ]
        for revision in range(count)
    )
    tracemalloc.start()
    try:
        lines = iter(render(["REV", "TIME", "BY", "MODEL", "EVENT", "CHANGES", "REASON"], rows))
        first = next(lines)
        _, held = tracemalloc.get_traced_memory()  # the most it held
    finally:
        tracemalloc.stop()
    assert first.split() == ["REV", "TIME", "BY", "MODEL", "EVENT", "CHANGES", "REASON"]
    # A row's text is about 120 characters, a string of about 170 bytes: kept
    # as lists of its cells' lines, and then as lines, a row took 1,330.
    assert held / count < 300, f"{held / count:.0f} bytes a row"
    assert sum(1 for _ in lines) == 2 * count
