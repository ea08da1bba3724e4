"""Tables as the CLI prints them: columns two spaces apart, each as wide as
its widest cell; on a terminal, the widest narrowed to fit it, with what no
longer fits a cell wrapped onto more lines. Nothing is cut short.

Drawn in one pass over the cells. rich's tables, which this replaces, took
about a millisecond a row: ``log`` of 10,000 events took 9 s and
``model list`` of 10,000 models 11 s, where their JSON took one.
Cells come here made safe for a terminal (:func:`catalog_es.cli.base.visible`).

Every row is read before the first line is written (a column is as wide as
its widest cell), so each is kept as one string, its cells and their lines
joined by controls no cell holds: kept as lists of lists of strings, and
then as the lines made of them, ``log`` of 1,000,000 events took 1.2 GB
(214 MB so), ``audit``'s table 1.4 GB more than its JSON (180 MB so),
and the collector's passes over them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain

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
# What a kept row's cells, and a cell's lines, are joined by: controls, which
# no cell holds.
_CELLS = "\x1f"
_LINES = "\n"


def render(
    header: Sequence[str] | None,
    rows: Iterable[Sequence[Cell]],
    *,
    width: int | None = None,
    bold: bool = False,
    keys: bool = False,
) -> Iterator[str]:
    """The lines of a table of ``rows`` under ``header`` (``None``: a listing
    without one), made as they are written. ``width``: the terminal's, to
    fit; ``None`` never wraps (a pipe: a name cut short would be read back
    wrong). ``bold``: the header in bold, and the first column too where it
    holds ``keys``."""
    heading = [[(text,) for text in header]] if header is not None else []
    kept: list[str] = []
    natural: list[int] = []
    longest: list[int] = []  # each column's longest word, to fit a terminal
    for row in chain(heading, rows):
        cells = list(row)
        if not natural:
            natural = [0] * len(cells)
            longest = [0] * len(cells)
        for i, cell in enumerate(cells):
            for line in cell:
                natural[i] = max(natural[i], cell_len(line))
                if width is not None:
                    longest[i] = max(longest[i], _longest_word(line))
        kept.append(_CELLS.join(_LINES.join(cell) for cell in cells))
    if not kept:
        return
    widths = natural if width is None else _fit(natural, _floors(natural, longest, header), width)
    for number, text in enumerate(kept):
        strong = bold and number == 0 and header is not None
        cells = [
            lines if widths[i] >= natural[i] else _wrap(lines, widths[i])
            for i, lines in enumerate(cell.split(_LINES) for cell in text.split(_CELLS))
        ]
        for k in range(max(map(len, cells), default=0) or 1):
            parts = []
            for i, cell in enumerate(cells):
                line = cell[k] if k < len(cell) else ""
                pad = " " * (widths[i] - cell_len(line))
                if strong or (bold and keys and i == 0):
                    line = click.style(line, bold=True)
                parts.append(line + pad)
            yield GAP.join(parts).rstrip(" ")


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


def _longest_word(line: str) -> int:
    return max((cell_len(word.rstrip(" ")) for word in _WORDS.findall(line)), default=0)


def _floors(natural: list[int], longest: list[int], header: Sequence[str] | None) -> list[int]:
    """How narrow each column may be made (see ``NARROWEST``), given its
    ``longest`` word."""
    floors = []
    for i, width in enumerate(natural):
        whole = longest[i] if longest[i] <= WHOLE_WORD else 0
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
