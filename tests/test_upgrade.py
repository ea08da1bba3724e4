"""Upgrades (issue 7): logs written by earlier versions keep loading.

``tests/fixtures/log-<version>.jsonl`` is a log as that version wrote it,
every kind of stored event in it, committed once and never regenerated
(``scripts/write_upgrade_fixture.py`` writes the next one). Each must load,
on both backends, to the catalog it gave when written: a later change to an
event's stored form must come with an upcaster, or these fail.

Then the upcasting machinery itself, with a v2 of ``Scaled`` defined here
under the topic the real one is stored with, as a release changing it would
ship.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar
from uuid import UUID

import msgspec
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from eventsourcing.persistence import StoredEvent

from catalog_es import mapper
from catalog_es.application import Models
from catalog_es.catalog import UNREADABLE_DECLARATION, Catalog, Skipped
from catalog_es.cli import cli
from catalog_es.configuration import CONFIGURATION_ID, Configuration
from catalog_es.errors import Refused
from catalog_es.inputs import DeclaredConfig, load_config
from catalog_es.mapper import EVENT_CLASSES, encode_event, topic_of
from catalog_es.model import DomainEvent, Model, Upcaster, model_id, utc_now
from catalog_es.persistence import SQLRecorder
from catalog_es.spec import Scaling
from catalog_es.storage.engines import create_engine
from catalog_es.storage.schema import metadata, streams_table
from projections import audit, pointintime, snapshots
from projections.audit import AuditView, _declaration_at
from tests.helpers import model_spec, round_trips, schema_of

FIXTURES = Path(__file__).parent / "fixtures"
LOGS = sorted(path.name.removesuffix(".jsonl") for path in FIXTURES.glob("log-*.jsonl"))


def load_fixture(url: str, log: str) -> int:
    """The fixture's rows into a fresh database, as they were stored: their
    revisions come back the same."""
    rows = [json.loads(line) for line in (FIXTURES / f"{log}.jsonl").read_text().splitlines()]
    stored = [
        StoredEvent(
            originator_id=UUID(row["originator_id"]),
            originator_version=row["originator_version"],
            topic=row["topic"],
            state=msgspec.json.encode(row["state"]),
        )
        for row in rows
    ]
    assert insert_stored(url, stored) == [row["revision"] for row in rows]
    return len(rows)


def insert_stored(url: str, stored: list[StoredEvent]) -> list[int]:
    """``stored`` into the log at ``url`` as they are: their revisions."""
    recorder = SQLRecorder(create_engine(url))
    with recorder.write() as conn:
        revisions = recorder.insert_events(stored, conn=conn)
    recorder.engine.dispose()
    return list(revisions or [])


def contains(actual: Any, expected: Any, where: str = "") -> None:
    """``actual`` is ``expected``, or more: the output formats only ever gain
    keys, and a field added with an upcaster shows up in ``fields``."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), where
        for key, value in expected.items():
            assert key in actual, f"{where}.{key} is gone"
            # Decoded events report the class_version this code reads them as.
            if key != "class_version":
                contains(actual[key], value, f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            contains(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# The log's table as 0.1.0 made it on SQLite: an index on (stream, version),
# no link from an event to its stream's event before it, no catalog_streams.
UNLINKED_SQLITE_TABLE = """
CREATE TABLE catalog_events_unlinked (
    revision INTEGER NOT NULL,
    originator_id CHAR(32) NOT NULL,
    originator_version INTEGER NOT NULL,
    topic TEXT NOT NULL,
    state BLOB NOT NULL,
    hash VARCHAR(64) NOT NULL,
    PRIMARY KEY (revision),
    CONSTRAINT catalog_events_stream UNIQUE (originator_id, originator_version)
)
"""


def unlink(url: str, *then: str) -> None:
    """Turn a log into the layout 0.1.0 wrote, and run ``then`` on it (what an
    operator made of it)."""
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE catalog_streams")
        if engine.dialect.name == "sqlite":
            conn.exec_driver_sql(UNLINKED_SQLITE_TABLE)
            conn.exec_driver_sql(
                "INSERT INTO catalog_events_unlinked SELECT revision, originator_id,"
                " originator_version, topic, state, hash FROM catalog_events"
            )
            conn.exec_driver_sql("DROP TABLE catalog_events")
            conn.exec_driver_sql("ALTER TABLE catalog_events_unlinked RENAME TO catalog_events")
        else:
            conn.exec_driver_sql(
                "ALTER TABLE catalog_events DROP COLUMN stream_previous, ADD CONSTRAINT"
                " catalog_events_stream UNIQUE (originator_id, originator_version)"
            )
        for sql in then:
            conn.exec_driver_sql(sql)
    engine.dispose()


def links(url: str) -> tuple[list[Any], list[Any], list[str | None]]:
    """Each event's link to its stream's event before it, each stream's last
    version and revision, and the indexes on the log's table."""
    engine = create_engine(url)
    with engine.connect() as conn:
        previous = conn.exec_driver_sql(
            "SELECT revision, stream_previous FROM catalog_events ORDER BY revision"
        ).all()
        streams = conn.exec_driver_sql(
            "SELECT originator_id, version, revision FROM catalog_streams ORDER BY revision"
        ).all()
        indexes = [i["name"] for i in sa.inspect(conn).get_indexes("catalog_events")]
        indexes += [c["name"] for c in sa.inspect(conn).get_unique_constraints("catalog_events")]
    engine.dispose()
    return [tuple(r) for r in previous], [tuple(r) for r in streams], indexes


@pytest.mark.parametrize("layout", ["today's", "0.1.0's"])
@pytest.mark.parametrize("log", LOGS)
def test_a_log_written_by_an_earlier_version_still_loads(
    db_url: str, log: str, layout: str
) -> None:
    """In today's tables, and in the tables 0.1.0 made, which the first start
    brings to today's: every event linked to its stream's event before it
    as an append links it, each stream's last version recorded, no index on
    (stream, version) left."""
    events = load_fixture(db_url, log)
    linked = links(db_url)
    if layout == "0.1.0's":
        unlink(db_url)
    expected = json.loads((FIXTURES / f"{log}.expected.json").read_text())
    config = load_config(str(FIXTURES / f"{log}.yaml"))
    models = Models(config, env={"CATALOG_ES_DB": db_url})
    assert links(db_url) == linked
    assert linked[2] == []
    assert models.verify()["ok"] is True
    assert models.revision == expected["revision"] == events
    assert [msgspec.to_builtins(s) for s in models.skipped()] == expected["skipped"]
    contains(models.list_models(), expected["models"], "models")
    contains(list(models.log_events()), expected["log"], "log")
    for model in models.list_models():
        own = [e for e in expected["log"] if e.get("model") == model["name"]]
        contains(list(models.log_events(model=model["name"])), own, model["name"])
    # Every stream goes on from where the old version left it.
    for model in models.list_models():
        if not model["declared"]:
            models.set_owner(model["name"], "team:upgraded", by="upgrade")
    reopened = Models(config, env={"CATALOG_ES_DB": db_url})
    assert reopened.skipped() == models.skipped()
    assert {m["owner"] for m in reopened.list_models() if not m["declared"]} == {"team:upgraded"}
    replay = CliRunner().invoke(
        cli, ["--db", db_url, "--config", str(FIXTURES / f"{log}.yaml"), "replay"]
    )
    assert replay.exit_code == 0, replay.stderr
    assert replay.stdout.startswith(f"replayed to revision {reopened.revision}: ")
    assert replay.stdout.rstrip().endswith(f" {len(expected['skipped'])} events skipped")
    models.close()
    reopened.close()


def test_a_sqlite_log_brought_over_keeps_the_views_triggers_and_indexes_made_on_it(
    tmp_path: Path,
) -> None:
    """SQLite remakes the table: what an operator made on it is made again,
    and a view reading it no longer stops every start."""
    url = f"sqlite:///{tmp_path}/ops.db"
    load_fixture(url, LOGS[-1])
    made = [
        "CREATE VIEW recent_events AS SELECT revision, topic FROM catalog_events",
        "CREATE INDEX ops_topic ON catalog_events (topic)",
        "CREATE TRIGGER append_only BEFORE UPDATE ON catalog_events"
        " BEGIN SELECT RAISE(ABORT, 'append-only'); END",
    ]
    unlink(url, *made)
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    models.close()
    engine = create_engine(url)
    with engine.connect() as conn:
        kept = conn.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE name IN ('recent_events', 'ops_topic',"
            " 'append_only')"
        ).scalars()
        assert sorted(kept) == sorted(made)
        assert conn.exec_driver_sql("SELECT count(*) FROM recent_events").scalar() == 20
        with pytest.raises(sa.exc.IntegrityError, match="append-only"):
            conn.exec_driver_sql("UPDATE catalog_events SET topic = 'x'")
    engine.dispose()
    assert links(url)[2] == ["ops_topic"]


def test_a_postgresql_log_brought_over_keeps_an_append_only_trigger_working(
    pg_url: str,
) -> None:
    """The one update the layout needs is let past an operator's trigger
    refusing updates, which refuses them again after."""
    load_fixture(pg_url, LOGS[-1])
    unlink(
        pg_url,
        "CREATE FUNCTION append_only() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN RAISE EXCEPTION 'catalog_events is append-only'; END $$;"
        " CREATE TRIGGER append_only BEFORE UPDATE ON catalog_events"
        " FOR EACH ROW EXECUTE FUNCTION append_only()",
    )
    engine = create_engine(pg_url)
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    models.close()
    assert links(pg_url)[2] == []
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), engine.begin() as conn:
        conn.exec_driver_sql("UPDATE catalog_events SET topic = 'x'")
    engine.dispose()


@pytest.mark.parametrize("layout", ["today's", "0.1.0's"])
def test_a_sqlite_log_whose_columns_are_named_in_another_case_is_the_log(
    tmp_path: Path, layout: str
) -> None:
    """SQLite's column names are the same in any case, as its queries read
    them: a log whose columns were renamed REVISION, Topic... was refused as
    a table without the log's columns, with the advice to drop it."""
    url = f"sqlite:///{tmp_path}/cased.db"
    load_fixture(url, LOGS[-1])
    linked = links(url)
    columns = ["revision", "originator_id", "originator_version", "topic", "state", "hash"]
    if layout == "today's":
        columns.append("stream_previous")
    else:
        unlink(url)
    # Renamed to upper case and back in another, each in turn.
    renames = [
        f"ALTER TABLE catalog_events RENAME COLUMN {c} TO {c.upper() if i % 2 else c.title()}"
        for i, c in enumerate(columns)
    ]
    engine = create_engine(url)
    with engine.begin() as conn:
        for rename in renames:
            conn.exec_driver_sql(rename)
    engine.dispose()
    result = CliRunner().invoke(cli, ["--db", url, "verify"])
    assert result.exit_code == 0, result.stderr
    assert links(url) == linked


@pytest.mark.parametrize("layout", ["today's", "0.1.0's"])
def test_a_log_with_a_column_dropped_by_hand_is_refused_as_damaged_and_left_as_it_was(
    db_url: str, layout: str
) -> None:
    """A log holding real events, a column dropped from it, was refused as
    a table of another's in the way, with the advice to drop or rename it:
    the catalog's history destroyed on the error's word (review). It is
    refused as a damaged log, with advice that keeps it."""
    load_fixture(db_url, LOGS[-1])
    drop = "ALTER TABLE catalog_events DROP COLUMN hash"
    engine = create_engine(db_url)
    if layout == "0.1.0's":
        unlink(db_url, drop)
    else:
        with engine.begin() as conn:
            conn.exec_driver_sql(drop)

    def stored() -> tuple[list[str], list[Any]]:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql("SELECT * FROM catalog_events ORDER BY revision").all()
            return sorted(sa.inspect(conn).get_table_names()), [tuple(row) for row in rows]

    before = stored()
    postgresql = db_url.startswith("postgresql")
    where = f" in schema {schema_of(db_url)}" if postgresql else ""
    other = "database or schema" if postgresql else "file"
    for command in (["model", "list"], ["verify"], ["model", "remove", "m"]):
        result = CliRunner().invoke(cli, ["--db", db_url, *command])
        assert result.exit_code == 1
        assert result.stderr.splitlines() == [
            f"error: the log's table catalog_events{where} lacks columns every release has"
            " made it with (hash): it was altered by hand; nothing was read or made; do not"
            " drop it, it may hold the catalog's history: restore the log from a backup, or"
            f" point --db at another {other}"
        ]
        assert stored() == before
    engine.dispose()


def test_a_log_that_cannot_be_brought_over_is_one_line_and_left_as_it_was(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path}/stuck.db"
    load_fixture(url, LOGS[-1])
    unlink(url, "CREATE TABLE catalog_events_relinked (left_by TEXT)")
    result = CliRunner().invoke(cli, ["--db", url, "model", "list"])
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1].startswith(
        "error: the log's tables could not be brought to this version's layout, nothing was"
        " changed: table catalog_events_relinked already exists"
    )
    engine = create_engine(url)
    assert "stream_previous" not in [
        c["name"] for c in sa.inspect(engine).get_columns("catalog_events")
    ]
    engine.dispose()


def test_a_sqlite_log_with_a_column_an_operator_added_is_refused_and_left_as_it_was(
    tmp_path: Path,
) -> None:
    """SQLite remakes the table, and could not make a column of the
    operator's again as it was: one line saying what to do, and nothing
    made (hostile test: the upgrade was passed over, an empty catalog_streams
    made, every write then refused as a hand edit, for good)."""
    url = f"sqlite:///{tmp_path}/noted.db"
    load_fixture(url, LOGS[-1])
    unlink(url, "ALTER TABLE catalog_events ADD COLUMN note TEXT")
    engine = create_engine(url)
    with engine.connect() as conn:
        before = conn.exec_driver_sql("SELECT * FROM catalog_events ORDER BY revision").all()
    for command in (["model", "list"], ["verify"]):
        result = CliRunner().invoke(cli, ["--db", url, *command])
        assert result.exit_code == 1
        assert result.stderr.splitlines() == [
            "error: the log's table catalog_events has columns 0.1.0 did not make (note): this"
            " version cannot bring a SQLite log with them to its layout, nothing was changed;"
            " copy what they hold elsewhere if it is needed, drop them (ALTER TABLE"
            " catalog_events DROP COLUMN note), and run again"
        ]
    with engine.begin() as conn:
        assert not sa.inspect(conn).has_table("catalog_streams")
        assert conn.exec_driver_sql("SELECT * FROM catalog_events ORDER BY revision").all() == (
            before
        )
        conn.exec_driver_sql("ALTER TABLE catalog_events DROP COLUMN note")
    engine.dispose()
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    assert models.verify()["ok"] is True
    models.close()


def test_a_postgresql_log_with_a_column_an_operator_added_is_brought_over_with_it(
    pg_url: str,
) -> None:
    load_fixture(pg_url, LOGS[-1])
    linked = links(pg_url)
    unlink(
        pg_url,
        "ALTER TABLE catalog_events ADD COLUMN note TEXT",
        "UPDATE catalog_events SET note = 'seen' WHERE revision = 2",
    )
    engine = create_engine(pg_url)
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": pg_url})
    assert links(pg_url) == linked
    assert models.verify()["ok"] is True
    with engine.connect() as conn:
        notes = conn.exec_driver_sql(
            "SELECT revision, note FROM catalog_events WHERE note IS NOT NULL"
        )
        assert [tuple(row) for row in notes] == [(2, "seen")]
    engine.dispose()
    models.close()


def test_a_0_1_0_log_beside_an_empty_catalog_streams_is_still_brought_over(db_url: str) -> None:
    """What a release that passed the upgrade over left behind: every table
    of today's, the log's still 0.1.0's. The next start brings it over
    (it was passed over for good, every write refused as a hand edit)."""
    load_fixture(db_url, LOGS[-1])
    linked = links(db_url)
    unlink(db_url)
    engine = create_engine(db_url)
    with engine.begin() as conn:
        streams_table.create(conn)
    engine.dispose()
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    assert links(db_url) == linked
    assert models.verify()["ok"] is True
    models.close()


def test_a_catalog_streams_dropped_from_todays_layout_is_made_again_from_the_events(
    db_url: str,
) -> None:
    """Left empty, every model's next version would be 1 again."""
    load_fixture(db_url, LOGS[-1])
    linked = links(db_url)
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE catalog_streams")
    engine.dispose()
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db_url})
    assert links(db_url) == linked
    assert models.verify()["ok"] is True
    models.close()


def statements_of_a_start(url: str) -> list[str]:
    """The statements a recorder's start runs on the log at ``url``, past
    those connecting runs."""
    engine = create_engine(url)
    with engine.connect():
        pass
    statements: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(" ".join(statement.split()))

    SQLRecorder(engine).close()
    engine.dispose()
    return statements


def test_a_start_reads_the_tables_once_and_nothing_of_those_it_has_just_made(
    db_url: str,
) -> None:
    """Every process pays its start, and every test its new database: on an
    existing log, which tables are there and the log's columns are read in
    one statement on PostgreSQL (a round trip a table, and SQLAlchemy's
    reflection of the columns, cost a start 15 ms; the columns apart, a
    round trip more), in two on SQLite, where a statement costs none; on a
    new database, nothing is read back of the tables just made, which are
    today's (that cost each 20 ms more)."""
    made = statements_of_a_start(db_url)
    creating = next(i for i, s in enumerate(made) if s.startswith("CREATE TABLE"))
    assert [s for s in made[creating:] if not s.startswith("CREATE ")] == []
    on_postgresql = db_url.startswith("postgresql")
    assert len(statements_of_a_start(db_url)) == (1 if on_postgresql else 2)
    if on_postgresql:
        # A round trip: in a transaction, BEGIN and ROLLBACK were two more.
        engine = create_engine(db_url)
        with engine.connect():
            pass
        with round_trips(engine) as trips:
            SQLRecorder(engine).close()
        engine.dispose()
        assert len(trips) == 1, trips


# What a schema holds, with the schema's name taken out: its tables'
# columns, the constraints and indexes on them, and its sequences.
_LAYOUT = (
    "SELECT table_name, column_name, ordinal_position, data_type, character_maximum_length,"
    " is_nullable, column_default FROM information_schema.columns"
    " WHERE table_schema = current_schema()",
    "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint"
    " WHERE connamespace = to_regnamespace(current_schema())",
    "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema()",
    "SELECT relname FROM pg_class WHERE relkind = 'S'"
    " AND relnamespace = to_regnamespace(current_schema())",
)


def layout(url: str) -> list[list[str]]:
    """What the schema of ``url`` holds (:data:`_LAYOUT`), in an order of its own."""
    schema = schema_of(url)
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        found = [
            sorted(str(row).replace(f"{schema}.", "") for row in conn.exec_driver_sql(query))
            for query in _LAYOUT
        ]
    engine.dispose()
    return found


def test_a_new_postgresql_log_is_made_in_one_round_trip_as_create_all_makes_it(
    pg_schema_url: Callable[..., str],
) -> None:
    """Every PostgreSQL test and every new schema makes a log: its tables
    and index went a statement each (seven round trips), and an audit
    table with its four indexes five. Each is sent in one, and the schema
    holds what SQLAlchemy's own create_all makes, to the name."""
    made = pg_schema_url()
    assert len([s for s in statements_of_a_start(made) if s.startswith("CREATE ")]) == 1
    engine = create_engine(made)
    store = SQLRecorder(engine)
    creates: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().startswith("CREATE "):
            creates.append(statement)

    AuditView(store, "config").resume_from("app")
    assert len(creates) == 2  # audit_tracking, then the changes table and its indexes
    store.close()
    engine.dispose()
    expected = pg_schema_url()
    engine = sa.create_engine(expected)
    metadata.create_all(engine)
    audit.metadata.create_all(engine)
    audit.changes_table_for("app", "config").create(engine)
    engine.dispose()
    assert layout(made) == layout(expected)


def test_the_newest_fixture_holds_every_kind_of_stored_event() -> None:
    """A new kind of event needs a new fixture (``scripts/write_upgrade_fixture.py``),
    so the release after it is held to reading it."""
    newest = LOGS[-1]
    rows = (FIXTURES / f"{newest}.jsonl").read_text().splitlines()
    topics = {json.loads(line)["topic"] for line in rows}
    assert topics == set(EVENT_CLASSES), f"not in {newest}: {set(EVENT_CLASSES) - topics}"
    rollbacks = [json.loads(line)["state"]["rollback_to"] for line in rows]
    assert any(r is not None for r in rollbacks), "no compensating event in the fixture"


# A definition's fields that a stored record may lack, and what each then is:
# the defaults every release has meant (spec.py has had these fields and
# defaults since the first), which input's own defaults no longer exercise.
DEFAULTED_FIELDS = [
    pytest.param(("profiles", 0, "gpus"), 0, id="gpus"),
    pytest.param(("profiles", 0, "gpu_memory_gb"), 0, id="gpu_memory_gb"),
    pytest.param(("profiles", 0, "min_memory_gb"), 0, id="min_memory_gb"),
    pytest.param(("profiles", 0, "cpu_cores"), 0, id="cpu_cores"),
    pytest.param(("scaling", "min"), 1, id="scaling.min"),
    pytest.param(("scaling", "max"), 1, id="scaling.max"),
    pytest.param(("scaling",), {"min": 1, "max": 1}, id="scaling"),
]


@pytest.mark.parametrize(("path", "default"), DEFAULTED_FIELDS)
def test_a_stored_definition_lacking_a_field_loads_with_its_default(
    tmp_path: Path, path: tuple[str | int, ...], default: Any
) -> None:
    """An ``Added`` record without the field, every other field set apart
    from its default: the model loads, that field at its default."""
    definition = model_spec(
        "m",
        profiles=[
            {"name": "g", "gpus": 2, "gpu_memory_gb": 40, "min_memory_gb": 16, "cpu_cores": 4}
        ],
        scaling={"min": 0, "max": 3},
    )
    added = Model.Added(
        originator_id=model_id("m"),
        originator_version=1,
        timestamp=utc_now(),
        by="older-release",
        model="m",
        spec=definition,
    )
    state = msgspec.json.decode(encode_event(added))
    *within, field = path
    holder = state["spec"]
    for part in within:
        holder = holder[part]
    del holder[field]
    url = f"sqlite:///{tmp_path}/older.db"
    stored = StoredEvent(model_id("m"), 1, topic_of(Model.Added), msgspec.json.encode(state))
    insert_stored(url, [stored])
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    assert models.skipped() == []
    loaded: Any = models.get_model("m")
    for part in path:
        loaded = loaded[part]
    assert loaded == default
    models.close()


# -- the upcasting machinery --------------------------------------------------------


class V2:
    class Scaled(Model.Scaled, frozen=True, kw_only=True):
        """``Scaled`` as a later release might store it: with what caused it."""

        class_version: int = 2
        cause: str
        upcasters: ClassVar[dict[int, Upcaster]] = {
            1: lambda data: data | {"cause": "recorded before causes were"}
        }


class V3:
    class Scaled(Model.Scaled, frozen=True, kw_only=True):
        """Two releases later: causes became a list. A v1 record goes through both upcasters."""

        class_version: int = 3
        causes: tuple[str, ...]
        upcasters: ClassVar[dict[int, Upcaster]] = {
            1: V2.Scaled.upcasters[1],
            2: lambda data: (
                {k: v for k, v in data.items() if k != "cause"} | {"causes": [data["cause"]]}
            ),
        }


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Callable[[type[DomainEvent]], None]:
    """Make ``cls`` the class stored ``Scaled`` records decode to, as a release
    that changed ``Scaled`` would: same topic, new class."""

    def put(cls: type[DomainEvent]) -> None:
        topic = topic_of(Model.Scaled)
        monkeypatch.setitem(mapper.EVENT_CLASSES, topic, cls)
        monkeypatch.setitem(mapper._decoders, topic, msgspec.json.Decoder(cls))
        monkeypatch.setitem(mapper._VERSIONS, cls, cls.current_version())

    return put


@pytest.fixture
def v1_log(tmp_path: Path) -> Iterator[tuple[str, Models]]:
    """A log with v1 ``Scaled`` records, written by this code."""
    url = f"sqlite:///{tmp_path}/upcast.db"
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    models.add(model_spec("m"), by="x")
    models.scale("m", 0, 2, by="x")
    models.scale("m", 1, 3, by="x")
    yield url, models
    models.close()


def plant(models: Models, event: DomainEvent) -> int:
    """A record as a later release would write it."""
    with models.store.write() as conn:
        version = models.store.stream_version(conn, event.originator_id) + 1
        stored = StoredEvent(
            event.originator_id, version, topic_of(Model.Scaled), encode_event(event)
        )
        (revision,) = models.store.insert_events([stored], conn=conn) or [0]
    return revision


def scaled(cls: type[Model.Scaled], scaling: Scaling, **fields: Any) -> Model.Scaled:
    return cls(
        originator_id=model_id("m"),
        originator_version=0,
        timestamp=utc_now(),
        by="later",
        model="m",
        scaling=scaling,
        **fields,
    )


def test_v1_records_load_through_an_upcaster(
    v1_log: tuple[str, Models], install: Callable[[type[DomainEvent]], None]
) -> None:
    url, writer = v1_log
    install(V2.Scaled)
    plant(writer, scaled(V2.Scaled, Scaling(0, 5), cause="traffic"))
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    assert models.skipped() == []
    assert models.get_model("m")["scaling"] == {"min": 0, "max": 5}
    scalings = [e for e in models.log_events() if e["event"] == "Scaled"]
    assert [(e["class_version"], e["fields"]["cause"]) for e in scalings] == [
        (2, "recorded before causes were"),
        (2, "recorded before causes were"),
        (2, "traffic"),
    ]
    assert [e["fields"]["scaling"]["max"] for e in scalings] == [2, 3, 5]


def test_upcasters_chain_from_any_older_version(
    v1_log: tuple[str, Models], install: Callable[[type[DomainEvent]], None]
) -> None:
    url, writer = v1_log
    install(V2.Scaled)
    plant(writer, scaled(V2.Scaled, Scaling(0, 5), cause="traffic"))
    install(V3.Scaled)
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    assert models.skipped() == []
    causes = [e["fields"]["causes"] for e in models.log_events() if e["event"] == "Scaled"]
    assert causes == [["recorded before causes were"]] * 2 + [["traffic"]]


class NoUpcaster:
    class Scaled(V2.Scaled, frozen=True, kw_only=True):
        upcasters: ClassVar[dict[int, Upcaster]] = {}


class FailingUpcaster:
    class Scaled(V2.Scaled, frozen=True, kw_only=True):
        upcasters: ClassVar[dict[int, Upcaster]] = {1: lambda data: data | {"cause": data["why"]}}


class ShapelessUpcaster:
    class Scaled(V2.Scaled, frozen=True, kw_only=True):
        upcasters: ClassVar[dict[int, Upcaster]] = {1: lambda data: data | {"cause": 7}}


@pytest.mark.parametrize(
    ("cls", "reason"),
    [
        (NoUpcaster.Scaled, "no upcaster for NoUpcaster.Scaled from class_version 1"),
        (
            FailingUpcaster.Scaled,
            "upcasting FailingUpcaster.Scaled from class_version 1 failed: KeyError: 'why'",
        ),
        (ShapelessUpcaster.Scaled, "invalid payload: Expected `str`, got `int` - at `$.cause`"),
    ],
    ids=["missing", "raising", "shapeless"],
)
def test_an_upcaster_that_cannot_skips_those_records_and_nothing_else(
    v1_log: tuple[str, Models],
    install: Callable[[type[DomainEvent]], None],
    cls: type[DomainEvent],
    reason: str,
) -> None:
    url, _ = v1_log
    install(cls)
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    assert [(s.revision, s.reason) for s in models.skipped()] == [(2, reason), (3, reason)]
    assert models.get_model("m")["scaling"] == {"min": 1, "max": 1}


def test_a_record_from_a_newer_release_is_skipped_by_an_older_one(
    v1_log: tuple[str, Models], install: Callable[[type[DomainEvent]], None]
) -> None:
    url, writer = v1_log
    install(V3.Scaled)
    newer = plant(writer, scaled(V3.Scaled, Scaling(0, 9), causes=("later",)))
    install(V2.Scaled)
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": url})
    assert [(s.revision, s.reason) for s in models.skipped()] == [
        (
            newer,
            "written by a newer version of catalog-es (V2.Scaled class_version 3; "
            "this one reads up to 2)",
        )
    ]
    assert models.get_model("m")["scaling"] == {"min": 1, "max": 3}


# -- a declared-config record from a newer release ------------------------------------

ROLLING = (
    "models:\n  - {name: base, engine: vllm, source: hf://org/base,"
    " profiles: [{name: g, gpus: 1}]}\n"
)


def plant_newer_declaration(models: Models) -> tuple[int, str]:
    """A declared-config record as a newer release writes it, ``class_version``
    2, which this code cannot read: its revision, and why it cannot."""
    with models.store.write() as conn:
        version = models.store.stream_version(conn, CONFIGURATION_ID) + 1
        state = {
            "originator_id": str(CONFIGURATION_ID),
            "originator_version": version,
            "timestamp": "2026-12-06T00:00:00Z",
            "class_version": 2,
            "by": "node-b",
            "reason": "",
            "rollback_to": None,
            "fingerprint": "f" * 64,
            "engines": ["vllm"],
            "models": [],
            "path": "/etc/catalog.yaml",
            "labels": {},
        }
        stored = StoredEvent(
            CONFIGURATION_ID, version, topic_of(Configuration.Declared), msgspec.json.encode(state)
        )
        (revision,) = models.store.insert_events([stored], conn=conn) or [0]
    return revision, (
        "written by a newer version of catalog-es (Configuration.Declared class_version 2;"
        " this one reads up to 1)"
    )


def test_a_config_record_this_release_cannot_read_is_not_taken_for_its_own(
    db_url: str, tmp_path: Path
) -> None:
    """A rolling deploy: a newer node records its config in a form this one
    cannot read. This node's next write records its own config again (the
    record it cannot read was not it), and a diff names the unreadable record
    as the one in force where ``--declared-then`` refuses to read over it,
    not the readable one before it (hostile test: the write recorded nothing,
    and the diff named revision 1's config)."""
    path = tmp_path / "catalog.yaml"
    path.write_text(ROLLING)
    config = load_config(str(path))
    env = {"CATALOG_ES_DB": db_url}
    writer = Models(config, env=env)
    writer.add(model_spec("a"), by="x")  # 1 ConfigDeclared, 2 Added
    newer, why = plant_newer_declaration(writer)
    writer.close()
    models = Models(config, env=env)
    assert models.scale("a", 1, 3, by="x").revision == newer + 2
    events = list(models.log_events(after=newer - 1))
    assert [(e["revision"], e["event"]) for e in events] == [
        (newer, "ConfigDeclared"),
        (newer + 1, "ConfigDeclared"),
        (newer + 2, "Scaled"),
    ]
    assert events[1]["fields"]["fingerprint"] == config.fingerprint
    unreadable = f"the declared config recorded at revision {newer} cannot be read: {why}"
    assert models.diff(newer - 1, newer)["declared"]["to"] == {
        "fingerprint": None,
        "recorded_at": newer,
        "error": unreadable,
    }
    with pytest.raises(Refused) as refused:
        models.list_models(at=newer, declared_then=True)
    assert str(refused.value) == unreadable
    assert models.diff(newer - 1, newer + 2)["declared"]["to"] == {
        "fingerprint": config.fingerprint,
        "recorded_at": newer + 1,
    }
    assert models.list_models(at=newer + 2, declared_then=True) == models.list_models()
    # Nor does a node that is already on the config the log recorded
    # write it again (the record from this node stands).
    assert models.scale("a", 1, 4, by="x").revision == newer + 3
    models.close()


def test_a_snapshot_from_before_names_the_unreadable_config_record_in_force(
    tmp_path: Path,
) -> None:
    """Snapshots written before the fix named the readable record before an
    unreadable one as in force, and the skip ``Declared``: restored, they
    name the unreadable one, so the next write records this node's config."""
    url = f"sqlite:///{tmp_path}/snap.db"
    path = tmp_path / "catalog.yaml"
    path.write_text(ROLLING)
    config = load_config(str(path))
    writer = Models(config, env={"CATALOG_ES_DB": url})
    writer.add(model_spec("a"), by="x")
    newer, why = plant_newer_declaration(writer)
    catalog = writer.catalog_at(newer)
    old = msgspec.structs.replace(
        snapshots.state_of(catalog),
        recorded_declaration=(config.fingerprint, 1),
        skipped=[Skipped(revision=newer, model="", event="Declared", reason=why)],
    )
    with writer.store.write() as conn:
        snapshots.save(conn, config.fingerprint, newer, snapshots.encode(old))
    writer.close()
    models = Models(config, env={"CATALOG_ES_DB": url})
    assert [(s.revision, s.event) for s in models.skipped()] == [(newer, "ConfigDeclared")]
    assert models.scale("a", 1, 3, by="x").revision == newer + 2
    assert [e["event"] for e in models.log_events(after=newer)] == ["ConfigDeclared", "Scaled"]
    models.close()


@pytest.mark.parametrize(
    ("recorded", "unreadable_at", "in_force"),
    [
        pytest.param(None, [], None, id="none-recorded"),
        pytest.param(None, [1], (UNREADABLE_DECLARATION, 1), id="an-unreadable-one-alone"),
        pytest.param(("fp", 1), [2, 5], (UNREADABLE_DECLARATION, 5), id="the-latest-unreadable"),
        pytest.param(("fp", 6), [2, 5], ("fp", 6), id="a-readable-one-after-them"),
    ],
)
def test_a_snapshot_from_before_restores_the_latest_config_record_as_in_force(
    recorded: tuple[str, int] | None, unreadable_at: list[int], in_force: tuple[str, int] | None
) -> None:
    """Of the readable record such a snapshot names and the unreadable ones it
    skipped, the latest is in force; a log that recorded no config has none."""
    catalog = Catalog()
    catalog.restore(
        revision=7,
        last_timestamp=None,
        recorded_declaration=recorded,
        aggregates=[],
        skipped=[
            Skipped(revision=r, model="", event="Declared", reason="newer") for r in unreadable_at
        ],
        unhealed=[],
    )
    assert catalog.recorded_declaration == in_force


def _a_log_with_a_newer_record(tmp_path: Path, config: str) -> tuple[str, Path, int, str]:
    """A SQLite log of one model over ``config`` (written in ``tmp_path``),
    then a config record of a newer release's: the log's URL, the config's
    path, the record's revision and why this release cannot read it."""
    url = f"sqlite:///{tmp_path}/newer.db"
    path = tmp_path / config
    path.write_text(ROLLING)
    writer = Models(load_config(str(path)), env={"CATALOG_ES_DB": url})
    writer.add(model_spec("a"), by="x")
    newer, why = plant_newer_declaration(writer)
    writer.close()
    return url, path, newer, why


def test_an_unreadable_config_record_is_shown_as_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """In ``log --json``, as a config record (``ConfigDeclared``, ``model``
    null) with why it cannot be read; in the load's warning, as the declared
    config's record (it showed ``"model": ""``, ``Declared`` and ``model ''``)."""
    url, path, newer, why = _a_log_with_a_newer_record(tmp_path, "catalog.yaml")
    log = CliRunner().invoke(cli, ["--db", url, "--config", str(path), "log", "--json"])
    assert log.exit_code == 0, log.stderr
    shown = json.loads(log.stdout.splitlines()[newer - 1])
    assert {k: shown[k] for k in ("revision", "model", "event", "error")} == {
        "revision": newer,
        "model": None,
        "event": "ConfigDeclared",
        "error": why,
    }
    assert f"skipped revision {newer} (the declared config's record): {why}" in caplog.messages
    audit = CliRunner().invoke(cli, ["--db", url, "--config", str(path), "audit", "--json"])
    assert audit.exit_code == 0, audit.stderr
    row = next(r for r in json.loads(audit.stdout) if r["revision"] == newer)
    assert (row["model"], row["event"], row["skipped"]) == (None, "ConfigDeclared", why)
    diff = CliRunner().invoke(
        cli, ["--db", url, "--config", str(path), "diff", str(newer - 1), str(newer)]
    )
    assert diff.exit_code == 0, diff.stderr
    assert diff.stderr.splitlines()[-1] == (
        f"note: the declared config recorded at revision {newer} cannot be read: {why}"
    )


def test_a_run_given_no_config_over_an_unreadable_record_says_it_goes_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Given no config, over a config record this release cannot read, a
    read was told it "goes without its models", which no one here can say
    (review): it goes without that config, said as such."""
    url, _, newer, _ = _a_log_with_a_newer_record(tmp_path, "deploy.yaml")
    monkeypatch.chdir(tmp_path)  # no ./catalog.yaml
    monkeypatch.delenv("CATALOG_ES_CONFIG", raising=False)
    listed = CliRunner().invoke(cli, ["--db", url, "model", "list"])
    assert listed.exit_code == 0, listed.stderr
    assert caplog.messages[-1] == (
        "no declared config given (--config, $CATALOG_ES_CONFIG or ./catalog.yaml): "
        f"the log's nodes recorded one at revision {newer}, and this run goes without it"
    )


def test_the_config_in_force_at_a_revision_reads_over_an_unreadable_record_or_refuses(
    db_url: str, tmp_path: Path
) -> None:
    """The last declared-config record at or before a revision, newest first
    along the config's stream: the audit passes over one it cannot read for
    the readable one before (as its replay leaves it), ``--declared-then``
    refuses it, and the configs kept snapshots of leave it out."""
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text(ROLLING)
    second.write_text(ROLLING.replace("hf://org/base", "hf://org/base-2"))
    env = {"CATALOG_ES_DB": db_url}
    writer = Models(load_config(str(first)), env=env)
    writer.add(model_spec("a"), by="x")  # 1 ConfigDeclared, 2 Added
    newer, why = plant_newer_declaration(writer)
    writer.close()
    other = Models(load_config(str(second)), env=env)
    other.add(model_spec("b"), by="x")  # records its own config, then Added
    a, b = load_config(str(first)).fingerprint, load_config(str(second)).fingerprint
    with other.store.read() as conn:
        in_audit = [_declaration_at(conn, revision) for revision in range(newer + 3)]
        assert [None if d is None else d.fingerprint for d in in_audit] == [None, a, a, a, b, b]
        around = (newer - 2, newer - 1, newer + 1, newer + 2)
        assert [pointintime.declared_at(conn, r).fingerprint for r in around] == [a, a, b, b]
        with pytest.raises(Refused) as refused:
            pointintime.declared_at(conn, newer)
        assert str(refused.value) == (
            f"the declared config recorded at revision {newer} cannot be read: {why}"
        )
        with pytest.raises(Refused, match="no declared config was recorded at or before"):
            pointintime.declared_at(conn, 0)
        assert snapshots.recorded_configs(conn, 3, besides="") == [b, a]
    other.close()
