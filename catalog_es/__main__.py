"""``python -m catalog_es`` and the ``catalog-es`` console script."""

import sys


def main() -> None:
    """Run the command line. Its imports take most of a second on a slow
    host: a Ctrl-C in them is told as one in a command is (click's
    ``Aborted!``, exit 1; nothing was written), not as a traceback."""
    try:
        from catalog_es.cli import main as run_command_line

        run_command_line()
    except KeyboardInterrupt:
        if sys.stderr is not None:  # started with it closed (`2>&-`): not on stdout
            print("\nAborted!", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
