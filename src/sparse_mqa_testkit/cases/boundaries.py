"""The boundary classes a backend's declared domain allows, and few explicit cases that visit them all.

A class is a label ``strategies.case_events`` reports (``H on tile``, ``sink pos_inf``, ``L > Skv``,
``dims 576/512``, ...). Each class has a requirement (the fields that put a case in it). The explicit examples
merge compatible requirements into as few cases as the backend's ``supports`` and a work cap allow, so that
every check can run every reachable class at least once, cheaply, before Hypothesis explores. A merge stands only
where every class of the example still bites (``coverage.effective_events``: an edge slot made invalid or an
edge row made empty by another mode is a class by name only); the merges left out are listed. A class no case
inside the domain can reach is listed with the reason ``supports`` gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..backends.spec import BackendSpec
from ..backends.tiles import tile_at, tile_ranges
from .case import INVALID_MODES, MAGNITUDES, PATTERNS, SINK_MODES, TOPK_MODES, WIDE_TILE, Case
from .coverage import effective_events
from .strategies import INEXACT_SCALE, TILE_OF, backend_dims, ranged, tile_label

H_SMALL = (1, 2, 15)  # "H < 16": the smallest the domain allows
UNDECLARED_TILE = 64  # the one of the common tile sizes an explicit case visits for a tile not declared
BASE = dict(B=1, S=2, Skv=8, H=2, L=4)  # the explicit examples start here
RESEEDS = 8  # seeds tried for an example whose draws happen to leave one of its classes toothless


@dataclass(frozen=True)
class Boundaries:
    """examples: explicit cases covering every reachable class (each bites in at least one); unreachable: class
    -> why no case can be in it; classes: every reachable class label; rejected: merges left out because they
    would have cancelled a class's boundary."""

    examples: tuple[Case, ...]
    classes: tuple[str, ...]
    unreachable: dict = field(default_factory=dict)
    rejected: tuple[str, ...] = ()


def _head_ranges(tiles: dict, key: str) -> list[tuple[int, dict]]:
    """(the tile size, the field H must take to be in its head range, or {}) per distinct size of ``key``; the
    undeclared tile as the common size ``UNDECLARED_TILE``."""
    ranges = tile_ranges(tiles, key)
    if len(ranges) < 2:
        return [(tile_at(tiles, key, BASE["H"]) or UNDECLARED_TILE, {})]
    return [(t, {"H": BASE["H"] if lo <= BASE["H"] <= (hi or BASE["H"]) else lo}) for lo, hi, t in ranges]


def requirements(backend) -> dict[str, list[dict]]:
    """class label -> the field assignments that put a case in it, most preferred first."""
    spec = BackendSpec.of(backend)
    tiles = spec.tiles
    req: dict[str, list[dict]] = {f"sink {m}": [{"sink": m}] for m in SINK_MODES}
    req["sink far"] = [{"sink": "far", "magnitude": "peaky", "sm_scale": INEXACT_SCALE}]  # beside lse near 400
    req |= {f"topk {m}": [{"topk": m}] for m in TOPK_MODES}
    req |= {f"invalid {m}": [{"invalid": m}] for m in INVALID_MODES if m not in ("leading", "middle")}  # below
    req["duplicates"] = [{"duplicates": True}]
    req["empty lse -inf"] = [{"empty_lse": "neg_inf", "invalid": "empty_rows"}]
    req |= {f"pattern {m}": [{"pattern": m}] for m in PATTERNS}
    req |= {f"magnitude {m}": [{"magnitude": m}] for m in MAGNITUDES if m != "unit"}
    req["magnitude peaky"] = [{"magnitude": "peaky", "sm_scale": INEXACT_SCALE}]
    req["H < 16"] = [{"H": h} for h in H_SMALL]
    req["L > Skv"] = [{"Skv": 2, "L": 4}, {"Skv": 1, "L": 2}]
    for dqk, dv in backend_dims(spec):
        req[f"dims {dqk}/{dv}"] = [{"Dqk": dqk, "Dv": dv}]
    for size, key in TILE_OF.items():
        for t, heads in _head_ranges(tiles, key):
            if t > 2:  # below / on / above are distinct classes only for tiles > 2
                for where, n in (("below", t - 1), ("on", t), ("above", t + 1)):
                    label = tile_label(size, where, tiles, key, heads.get("H", BASE["H"]))
                    req[label] = [{size: n, **heads}]
    # top-k lengths and whole invalid tiles, on each top-k tile the kernel has (every grid length in some row:
    # as many rows as the grid has lengths)
    req["topk length <= 0"] = [{"topk": "edges", "S": 8}]
    for t, heads in _head_ranges(tiles, "topk_block"):
        H = heads.get("H", BASE["H"])
        declared = {"topk_tile": t} if tile_at(tiles, "topk_block", H) else {}
        run = t if declared else 16  # without a declared tile the mode's own choice below L: 16 at L = 20
        req[ranged("topk length at tile edge", tiles, "topk_block", H)] = [
            {"topk": "edges", "L": t + 2, "S": 16, **declared, **heads}]
        req["topk length 511-513"] = [{"topk": "edges", "L": WIDE_TILE + 2, "S": 24, **declared, **heads}]
        for mode, L in (("leading", run + 4), ("middle", 2 * run + 4)):  # valid slots before (middle) and after
            req[ranged(f"invalid {mode}", tiles, "topk_block", H)] = [{"invalid": mode, "L": L, **declared, **heads}]
    hg = tile_at(tiles, "head_group", 1)
    if hg and hg > BASE["H"]:
        req["query tile"] = [{"pattern": "disjoint", "S": 4}]
    return req


def _work(case: Case) -> int:
    return case.B * case.S * case.H * case.L * case.Dqk


def _fields(m: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in sorted(m.items()))


def explicit_examples(backend, *, max_work: int, seed: int = 0) -> Boundaries:
    """Few cases, inside the backend's domain, that together make every class it can reach bite.

    Requirements are merged greedily into the first example that has no conflicting field, stays inside the
    domain and within ``max_work`` (B*S*H*L*Dqk; a single requirement may exceed it: a tile boundary is worth
    one large case), and keeps every class of the example biting; a class no example makes bite gets a case of
    its own (other seeds tried when its draws leave it toothless).
    """
    spec = BackendSpec.of(backend)
    dqk, dv = backend_dims(spec)[0]
    base = Case(**BASE, Dqk=dqk, Dv=dv, seed=seed)
    tiles = spec.tiles
    merged: list[dict] = []
    claims: list[set] = []
    unreachable: dict[str, str] = {}
    solo: dict[str, dict] = {}
    rejected: list[str] = []
    for label, options in requirements(spec).items():
        for opt in options:
            reason = spec.supports(base.replace(**opt))
            if reason is None:
                solo[label] = opt
                break
        else:
            unreachable[label] = reason
            continue
        for i, m in enumerate(merged):
            if any(k in m and m[k] != v for k, v in solo[label].items()):
                continue
            trial = base.replace(**{**m, **solo[label]}, seed=seed + i)
            if spec.supports(trial) is not None or _work(trial) > max(max_work, _work(base)):
                continue
            lost = (claims[i] | {label}) - effective_events(trial, tiles)
            if lost:
                rejected.append(f"{label} into example {i} ({_fields(m)}): {', '.join(sorted(lost))} would not bite")
                continue
            m.update(solo[label])
            claims[i].add(label)
            break
        else:
            merged.append(dict(solo[label]))
            claims.append({label})
    examples = [base.replace(**m, seed=seed + i) for i, m in enumerate(merged)]
    seen = {label for c in examples for label in effective_events(c, tiles)}
    for label in sorted(set(solo) - seen):
        case = next((c for k in range(RESEEDS) for c in [base.replace(**solo[label], seed=seed + 1000 * (k + 1))]
                     if label in effective_events(c, tiles)), None)
        if case is None:
            unreachable[label] = f"no case with {_fields(solo[label])} made it bite in {RESEEDS} seeds"
            solo.pop(label)
        else:
            examples.append(case)
    return Boundaries(tuple(examples), tuple(sorted(solo)), unreachable, tuple(rejected))
