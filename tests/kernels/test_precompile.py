"""The precompile's process pool: every variant once, each pool process writing into the same TileLang cache."""

import pytest

pytest.importorskip("tilelang")

from sparse_mqa_kernels import backward, bwd_plan, forward, fwd_plan, precompile  # noqa: E402
from sparse_mqa_testkit import contract  # noqa: E402


def test_the_pool_compiles_every_variant_a_plan_can_ask_for():
    tasks = precompile.variants()
    assert len(tasks) == len(set(map(precompile.describe, tasks)))
    assert {precompile.describe(t) for t in tasks if t[0] == "forward"} == \
        {k.describe() for k in fwd_plan.all_variants()}
    assert {t[1] for t in tasks if t[0] == "backward"} == set(bwd_plan.all_variants())
    assert {t[1] for t in tasks if t[0] == "prep"} == set(contract.PRODUCTION_DIMS)
    assert forward.precompile and backward.precompile  # the one-process path compiles the same kinds


def test_two_processes_fill_one_cache(tmp_path, monkeypatch):
    """Two spawned processes, one variant each, into one cache directory: two complete entries."""
    monkeypatch.setattr(precompile, "variants", lambda: [("prep", d) for d in contract.PRODUCTION_DIMS])
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))  # restored after (compile_all sets it)
    done = precompile.compile_all(tmp_path, jobs=2)
    assert [d.split(" (")[0] for d in done] == [f"sparse_mqa_bwd_prep Dqk={a} Dv={b}" for a, b in
                                                contract.PRODUCTION_DIMS]
    entries = [p for p in tmp_path.glob("*/*/kernels/*") if p.is_dir()]  # TileLang's layout: VERSION/PLATFORM/
    assert len(entries) == 2 and all((p / "executable.so").is_file() for p in entries)
