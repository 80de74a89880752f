"""The suite's pytest fixtures, and what they hand a test: the backend, a drawn case with its tensors, the oracle,
and the checks bound to the test's backend and recorder.

``smqa_bind`` (autouse) binds ``backend_cases()`` to the backend of each test that takes one, and gives a
Hypothesis test the selected profile's settings and an example-database key per backend: all in fixture setup,
which every runner of the tests (pytest, HypoFuzz) performs.
"""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

from .. import oracle
from ..backends.spec import BackendSpec
from ..calls import Call
from ..cases import Case
from ..cases.planning import warm_up
from ..cases.strategies import cases_for, draw_examples, drawing_for, outside_dims
from ..checks.memory import fits
from ..checks.registry import get_check
from ..compare import Expected
from ..compare.expected import forget as forget_expected
from ..contract import inputs_of
from . import hypothesis_compat, profiles
from .options import as_typed
from .recording import PROPERTY, Recorder, run_check
from .state import run_state, selected

NO_GPU = "{what} needs a CUDA GPU: torch.cuda.is_available() is False on this machine"
_REC = pytest.StashKey[Recorder]()


def no_gpu(config, what: str):
    msg = NO_GPU.format(what=what)
    if config.getoption("smqa_require_gpu"):
        pytest.fail(msg + " (--smqa-require-gpu)", pytrace=False)
    pytest.skip(msg)


def say(config):
    """A line to the terminal now, past pytest's capture of the test's output (progress of a long run)."""
    capman = config.pluginmanager.getplugin("capturemanager")

    def write(line: str) -> None:
        with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    return write


def not_applicable(spec: BackendSpec, check: str, outside: bool = False) -> str | None:
    """Why ``check`` (run on cases outside the backend's domain with ``outside``) does not apply to the backend,
    or None when it does: what the skip marker of its test says."""
    if outside and not outside_dims(spec):
        return f"backend {spec.name!r} declares no (Dqk, Dv) restriction: nothing outside its domain to refuse"
    return get_check(check).applies_to(spec)


def n_cases(node) -> int:
    marker = node.get_closest_marker("smqa_cases")
    return int(marker.args[0]) if marker and marker.args else 3


def recorder(item, check: str | None = None, backend: str | None = None) -> Recorder:
    """The item's recorder, made on first use (for ``check`` on ``backend``, else as the item's parameters say)
    and listed in its ``user_properties`` for the table."""
    rec = item.stash.get(_REC, None)
    if rec is None:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if check is None:
            check = params.get("smqa_check") or item.originalname.removeprefix("test_")
            if params.get("smqa_check") and item.get_closest_marker("smqa_outside_domain") is not None:
                check += "_outside_domain"
            if "smqa_case" in params:
                check += f"[case{params['smqa_case']}]"
        name = re.split(r"[\[@]", item.nodeid.partition("::")[2])[0]  # without params or an xdist group
        test = f"{item.path}::{name}"
        rec = Recorder(check=check, backend=backend or str(params.get("smqa_backend", "?")), test=test,
                       say=say(item.config))
        item.stash[_REC] = rec
        item.user_properties.append((PROPERTY, rec.data()))
    return rec


def recorded(item) -> Recorder | None:
    return item.stash.get(_REC, None)


@dataclass
class DrawnCase:
    """A case and its arguments on the backend's device, with ``out``/``lse`` from the float64 oracle rounded
    to kernel dtypes (what a forward returns), ready for ``backend.backward(**drawn.backward_args)``."""

    case: Case
    call: Call

    @property
    def tensors(self) -> dict:
        return self.call.args

    @property
    def backward_args(self) -> dict:
        return {n: self.call.get(n) for n in inputs_of("backward")}


class Oracle:
    """The NumPy oracle on a case: ``oracle.forward(case)`` -> (out, lse), ``oracle.backward(case)`` ->
    (dq, dkv, d_sink), float64 unless ``dtype`` says otherwise."""

    def forward(self, case: Case, dtype=np.float64):
        return oracle.forward(**Call(case.inputs()).oracle_args("forward"), dtype=dtype)

    def backward(self, case: Case, dtype=np.float64):
        return oracle.backward(**Call(case.inputs()).oracle_args("backward"), dtype=dtype)


class Checks:
    """The checks bound to one backend and one test's recorder: ``smqa_checks.tolerance(case)`` runs,
    records and raises ``CheckFailure`` on failure, and returns the ``CheckResult``. ``defaults(check, case)``:
    the options the run's profile gives a check on a case (the caller's own options win)."""

    def __init__(self, backend, recorder: Recorder | None = None, defaults=None):
        self.backend, self.recorder = backend, recorder
        self.defaults = defaults or (lambda check, case: {})

    def __repr__(self) -> str:
        return f"<checks for backend {BackendSpec.of(self.backend).name}>"

    def run(self, check: str, case: Case, **options):
        return run_check(check, self.backend, case, recorder=self.recorder,
                         **{**self.defaults(check, case), **options})

    def __getattr__(self, check: str):
        if check.startswith("_"):
            raise AttributeError(check)
        try:
            name = get_check(check).name  # an unknown name fails here, not when called
        except ValueError as e:
            raise AttributeError(str(e)) from None
        return lambda case, **options: self.run(name, case, **options)


class BoundCheck:
    """One registry check bound to a backend and a test's recorder: ``smqa_check(case)``."""

    def __init__(self, name: str, checks: Checks):
        self.name, self.checks = name, checks

    @property
    def recorder(self) -> Recorder | None:
        return self.checks.recorder

    def __call__(self, case: Case, **options):
        return self.checks.run(self.name, case, **options)

    def __repr__(self) -> str:
        return f"<check {self.name} for backend {BackendSpec.of(self.checks.backend).name}>"


# ---- the fixtures ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def smqa_backend(request):
    """The backend under test (one per ``--smqa-backend``), planned and warmed up once per worker."""
    try:
        state = selected(request.config)
    except pytest.UsageError as e:
        pytest.fail(str(e), pytrace=False)
    name = getattr(request, "param", None) or state.names[0]
    if name in state.missing:
        pytest.skip(as_typed(f"backend {name!r} skipped (--smqa-allow-missing): {state.missing[name]}"))
    spec = state.specs[name]
    if spec.device != "cpu" and not torch.cuda.is_available():
        no_gpu(request.config, f"backend {name!r} (device {spec.device})")
    if not state.plan(name).compile and state.pool_used:
        warm(request.config, state, name)
    return spec.backend


def warm(config, state, name: str) -> None:
    """The backend's warm-up: each pooled kernel key compiled once, before any check, timed apart from them."""
    done = warm_up(state.plan(name))
    keys = f"{done['keys']} pooled kernel keys" if done["keys"] else "no compile keys declared"
    say(config)(f"[smqa] warm-up {name}: {keys}, {done['seconds']:.1f} s")
    state.compile[name] = done


@pytest.fixture(scope="session")
def smqa_plan(request, smqa_backend):
    """The run's plan for the backend: ``.boundaries.examples`` (explicit cases covering every boundary class
    its domain allows), ``.boundaries.unreachable``, ``.pool`` (compile keys), ``.compile`` (warm-up time)."""
    return run_state(request.config).plan_of(smqa_backend)


@pytest.fixture(autouse=True)
def smqa_bind(request):
    """For a test that takes a backend: ``backend_cases()`` draws for it, and a Hypothesis test runs under the
    selected profile (unless it chose its own settings) with its examples keyed by test and backend."""
    if "smqa_backend" not in request.fixturenames:
        yield
        return
    backend = request.getfixturevalue("smqa_backend")
    state = run_state(request.config)
    _hypothesis_settings(request.node, state)
    rec = recorder(request.node)
    rec.tiles = dict(state.specs[state.name_of(backend)].tiles)
    with drawing_for(state.plan_of(backend).draw):
        yield


def _hypothesis_settings(item, state) -> None:
    fn = getattr(item, "obj", None)
    if hypothesis_compat.inner_test(fn) is None:
        return
    own = hypothesis_compat.own_settings(fn)
    base = own or state.settings
    check = getattr(getattr(item, "callspec", None), "params", {}).get("smqa_check")
    examples = base.max_examples if own or not check else \
        profiles.drawn_examples(state.profile, base.max_examples, execution=get_check(check).execution)
    # the smqa fixtures belong to the test, not to one example: they are meant to outlive the examples
    hypothesis_compat.use_settings(fn, settings(base, max_examples=examples,
                                                suppress_health_check=set(base.suppress_health_check)
                                                | {HealthCheck.function_scoped_fixture}))
    hypothesis_compat.set_example_key(fn, f"{item.module.__name__}::{item.name}".encode())


@pytest.fixture
def smqa_checks(request, smqa_backend):
    """The checks bound to the backend and this test: ``smqa_checks.tolerance(case)``, ``.determinism(case)``,
    ``.guards``, ``.rejection``, ``.forward_tolerance``, ``.graph``, ``.streams``, ``.host_sync``,
    ``.allocations``, ``.repeats``; each records, raises ``CheckFailure`` on failure (a pytest skip when it does
    not apply) and returns the ``CheckResult``. The profile sets options a check takes (the repeats' count,
    longer on the plan's explicit boundary examples)."""
    state = run_state(request.config)
    explicit, profile = set(state.plan_of(smqa_backend).boundaries.examples), state.profile

    def defaults(check: str, case: Case) -> dict:
        return profiles.check_options(profile, check, explicit=case in explicit)

    return Checks(smqa_backend, recorder(request.node), defaults)


@pytest.fixture
def smqa_check(request, smqa_checks):
    """One check of the registry, bound to the backend and this test: ``smqa_check(case)``. A check that does
    not apply to the backend is skipped at collection (the plugin marks it), with the reason."""
    return BoundCheck(get_check(request.param).name, smqa_checks)


@pytest.fixture
def smqa_case(request, smqa_backend, smqa_plan):
    """A case drawn (deterministically) inside the backend's domain, with its tensors on the backend's device."""
    state = run_state(request.config)
    n = n_cases(request.node)
    key = (id(smqa_backend), n)
    if key not in state.drawn:
        state.drawn[key] = draw_examples(cases_for(smqa_backend, pool=smqa_plan.pool), n)
    drawn = state.drawn[key]
    recorder(request.node)
    case = drawn[getattr(request, "param", 0) % len(drawn)]
    spec = smqa_plan.backend
    return DrawnCase(case, Expected.for_backend(spec, case).call(spec.device))


@pytest.fixture
def smqa_scale_case(request, smqa_backend):
    """A production-shaped case of the scale tier (``cases.scale``), checked to fit in the backend's device memory
    first (skipped with the numbers when it does not)."""
    case = request.param
    spec = run_state(request.config).plan_of(smqa_backend).backend
    if not spec.is_cuda:
        pytest.skip(f"the scale tier runs production sizes on a CUDA backend; {spec.name!r} runs on {spec.device}")
    forget_expected()  # the last case's expected results hold tens of GiB
    torch.cuda.empty_cache()
    reason = fits(case, spec.device)
    if reason:
        pytest.skip(reason)
    return case


@pytest.fixture(scope="session")
def smqa_oracle():
    """The NumPy oracle on a case: ``smqa_oracle.forward(case)``, ``smqa_oracle.backward(case)`` (float64)."""
    return Oracle()


SUITE_FIXTURES = ("smqa_backend", "smqa_case", "smqa_checks", "smqa_check", "smqa_scale_case")
FUZZ_ARG = "smqa_target"  # the fuzz entry's one direct parameter (harness/fuzzing.py)


def uses_suite(item) -> bool:
    """The test takes one of the suite's fixtures or is the fuzz entry (it has a row in the conformance table)."""
    return any(f in getattr(item, "fixturenames", ()) for f in (*SUITE_FIXTURES, FUZZ_ARG))
