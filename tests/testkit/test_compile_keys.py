"""Compile-aware drawing: declared compile keys, the pool a run may compile, explicit boundary cases, and a
whole ci run on a backend that compiles per shape (pays at most the budget, covers every class, still finds a
bug planted in one class)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json

import pytest

from sparse_mqa_testkit import BackendBase, Case
from sparse_mqa_testkit.cases import planning
from sparse_mqa_testkit.cases.boundaries import explicit_examples
from sparse_mqa_testkit.cases.compile_keys import DEFAULT_BUDGET, CompileKey, key_of, resolve
from sparse_mqa_testkit.cases.strategies import cases_for, draw_examples
from sparse_mqa_testkit.tools import cli
from support import COMPILING_SOURCE


class Keyed(BackendBase):
    name = "keyed"
    tiles = {"head_group": 16, "topk_block": 16}
    compile_keys = ("H", "L", "topk_given")

    def backward(self, *args, **kwargs):  # never called here
        raise NotImplementedError


@pytest.fixture
def compiling(tmp_path, monkeypatch):
    (tmp_path / "compiling.py").write_text(COMPILING_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("COMPILE_LOG", str(tmp_path / "compiles.log"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SMQA_COMPILE_BUDGET", raising=False)
    return tmp_path


def _logged_keys(path) -> list[tuple]:
    return [ast.literal_eval(line) for line in path.read_text().splitlines()]


def test_unknown_compile_keys_name_the_backend():
    bad = Keyed()
    bad.compile_keys = ("H", "head_count")
    with pytest.raises(ValueError, match=r"backend 'keyed': compile_keys names 'head_count'.*choose from"):
        resolve(bad)
    bad.compile_keys = (CompileKey("rows", "rows", len),)
    with pytest.raises(ValueError, match=r"backend 'keyed': compile key 'rows' derives from 'rows'"):
        resolve(bad)


def test_a_budget_below_what_the_boundary_cases_need_is_an_error():
    with pytest.raises(ValueError, match=r"backend 'keyed': compile budget 2 is smaller than the \d+ kernel keys "
                                         r"its boundary examples need; give at least \d+"):
        planning.plan_backend(Keyed(), profile="ci", budget=2)
    with pytest.raises(ValueError, match="SMQA_COMPILE_BUDGET must be a positive integer"):
        __import__("os").environ["SMQA_COMPILE_BUDGET"] = "many"
        try:
            planning.compile_budget(None, "ci")
        finally:
            del __import__("os").environ["SMQA_COMPILE_BUDGET"]
    assert planning.compile_budget(None, "ci") == DEFAULT_BUDGET["ci"] and planning.compile_budget(5, "ci") == 5


def test_drawn_cases_stay_inside_the_pool_and_free_fields_vary():
    plan = planning.plan_backend(Keyed(), profile="ci", budget=16)
    keys = resolve(Keyed())
    assert len(plan.pool) == 16
    drawn = draw_examples(cases_for(Keyed(), pool=plan.pool), 300)
    assert {key_of(c, keys) for c in drawn} <= set(plan.pool.values)
    assert len({c.S for c in drawn}) > 5 and len({c.sink for c in drawn}) == 7  # unkeyed fields are free
    # the explicit boundary cases' keys are pooled first, and they visit every class
    assert set(plan.pool.values[:len({key_of(c, keys) for c in plan.boundaries.examples})]) == \
        {key_of(c, keys) for c in plan.boundaries.examples}
    from sparse_mqa_testkit.cases.strategies import case_events

    seen = {label for c in plan.boundaries.examples for label in case_events(c, Keyed.tiles)}
    assert set(plan.boundaries.classes) <= seen
    assert {"L below tile", "L on tile", "L above tile", "H on tile", "topk random", "L > Skv"} <= seen


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Case)])
def test_every_case_field_can_be_a_compile_key(field):
    """Whatever a kernel specialises on, Case fields added later included: the pool fixes the field, drawn cases
    keep it inside the pool, and the other fields stay free."""
    keyed = Keyed()
    keyed.compile_keys = (field,)
    (key,) = resolve(keyed)
    need = len({key_of(c, (key,)) for c in explicit_examples(keyed, max_work=1_500_000).examples})
    plan = planning.plan_backend(keyed, profile="ci", budget=need + 2, draws=60)
    assert need <= len(plan.pool) <= need + 2
    drawn = draw_examples(cases_for(keyed, pool=plan.pool), 60)
    assert {key_of(c, (key,)) for c in drawn} <= set(plan.pool.values), field
    free = "seed" if field != "seed" else "S"
    assert len({getattr(c, free) for c in drawn}) > 3


def test_sm_scale_as_a_compile_key_fixes_the_drawn_scales():
    keyed = Keyed()
    keyed.compile_keys = ("H", "sm_scale", CompileKey("scale_given", "sm_scale", lambda v: v is not None))
    plan = planning.plan_backend(keyed, profile="ci", budget=24)  # past the boundary examples' keys
    scales = {v[1] for v in plan.pool.values}
    assert len(scales) == 3  # None, 0.5 and 1/sqrt(192): each a kernel of its own
    for entry, values in zip(plan.pool.entries, plan.pool.values):
        assert entry["sm_scale"] == (values[1],)  # a float is fixed to the value the pool drew
    drawn = draw_examples(cases_for(keyed, pool=plan.pool), 200)
    assert {key_of(c, plan.pool.keys) for c in drawn} <= set(plan.pool.values)
    assert {c.sm_scale for c in drawn} == scales


def test_nightly_rotates_the_pool(monkeypatch):
    ci = planning.plan_backend(Keyed(), profile="ci", budget=12)
    monkeypatch.setattr(planning, "rotation", lambda profile: 738000)
    night = planning.plan_backend(Keyed(), profile="nightly", budget=12)
    monkeypatch.setattr(planning, "rotation", lambda profile: 738001)
    next_night = planning.plan_backend(Keyed(), profile="nightly", budget=12)
    assert ci.pool.values != night.pool.values != next_night.pool.values
    assert night.boundaries.classes == ci.boundaries.classes  # every night covers every class


def test_a_class_the_domain_cannot_reach_is_listed_with_the_reason():
    class NoTopk(Keyed):
        def supports(self, case):
            return "topk_length is not supported" if case.topk != "none" else None

    b = explicit_examples(NoTopk(), max_work=1_500_000)
    topk = {"topk random", "topk edges", "topk length <= 0", "topk length at tile edge", "topk length 511-513"}
    assert b.unreachable == dict.fromkeys(topk, "topk_length is not supported")
    assert not topk & set(b.classes) and all(c.topk == "none" for c in b.examples)


def test_a_ci_run_compiles_at_most_its_budget_and_covers_every_class(compiling, capfd, monkeypatch):
    monkeypatch.setenv("SMQA_MAX_EXAMPLES", "25")
    path = compiling / "r.json"
    assert cli.main(["--backend", "compiling:Compiling", "--profile", "ci", "--json", str(path)]) == 0
    out = capfd.readouterr()
    calls = _logged_keys(compiling / "compiles.log")
    plan = planning.plan_backend(importlib.import_module("compiling").Compiling(), profile="ci",
                                 budget=DEFAULT_BUDGET["ci"])
    assert len(set(calls)) <= DEFAULT_BUDGET["ci"] and set(calls) <= set(plan.pool.values)
    data = json.loads(path.read_text())
    covered = set(data["coverage"]["compiling:Compiling"])
    assert set(plan.boundaries.classes) <= covered
    timing = data["timing"]["compiling:Compiling"]
    assert timing["keys"] == len(plan.pool) and timing["compile_s"] > 0 and timing["check_s"] > 0
    assert "time on compiling:Compiling: warm-up" in out.out and "[smqa] warm-up compiling:Compiling:" in out.err


def test_a_compile_keyed_backend_draws_its_pool_after_pytest_starts(compiling, pytester, monkeypatch):
    """The pool's cases are drawn where Hypothesis expects draws (after its plugin's initialization): no
    HypothesisSideeffectWarning, with the backend named on the command line (validated at session start)."""
    monkeypatch.setenv("SMQA_MAX_EXAMPLES", "2")
    monkeypatch.delenv("SMQA_PROFILE", raising=False)
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pyargs", "sparse_mqa_testkit.property_tests",
                                      "--smqa-backend", "compiling:Compiling", "-k", "tolerance and not forward")
    r.assert_outcomes(passed=2)
    out = r.stdout.str() + r.stderr.str()
    assert "[smqa] warm-up compiling:Compiling: " in out and "HypothesisSideeffectWarning" not in out


def test_a_bug_planted_in_one_boundary_class_is_found(compiling, capfd, monkeypatch):
    monkeypatch.setenv("SMQA_MAX_EXAMPLES", "5")
    assert cli.main(["--backend", "compiling:PlantedAboveTile", "--profile", "ci", "--check", "tolerance"]) == 1
    out = capfd.readouterr().out
    assert "tolerance check failed for backend 'compiling'" in out and "L=17" in out
