"""Tables as the CLI prints them: columns two spaces apart, each as wide as
its widest cell; on a terminal, narrowed to fit it, the widest first, with
what no longer fits a cell wrapped onto more lines.

Drawn in one pass over the cells. rich's tables, which this replaces, took
about a millisecond a row: ``log`` of 10,000 events took 9 s and
``model list`` of 10,000 models 11 s, where their JSON took one.
Cells come here made safe for a terminal (:func:`catalog_es.cli.base.visible`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Sequence

import click
from rich.cells import cell_len

# Between two columns.
GAP = "  "
# The narrowest a column is made to fit a terminal: its header's width, or this.
NARROWEST = 6
# A word and the spaces after it: a wrapped line breaks after them.
_WORDS = re.compile(r"\S+\s*|\s+")

Cell = Sequence[str]  # a cell's lines


def render(
    header: Sequence[str] | None,
    rows: Iterable[Sequence[Cell]],
    *,
    width: int | None = None,
    bold: bool = False,
    keys: bool = False,
) -> list[str]:
    """The lines of a table of ``rows`` under ``header`` (``None``: a listing
    without one). ``width``: the terminal's, to fit; ``None`` never wraps (a
    pipe: a name cut short would be read back wrong). ``bold``: the header in
    bold, and the first column too where it holds ``keys``."""
    table: list[list[Cell]] = [[(h,) for h in header]] if header is not None else []
    table.extend(list(row) for row in rows)
    if not table:
        return []
    natural = [
        max((cell_len(line) for row in table for line in row[i]), default=0)
        for i in range(len(table[0]))
    ]
    widths = natural if width is None else _fit(natural, header, width)
    lines: list[str] = []
    for number, row in enumerate(table):
        strong = bold and number == 0 and header is not None
        cells = [
            cell if widths[i] >= natural[i] else _wrap(cell, widths[i])
            for i, cell in enumerate(row)
        ]
        for k in range(max(map(len, cells), default=0) or 1):
            parts = []
            for i, cell in enumerate(cells):
                text = cell[k] if k < len(cell) else ""
                pad = " " * (widths[i] - cell_len(text))
                if strong or (bold and keys and i == 0):
                    text = click.style(text, bold=True)
                parts.append(text + pad)
            lines.append(GAP.join(parts).rstrip())
    return lines


def _fit(natural: list[int], header: Sequence[str] | None, room: int) -> list[int]:
    """Widths that fit ``room`` cells: the widest column narrowed first, a
    cell at a time, none below its floor. What cannot fit is left wide (the
    terminal wraps it)."""
    widths = list(natural)
    floors = [
        min(w, max(cell_len(header[i]) if header is not None else 0, NARROWEST))
        for i, w in enumerate(natural)
    ]
    excess = sum(widths) + len(GAP) * (len(widths) - 1) - room
    while excess > 0:
        slack = [i for i, w in enumerate(widths) if w > floors[i]]
        if not slack:
            break
        widest = max(slack, key=widths.__getitem__)
        widths[widest] -= 1
        excess -= 1
    return widths


def _wrap(cell: Cell, width: int) -> list[str]:
    """Each line of ``cell`` in pieces at most ``width`` cells wide, broken
    after a space where there is one, within a word where there is not."""
    pieces: list[str] = []
    for line in cell:
        current = ""
        for word in _WORDS.findall(line) or [""]:
            if cell_len((current + word).rstrip()) <= width:
                current += word
                continue
            if current.strip():
                pieces.append(current.rstrip())
            current = ""
            for char in word:
                if cell_len(current + char) > width and current:
                    pieces.append(current)
                    current = ""
                current += char
        pieces.append(current.rstrip())
    return pieces


def echo(lines: Iterable[str]) -> None:
    """Write the table out in one write, through ``sys.stdout`` as it is set
    up (what its encoding lacks written escaped; ``click.echo`` would write
    UTF-8 to a terminal that said it is ASCII)."""
    text = "\n".join(lines)
    if text:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
