"""The composition root: where the service is wired to its database, config and ports.

Importing it loads none of the service: the command line names its settings
as it is built (``--help``, a usage error), and each function here loads what
it wires when it is called.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from catalog_es.errors import ConfigError, InputError, shown
from catalog_es.values import whole_number

if TYPE_CHECKING:
    from fastapi import FastAPI

    from catalog_es.application import Models
    from catalog_es.configuration import DeclaredConfig
    from catalog_es.ports import Applier, PreAddCheck
    from catalog_es.web.tokens import TokenStore
    from catalog_es.weights import Weights

# persistence.Factory.URL, which a service made without this module reads;
# spelled out here, as naming it must load no service.
DB_ENV = "CATALOG_ES_DB"
CONFIG_ENV = "CATALOG_ES_CONFIG"
ACTOR_ENV = "CATALOG_ES_ACTOR"
MIRROR_ENV = "CATALOG_ES_MIRROR"
WEIGHTS_ENV = "CATALOG_ES_WEIGHTS"
TOKENS_ENV = "CATALOG_ES_TOKENS"
DEFAULT_CONFIG = "catalog.yaml"
# Where a run takes its declared config from, as told when it has none.
CONFIG_GIVEN_BY = f"--config, ${CONFIG_ENV} or ./{DEFAULT_CONFIG}"
SNAPSHOT_ENV = "CATALOG_ES_SNAPSHOT_EVERY"
DEFAULT_WEIGHTS = "weights"
DEFAULT_TOKENS = "catalog-tokens.json"


def database_url(given: str | None = None) -> str:
    """``--db``, else ``CATALOG_ES_DB``, else the SQLite file ``catalog.db`` here."""
    # Refused before persistence (SQLAlchemy) is loaded: a refusal reads no log.
    refuse_empty(given, "--db", "a database URL")
    url = given or from_env(DB_ENV, "a database URL")
    if url:
        return url
    from catalog_es.persistence import DEFAULT_URL

    return DEFAULT_URL


def config_path(given: str | None = None) -> str | None:
    """``--config``, else ``CATALOG_ES_CONFIG``, else ``./catalog.yaml`` when present."""
    refuse_empty(given, "--config", "a config file")
    if given:
        return given
    in_env = from_env(CONFIG_ENV, "a config file")
    if in_env is not None:
        return in_env
    return DEFAULT_CONFIG if Path(DEFAULT_CONFIG).is_file() else None


def refuse_empty(given: str | None, option: str, what: str) -> None:
    """An option given empty (``--db "$URL"``, the variable unset) is refused,
    as ``--by ''`` is, not taken for one left out: the default it fell back
    to was another log, or another declared layer, than the one meant."""
    if given == "":
        raise InputError(f"{option} is empty: give {what}, or leave {option} out")


def from_env(name: str, what: str) -> str | None:
    """The environment variable ``name``, ``None`` when unset. Set empty, it
    is refused as its option given empty is (:func:`refuse_empty`):
    ``CATALOG_ES_DB=$URL`` with ``URL`` unset made ./catalog.db and read it."""
    value = os.environ.get(name)
    if value == "":
        raise InputError(f"${name} is set but empty: give {what}, or unset it")
    return value


def actor(given: str | None = None) -> str:
    """``--by``, else ``CATALOG_ES_ACTOR``, else the OS user. A ``--by`` given
    empty is refused as a blank one is (by the command), not replaced: it
    was said, and it names no one; the variable set empty is refused too
    (``CATALOG_ES_ACTOR=$DEPLOYER``, unset, recorded the OS user unsaid)."""
    if given is not None:
        return given
    in_env = from_env(ACTOR_ENV, "an actor")
    if in_env is not None:
        return in_env
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def declared_config(given: str | None = None) -> DeclaredConfig:
    """The declared config at ``--config`` (:func:`config_path`), loaded."""
    from catalog_es.inputs import load_config

    return load_config(config_path(given))


def open_models(
    db: str | None = None,
    config: str | DeclaredConfig | None = None,
    *,
    applier: Applier | None = None,
    pre_add_check: PreAddCheck | None = None,
    make_log: bool = True,
    in_memory: bool = False,
) -> Models:
    """The service on a database and a declared config (``--config``, or one
    already loaded), its log replayed. ``make_log``: where there is no log,
    make one; if not, raise :class:`~catalog_es.errors.NoLogYet`, having
    made nothing. ``in_memory``: on a new, empty log in memory, gone with the
    service, in place of ``db``'s."""
    from catalog_es.application import Models
    from catalog_es.configuration import DeclaredConfig
    from catalog_es.persistence import Factory

    env = {Factory.URL: database_url(db)}
    if not make_log:
        env[Factory.MAKE_LOG] = "no"
    if in_memory:
        env[Factory.IN_MEMORY] = "yes"
    return Models(
        config if isinstance(config, DeclaredConfig) else declared_config(config),
        applier=applier,
        pre_add_check=pre_add_check,
        snapshot_interval=snapshot_interval(),
        env=env,
    )


def snapshot_interval() -> int:
    """``CATALOG_ES_SNAPSHOT_EVERY``: revisions between projection snapshots.
    Fewer makes reads of the past faster and the database larger."""
    from projections.snapshots import DEFAULT_INTERVAL

    text = os.environ.get(SNAPSHOT_ENV, "")
    if not text.strip():  # unset, or set empty as unset
        return DEFAULT_INTERVAL
    interval = whole_number(text.strip())
    if interval is None or interval < 1:
        raise ConfigError(
            f"{SNAPSHOT_ENV} must be a whole number of revisions, at least 1, not {shown(text)}"
        )
    return interval


def open_weights(
    models: Callable[[], Models], mirror: str | None = None, weights: str | None = None
) -> Weights:
    """Weights provenance over the service ``models`` opens, once the
    registry is known: the mirror at ``--mirror``, else ``CATALOG_ES_MIRROR``;
    fetched commits are kept under ``--weights``, else ``CATALOG_ES_WEIGHTS``,
    else ``./weights``."""
    from catalog_es.registry import MirrorRegistry
    from catalog_es.weights import Weights, WeightsStore

    refuse_empty(mirror, "--mirror", "a mirror directory")
    refuse_empty(weights, "--weights", "a weights directory")
    root = mirror or from_env(MIRROR_ENV, "a mirror directory")
    if not root:
        raise InputError(f"no registry to compare with: give --mirror DIR or set {MIRROR_ENV}")
    if not Path(root).is_dir():
        raise InputError(f"mirror {root}: not a directory")
    store = Path(weights or from_env(WEIGHTS_ENV, "a weights directory") or DEFAULT_WEIGHTS)
    return Weights(models(), MirrorRegistry(Path(root)), WeightsStore(store, apart_from=Path(root)))


def tokens_path(given: str | None = None) -> Path:
    """``--tokens``, else ``CATALOG_ES_TOKENS``, else ``./catalog-tokens.json``."""
    refuse_empty(given, "--tokens", "a tokens file")
    return Path(given or from_env(TOKENS_ENV, "a tokens file") or DEFAULT_TOKENS)


def open_tokens(given: str | None = None, *, existing: bool = False) -> TokenStore:
    """The tokens file; ``existing``: refused when it is not there (listing or
    revoking in one is a mistyped path, not an empty file)."""
    from catalog_es.web.tokens import TokenStore

    tokens = TokenStore(tokens_path(given))
    if existing:
        tokens.require()
    return tokens


def open_web_app(models: Models, tokens: TokenStore, *, max_watches: int) -> FastAPI:
    """The HTTP API and the console over the service, each request's actor
    the one its token stands for."""
    from catalog_es.web.app import create_app  # FastAPI is loaded only to serve

    return create_app(models, tokens, max_watches=max_watches)
