"""Compile-aware drawing: a backend whose kernels compile per shape declares what they specialise on
(``compile_keys``), and a run draws those fields from a pool of at most N keys chosen before the checks.

``compile_keys`` names Case fields (``H``, ``L``, ``Dqk``, ``Dv``, ``B``, ``S``, ``Skv``, ``sink``, ``topk``, ...),
derived values (``sink_given``, ``topk_given``), or ``CompileKey(name, field, fn)`` for a value the backend
derives from one size field (its head group from H, say). The pool holds the keys of the explicit boundary
examples (``boundaries``) first, then keys of drawn cases up to the budget; the strategies draw a pool entry
and only the free fields, so shrinking stays inside the pool and no case compiles a new kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..backends.spec import BackendSpec
from .case import SINK_MODES, TOPK_MODES, Case
from .strategies import backend_dims

SIZE_FIELDS = ("B", "S", "Skv", "H", "L", "Dqk", "Dv")
MODE_FIELDS = {"sink": SINK_MODES, "topk": TOPK_MODES}
BUDGET_ENV = "SMQA_COMPILE_BUDGET"
DEFAULT_BUDGET = {"dev": 8, "ci": 16, "nightly": 32, "scale": 16}


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
    known = (*SIZE_FIELDS, *MODE_FIELDS, *DERIVED)
    out = []
    for k in declared:
        if isinstance(k, CompileKey):
            if k.field not in SIZE_FIELDS + tuple(MODE_FIELDS):
                raise ValueError(f"backend {name!r}: compile key {k.name!r} derives from {k.field!r}, which is "
                                 f"not a Case field; choose from {', '.join(SIZE_FIELDS + tuple(MODE_FIELDS))}")
            out.append(k)
        elif k in DERIVED:
            out.append(DERIVED[k])
        elif k in SIZE_FIELDS or k in MODE_FIELDS:
            out.append(CompileKey(k, k, lambda v: v))
        else:
            raise ValueError(f"backend {name!r}: compile_keys names {k!r}, which is neither a Case field nor a "
                             f"derived key; choose from {', '.join(known)} or give a CompileKey")
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


def _entry(case: Case, keys, dims: tuple, limits: dict) -> dict:
    """The fields a key tuple fixes, each with every value (within the limits) that gives the same key."""
    entry: dict = {}
    for k in keys:
        if k.field in ("Dqk", "Dv"):
            entry["dims"] = tuple(d for d in dims if k(Case(Dqk=d[0], Dv=d[1])) == k(case)
                                  and d in entry.get("dims", dims))
        elif k.field in MODE_FIELDS:
            entry[k.field] = tuple(m for m in MODE_FIELDS[k.field] if k(case.replace(**{k.field: m})) == k(case))
        else:
            top = max(limits.get(f"max_{k.field.lower()}", 1), getattr(case, k.field))
            same = tuple(v for v in range(1, top + 1) if k.fn(v) == k(case))
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
    for case in (*examples, *drawn):
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
        entries.append(_entry(case, keys, dims, limits))
    return Pool(keys, tuple(entries), tuple(values))
