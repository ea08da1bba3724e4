"""The HTTP API and the web console: a thin layer over the application service."""

# Watches open at once, at most, unless ``serve --max-watches`` says: each
# holds a thread and reads the log (on SQLite five times a second); a
# thousand held a server's CPU with no change to send, five thousand stopped
# it answering (hostile test). Here, not in ``app``: the CLI reads it without
# loading FastAPI.
MAX_WATCHES = 256
