"""The suite's fixture-free fuzz entry (``property_tests/test_fuzz.py``, ``harness/fuzzing.py``) without HypoFuzz:
collected only when asked, one item per (backend, check) with the table's rows and SKIP reasons, runnable as a
plain call of the test function, each item keyed by its node id (HypoFuzz's key), and a named database made
Hypothesis's default so a runner that reads only ``settings().database`` finds it. Every pytest run here is a
child process: the fuzz entry loads a Hypothesis profile for the rest of its process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import settings

from sparse_mqa_testkit.backends import get_backend
from sparse_mqa_testkit.cases.planning import plan_backend
from sparse_mqa_testkit.checks.result import CheckFailure
from sparse_mqa_testkit.harness import hypothesis_compat, profiles
from sparse_mqa_testkit.harness.fuzzing import FuzzTarget, fuzz_test
from sparse_mqa_testkit.tools import runner
from support import DQ_DOUBLED_SOURCE, TopkIgnored

APPLIES = {"tolerance", "forward_tolerance", "determinism", "rejection", "guards"}
CUDA_ONLY = {"graph", "streams", "host_sync", "allocations", "repeats"}


@pytest.fixture
def downstream(tmp_path, monkeypatch):
    (tmp_path / "brokenkernels.py").write_text(DQ_DOUBLED_SOURCE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.chdir(tmp_path)
    for name in ("SMQA_PROFILE", "SMQA_DATABASE", "SMQA_BACKEND", "SMQA_FUZZ"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _collect(*extra, env=None) -> list[str]:
    cmd = runner.suite_command(["reference"], extra=["--collect-only", *extra])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_entry_is_collected_only_when_asked_and_then_replaces_test_check(downstream):
    plain = _collect()
    assert any("test_check[reference-tolerance]" in n for n in plain)
    assert not any("test_fuzz" in n for n in plain)
    for asked in (_collect("--smqa-fuzz"), _collect(env=dict(os.environ, SMQA_FUZZ="1"))):
        fuzz = sorted(n.split("[")[1].rstrip("]") for n in asked if "::test_fuzz[" in n)
        assert fuzz == sorted(f"reference-{c}" for c in APPLIES | CUDA_ONLY | {"rejection_outside_domain"})
        assert not any("::test_check[" in n or "::test_check_outside_domain[" in n for n in asked)
        assert any("test_check_boundaries[reference-tolerance]" in n for n in asked)  # not a drawn test
    only = _collect("--smqa-fuzz", "--smqa-check", "guards")
    assert [n for n in only if "test_fuzz" in n] == [n for n in only if n.endswith("test_fuzz[reference-guards]")] != []


def test_a_fuzz_run_fills_the_table_with_the_same_rows_and_skip_reasons(downstream, monkeypatch):
    monkeypatch.setenv("SMQA_MAX_EXAMPLES", "2")
    rc, data = runner.run_suite(["reference"], extra=["--smqa-fuzz", "-k", "test_fuzz"])
    assert rc == 0
    rows = {r["check"]: r for r in data["rows"]}
    assert all("::test_fuzz[" in r["nodeid"] for r in rows.values())
    assert {c for c, r in rows.items() if r["outcome"] == "passed" and r["cases"] == 2} == APPLIES
    skipped = {c: r["reason"] for c, r in rows.items() if r["outcome"] == "skipped"}
    assert set(skipped) == CUDA_ONLY | {"rejection_outside_domain"}
    assert "CUDA only" in skipped["graph"] and "declares no (Dqk, Dv) restriction" in skipped[
        "rejection_outside_domain"]


def test_a_plain_call_of_the_fuzz_test_runs_its_check():
    """No pytest and no fixture: the test function and its parameter are all a runner needs."""
    def target(backend, name):
        spec = get_backend(backend) if isinstance(backend, str) else backend
        return FuzzTarget(name, "tolerance", plan_backend(spec, profile="dev", budget=8))

    test = settings(max_examples=20, database=None, deadline=None)(fuzz_test(b"plain call"))
    test(target("reference", "reference"))
    with pytest.raises(CheckFailure, match="tolerance check failed for backend 'broken-topk-ignored'"):
        test(target(TopkIgnored(), "support:TopkIgnored"))


def test_each_item_is_keyed_by_its_node_id_as_hypofuzz_keys_it(downstream):
    """HypoFuzz keys a test by function_digest of its inner test with the node id added; each of our items has
    its own copy of the test, so even a runner that reads every key before running anything sees distinct ones."""
    (downstream / "keyprobe.py").write_text('''
import json
from sparse_mqa_testkit.harness import hypothesis_compat

def pytest_collection_finish(session):
    keys = {i.nodeid: hypothesis_compat.example_key(i.obj).hex() for i in session.items if "test_fuzz" in i.nodeid}
    open("keys.json", "w").write(json.dumps(keys))
''')
    _collect("--smqa-fuzz", "-p", "keyprobe")
    keys = json.loads((downstream / "keys.json").read_text())
    assert len(keys) == 11 and len(set(keys.values())) == 11
    for nodeid, key in keys.items():
        hypofuzz_view = fuzz_test()
        hypothesis_compat.inner_test(hypofuzz_view)._hypothesis_internal_add_digest = nodeid.encode()
        assert hypothesis_compat.example_key(hypofuzz_view).hex() == key, nodeid


PROBE = '''
from hypothesis import settings

def test_probe():
    db = settings().database
    print("DATABASE", getattr(db, "path", db), "DERANDOMIZE", settings().derandomize)
'''


@pytest.mark.parametrize("fuzz", [True, False])
def test_a_named_database_becomes_hypothesis_default_with_the_fuzz_entry(downstream, fuzz):
    """HypoFuzz reads the database from settings() after collection and leaves out derandomized tests: with the
    entry on, the named database is the default, derandomize off even under Hypothesis's CI profile."""
    (downstream / "test_probe.py").write_text(PROBE)
    named = downstream / "named-db"
    cmd = [sys.executable, "-m", "pytest", "test_probe.py", "-s", "-q", "-p", "no:cacheprovider", "-c", os.devnull,
           "--rootdir", str(downstream), "--smqa-backend", "reference", "--smqa-database", str(named)]
    done = subprocess.run(cmd + (["--smqa-fuzz"] if fuzz else []), capture_output=True, text=True,
                          env=dict(os.environ, CI="true"))
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("DATABASE"))
    if fuzz:
        assert line == f"DATABASE {named} DERANDOMIZE False"
    else:  # a plain run leaves Hypothesis's own (CI) profile alone
        assert str(named) not in line and line.endswith("DERANDOMIZE True")


def test_a_failure_pytest_finds_is_saved_under_the_key_hypofuzz_reads_and_replays(downstream, monkeypatch):
    db = downstream / "db"
    only = ["--smqa-fuzz", "-k", "test_fuzz", "--smqa-check", "tolerance"]
    rc, data = runner.run_suite(["brokenkernels:Broken"], profile="ci", database=db, extra=only)
    (row,) = [r for r in data["rows"] if r["outcome"] == "failed"]
    assert rc == 1 and row["check"] == "tolerance"
    key = hypothesis_compat.example_key(fuzz_test(row["nodeid"].encode()))
    assert list(profiles.example_database(db).fetch(key)), "the failure is not under the node id's key"
    # one derandomized example (the simplest case, Skv = 1) passes; pointed at the database, the failure replays
    monkeypatch.setenv("SMQA_MAX_EXAMPLES", "1")
    rc, _ = runner.run_suite(["brokenkernels:Broken"], profile="ci", extra=only)
    assert rc == 0
    rc, data = runner.run_suite(["brokenkernels:Broken"], profile="ci", database=db, extra=only)
    assert rc == 1 and [r["nodeid"] for r in data["rows"] if r["outcome"] == "failed"] == [row["nodeid"]]
