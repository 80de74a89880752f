"""Hypothesis profiles for the conformance suite: ``dev`` (fast), ``ci`` (reproducible), ``nightly`` (searching),
``scale`` (only the production-shaped tier, ``sparse_mqa_testkit.scale``; settings as ``ci``).

Chosen by ``--smqa-profile`` or ``SMQA_PROFILE`` (default ``dev``) and applied to the suite's own tests
only (the plugin's run state holds it), so a downstream repo's other Hypothesis tests keep their settings.

Example database: ``ci`` has none unless one is given (then it replays it, and is not derandomized); ``dev`` and
``nightly`` use what ``--smqa-database`` / ``SMQA_DATABASE`` give, else ``./.hypothesis/smqa`` in the working
directory. A database spec is directories and ``redis://HOST:PORT[/DB]`` URLs, comma-separated, all read and
written together, so a fleet of nightly runners shares one Redis database (Hypothesis's own, from the
``hypothesis[redis]`` extra) beside their local directories. Examples are keyed by test and backend. A database is
never placed inside the installed package (an installed copy run from a downstream repo must not write into
site-packages).

No profile has a deadline: the first call of a GPU kernel pays its JIT, and Hypothesis would report that
example as flaky.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase, MultiplexedDatabase

PROFILES = ("dev", "ci", "nightly", "scale")
DEFAULT_PROFILE = "dev"
PROFILE_ENV = "SMQA_PROFILE"
DATABASE_ENV = "SMQA_DATABASE"
MAX_EXAMPLES_ENV = "SMQA_MAX_EXAMPLES"  # overrides the profile's examples per test (the nightly driver sizes rounds)

# Examples per property test. ci is sized so a 2-core CPU run of `reference` stays well under 3 minutes.
MAX_EXAMPLES = {"dev": 12, "ci": 100, "nightly": 2000, "scale": 100}
# Drawn examples per test of an execution check (graph, streams, host_sync, allocations, repeats), at most: what
# they judge (capture, streams, host round trips, memory) follows the shapes and modes, which the explicit
# boundary examples already cover class by class, and a case costs a capture, two parked streams or many calls.
EXECUTION_EXAMPLES = {"dev": 4, "ci": 10, "nightly": 200, "scale": 10}
# Calls per case of the repeats check: (an explicit boundary example, a drawn case). cuDNN frontend's own suite
# repeats 1000 times; nightly does so on the boundary examples, and drawn cases, being many, keep a short run.
REPEATS = {"dev": (4, 4), "ci": (4, 4), "nightly": (1000, 4), "scale": (4, 4)}

_SUPPRESS = (HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
             HealthCheck.differing_executors)
_NO_TARGET = (Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink)


def _package_dir() -> Path:
    return Path(__file__).resolve().parent


def database_dir(explicit: str | os.PathLike | None = None, *, cwd: Path | None = None,
                 ignore_env: bool = False) -> Path | None:
    """Where the example database goes: explicit, else $SMQA_DATABASE, else ./.hypothesis/smqa.

    None when the default would land inside the installed package (the working directory is in it).
    """
    given = explicit or (None if ignore_env else os.environ.get(DATABASE_ENV))
    if given:
        return Path(given).expanduser().resolve()
    cwd = (cwd or Path.cwd()).resolve()
    pkg = _package_dir()
    if cwd == pkg or pkg in cwd.parents:
        return None
    return cwd / ".hypothesis" / "smqa"


REDIS_PREFIX = b"sparse-mqa-testkit:"


def _redis(url: str):
    """Hypothesis's Redis example database at ``url``; ValueError naming the URL when it cannot be reached."""
    try:
        import redis
        from hypothesis.extra.redis import RedisExampleDatabase
    except ImportError as e:
        raise ValueError(f"example database {url}: a Redis database needs the redis client: "
                         f"pip install 'hypothesis[redis]' ({e})") from None
    client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30)
    try:
        client.ping()
    except redis.exceptions.RedisError as e:
        raise ValueError(f"example database {url} is unreachable: {e}") from None
    return RedisExampleDatabase(client, key_prefix=REDIS_PREFIX)


class FleetDatabase(MultiplexedDatabase):
    """Several example databases read and written together; ``parts`` says which (for the report header)."""

    def __init__(self, *parts):
        super().__init__(*parts)
        self.parts = parts


def example_database(spec: str | os.PathLike | None = None):
    """The example database of a spec: directories and ``redis://HOST:PORT[/DB]`` URLs, comma-separated, read and
    written all together (a URL alone also keeps the local default directory). None: nowhere to write."""
    parts = [x.strip() for x in str(spec or "").split(",") if x.strip()]
    urls = [x for x in parts if x.startswith(("redis://", "rediss://"))]
    dirs = [x for x in parts if x not in urls]
    if urls and not dirs:
        dirs = [d for d in [database_dir(cwd=None, ignore_env=True)] if d is not None]
    dbs = [DirectoryBasedExampleDatabase(str(database_dir(d))) for d in dirs] + [_redis(u) for u in urls]
    if not parts:
        where = database_dir()
        dbs = [DirectoryBasedExampleDatabase(str(where))] if where is not None else []
    if not dbs:
        return None
    return dbs[0] if len(dbs) == 1 else FleetDatabase(*dbs)


def describe_database(db) -> str:
    """Where a settings object's examples go, in words."""
    if db is None:
        return "none"
    if isinstance(db, FleetDatabase):
        return " + ".join(describe_database(d) for d in db.parts)
    client = getattr(db, "redis", None)
    if client is not None:
        kw = client.connection_pool.connection_kwargs
        return f"redis://{kw.get('host')}:{kw.get('port')}/{kw.get('db', 0)}"
    return str(getattr(db, "path", db))


def max_examples_override() -> int | None:
    """$SMQA_MAX_EXAMPLES as a positive int, None when unset; ValueError naming the variable otherwise."""
    raw = os.environ.get(MAX_EXAMPLES_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{MAX_EXAMPLES_ENV} must be a positive integer (examples per test), got {raw!r}")
    return int(raw)


def profile_name(name: str | None = None) -> str:
    """``name``, else $SMQA_PROFILE, else dev; ValueError naming where an unknown name came from."""
    chosen = name or os.environ.get(PROFILE_ENV) or DEFAULT_PROFILE
    if chosen not in PROFILES:
        where = "profile" if name else PROFILE_ENV
        raise ValueError(f"{where} must be one of {', '.join(PROFILES)}, got {chosen!r}")
    return chosen


def check_options(profile: str, check: str, *, explicit: bool) -> dict:
    """The options the suite passes ``check`` under ``profile`` (``explicit``: the case is one of the plan's
    boundary examples, not a drawn one)."""
    if check == "repeats":
        return {"repeats": REPEATS[profile][0 if explicit else 1]}
    return {}


def drawn_examples(profile: str, base: int, *, execution: bool) -> int:
    """Examples a drawn test of a check runs: the profile's (``base``), capped for an execution check."""
    return min(base, EXECUTION_EXAMPLES[profile]) if execution else base


def profile_settings(name: str, database: str | os.PathLike | None = None) -> settings:
    """The settings object of profile ``name`` (database as resolved by ``database_dir``)."""
    if name not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {name!r}")
    explicit = database or os.environ.get(DATABASE_ENV)
    db = None if name in ("ci", "scale") and not explicit else example_database(explicit)
    common = dict(deadline=None, database=db, suppress_health_check=_SUPPRESS,
                  max_examples=max_examples_override() or MAX_EXAMPLES[name])
    if name == "dev":
        return settings(phases=_NO_TARGET, **common)
    if name in ("ci", "scale"):
        # derandomized unless pointed at a database (Hypothesis allows only one: replaying wins)
        return settings(derandomize=db is None, phases=_NO_TARGET, print_blob=True, **common)
    # nightly: the target phase climbs hypothesis.target(ratio) toward a failure
    return settings(phases=tuple(Phase), print_blob=True, stateful_step_count=50, **common)
