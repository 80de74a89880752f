"""Hypothesis strategies that draw ``Case`` values: configurations and a seed, never element-wise arrays.

Sizes are biased toward tile boundaries: for each tile t a backend declares (head_group, query_chunk,
topk_block), H, S and L are drawn at t-1, t, t+1 (and small multiples), and H < 16 is always in the mix.
Each boundary class is reported with ``hypothesis.event`` so a run shows what it covered.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from . import contract
from .cases import INVALID_MODES, ORDERS, SINK_MODES, TOPK_MODES, Case

# Small dims keep CPU runs fast; production dims are added when the backend asks for them.
SMALL_DIMS = ((16, 8), (8, 8), (24, 16), (5, 3), (1, 1))


def near_multiples(tile: int, max_mult: int = 2) -> list[int]:
    """t-1, t, t+1 at 1..max_mult multiples of a tile (sizes >= 1)."""
    out = set()
    for m in range(1, max_mult + 1):
        out.update(x for x in (m * tile - 1, m * tile, m * tile + 1) if x >= 1)
    return sorted(out)


def boundary_class(size: int, tile: int | None) -> str:
    """'below' / 'on' / 'above' a multiple of the tile, or 'interior'."""
    if not tile:
        return "interior"
    r = size % tile
    return "on" if r == 0 else "below" if r == tile - 1 else "above" if r == 1 else "interior"


def _size(limit: int, tile: int | None, floor: int = 1, reach: int | None = None) -> st.SearchStrategy[int]:
    """Uniform in [floor, limit], or a size near a tile multiple up to ``reach`` (default: the limit)."""
    limit = max(limit, floor)
    choices = st.integers(floor, limit)
    if tile:
        near = [x for x in near_multiples(tile) if floor <= x <= max(limit, reach or limit)]
        if near:
            choices = st.one_of(st.sampled_from(near), choices)
    return choices


def case_events(case: Case, tiles: dict | None = None) -> list[str]:
    """The boundary classes a case covers, as the labels the strategies report with ``hypothesis.event``."""
    tiles = tiles or {}
    out = [f"{name} {boundary_class(size, tiles.get(key))} tile"
           for name, size, key in (("H", case.H, "head_group"), ("S", case.S, "query_chunk"),
                                   ("L", case.L, "topk_block"))]
    if case.H < 16:
        out.append("H < 16")
    out += [f"sink {case.sink}", f"topk {case.topk}", f"invalid {case.invalid}"]
    if case.duplicates:
        out.append("duplicates")
    if case.L > case.Skv:
        out.append("L > Skv")
    return out


def _emit(case: Case, tiles: dict | None) -> Case:
    for label in case_events(case, tiles):
        event(label)
    return case


@st.composite
def cases(draw, *, dims=None, tiles: dict | None = None, max_b: int = 2, max_s: int = 24, max_skv: int = 48,
          max_h: int = 20, max_l: int = 40, sink_modes=SINK_MODES, topk_modes=TOPK_MODES,
          invalid_modes=INVALID_MODES, max_work: int | None = None) -> Case:
    """Draw a ``Case``.

    dims: (Dqk, Dv) pairs to choose from (default: small CPU sizes). tiles: the backend's declared
    ``head_group`` / ``query_chunk`` / ``topk_block``; sizes near one and two multiples of each are in the mix
    even past the limits. max_work caps B*S*H*L*Dqk (what the oracle pays): S is drawn first, then H and L
    within what is left, so a large tile boundary is reached with small other sizes.
    """
    tiles = dict(tiles or {})
    hg, qc, tb = tiles.get("head_group"), tiles.get("query_chunk"), tiles.get("topk_block")
    dqk, dv = draw(st.sampled_from(tuple(dims or SMALL_DIMS)))
    b = draw(st.integers(1, max_b))
    work = max_work or 1 << 62

    def room(*sizes):  # the largest next size that keeps B*...*Dqk within the work cap
        used = b * dqk
        for x in sizes:
            used *= x
        return max(1, work // used)

    s = draw(_size(min(max_s, room()), qc, reach=room()))
    h_cap = min(max_h, room(s))
    h = draw(st.one_of(st.integers(1, min(15, h_cap)), _size(h_cap, hg, reach=room(s))))
    l_ = draw(_size(min(max_l, room(s, h)), tb, reach=room(s, h)))
    skv = draw(st.integers(1, max_skv))
    case = Case(
        B=b, S=s, Skv=skv, H=h, L=l_, Dqk=dqk, Dv=dv,
        sm_scale=draw(st.sampled_from([None, 0.5, 1.0 / 192**0.5])),
        sink=draw(st.sampled_from(tuple(sink_modes))),
        topk=draw(st.sampled_from(tuple(topk_modes))),
        invalid=draw(st.sampled_from(tuple(invalid_modes))),
        duplicates=draw(st.booleans()),
        order=draw(st.sampled_from(ORDERS)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )
    return _emit(case, tiles)


# ---- drawing for a backend ------------------------------------------------------------------------------------
PRODUCTION_DIMS = contract.PRODUCTION_DIMS
# Defaults per device: CPU runs stay small; GPU runs reach H = 128 and production dims. max_work bounds what the
# NumPy oracle pays per case (B*S*H*L*Dqk; 8M is about 1 s for both float64 and float32 on one core).
CPU_LIMITS = dict(max_b=2, max_s=24, max_skv=48, max_h=20, max_l=40, max_work=1_500_000)
GPU_LIMITS = dict(max_b=2, max_s=64, max_skv=512, max_h=128, max_l=128, max_work=8_000_000)


def backend_dims(backend) -> tuple:
    """The (Dqk, Dv) pairs to draw for a backend: its declared ones, else small sizes (plus production on GPU).

    Production dims are drawn only for GPU backends (a CPU oracle at 576/512 is slow) unless the backend
    declares nothing else.
    """
    gpu = getattr(backend, "device", "cpu") != "cpu"
    declared = getattr(backend, "dims", None)
    if declared is None:
        return SMALL_DIMS + PRODUCTION_DIMS if gpu else SMALL_DIMS
    declared = tuple(map(tuple, declared))
    if gpu:
        return declared
    small = tuple(d for d in declared if d not in PRODUCTION_DIMS)
    return small or declared


def cases_for(backend, **limits) -> st.SearchStrategy[Case]:
    """Cases inside a backend's declared domain (``dims``, ``supports``), biased to its ``tiles``.

    ``limits`` override the per-device defaults (``CPU_LIMITS`` / ``GPU_LIMITS``) and any ``cases`` argument.
    """
    gpu = getattr(backend, "device", "cpu") != "cpu"
    kw = dict(GPU_LIMITS if gpu else CPU_LIMITS)
    kw.update(dims=backend_dims(backend), tiles=dict(getattr(backend, "tiles", None) or {}))
    kw.update(limits)
    supports = getattr(backend, "supports", None)
    strategy = cases(**kw)
    if callable(supports):
        strategy = strategy.filter(lambda c: supports(c) is None)
    return strategy


def outside_dims(backend) -> tuple:
    """(Dqk, Dv) pairs a backend with declared dims does not support (empty when it takes any)."""
    declared = getattr(backend, "dims", None)
    if declared is None:
        return ()
    declared = set(map(tuple, declared))
    near = [(16, 8), (8, 8), (64, 64), (576, 576), (576, 448), (512, 256), (640, 512)]
    return tuple(d for d in near if d not in declared)


def cases_outside(backend, **limits) -> st.SearchStrategy[Case]:
    """Cases a backend declares it does not support (dims outside ``dims``): it must refuse them."""
    kw = dict(CPU_LIMITS)
    kw.update(max_h=8, max_s=4, max_l=8, max_skv=16, dims=outside_dims(backend) or ((16, 8),))
    kw.update(limits)
    supports = getattr(backend, "supports", None)
    return cases(**kw).filter(lambda c: callable(supports) and supports(c) is not None)


TILE_OF = {"H": "head_group", "S": "query_chunk", "L": "topk_block"}


def boundary_examples(backend) -> dict[str, Case]:
    """Each boundary class a backend's declared domain allows -> one small case in it (tiles > 2 only have
    distinct below / on / above classes)."""
    tiles = dict(getattr(backend, "tiles", None) or {})
    dqk, dv = backend_dims(backend)[0]
    base = Case(B=1, S=2, Skv=8, H=2, L=4, Dqk=dqk, Dv=dv)
    want = {f"sink {m}": base.replace(sink=m) for m in SINK_MODES}
    want |= {f"topk {m}": base.replace(topk=m) for m in TOPK_MODES}
    want |= {f"invalid {m}": base.replace(invalid=m) for m in INVALID_MODES}
    want |= {"H < 16": base.replace(H=1), "duplicates": base.replace(duplicates=True)}
    for size, key in TILE_OF.items():
        t = tiles.get(key, 0)
        if t > 2:
            for where, n in (("below", t - 1), ("on", t), ("above", t + 1)):
                want[f"{size} {where} tile"] = base.replace(**{size: n})
    supports = getattr(backend, "supports", None)
    return {k: c for k, c in want.items() if not callable(supports) or supports(c) is None}


# ---- the suite's strategy: cases for whichever backend the running test was given -----------------------------
# The plugin puts the running test's backend here (in the pytest item's stash) before the test is called.
BACKEND = pytest.StashKey[object]()


def _running_backend():
    """The backend of the pytest test whose Hypothesis test is drawing now, or None."""
    # Hypothesis's pytest plugin records the item it is running; the backend is in that item's own stash
    from hypothesis.internal.escalation import current_pytest_item

    item = current_pytest_item.value
    return None if item is None else item.stash.get(BACKEND, None)


@st.composite
def backend_cases(draw, *, outside: bool = False, **limits) -> Case:
    """``cases_for`` the running test's backend (``cases_outside`` with ``outside=True``), resolved at draw time.

    Lets a test write ``@given(case=backend_cases())`` and take ``smqa_backend`` as a fixture, so a failing
    case prints (and patches in as ``@example(case=Case(...))``) on its own.
    """
    backend = _running_backend()
    if backend is None:
        raise RuntimeError("backend_cases() draws for the backend of the test running it: use it in a test that "
                           "takes the smqa_backend fixture (sparse_mqa_testkit's pytest plugin)")
    make = cases_outside if outside else cases_for
    return draw(make(backend, **limits))


def draw_examples(strategy, n: int) -> list:
    """The first ``n`` examples of a derandomized run of ``strategy`` (the same every time), outside @given."""
    box: list = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def grab(x):
        if len(box) < n:
            box.append(x)

    grab()
    return box
