"""Compile-aware drawing: a backend whose kernels compile per shape declares what they specialise on
(``compile_keys``), and a run draws those fields from a pool of at most N keys chosen before the checks.

``compile_keys`` names any Case field (``H``, ``L``, ``Dqk``, ``Dv``, ``sm_scale``, ``sink``, ``topk``, any other
mode, ...), derived values (``sink_given``, ``topk_given``), or ``CompileKey(name, field, fn)`` for a value the
backend derives from one field (its head group from H, say). The pool holds the keys of the explicit boundary
examples (``boundaries``) first, then keys of drawn cases up to the budget; each entry fixes its fields to every
value that gives the same key (a size within the limits, a field's declared modes, both booleans, else the values
the pool's cases drew: a float such as sm_scale), and the strategies draw an entry and only the free fields, so
shrinking stays inside the pool and no case compiles a new kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from ..backends.spec import BackendSpec
from .case import MODES, Case
from .strategies import backend_dims

SIZE_FIELDS = ("B", "S", "Skv", "H", "L")  # drawn from 1 up to the run's limits
DIM_FIELDS = ("Dqk", "Dv")  # drawn as the backend's (Dqk, Dv) pairs
BUDGET_ENV = "SMQA_COMPILE_BUDGET"
DEFAULT_BUDGET = {"dev": 16, "ci": 16, "nightly": 32, "scale": 16}  # dev: the boundary examples need up to ~12


def case_fields() -> tuple[str, ...]:
    """Every field of ``Case``, each a possible compile key."""
    return tuple(f.name for f in dataclasses.fields(Case))


@dataclass(frozen=True)
class CompileKey:
    """A value a backend's kernels specialise on, derived from one Case field by ``fn``."""

    name: str
    field: str
    fn: Callable

    def __call__(self, case: Case):
        return self.fn(getattr(case, self.field))


DERIVED = {
    "sink_given": CompileKey("sink_given", "sink", lambda mode: mode != "none"),
    "topk_given": CompileKey("topk_given", "topk", lambda mode: mode != "none"),
}


def resolve(backend) -> tuple[CompileKey, ...]:
    """The backend's ``compile_keys`` as CompileKey objects; ValueError naming the backend for an unknown one."""
    spec = BackendSpec.of(backend)
    declared, name = spec.compile_keys, spec.name
    fields = case_fields()
    out = []
    for k in declared:
        if isinstance(k, CompileKey):
            if k.field not in fields:
                raise ValueError(f"backend {name!r}: compile key {k.name!r} derives from {k.field!r}, which is "
                                 f"not a Case field; choose from {', '.join(fields)}")
            out.append(k)
        elif k in DERIVED:
            out.append(DERIVED[k])
        elif k in fields:
            out.append(CompileKey(k, k, lambda v: v))
        else:
            raise ValueError(f"backend {name!r}: compile_keys names {k!r}, which is neither a Case field nor a "
                             f"derived key; choose from {', '.join((*fields, *DERIVED))} or give a CompileKey")
    return tuple(out)


def key_of(case: Case, keys: tuple[CompileKey, ...]) -> tuple:
    return tuple(k(case) for k in keys)


@dataclass(frozen=True)
class Pool:
    """The keys a run may compile, each as the candidate values of the fields it fixes."""

    keys: tuple[CompileKey, ...]
    entries: tuple[dict, ...]  # field -> tuple of allowed values (dims as (Dqk, Dv) pairs)
    values: tuple[tuple, ...]  # the key tuple of each entry, in the same order

    def __len__(self) -> int:
        return len(self.entries)


def _candidates(field: str, case: Case, limits: dict, seen: tuple[Case, ...]) -> tuple:
    """The values a pool entry may give ``field``: sizes from 1 to the limit, a field's declared modes, both
    booleans, else the values the pool's cases (``seen``) drew."""
    value = getattr(case, field)
    if field in SIZE_FIELDS:
        return tuple(range(1, max(limits.get(f"max_{field.lower()}", 1), value) + 1))
    if field in MODES:
        return tuple(MODES[field])
    if isinstance(value, bool):
        return (False, True)
    return tuple(dict.fromkeys(getattr(c, field) for c in (case, *seen)))


def _entry(case: Case, keys, dims: tuple, limits: dict, seen: tuple[Case, ...]) -> dict:
    """The fields a key tuple fixes, each with every value (within the limits) that gives the same key."""
    entry: dict = {}
    for k in keys:
        if k.field in DIM_FIELDS:
            entry["dims"] = tuple(d for d in dims if k(Case(Dqk=d[0], Dv=d[1])) == k(case)
                                  and d in entry.get("dims", dims))
            continue
        same = tuple(v for v in _candidates(k.field, case, limits, seen) if k.fn(v) == k(case))
        entry[k.field] = tuple(v for v in same if v in entry.get(k.field, same))
    return entry


def choose_pool(backend, examples: tuple[Case, ...], *, budget: int, limits: dict, drawn: list[Case]) -> Pool | None:
    """The pool for a backend with compile keys (None without): the keys of the explicit boundary ``examples``,
    then keys of ``drawn`` cases (in order) up to ``budget``. ValueError naming the backend when the examples
    alone need more than the budget."""
    keys = resolve(backend)
    if not keys:
        return None
    name = BackendSpec.of(backend).name
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"backend {name!r}: the compile budget must be an int >= 1, got {budget!r}")
    dims = backend_dims(backend)
    values, entries = [], []
    seen = (*examples, *drawn)
    for case in seen:
        v = key_of(case, keys)
        if v in values:
            continue
        if len(values) >= budget:
            if case in examples:
                need = len({key_of(c, keys) for c in examples})
                raise ValueError(f"backend {name!r}: compile budget {budget} is smaller than the {need} kernel "
                                 f"keys its boundary examples need; give at least {need} (--smqa-compile-budget "
                                 f"or ${BUDGET_ENV})")
            break
        values.append(v)
        entries.append(_entry(case, keys, dims, limits, seen))
    return Pool(keys, tuple(entries), tuple(values))
