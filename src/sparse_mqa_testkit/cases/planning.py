"""What a run of the suite draws for one backend, settled before any check: the size limits, the explicit
boundary examples, the pool of compile keys, and the warm-up that compiles each pooled key once.

Every process (each xdist worker too) computes the same plan from the same inputs; the nightly profile turns
the rotation each day, so keys outside today's pool get their turn on later nights.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from ..backends.spec import BackendSpec
from .boundaries import Boundaries, explicit_examples
from .compile_keys import BUDGET_ENV, DEFAULT_BUDGET, Pool, choose_pool, key_of, resolve
from .strategies import DrawTarget, cases_for, device_limits, draw_examples

POOL_DRAWS = 200  # drawn cases whose keys fill the pool after the boundary examples' keys


@dataclass
class Plan:
    """The run's plan for one backend. draw: what the strategies draw for; boundaries: the explicit examples;
    drawn: the cases whose keys filled the pool; compile: warm-up seconds and keys (empty until warmed up)."""

    draw: DrawTarget
    boundaries: Boundaries
    drawn: tuple = ()
    compile: dict = field(default_factory=dict)

    @property
    def pool(self) -> Pool | None:
        return self.draw.pool

    @property
    def backend(self) -> BackendSpec:
        return self.draw.backend

    def warmup_cases(self) -> list:
        """One case per pooled key (the first that has it), or every boundary example without a pool."""
        if self.pool is None:
            return list(self.boundaries.examples)
        out, seen = [], set()
        for case in self.boundaries.examples + self.drawn:
            k = key_of(case, self.pool.keys)
            if k in self.pool.values and k not in seen:
                seen.add(k)
                out.append(case)
        return out


def rotation(profile: str) -> int:
    """0 for dev and ci (the same plan every run); the UTC day number for nightly."""
    return datetime.now(timezone.utc).toordinal() if profile == "nightly" else 0


def compile_budget(given, profile: str) -> int:
    """The compile budget: ``given``, else $SMQA_COMPILE_BUDGET, else the profile's default; ValueError naming
    where a bad value came from."""
    raw, where = (given, "--smqa-compile-budget") if given is not None else (os.environ.get(BUDGET_ENV), BUDGET_ENV)
    if raw is None or str(raw).strip() == "":
        return DEFAULT_BUDGET[profile]
    if not str(raw).strip().isdigit() or int(raw) < 1:
        raise ValueError(f"{where} must be a positive integer (kernel keys a run may compile), got {raw!r}")
    return int(raw)


def plan_backend(backend, *, profile: str, budget: int, limits: dict | None = None, draws: int = POOL_DRAWS) -> Plan:
    """The plan for ``backend``; ValueError naming the backend for a bad compile-key declaration or a budget
    smaller than its boundary examples need. ``draws=0`` finds those errors without drawing (no Hypothesis: what
    a pytest plugin may do while pytest starts); its pool holds the boundary examples' keys only."""
    backend = BackendSpec.of(backend)
    lim = {**device_limits(backend), **(limits or {})}
    seed = rotation(profile)
    boundaries = explicit_examples(backend, max_work=lim["max_work"], seed=seed)
    drawn = ()
    if resolve(backend) and draws:
        drawn = tuple(draw_examples(cases_for(backend, **(limits or {})), draws, seed=seed or None))
    pool = choose_pool(backend, boundaries.examples, budget=budget, limits=lim, drawn=drawn)
    return Plan(DrawTarget(backend, pool, dict(limits or {})), boundaries, drawn)


def warm_up(plan: Plan) -> dict:
    """The backend's warm-up on the plan's cases, timed; returns and records {"seconds", "keys"}."""
    t0 = time.monotonic()
    plan.backend.warmup(plan.warmup_cases())
    plan.compile = {"seconds": round(time.monotonic() - t0, 3), "keys": len(plan.pool) if plan.pool else None}
    return plan.compile
