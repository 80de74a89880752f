"""The boundary classes a backend's declared domain allows, and few explicit cases that visit them all.

A class is a label ``strategies.case_events`` reports (``H on tile``, ``sink pos_inf``, ``L > Skv``,
``dims 576/512``, ...). Each class has a requirement (the fields that put a case in it). The explicit examples
merge compatible requirements into as few cases as the backend's ``supports`` and a work cap allow, so that
every check can run every reachable class at least once, cheaply, before Hypothesis explores. A class no case
inside the domain can reach is listed with the reason ``supports`` gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..backends.spec import BackendSpec
from .case import INVALID_MODES, MAGNITUDES, PATTERNS, SINK_MODES, TOPK_MODES, Case
from .strategies import TILE_OF, backend_dims, case_events

H_SMALL = (1, 2, 15)  # "H < 16": the smallest the domain allows
UNDECLARED_TILE = 64  # the one of the common tile sizes an explicit case visits for a tile not declared


@dataclass(frozen=True)
class Boundaries:
    """examples: explicit cases covering every reachable class; unreachable: class -> why no case can be in
    it; classes: every reachable class label."""

    examples: tuple[Case, ...]
    classes: tuple[str, ...]
    unreachable: dict = field(default_factory=dict)


def requirements(backend) -> dict[str, list[dict]]:
    """class label -> the field assignments that put a case in it, most preferred first."""
    tiles = BackendSpec.of(backend).tiles
    req: dict[str, list[dict]] = {f"sink {m}": [{"sink": m}] for m in SINK_MODES}
    req |= {f"topk {m}": [{"topk": m}] for m in TOPK_MODES}
    req |= {f"invalid {m}": [{"invalid": m}] for m in INVALID_MODES}
    req["duplicates"] = [{"duplicates": True}]
    req["empty lse -inf"] = [{"empty_lse": "neg_inf", "invalid": "empty_rows"}]
    req |= {f"pattern {m}": [{"pattern": m}] for m in PATTERNS}
    req |= {f"magnitude {m}": [{"magnitude": m}] for m in MAGNITUDES if m != "unit"}
    req["H < 16"] = [{"H": h} for h in H_SMALL]
    req["L > Skv"] = [{"Skv": 2, "L": 4}, {"Skv": 1, "L": 2}]
    for dqk, dv in backend_dims(backend):
        req[f"dims {dqk}/{dv}"] = [{"Dqk": dqk, "Dv": dv}]
    for size, key in TILE_OF.items():
        t = tiles.get(key) or UNDECLARED_TILE
        if t > 2:  # below / on / above are distinct classes only for tiles > 2
            for where, n in (("below", t - 1), ("on", t), ("above", t + 1)):
                req[f"{size} {where} tile"] = [{size: n}]
    return req


def _work(case: Case) -> int:
    return case.B * case.S * case.H * case.L * case.Dqk


def explicit_examples(backend, *, max_work: int, seed: int = 0) -> Boundaries:
    """Few cases, inside the backend's domain, that together visit every class it can reach.

    Requirements are merged greedily into the first example that has no conflicting field, stays inside the
    domain and within ``max_work`` (B*S*H*L*Dqk; a single requirement may exceed it: a tile boundary is worth
    one large case); a class a merge lost (``L > Skv`` after L grew, say) gets a case of its own.
    """
    spec = BackendSpec.of(backend)
    dqk, dv = backend_dims(spec)[0]
    base = Case(B=1, S=2, Skv=8, H=2, L=4, Dqk=dqk, Dv=dv, seed=seed)
    tiles = spec.tiles
    merged: list[dict] = []
    unreachable: dict[str, str] = {}
    solo: dict[str, dict] = {}
    for label, options in requirements(spec).items():
        for opt in options:
            reason = spec.supports(base.replace(**opt))
            if reason is None:
                solo[label] = opt
                break
        else:
            unreachable[label] = reason
            continue
        for m in merged:
            if any(k in m and m[k] != v for k, v in solo[label].items()):
                continue
            trial = base.replace(**{**m, **solo[label]})
            if spec.supports(trial) is None and _work(trial) <= max(max_work, _work(base)):
                m.update(solo[label])
                break
        else:
            merged.append(dict(solo[label]))
    examples = [base.replace(**m, seed=seed + i) for i, m in enumerate(merged)]
    seen = {label for c in examples for label in case_events(c, tiles)}
    for label in sorted(set(solo) - seen):
        examples.append(base.replace(**solo[label], seed=seed + len(examples)))
    return Boundaries(tuple(examples), tuple(sorted(solo)), unreachable)
