"""Hypothesis profiles for the conformance suite: ``dev`` (fast), ``ci`` (reproducible), ``nightly`` (searching).

Chosen by ``--smqa-profile`` or ``SMQA_PROFILE`` (default ``dev``) and applied to the suite's own tests
only (``active()``), so a downstream repo's other Hypothesis tests keep their settings.

Example database: ``ci`` has none unless one is given (then it replays it, and is not derandomized); ``dev`` and ``nightly`` use the directory given by
``--smqa-database`` / ``SMQA_DATABASE``, else ``./.hypothesis/smqa`` in the working directory. A database is
never placed inside the installed package (an installed copy run from a downstream repo must not write into
site-packages).

No profile has a deadline: the first call of a GPU kernel pays its JIT, and Hypothesis would report that
example as flaky.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

PROFILES = ("dev", "ci", "nightly")
DEFAULT_PROFILE = "dev"
PROFILE_ENV = "SMQA_PROFILE"
DATABASE_ENV = "SMQA_DATABASE"
MAX_EXAMPLES_ENV = "SMQA_MAX_EXAMPLES"  # overrides the profile's examples per test (the nightly driver sizes rounds)

# Examples per property test. ci is sized so a 2-core CPU run of `reference` stays well under 3 minutes.
MAX_EXAMPLES = {"dev": 12, "ci": 100, "nightly": 2000}

_SUPPRESS = (HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
             HealthCheck.differing_executors)
_NO_TARGET = (Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink)


def _package_dir() -> Path:
    return Path(__file__).resolve().parent


def database_dir(explicit: str | os.PathLike | None = None, *, cwd: Path | None = None) -> Path | None:
    """Where the example database goes: explicit, else $SMQA_DATABASE, else ./.hypothesis/smqa.

    None when the default would land inside the installed package (the working directory is in it).
    """
    given = explicit or os.environ.get(DATABASE_ENV)
    if given:
        return Path(given).expanduser().resolve()
    cwd = (cwd or Path.cwd()).resolve()
    pkg = _package_dir()
    if cwd == pkg or pkg in cwd.parents:
        return None
    return cwd / ".hypothesis" / "smqa"


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


def profile_settings(name: str, database: str | os.PathLike | None = None) -> settings:
    """The settings object of profile ``name`` (database as resolved by ``database_dir``)."""
    if name not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {name!r}")
    explicit = database or os.environ.get(DATABASE_ENV)
    if name == "ci" and not explicit:
        db = None
    else:
        where = database_dir(database)
        db = DirectoryBasedExampleDatabase(str(where)) if where is not None else None
    common = dict(deadline=None, database=db, suppress_health_check=_SUPPRESS,
                  max_examples=max_examples_override() or MAX_EXAMPLES[name])
    if name == "dev":
        return settings(phases=_NO_TARGET, **common)
    if name == "ci":
        # derandomized unless pointed at a database (Hypothesis allows only one: replaying wins)
        return settings(derandomize=db is None, phases=_NO_TARGET, print_blob=True, **common)
    # nightly: the target phase climbs hypothesis.target(ratio) toward a failure
    return settings(phases=tuple(Phase), print_blob=True, stateful_step_count=50, **common)


_active: tuple[str, settings] | None = None


def select(name: str | None = None, database: str | os.PathLike | None = None) -> str:
    """Choose the suite's profile (``name``, else $SMQA_PROFILE, else dev); returns its name.

    Only the suite's own tests use it (``active()``); Hypothesis's global default profile is left alone, so a
    downstream repo's other property tests keep their settings.
    """
    global _active
    name = profile_name(name)
    _active = (name, profile_settings(name, database))
    return name


def active() -> settings:
    """Settings of the selected profile (selecting the default first if none was chosen)."""
    if _active is None:
        select()
    return _active[1]


def active_name() -> str:
    if _active is None:
        select()
    return _active[0]
