"""The HTTP API and the web console: a thin layer over the application service.

What the command line reads of them is here, not in ``app`` or ``tokens``:
it loads neither FastAPI nor the service as it is built.
"""

import enum


class Role(enum.IntEnum):
    """What a token may do; each role may do what the ones below it may."""

    read = 1  # every query, a rollback's dry run
    write = 2  # the commands that change models
    admin = 3  # rollback


# Watches open at once, at most, unless ``serve --max-watches`` says: each
# holds a thread and reads the log (on SQLite five times a second); a
# thousand held a server's CPU with no change to send, five thousand stopped
# it answering (hostile test).
MAX_WATCHES = 256
