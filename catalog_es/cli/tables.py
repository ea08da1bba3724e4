"""Tables as the CLI prints them: columns two spaces apart, each as wide as
its widest cell; on a terminal, the widest narrowed to fit it, with what no
longer fits a cell wrapped onto more lines. Nothing is cut short.

Drawn in one pass over the cells. rich's tables, which this replaces, took
about a millisecond a row: ``log`` of 10,000 events took 9 s and
``model list`` of 10,000 models 11 s, where their JSON took one.
Cells come here made safe for a terminal (:func:`catalog_es.cli.base.visible`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import click
from rich.cells import cell_len

# Between two columns.
GAP = "  "
# The narrowest a column is made to fit a terminal: its header's width, or
# this; or its longest word, where that is no longer than WHOLE_WORD (a time,
# an event's name, a revision: broken, they no longer read as one).
NARROWEST = 6
WHOLE_WORD = 32  # a time with its microseconds is 27
# A word and the spaces after it: a wrapped line breaks after them. Spaces
# only: a no-break space, an ideographic one, is text.
_WORDS = re.compile(r"[^ ]+ *| +")

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
    widths = natural if width is None else _fit(natural, _floors(table, natural, header), width)
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
            lines.append(GAP.join(parts).rstrip(" "))
    return lines


def _fit(natural: list[int], floors: list[int], room: int) -> list[int]:
    """Widths that fit ``room`` cells: every column wider than some cap cut
    down to it, none below its floor, the cap as high as fits. Where even
    the floors do not fit, they are what it gets (the terminal wraps lines)."""
    spare = room - len(GAP) * (len(natural) - 1)

    def capped(cap: int) -> list[int]:
        return [max(floor, min(width, cap)) for width, floor in zip(natural, floors, strict=True)]

    if sum(natural) <= spare:
        return natural
    low, high = 0, max(natural)  # capped(low) fits, or nothing does; capped(high) does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if sum(capped(middle)) <= spare else (low, middle)
    return capped(low)


def _floors(table: list[list[Cell]], natural: list[int], header: Sequence[str] | None) -> list[int]:
    """How narrow each column may be made (see ``NARROWEST``)."""
    floors = []
    for i, width in enumerate(natural):
        longest = max(
            (
                cell_len(word.rstrip(" "))
                for row in table
                for line in row[i]
                for word in _WORDS.findall(line)
            ),
            default=0,
        )
        whole = longest if longest <= WHOLE_WORD else 0
        heading = cell_len(header[i]) if header is not None else 0
        floors.append(min(width, max(heading, whole, NARROWEST)))
    return floors


def _wrap(cell: Cell, width: int) -> list[str]:
    """Each line of ``cell`` in pieces at most ``width`` cells wide, broken
    after a space where there is one, within a word where there is not. The
    spaces at a break go: a piece after one never starts with them."""
    pieces: list[str] = []
    for line in cell:
        current = ""
        for word in _WORDS.findall(line) or [""]:
            if cell_len((current + word).rstrip(" ")) <= width:
                current += word
                continue
            if current.strip(" "):
                pieces.append(current.rstrip(" "))
            current = ""
            text = word.rstrip(" ")
            for char in text:
                if cell_len(current + char) > width and current:
                    pieces.append(current)
                    current = ""
                current += char
            if current:
                current += word[len(text) :]
        pieces.append(current.rstrip(" "))
    return pieces
