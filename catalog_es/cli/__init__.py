"""``catalog-es``: a thin command line over :class:`catalog_es.application.Models`.

Each module registers its commands on the root group (:mod:`.base`, which
says what every command shares); :func:`main` runs it.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from pathlib import Path

from catalog_es.cli import audit as _audit  # noqa: F401  (registers the commands)
from catalog_es.cli import models as _models  # noqa: F401  (registers the commands)
from catalog_es.cli import revisions as _revisions  # noqa: F401
from catalog_es.cli import serve as _serve  # noqa: F401
from catalog_es.cli import weights as _weights  # noqa: F401
from catalog_es.cli.base import cli, warnings_to

__all__ = ["cli", "main"]


def main() -> None:
    """The command line, once :func:`catalog_es.__main__.main` has imported it."""
    # Started with standard output or error closed (`>&-`), Python has none:
    # what would be written there goes nowhere, rather than a write committed
    # and then refused for want of somewhere to say so.
    if sys.stdout is None:
        sys.stdout = Path(os.devnull).open("w")  # noqa: SIM115 (for the process's life)
    if sys.stderr is None:
        sys.stderr = Path(os.devnull).open("w")  # noqa: SIM115 (for the process's life)
    # What the terminal's encoding cannot write is written escaped: a write
    # committed and then told in a character it lacks must not exit 1, which
    # says nothing was written (a script would make the change again).
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    logging.basicConfig(level=logging.WARNING, handlers=[warnings_to(sys.stderr)])
    cli.owns_the_stops = True
    cli(prog_name="catalog-es")
