"""The suite's drawn checks as one fixture-free Hypothesis test, ``property_tests/test_fuzz.py``: what any runner
of Hypothesis tests can run (pytest, and HypoFuzz, which sets up no fixture and never runs pytest's run hooks).

``test_fuzz(smqa_target, data)`` takes one direct parameter, a ``FuzzTarget`` per (backend, check) of the run,
made at collection from the run's loaded backends; a check that does not apply carries a skip marker (HypoFuzz
leaves skip-marked tests out, the table shows them as SKIP). Each collected item gets its own copy of the test,
keyed in the example database by its node id: the key HypoFuzz gives a test, so a failure either runner finds
replays in the other when both collect the suite from the same directory (a node id can depend on it).

The entry is collected with ``--smqa-fuzz`` or ``SMQA_FUZZ=1``, and always under HypoFuzz's collection; it then
takes the place of ``test_check`` and ``test_check_outside_domain`` (the table keeps the same rows). When such
a run names its database (``--smqa-database`` / ``SMQA_DATABASE``), that database becomes Hypothesis's default
profile (HypoFuzz reads ``settings().database`` after pytest's session has ended, so the profile stays loaded):
every Hypothesis test of the run that keeps the default settings uses it too.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ..cases.planning import Plan, warm_up
from ..checks.registry import CHECKS, get_check
from . import gpu_workers, hypothesis_compat, profiles
from .fixtures import FUZZ_ARG, NO_GPU, no_gpu, not_applicable, recorder, warm
from .recording import Recorder, run_check
from .state import run_state, selected

FUZZ_ENV = "SMQA_FUZZ"  # 1: collect the fuzz entry (as --smqa-fuzz)
RECORD_ENV = "SMQA_FUZZ_RECORD"  # a directory: outside pytest, each process writes what its targets saw there
PROFILE = "sparse-mqa-testkit-fuzz"  # the Hypothesis profile holding the run's named database
ARG = FUZZ_ARG
CHECKS_MODULE = "sparse_mqa_testkit.property_tests.test_checks"
REPLACED = ("test_check", "test_check_outside_domain")
FLUSH_SECONDS = 5.0


@dataclass(eq=False)
class FuzzTarget:
    """One (backend, check) of the run: ``cases()`` draws inside the backend's domain (outside it for an
    ``outside`` target), ``run(case)`` runs the check and raises ``CheckFailure`` on a failure. ``plan`` is None
    for a backend skipped as missing. ``recorder``: the pytest item's (the conformance table's row)."""

    name: str
    check: str
    plan: Plan | None = None
    outside: bool = False
    profile: str = profiles.DEFAULT_PROFILE
    recorder: Recorder | None = field(default=None, repr=False)
    _own: Recorder | None = field(default=None, repr=False)  # outside pytest, with RECORD_ENV set
    _flushed: tuple = field(default=(0.0, 0), repr=False)  # when the record was last written, with how many failures

    @property
    def label(self) -> str:
        """The check as the table names it."""
        return f"{self.check}_outside_domain" if self.outside else self.check

    def __repr__(self) -> str:  # HypoFuzz and Hypothesis print it in a failing example's call
        return f"FuzzTarget({self.name!r}, {self.label!r})"

    def _repr_pretty_(self, printer, cycle) -> None:  # Hypothesis prints a dataclass field by field otherwise
        printer.text(repr(self))

    def cases(self):
        return self.plan.draw.cases(outside=self.outside)

    def run(self, case):
        if not self.plan.compile:  # outside pytest no fixture warmed the backend up: once per process
            warm_up(self.plan)
        rec = self.recorder or self._own_recorder()
        try:
            return run_check(self.check, self.plan.backend.backend, case, recorder=rec,
                             **profiles.check_options(self.profile, self.check, explicit=False))
        finally:
            if rec is not None and rec is self._own:
                self._flush(rec)

    def _own_recorder(self) -> Recorder | None:
        if not os.environ.get(RECORD_ENV):
            return None
        if self._own is None:
            self._own = Recorder(check=self.label, backend=self.name, tiles=dict(self.plan.backend.tiles))
        return self._own

    def _flush(self, rec: Recorder) -> None:
        """This process's record of the target to RECORD_ENV, at a new failure and at most every FLUSH_SECONDS
        otherwise (a fuzzing process is stopped, not ended: what it saw in its last seconds is lost)."""
        now = time.monotonic()
        if now - self._flushed[0] < FLUSH_SECONDS and rec.failed == self._flushed[1]:
            return
        self._flushed = (now, rec.failed)
        where = Path(os.environ[RECORD_ENV])
        where.mkdir(parents=True, exist_ok=True)
        path = where / (re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{self.name}-{self.label}") + f"-{os.getpid()}.json")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec.data()))
        os.replace(tmp, path)


def fuzz_test(key: bytes = b""):
    """A new copy of the fuzz test, its examples keyed by ``key`` (each item runs its own copy: one function
    object per key, since a runner may read the key of every item before running any)."""

    @given(data=st.data())
    def test_fuzz(smqa_target, data):
        smqa_target.run(data.draw(smqa_target.cases(), label="case"))

    hypothesis_compat.set_example_key(test_fuzz, key)
    return test_fuzz


def under_hypofuzz(config) -> bool:
    """The session is HypoFuzz's collection (its collector is a plugin of the session)."""
    return any(type(p).__module__.split(".")[0] == "hypofuzz" for p in config.pluginmanager.get_plugins())


def enabled(config) -> bool:
    return bool(config.getoption("smqa_fuzz") or os.environ.get(FUZZ_ENV, "") not in ("", "0")
                or under_hypofuzz(config))


def use_database(config) -> None:
    """With the fuzz entry on and a database named: a Hypothesis profile with that database (and derandomize
    off, which HypoFuzz refuses, over whatever profile is loaded), loaded as the default."""
    spec = config.getoption("smqa_database") or os.environ.get(profiles.DATABASE_ENV)
    if not spec or not enabled(config):
        return
    try:
        db = profiles.example_database(spec)
    except ValueError as e:
        raise pytest.UsageError(f"sparse-mqa-testkit: {e}") from None
    settings.register_profile(PROFILE, parent=settings.default, database=db, derandomize=False)
    settings.load_profile(PROFILE)


def parametrize(metafunc) -> None:
    """The fuzz entry's targets: every check on every backend of the run, with a skip marker where it does not
    apply; nothing when the entry is off or the backends cannot load (the item is then deselected, or the
    collection reports the error)."""
    if not enabled(metafunc.config):
        return
    try:
        state = selected(metafunc.config)
    except pytest.UsageError:
        return
    params = []
    for name in state.names:
        for check in CHECKS.values():
            for outside in (False, True) if check.outside_domain else (False,):
                plan = None if name in state.missing else state.plan(name)
                target = FuzzTarget(name, check.name, plan, outside, state.profile)
                reason = _not_applicable(metafunc.config, state, name, check.name, outside)
                marks = [pytest.mark.skip(reason=reason)] if reason else []
                params.append(pytest.param(target, id=f"{name}-{target.label}", marks=marks))
    metafunc.parametrize(ARG, params)


def _not_applicable(config, state, name: str, check: str, outside: bool) -> str | None:
    if name in state.missing:
        return f"backend {name!r} skipped (--smqa-allow-missing): {state.missing[name]}"
    spec = state.specs[name]
    # counted through NVML: HypoFuzz forks its workers after collection, and a CUDA runtime started here would
    # be unusable in them
    if spec.device != "cpu" and not config.getoption("smqa_require_gpu") and not gpu_workers.cuda_device_count():
        return NO_GPU.format(what=f"backend {name!r} (device {spec.device})")
    return not_applicable(spec, check, outside)


def target_of(item) -> FuzzTarget | None:
    return getattr(getattr(item, "callspec", None), "params", {}).get(ARG)


def select(item, state, profile: str) -> bool | None:
    """Whether the plugin keeps ``item`` when it is the fuzz entry or a test the entry replaces (the entry's
    kept items get their own keyed copy of the test and their table row); None for any other item."""
    on = enabled(item.config)
    if ARG in getattr(item, "fixturenames", ()):
        target = target_of(item)
        if not on or profile == "scale":
            return False
        if target is None:
            return True  # not parametrized: the backends did not load, and running it says why
        if state.checks and target.check not in state.checks:
            return False
        item.obj = fuzz_test(item.nodeid.encode())
        recorder(item, check=target.label, backend=target.name)
        return True
    if on and getattr(item, "originalname", None) in REPLACED and item.module.__name__ == CHECKS_MODULE:
        return False
    return None


def setup(item) -> None:
    """Before a fuzz item runs under pytest: its table row, the profile's settings (examples, phases,
    database; never applied at collection, where HypoFuzz reads them) and the backend's warm-up."""
    target = target_of(item)
    if target is None or target.plan is None:
        return
    if target.plan.backend.device != "cpu" and not torch.cuda.is_available():
        no_gpu(item.config, f"backend {target.name!r} (device {target.plan.backend.device})")
    state = run_state(item.config)
    target.recorder = rec = recorder(item)
    rec.tiles = dict(target.plan.backend.tiles)
    base = state.settings
    examples = profiles.drawn_examples(state.profile, base.max_examples, execution=get_check(target.check).execution)
    hypothesis_compat.use_settings(item.obj, settings(base, max_examples=examples))
    if not target.plan.compile:
        warm(item.config, state, target.name)
