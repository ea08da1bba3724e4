"""``python -m catalog_es`` and the ``catalog-es`` console script."""

import signal
import sys

from catalog_es import early_stop


def main() -> None:
    """Run the command line. Its imports (the service's, once a command
    opens the log) take most of a second on a slow host: a Ctrl-C in them
    is told as one in a command is (click's ``Aborted!``, exit 1; nothing
    was written), not as a traceback. Once the command is done, told or
    refused, a Ctrl-C changes nothing: in the interpreter's shutdown, which
    puts the default handler back, it killed the process (status 130 after
    a write was told: a script would make it again; hostile test). Nor
    does a Ctrl-C the command took as ``Aborted!``: see
    :func:`_forget_interrupted_exec`."""
    early_stop.note_stops(sys.argv[1:])
    try:
        from catalog_es.cli import main as run_command_line

        run_command_line()
    except KeyboardInterrupt:
        if sys.stderr is not None:  # started with it closed (`2>&-`): not on stdout
            print("\nAborted!", file=sys.stderr)
        sys.exit(1)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _forget_interrupted_exec()


def _forget_interrupted_exec() -> None:
    """Clear CPython's note that a KeyboardInterrupt ended an ``exec`` of
    source text, which dataclasses and SQLAlchemy run as the service loads.
    Run as ``python -m``, the interpreter checks that note as it exits and,
    even though the interrupt was caught and told (``Aborted!``, 1), kills
    itself with SIGINT: status 130, which says a write stands (hostile test,
    one Ctrl-C in six as a command loaded). Each ``exec`` of text starts by
    clearing it."""
    exec("")  # text of our own, evaluated to clear the note


if __name__ == "__main__":
    main()
