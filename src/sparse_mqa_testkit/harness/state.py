"""What the plugin knows about one pytest run, in one typed object kept on the config (``run_state(config)``),
and how the run's options become it: validated and loaded on first use (``selected``), so that a repo that never
uses the suite never pays for it or fails on it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

from ..backends import BackendNotFound, MissingDependency, default_backend_name, get_backend
from ..backends.spec import BackendSpec
from ..cases.limits import parse_limits
from ..cases.planning import Plan, compile_budget, plan_backend
from ..checks.registry import CHECKS
from ..checks.result import exception_summary
from . import profiles
from .options import BACKEND_ENV, LIMITS_ENV, as_typed

_KEY = pytest.StashKey["SuiteState"]()


@dataclass
class SuiteState:
    """names: the backends as the run gave them (a registered name or module:attr). After ``selected``:
    profile and its Hypothesis ``settings``, size ``limits``, compile ``budget``, the ``checks`` asked for, the
    loaded ``specs`` and their ``plans`` by name (each made on first use, ``plan``), and ``missing`` (name -> why
    its package is absent, with --smqa-allow-missing). Collected along the run: ``collected`` (the suite tests'
    node ids), ``finished`` (the tests with a result), ``reports`` (the suite tests'), ``compile`` (warm-up per
    backend), ``drawn`` (smqa_case's cases), ``workers`` (xdist workers and their GPUs)."""

    names: list[str] | None = None
    given_as: str = "--smqa-backend "  # where the names came from, as an error message names it
    error: str | None = None
    profile: str | None = None
    settings: object = None
    limits: dict = field(default_factory=dict)
    budget: int = 0
    checks: list[str] = field(default_factory=list)
    specs: dict[str, BackendSpec] = field(default_factory=dict)
    plans: dict[str, Plan] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    pool_used: bool = True
    collected: list = field(default_factory=list)  # the node ids of the suite tests the run will run
    finished: set = field(default_factory=set)  # the node ids of the tests that have a result
    reports: list = field(default_factory=list)
    compile: dict = field(default_factory=dict)
    drawn: dict = field(default_factory=dict)
    workers: dict = field(default_factory=dict)

    def name_of(self, backend) -> str:
        """The name the run gave a loaded backend object."""
        return next(n for n, s in self.specs.items() if s.backend is backend)

    def plan(self, name: str) -> Plan:
        """A loaded backend's plan, made on first use: its pool's cases are drawn by Hypothesis, which expects
        no draws while pytest starts (plugins, conftest, session start)."""
        if name not in self.plans:
            self.plans[name] = plan_backend(self.specs[name], profile=self.profile, budget=self.budget,
                                            limits=self.limits)
        return self.plans[name]

    def plan_of(self, backend) -> Plan:
        return self.plan(self.name_of(backend))


def backend_names(config) -> tuple[list[str], str]:
    """The backends the run names (option, else $SMQA_BACKEND), else the machine's default, each once; and where
    they came from, as a message names it (``--smqa-backend `` or ``SMQA_BACKEND=``)."""
    option = config.getoption("smqa_backend")
    given = option or [os.environ.get(BACKEND_ENV, "")]
    names = [n.strip() for arg in given for n in arg.split(",") if n.strip()]
    where = "--smqa-backend " if option else f"{BACKEND_ENV}=" if names else "the default backend "
    return list(dict.fromkeys(names or [default_backend_name()])), where


def run_state(config) -> SuiteState:
    """The run's state; its backend names are read from the options on first use (the default backend
    imports torch, which a run that never uses the suite should not pay for)."""
    if _KEY not in config.stash:
        config.stash[_KEY] = SuiteState()
    state = config.stash[_KEY]
    if state.names is None:
        state.names, state.given_as = backend_names(config)
    return state


def selected(config) -> SuiteState:
    """The run's state with its profile, checks, limits and backends validated and loaded (once):
    pytest.UsageError naming what is wrong, every time it is asked after a failure."""
    state = run_state(config)
    if state.error:
        raise pytest.UsageError(state.error)
    if state.profile is None:
        try:
            _select(config, state)
        except pytest.UsageError as e:
            state.error = as_typed(str(e))
            raise pytest.UsageError(state.error) from None
    return state


def _select(config, state: SuiteState) -> None:
    try:
        profile = profiles.profile_name(config.getoption("smqa_profile"))
        state.settings = profiles.profile_settings(profile, config.getoption("smqa_database"))
        given = config.getoption("smqa_limits")
        state.limits = parse_limits(given or os.environ.get(LIMITS_ENV, ""),
                                    where="--smqa-limits" if given else LIMITS_ENV)
        state.budget = compile_budget(config.getoption("smqa_compile_budget"), profile)
    except ValueError as e:
        raise pytest.UsageError(f"sparse-mqa-testkit: {e}") from None
    wanted = [c.removeprefix("check_") for c in config.getoption("smqa_check")]
    unknown = sorted(set(wanted) - set(CHECKS))
    if unknown:
        raise pytest.UsageError(f"--smqa-check {', '.join(unknown)}: not a check; choose from {', '.join(CHECKS)}")
    state.checks = wanted
    for name in state.names:
        _load(config, state, name, profile, f"{state.given_as}{name}")
    state.profile = profile


def _load(config, state: SuiteState, name: str, profile: str, given: str) -> None:
    """Load and plan one backend, or raise pytest.UsageError saying why it cannot be, starting with how the run
    ``given`` it (a missing optional package is a skip with --smqa-allow-missing)."""
    try:
        spec = BackendSpec.of(get_backend(name))
        spec.require()
    except BackendNotFound as e:
        raise pytest.UsageError(f"{given}: {e}") from None
    except MissingDependency as e:
        if config.getoption("smqa_allow_missing"):
            state.missing[name] = str(e)
            return
        raise pytest.UsageError(f"{given}: {e}\n(pass --smqa-allow-missing to skip its tests "
                                "instead)") from None
    except Exception as e:  # a broken backend module is an error, with where it broke: never a skip
        raise pytest.UsageError(f"{given}: loading it raised {exception_summary(e, frames=6)}") \
            from None
    try:  # what its plan would refuse, found without drawing; the plan itself is made on first use
        plan_backend(spec, profile=profile, budget=state.budget, limits=state.limits, draws=0)
    except ValueError as e:
        raise pytest.UsageError(f"{given}: {e}") from None
    state.specs[name] = spec
