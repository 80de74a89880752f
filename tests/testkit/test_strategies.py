"""Strategies: drawing inside a backend's domain, biased to its tiles, within the work cap; boundary labels."""

import pytest

from sparse_mqa_testkit.backends import BackendBase, get_backend
from sparse_mqa_testkit.cases import Case, strategies
from sparse_mqa_testkit.cases.strategies import (
    PRODUCTION_DIMS,
    SMALL_DIMS,
    boundary_class,
    case_events,
    cases,
    cases_for,
    cases_outside,
    draw_examples,
    near_multiples,
)


class Fake(BackendBase):
    def __init__(self, device="cpu", dims=None, tiles=None, max_h=None):
        self.name, self.device, self.dims, self.tiles, self.max_h = "fake", device, dims, tiles or {}, max_h

    def supports(self, case):
        if self.max_h and case.H > self.max_h:
            return f"H > {self.max_h}"
        return super().supports(case)

    def backward(self, *a, **k):
        raise NotImplementedError


def test_near_multiples_and_classes():
    assert near_multiples(16) == [15, 16, 17, 31, 32, 33]
    assert near_multiples(1) == [1, 2, 3]
    assert [boundary_class(n, 16) for n in (15, 16, 17, 20, 32)] == ["below", "on", "above", "interior", "on"]
    assert boundary_class(7, None) == "interior"


def test_case_events_labels():
    tiles = {"head_group": 16, "query_chunk": 8, "topk_block": 32}
    ev = case_events(Case(H=17, S=7, L=32, Skv=16, sink="mixed", topk="random", invalid="holes",
                          duplicates=True), tiles)
    assert {"H above tile", "S below tile", "L on tile", "sink mixed", "topk random", "invalid holes",
            "duplicates", "L > Skv"} <= set(ev)
    assert "H < 16" not in ev
    assert "H < 16" in case_events(Case(H=15), tiles)


def test_reference_draws_small_dims_inside_domain():
    for c in draw_examples(cases_for(get_backend("reference")), 60):
        assert (c.Dqk, c.Dv) in SMALL_DIMS
        assert c.B * c.S * c.H * c.L * c.Dqk <= strategies.CPU_LIMITS["max_work"]


def test_production_dims_only_for_gpu_backends():
    cpu_any = {(c.Dqk, c.Dv) for c in draw_examples(cases_for(Fake()), 80)}
    assert not cpu_any & set(PRODUCTION_DIMS)
    gpu_any = {(c.Dqk, c.Dv) for c in draw_examples(cases_for(Fake(device="cuda")), 150)}
    assert gpu_any & set(PRODUCTION_DIMS), gpu_any
    # a CPU backend that supports only production dims still gets them (nothing else to draw)
    cpu_prod = {(c.Dqk, c.Dv) for c in draw_examples(cases_for(Fake(dims=((576, 512),))), 10)}
    assert cpu_prod == {(576, 512)}


def test_declared_dims_and_supports_are_respected():
    be = Fake(dims=((16, 8), (576, 512)), max_h=9)
    drawn = draw_examples(cases_for(be), 80)
    assert {(c.Dqk, c.Dv) for c in drawn} == {(16, 8)}  # production dims dropped on CPU
    assert max(c.H for c in drawn) <= 9


def test_tile_bias_reaches_every_boundary_class():
    tiles = {"head_group": 16, "query_chunk": 8, "topk_block": 32}
    seen = set()
    for c in draw_examples(cases_for(Fake(tiles=tiles)), 250):
        seen.update(case_events(c, tiles))
    for size in "HSL":
        assert {f"{size} below tile", f"{size} on tile", f"{size} above tile"} <= seen, sorted(seen)
    assert "H < 16" in seen


def test_work_cap_holds_while_large_tiles_are_reached():
    tiles = {"query_chunk": 4096, "head_group": 64, "topk_block": 32}
    be = Fake(device="cuda", dims=((576, 512),), tiles=tiles)
    drawn = draw_examples(cases_for(be, max_work=20_000_000), 200)
    assert all(c.B * c.S * c.H * c.L * c.Dqk <= 20_000_000 for c in drawn)
    assert any(c.S >= 4095 for c in drawn), "the query_chunk boundary was never reached"


def test_cases_outside_are_refused_by_the_backend():
    be = Fake(dims=((576, 512), (512, 512)))
    for c in draw_examples(cases_outside(be), 20):
        assert be.supports(c) is not None


def test_cases_keeps_its_original_signature():
    c = draw_examples(cases(dims=((8, 8),), max_h=4, max_s=3), 5)
    assert all(x.Dqk == 8 for x in c)


def test_backend_cases_without_an_active_backend_says_what_to_do():
    with pytest.raises(RuntimeError, match="smqa_backend"):
        draw_examples(strategies.backend_cases(), 1)


def test_backend_cases_draws_for_the_bound_target_without_pytest():
    """The draw target is bound by a context manager (the plugin's fixture uses it), so any runner that sets up
    the test's fixtures gets the same draws; a plain call inside the block too."""
    from sparse_mqa_testkit.backends import BackendSpec
    from sparse_mqa_testkit.cases.strategies import DrawTarget, bound_target, drawing_for

    narrow = Fake(dims=((24, 16),), max_h=3)
    with drawing_for(DrawTarget(BackendSpec.of(narrow))) as target:
        assert bound_target() is target
        drawn = draw_examples(strategies.backend_cases(), 20)
    assert bound_target() is None
    assert all((c.Dqk, c.Dv) == (24, 16) and c.H <= 3 for c in drawn)
