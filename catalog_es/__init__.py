"""The model catalog of an LLM-serving gateway, kept as an event-sourced log."""

import os
import sys

# The event library resolves $TZINFO_TOPIC as it is imported, for timestamps
# catalog-es never takes (its events carry their own, in UTC): another app's,
# not importable here, failed a script's import of the service (the command
# line alone dropped it). Hidden from that import only, made here before any
# module of ours makes it, and only then: a command without a log loads none.
if "TZINFO_TOPIC" in os.environ and "eventsourcing.domain" not in sys.modules:
    _tzinfo_topic = os.environ.pop("TZINFO_TOPIC")
    try:
        import eventsourcing.domain  # noqa: F401
    finally:
        os.environ["TZINFO_TOPIC"] = _tzinfo_topic
