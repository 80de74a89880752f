"""The plugin's command-line options: every ``--smqa-*`` flag, with the environment variable it defaults to; and
messages in the terms of the front end the user typed (``sparse-mqa-check`` has its own flags)."""

from __future__ import annotations

import os
import re

from ..cases.compile_keys import DEFAULT_BUDGET
from . import profiles

BACKEND_ENV = "SMQA_BACKEND"
LIMITS_ENV = "SMQA_LIMITS"
FRONT_END_ENV = "SMQA_FRONT_END"  # "sparse-mqa-check" in the CLI's child pytest
CLI = "sparse-mqa-check"
CLI_FLAGS = {"--smqa-backend": "--backend", "--smqa-profile": "--profile", "--smqa-database": "--database",
             "--smqa-check": "--check", "--smqa-json": "--json", "--smqa-allow-missing": "--allow-missing",
             "--smqa-limits": "--limits", "--smqa-compile-budget": "--compile-budget"}


def as_typed(message: str) -> str:
    """``message`` with each ``--smqa-*`` flag named as the user typed it: sparse-mqa-check's own flag in its
    child pytest, unchanged in a plain pytest run."""
    if os.environ.get(FRONT_END_ENV) != CLI:
        return message
    return re.sub(r"--smqa-[a-z-]+", lambda m: CLI_FLAGS.get(m.group(0), m.group(0)), message)


def add_options(parser) -> None:
    """The suite's command-line options (``--smqa-*``)."""
    g = parser.getgroup("sparse-mqa-testkit", "sparse-mqa-testkit conformance suite")
    g.addoption("--smqa-backend", action="append", default=[], metavar="NAME",
                help="backend to run the suite on: a registered name or module:attr (repeatable; "
                     f"default ${BACKEND_ENV} or the machine's default backend)")
    g.addoption("--smqa-profile", choices=profiles.PROFILES, default=None,
                help=f"Hypothesis profile for the suite (default ${profiles.PROFILE_ENV} or dev)")
    g.addoption("--smqa-database", default=None, metavar="DIR|redis://HOST:PORT[/DB]",
                help="Hypothesis example database: directories and Redis URLs, comma-separated, all read and "
                     f"written (default ${profiles.DATABASE_ENV}, else ./.hypothesis/smqa)")
    g.addoption("--smqa-check", action="append", default=[], metavar="NAME",
                help="run only these checks of the suite (repeatable; the names of "
                     "sparse_mqa_testkit.checks.CHECKS)")
    g.addoption("--smqa-compile-budget", type=int, default=None, metavar="N",
                help="a backend that declares compile_keys compiles at most N kernel keys in the run (default "
                     "$SMQA_COMPILE_BUDGET, else " + ", ".join(f"{n} for {p}" for p, n in DEFAULT_BUDGET.items())
                     + ")")
    g.addoption("--smqa-json", default=None, metavar="PATH",
                help="write the conformance table (per test: cases, worst ratio, coverage, failure) as JSON, "
                     "rewritten as results arrive; a run ended by SIGINT or SIGTERM writes what finished, marked "
                     "interrupted, with the tests that did not finish")
    g.addoption("--smqa-verdicts", action="store_true",
                help="print each suite test's verdict line (and a failure's replay line) as it finishes")
    g.addoption("--smqa-require-gpu", action="store_true",
                help="fail gpu-marked tests and CUDA backends when CUDA is absent instead of skipping them")
    g.addoption("--smqa-allow-missing", action="store_true",
                help="skip a backend whose optional packages are not installed (MissingDependency) instead of "
                     "failing the run; a backend that fails to import for any other reason is always an error")
    g.addoption("--smqa-scale", action="store_true",
                help="also run the scale tier: production-shaped cases on each CUDA backend (the scale profile "
                     "runs only that tier)")
    g.addoption("--smqa-fuzz", action="store_true",
                help="collect the suite's fixture-free fuzz entry (property_tests/test_fuzz.py, what HypoFuzz "
                     "runs; always on under HypoFuzz) in place of test_check; with --smqa-database that database "
                     "becomes Hypothesis's default for the run (default $SMQA_FUZZ)")
    g.addoption("--smqa-limits", default=None, metavar="SIZE=N,...",
                help="raise or lower the drawn size limits: B, S, Skv, H, L (largest size) and work "
                     f"(B*S*H*L*Dqk); default ${LIMITS_ENV}, e.g. L=130,H=20")
