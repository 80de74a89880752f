"""The strategies reach every boundary class of the backend's tiles, inside its declared domain."""

from sparse_mqa_testkit import suite
from sparse_mqa_testkit.cases import INVALID_MODES, SINK_MODES, TOPK_MODES, Case
from sparse_mqa_testkit.strategies import backend_dims, case_events, cases_for

DRAWS = 300
TILE_OF = {"H": "head_group", "S": "query_chunk", "L": "topk_block"}


def expected_classes(backend, tiles: dict) -> dict[str, Case]:
    """Each class the strategies should reach -> a representative case (kept only if the domain allows it)."""
    dqk, dv = backend_dims(backend)[0]
    base = Case(B=1, S=2, Skv=8, H=2, L=4, Dqk=dqk, Dv=dv)
    want = {f"sink {m}": base.replace(sink=m) for m in SINK_MODES}
    want |= {f"topk {m}": base.replace(topk=m) for m in TOPK_MODES}
    want |= {f"invalid {m}": base.replace(invalid=m) for m in INVALID_MODES}
    want |= {"H < 16": base.replace(H=1), "duplicates": base.replace(duplicates=True)}
    for size, key in TILE_OF.items():
        t = tiles.get(key, 0)
        if t > 2:  # below / on / above are distinct classes only for tiles > 2
            for where, n in (("below", t - 1), ("on", t), ("above", t + 1)):
                want[f"{size} {where} tile"] = base.replace(**{size: n})
    supports = getattr(backend, "supports", None)
    return {k: c for k, c in want.items() if not callable(supports) or supports(c) is None}


def test_boundary_coverage(smqa_backend):
    tiles = dict(getattr(smqa_backend, "tiles", None) or {})
    drawn = suite.draw_examples(cases_for(smqa_backend), DRAWS)
    dims = set(backend_dims(smqa_backend))
    seen = set()
    for case in drawn:
        refused = smqa_backend.supports(case) if hasattr(smqa_backend, "supports") else None
        assert refused is None, f"drew a case outside the domain ({refused}): {case.repro()}"
        assert (case.Dqk, case.Dv) in dims, f"drew dims {(case.Dqk, case.Dv)} outside {sorted(dims)}"
        seen.update(case_events(case, tiles))
        if suite.current is not None:
            suite.current.add_case(case)
    missing = sorted(set(expected_classes(smqa_backend, tiles)) - seen)
    assert not missing, (f"{len(drawn)} cases drawn for backend {smqa_backend.name!r} (tiles {tiles}) never "
                         f"reached: {', '.join(missing)}")
