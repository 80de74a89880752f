"""The boundary classes that shipped kernels broke on (issue 22): top-k lengths <= 0 and on the tile grid, huge and
far sinks, fully invalid leading and middle tiles, peaky logits, neighbouring queries with disjoint top-k rows.

For each: the contract, the NumPy oracle (float32 against float64, within the error model) and the device oracle
(against the NumPy one, to 1e-12) agree; a correct backend passes; a backend with that class's bug fails on the
explicit boundary examples alone (what every ``ci`` run starts with); and the examples make each class bite.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparse_mqa_testkit import contract
from sparse_mqa_testkit.backends import BackendBase, get_backend
from sparse_mqa_testkit.backends.tiles import ByHeads
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.cases.boundaries import explicit_examples
from sparse_mqa_testkit.cases.coverage import effective_events
from sparse_mqa_testkit.cases.strategies import INEXACT_SCALE, case_events
from sparse_mqa_testkit.cases.tensors import case_tensors
from sparse_mqa_testkit.checks import check_backward_tolerance, check_forward_tolerance
from sparse_mqa_testkit.oracle import device as device_oracle
from support import CLASS_BUGS, EmulatedKernel, run

# one case per new class, each biting
CLASS_CASES = {
    "topk length <= 0": Case(S=8, Skv=24, H=3, L=6, topk="edges", seed=1),
    "topk length at tile edge": Case(S=16, Skv=40, H=3, L=18, topk="edges", topk_tile=16, seed=2),
    "topk length 511-513": Case(S=24, Skv=40, H=2, L=514, topk="edges", seed=3),
    "sink huge": Case(S=4, Skv=16, H=4, L=8, sink="huge", seed=4),
    "sink far": Case(S=6, Skv=40, H=4, L=20, sink="far", magnitude="peaky", sm_scale=INEXACT_SCALE, seed=5),
    "invalid leading": Case(S=4, Skv=64, H=3, L=20, invalid="leading", seed=6),
    "invalid middle": Case(S=4, Skv=64, H=3, L=36, invalid="middle", topk_tile=16, seed=7),
    "magnitude peaky": Case(S=6, Skv=40, H=4, L=20, magnitude="peaky", sm_scale=INEXACT_SCALE, seed=8),
    "pattern disjoint": Case(S=8, Skv=64, H=3, L=6, pattern="disjoint", seed=9),
}
TILES = {"head_group": 64, "topk_block": 16}


@pytest.mark.parametrize("label", sorted(CLASS_CASES))
def test_each_class_case_bites(label):
    case = CLASS_CASES[label]
    assert label in case_events(case, TILES) and label in effective_events(case, TILES)


@pytest.mark.parametrize("label", sorted(CLASS_CASES))
def test_the_float32_oracle_agrees_with_the_float64_one_within_the_model(label):
    ref = get_backend("reference")  # the float32 oracle, bf16 outputs
    for res in (check_backward_tolerance(ref, CLASS_CASES[label]), check_forward_tolerance(ref, CLASS_CASES[label])):
        assert res.passed and res.ratio < 0.6, res.message


@pytest.mark.parametrize("label", sorted(CLASS_CASES))
def test_the_device_oracle_agrees_with_the_numpy_one(label):
    case = CLASS_CASES[label]
    want = run(case.inputs())
    t = case_tensors(case)
    kw = dict(sm_scale=t["sm_scale"], d_v=t["d_v"], attn_sink=t["attn_sink"], topk_length=t["topk_length"])
    got = dict(zip(("out", "lse"), device_oracle.forward(t["q"], t["kv"], t["indices"], **kw)))
    got.update(zip(("dq", "dkv", "d_sink"), device_oracle.backward(t["q"], t["kv"], t["indices"], t["grad_out"], **kw)))
    for name, w in want.items():
        if w is None:
            assert got[name] is None
            continue
        g = got[name].numpy()
        np.testing.assert_array_equal(np.isposinf(g), np.isposinf(w), err_msg=name)
        fin = np.isfinite(w)
        scale = max(float(np.abs(w[fin]).max(initial=0)), 1e-300)
        np.testing.assert_allclose(g[fin], w[fin], rtol=1e-12, atol=1e-12 * scale, err_msg=name)


@pytest.mark.parametrize("label", sorted(CLASS_CASES))
@pytest.mark.parametrize("backend", ["tilelang-model", "emulated"])
def test_a_correct_kernel_passes(label, backend):
    b = EmulatedKernel() if backend == "emulated" else get_backend(backend)
    res = check_backward_tolerance(b, CLASS_CASES[label])
    assert res.passed, res.message


def test_the_contract_rules_for_lengths_and_sinks():
    idx = np.zeros((1, 3, 4), np.int32)
    tl = np.array([[-3, 0, 2]], np.int32)
    assert contract.valid_mask(idx, 8, tl).sum(-1).tolist() == [[0, 0, 2]]  # a length <= 0: an empty row
    lse = np.array([[[3.0, 3.0, 400.0]]], np.float32)
    sink = np.array([3.0e38, -3.0e38, 400.0], np.float32)
    p = contract.sink_probability(lse, sink)
    assert p.dtype == np.float32 and p[0, 0, :2].tolist() == [1.0, 0.0] and abs(p[0, 0, 2] - 0.5) < 1e-5
    assert np.isposinf(contract.lse_to_base2(lse, sink)[0, 0, 0])  # 3e38 log2(e) is past float32: all sink mass
    x = CLASS_CASES["sink huge"].inputs()
    assert np.isfinite(x["attn_sink"]).all() and (np.abs(x["attn_sink"]) >= 2.3e38).all()
    assert (x["attn_sink"] > 0).any() and (x["attn_sink"] < 0).any()
    out, _ = run(x)["out"], None
    assert not np.isnan(out).any() and (out[:, :, x["attn_sink"] > 0] == 0).all()  # the sink holds every row


def test_case_arrays_of_the_new_modes():
    x = CLASS_CASES["topk length at tile edge"].inputs()
    assert set(x["topk_length"].ravel().tolist()) == {-3, -1, 0, 1, 15, 16, 17}  # every grid length, once first
    lead = CLASS_CASES["invalid leading"].inputs()["indices"]
    assert not contract.valid_mask(lead[..., :16], 64).any() and contract.valid_mask(lead[..., 16:], 64).all()
    assert {-1} < set(lead[..., :16].ravel().tolist())  # -1 and out-of-range values mixed
    mid = CLASS_CASES["invalid middle"].inputs()["indices"]
    assert not contract.valid_mask(mid[..., 16:32], 64).any() and contract.valid_mask(mid[..., :16], 64).all()
    assert contract.valid_mask(mid[..., 32:], 64).all()
    far = CLASS_CASES["sink far"]
    xf = far.inputs()
    assert sorted(set(np.abs(xf["attn_sink"]).tolist())) == [400.0]
    assert run(xf)["lse"].max() > 300, "peaky logits put some rows' lse near the +400 sink"
    peaky = CLASS_CASES["magnitude peaky"]
    assert peaky.q_bits() > 0 and float(torch.tensor(peaky.scale).to(torch.bfloat16)) != peaky.scale
    disjoint = CLASS_CASES["pattern disjoint"].inputs()["indices"]
    assert all(not set(disjoint[0, i].tolist()) & set(disjoint[0, i + 1].tolist()) for i in range(7))


# ---- the planted bugs: each caught by the explicit boundary examples alone ---------------------------------------
def _first_failure(backend, check):
    for case in explicit_examples(backend, max_work=1_500_000).examples:
        res = check(backend, case)
        if not res.passed:
            return res
    return None


@pytest.mark.parametrize("label", sorted(CLASS_BUGS))
def test_each_class_bug_is_caught_by_the_explicit_examples(label):
    backend = CLASS_BUGS[label]()
    res = _first_failure(backend, check_backward_tolerance)
    assert res is not None, f"{backend.name}: no explicit boundary example caught it"
    assert "repro: sparse-mqa-check" in res.message


@pytest.mark.parametrize("label", sorted(CLASS_BUGS))
def test_each_class_bug_breaks_only_where_its_class_bites(label):
    """A plain case of the same sizes passes: the bug lives in its class (the query-pair bug also needs different
    neighbouring rows, which most random cases have: it is the exception)."""
    backend = CLASS_BUGS[label]()
    plain = Case(S=6, Skv=64, H=3, L=20, seed=12)
    if label == "query tile":
        plain = plain.replace(S=1)
    assert check_backward_tolerance(backend, plain).passed


def test_the_trials_partial_tile_bug_is_caught_by_the_examples_a_declared_tile_brings():
    # the trial: tiles {"head_group": 16, "topk_block": 64}; the L = 65 example once merged with empty_rows and a
    # mixed sink, so slot 64 was valid in no row. Now each L example makes its edge slot bite, and the bug is caught
    backend = CLASS_BUGS["L above tile"]()
    plan = explicit_examples(backend, max_work=1_500_000)
    l65 = [c for c in plan.examples if c.L == 65]
    assert l65 and all("L above tile" in effective_events(c, backend.tiles) for c in l65)
    assert any("L above tile" in r for r in plan.rejected) or all(c.invalid != "empty_rows" for c in l65)
    assert _first_failure(backend, check_backward_tolerance) is not None


def test_merges_that_would_cancel_a_boundary_are_left_out_and_listed():
    class Tiled(BackendBase):
        name, tiles = "tiled", {"head_group": 16, "topk_block": 64}

        def backward(self, *a, **kw):
            raise NotImplementedError

    plan = explicit_examples(Tiled(), max_work=1_500_000)
    for case in plan.examples:  # every class an example claims by name, it makes bite
        named = set(case_events(case, Tiled.tiles)) & set(plan.classes)
        assert named, case.repro()
    covered = set().union(*(effective_events(c, Tiled.tiles) for c in plan.examples))
    assert set(plan.classes) <= covered
    assert plan.rejected and all("would not bite" in r for r in plan.rejected)


def test_tiles_that_depend_on_the_head_count_put_examples_on_each_size():
    class ByHeadCount(BackendBase):
        name, tiles = "by-heads", {"head_group": 64, "topk_block": ByHeads({16: 32, 32: 16})}

        def backward(self, *a, **kw):
            raise NotImplementedError

    plan = explicit_examples(ByHeadCount(), max_work=1_500_000)
    assert {"L above tile [H 1-16: 32]", "L above tile [H 17-: 16]"} <= set(plan.classes)
    edges = {(c.H <= 16, c.L) for c in plan.examples if c.L in (15, 16, 17, 31, 32, 33)}
    assert {(True, 31), (True, 32), (True, 33), (False, 15), (False, 16), (False, 17)} <= edges
    assert ByHeads({16: 32, 32: 16}).at(1) == 32 and ByHeads({16: 32, 32: 16}).at(100) == 16


PARTIAL_TILE = """
import sys
sys.path.insert(0, {tests!r})
from support import DropsLastSlotOfPartialTile as Backend
"""


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_dev_from_a_fresh_database_catches_the_partial_tile_bug(seed, tmp_path, monkeypatch):
    """``sparse-mqa-check --profile dev --check tolerance`` on the trial's backend, a fresh example database and
    Hypothesis seed each time: failed every time (the explicit examples run first)."""
    import os

    from sparse_mqa_testkit.tools import cli

    (tmp_path / "partial_tile.py").write_text(PARTIAL_TILE.format(tests=os.path.dirname(os.path.dirname(__file__))))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["--backend", "partial_tile:Backend", "--profile", "dev", "--check", "tolerance",
                   "--database", str(tmp_path / "db"), "--", f"--hypothesis-seed={seed}"])
    assert rc == 1
