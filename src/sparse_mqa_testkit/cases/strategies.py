"""Hypothesis strategies that draw ``Case`` values: configurations and a seed, never element-wise arrays.

Sizes are biased toward tile boundaries: for each tile t a backend declares (head_group, query_chunk,
topk_block), H, S and L are drawn at t-1, t, t+1 (and small multiples), and H < 16 is always in the mix. For a
tile the backend does not declare, the common sizes 16, 32, 64 and 128 take its place. Each boundary class is
reported with ``hypothesis.event`` so a run shows what it covered.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from .. import contract
from ..backends.spec import BackendSpec
from ..backends.tiles import tile_at, tile_ranges
from ..oracle.bf16 import round_bf16
from .case import (
    COMMON_TILES,
    EMPTY_LSE_MODES,
    INVALID_MODES,
    MAGNITUDES,
    ORDERS,
    PATTERNS,
    SINK_MODES,
    TOPK_MODES,
    WIDE_TILE,
    Case,
)

# Small dims keep CPU runs fast; production dims are added when the backend asks for them.
SMALL_DIMS = ((16, 8), (8, 8), (24, 16), (5, 3), (1, 1))
# sm_scale for peaky logits when the drawn one is exact in bf16: DeepSeek's 1/sqrt(192), which is not, so a kernel
# that rounds sm_scale to bf16 is off by up to 2^-9 of logits of a few hundred
INEXACT_SCALE = 1.0 / 192 ** 0.5


def _tiles(tile) -> tuple[int, ...]:
    """A declared tile as a tuple; no declaration means the common tile sizes."""
    if isinstance(tile, tuple):
        return tile
    return (tile,) if tile else COMMON_TILES


def near_multiples(tile: int, max_mult: int = 2) -> list[int]:
    """t-1, t, t+1 at 1..max_mult multiples of a tile (sizes >= 1)."""
    out = set()
    for m in range(1, max_mult + 1):
        out.update(x for x in (m * tile - 1, m * tile, m * tile + 1) if x >= 1)
    return sorted(out)


def boundary_class(size: int, tile) -> str:
    """'below' / 'on' / 'above' a multiple of the tile (of any of the common sizes when ``tile`` is None or
    a tuple of them), or 'interior'."""
    rs = [(size % t, t) for t in _tiles(tile)]
    for where, hit in (("on", lambda r, t: r == 0), ("below", lambda r, t: r == t - 1),
                       ("above", lambda r, t: r == 1)):
        if any(hit(r, t) for r, t in rs):
            return where
    return "interior"


def _size(limit: int, tile, floor: int = 1, reach: int | None = None) -> st.SearchStrategy[int]:
    """Uniform in [floor, limit], or a size near a tile multiple (the common sizes without a declared tile)
    up to ``reach`` (default: the limit)."""
    limit = max(limit, floor)
    choices = st.integers(floor, limit)
    mults = 2 if tile and not isinstance(tile, tuple) else 1
    near = sorted({x for t in _tiles(tile) for x in near_multiples(t, mults)
                   if floor <= x <= max(limit, reach or limit)})
    if near:
        choices = st.one_of(st.sampled_from(near), choices)
    return choices


def ranged(label: str, tiles: dict, key: str, H: int) -> str:
    """``label``, naming the head range when the declared size of tile ``key`` depends on H (the class is then
    one per size: ``"L on tile [H 1-16: 32]"``)."""
    ranges = tile_ranges(tiles, key)
    if len(ranges) < 2:
        return label
    lo, hi, t = next(r for r in ranges if r[0] <= H and (r[1] is None or H <= r[1]))
    return f"{label} [H {lo}-{hi if hi is not None else ''}: {t}]"


def tile_label(name: str, where: str, tiles: dict, key: str, H: int) -> str:
    """``"L on tile"`` (with the head range where the tile depends on H)."""
    return ranged(f"{name} {where} tile", tiles, key, H)


def topk_tile_edges(case: Case) -> tuple[int, ...]:
    """The lengths of ``case.edge_lengths()`` one below, on or above a top-k tile (not the -3..1 and 511-513)."""
    return tuple(v for v in case.edge_lengths() if any(abs(v - t) <= 1 for t in case.topk_tiles()) and v > 1)


def case_events(case: Case, tiles: dict | None = None) -> list[str]:
    """The boundary classes a case covers, as the labels the strategies report with ``hypothesis.event``."""
    tiles = tiles or {}
    out = [tile_label(name, boundary_class(size, tile_at(tiles, key, case.H)), tiles, key, case.H)
           for name, size, key in (("H", case.H, "head_group"), ("S", case.S, "query_chunk"),
                                   ("L", case.L, "topk_block"))]
    if case.H < 16:
        out.append("H < 16")
    out += [f"dims {case.Dqk}/{case.Dv}", f"sink {case.sink}", f"topk {case.topk}", f"invalid {case.invalid}"]
    if case.invalid in ("leading", "middle"):  # one class per top-k tile the kernel has
        out[-1] = ranged(out[-1], tiles, "topk_block", case.H)
    if case.topk == "edges":
        out.append("topk length <= 0")
        if topk_tile_edges(case):
            out.append(ranged("topk length at tile edge", tiles, "topk_block", case.H))
        if case.L + 1 >= WIDE_TILE + 1:
            out.append("topk length 511-513")
    hg = tile_at(tiles, "head_group", case.H)
    if case.pattern == "disjoint" and hg and hg > case.H and case.S > 1:
        out.append("query tile")
    if case.duplicates:
        out.append("duplicates")
    if case.empty_lse == "neg_inf":
        out.append("empty lse -inf")
    out.append(f"pattern {case.pattern}")
    if case.magnitude != "unit":
        out.append(f"magnitude {case.magnitude}")
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
          invalid_modes=INVALID_MODES, magnitudes=MAGNITUDES, max_work: int | None = None, pool=None) -> Case:
    """Draw a ``Case``.

    dims: (Dqk, Dv) pairs to choose from (default: small CPU sizes). tiles: the backend's declared
    ``head_group`` / ``query_chunk`` / ``topk_block``; sizes near one and two multiples of each are in the mix
    even past the limits. max_work caps B*S*H*L*Dqk (what the oracle pays): S is drawn first, then H and L
    within what is left, so a large tile boundary is reached with small other sizes. pool: a
    ``compile_keys.Pool``; its entry, drawn first, fixes the fields a backend's kernels compile on.
    """
    tiles = dict(tiles or {})
    fixed = draw(st.sampled_from(pool.entries)) if pool else {}
    picked = set()

    def pick(field, strategy):
        picked.add(field)
        return draw(st.sampled_from(fixed[field]) if field in fixed else strategy)

    dqk, dv = pick("dims", st.sampled_from(tuple(dims or SMALL_DIMS)))
    b = pick("B", st.integers(1, max_b))
    work = max_work or 1 << 62

    def room(*sizes):  # the largest next size that keeps B*...*Dqk within the work cap
        used = b * dqk
        for x in sizes:
            used *= x
        return max(1, work // used)

    hg = tiles.get("head_group")  # a head group cannot depend on H; the other tiles may (ByHeads)
    if "H" in fixed or "L" in fixed:  # the kernel sizes are the pool's: S gets what the work cap leaves
        h = pick("H", st.one_of(st.integers(1, min(15, max_h)), _size(max_h, hg)))
        l_ = pick("L", _size(min(max_l, room(h)), tile_at(tiles, "topk_block", h), reach=room(h)))
        s = pick("S", _size(min(max_s, room(h, l_)), tile_at(tiles, "query_chunk", h), reach=room(h, l_)))
    else:
        s = pick("S", _size(min(max_s, room()), tile_at(tiles, "query_chunk", 1), reach=room()))
        h_cap = min(max_h, room(s))
        h = draw(st.one_of(st.integers(1, min(15, h_cap)), _size(h_cap, hg, reach=room(s))))
        l_ = draw(_size(min(max_l, room(s, h)), tile_at(tiles, "topk_block", h), reach=room(s, h)))
    skv = pick("Skv", st.integers(1, max_skv))
    case = Case(
        B=b, S=s, Skv=skv, H=h, L=l_, Dqk=dqk, Dv=dv,
        sm_scale=pick("sm_scale", st.sampled_from([None, 0.5, INEXACT_SCALE])),
        sink=pick("sink", st.sampled_from(tuple(sink_modes))),
        topk=pick("topk", st.sampled_from(tuple(topk_modes))),
        invalid=pick("invalid", st.sampled_from(tuple(invalid_modes))),
        duplicates=pick("duplicates", st.booleans()),
        order=pick("order", st.sampled_from(ORDERS)),
        empty_lse=pick("empty_lse", st.sampled_from(EMPTY_LSE_MODES)),
        pattern=pick("pattern", st.sampled_from(PATTERNS)),
        magnitude=pick("magnitude", st.sampled_from(tuple(magnitudes))),
        topk_tile=tile_at(tiles, "topk_block", h) or 0,
        seed=pick("seed", st.integers(0, 2**32 - 1)),
    )
    rest = {f: draw(st.sampled_from(v)) for f, v in fixed.items() if f not in picked}
    if rest:  # a field the pool fixes that is drawn above without pick(): the pool's value still holds
        case = case.replace(**rest)
    return _emit(case if "sm_scale" in fixed else peaky_scale(case), tiles)


def bf16_exact(x: float) -> bool:
    return float(round_bf16(x).astype("float32")) == x


def peaky_scale(case: Case) -> Case:
    """A peaky case with an sm_scale exact in bf16 takes ``INEXACT_SCALE`` instead: at logits of a few hundred,
    a kernel that rounds sm_scale to bf16 must show it (unless a compile pool fixes sm_scale)."""
    if case.magnitude == "peaky" and bf16_exact(case.scale):
        return case.replace(sm_scale=INEXACT_SCALE)
    return case


# ---- drawing for a backend ------------------------------------------------------------------------------------
PRODUCTION_DIMS = contract.PRODUCTION_DIMS
# Defaults per device: CPU runs stay small; GPU runs reach H = 128 and production dims. max_work bounds what the
# NumPy oracle pays per case (B*S*H*L*Dqk; 8M is about 1 s for both float64 and float32 on one core).
CPU_LIMITS = dict(max_b=2, max_s=24, max_skv=48, max_h=20, max_l=40, max_work=1_500_000)
GPU_LIMITS = dict(max_b=2, max_s=64, max_skv=512, max_h=128, max_l=128, max_work=8_000_000)


def device_limits(backend) -> dict:
    """The default size limits for the backend's device (``GPU_LIMITS`` or ``CPU_LIMITS``)."""
    return dict(GPU_LIMITS if BackendSpec.of(backend).device != "cpu" else CPU_LIMITS)


def backend_dims(backend) -> tuple:
    """The (Dqk, Dv) pairs to draw for a backend: its declared ones, else small sizes (plus production on GPU).

    Production dims are drawn only for GPU backends (a CPU oracle at 576/512 is slow) unless the backend
    declares nothing else.
    """
    spec = BackendSpec.of(backend)
    gpu = spec.device != "cpu"
    if spec.dims is None:
        return SMALL_DIMS + PRODUCTION_DIMS if gpu else SMALL_DIMS
    if gpu:
        return spec.dims
    small = tuple(d for d in spec.dims if d not in PRODUCTION_DIMS)
    return small or spec.dims


def cases_for(backend, **limits) -> st.SearchStrategy[Case]:
    """Cases inside a backend's declared domain (``dims``, ``supports``), biased to its ``tiles``.

    ``limits`` override the per-device defaults (``CPU_LIMITS`` / ``GPU_LIMITS``) and any ``cases`` argument.
    """
    spec = BackendSpec.of(backend)
    kw = device_limits(spec)
    kw.update(dims=backend_dims(spec), tiles=dict(spec.tiles))
    kw.update(limits)
    return cases(**kw).filter(lambda c: spec.supports(c) is None)


def outside_dims(backend) -> tuple:
    """(Dqk, Dv) pairs a backend with declared dims does not support (empty when it takes any)."""
    declared = BackendSpec.of(backend).dims
    if declared is None:
        return ()
    near = [(16, 8), (8, 8), (64, 64), (576, 576), (576, 448), (512, 256), (640, 512)]
    return tuple(d for d in near if d not in declared)


def cases_outside(backend, **limits) -> st.SearchStrategy[Case]:
    """Cases a backend declares it does not support (dims outside ``dims``): it must refuse them."""
    spec = BackendSpec.of(backend)
    kw = dict(CPU_LIMITS)
    kw.update(max_h=8, max_s=4, max_l=8, max_skv=16, dims=outside_dims(spec) or ((16, 8),))
    kw.update(limits)
    return cases(**kw).filter(lambda c: spec.supports(c) is not None)


TILE_OF = {"H": "head_group", "S": "query_chunk", "L": "topk_block"}


# ---- the suite's strategy: cases for the backend the running test is bound to ----------------------------------
@dataclass(frozen=True)
class DrawTarget:
    """What a suite test draws for: its backend (``BackendSpec``), the compile pool (``compile_keys.Pool`` or
    None) and size limits over the per-device defaults."""

    backend: BackendSpec
    pool: object = None
    limits: dict = field(default_factory=dict)

    def cases(self, *, outside: bool = False, **limits) -> st.SearchStrategy[Case]:
        """``cases_for`` this backend with this pool and limits (``cases_outside`` with ``outside=True``)."""
        if outside:
            return cases_outside(self.backend, **limits)
        return cases_for(self.backend, pool=self.pool, **{**self.limits, **limits})


_BOUND: list[DrawTarget] = []  # innermost last: the target of the test running now (``drawing_for``)


@contextlib.contextmanager
def drawing_for(target: DrawTarget):
    """Bind ``backend_cases()`` to ``target`` while the block runs. The suite's pytest fixtures do this around
    each test that takes a backend; any runner that sets up a test's fixtures (pytest, HypoFuzz, a plain call of
    the test function inside this block) gets the same draws."""
    _BOUND.append(target)
    try:
        yield target
    finally:
        _BOUND.remove(target)


def bound_target() -> DrawTarget | None:
    """The target ``backend_cases()`` draws for now, or None outside a suite test."""
    return _BOUND[-1] if _BOUND else None


@st.composite
def backend_cases(draw, *, outside: bool = False, **limits) -> Case:
    """``cases_for`` the running test's backend (``cases_outside`` with ``outside=True``), resolved at draw time.

    Lets a test write ``@given(case=backend_cases())`` and take ``smqa_backend`` as a fixture, so a failing
    case prints (and patches in as ``@example(case=Case(...))``) on its own.
    """
    target = bound_target()
    if target is None:
        raise RuntimeError("backend_cases() draws for the backend of the test running it: use it in a test that "
                           "takes the smqa_backend fixture (sparse_mqa_testkit's pytest plugin), or inside "
                           "sparse_mqa_testkit.cases.strategies.drawing_for(DrawTarget(...))")
    return draw(target.cases(outside=outside, **limits))


def draw_examples(strategy, n: int, seed: int | None = None) -> list:
    """The first ``n`` examples of a run of ``strategy`` outside @given: derandomized (the same every time), or
    from ``seed``."""
    box: list = []

    @settings(max_examples=n, derandomize=seed is None, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def grab(x):
        if len(box) < n:
            box.append(x)

    if seed is not None:
        grab = hypothesis_seed(seed)(grab)
    grab()
    return box
