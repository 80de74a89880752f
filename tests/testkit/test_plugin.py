"""The pytest plugin seen from a downstream project (pytester): registering a backend, fixtures, options,
skip reasons on a CPU-only machine, the report header, and where the example database goes."""

import json
import re
import sys

import pytest

from sparse_mqa_testkit.harness import profiles
from support import DQ_DOUBLED_SOURCE

# Hypothesis writes its failure patches with libcst, whose native parser can be initialised only once per
# process: load it before the in-process pytester runs, so their sys.modules restore cannot drop it and break
# a later test in this process that writes a patch.
try:
    import libcst.native  # noqa: F401
except ImportError:
    pass

NO_CUDA = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks CPU-only behaviour")

# A downstream kernel: the reference backend under another name, plus a broken one (dq doubled for Skv >= 9).
BACKENDS = DQ_DOUBLED_SOURCE + '''
class Mine(ReferenceBackend):
    name = "mine"

class OnGpu(ReferenceBackend):
    name = "ongpu"
    device = "cuda"
    def __init__(self):
        pass

def needs_missing_package():
    import no_such_kernel_package  # noqa: F401

class NeedsOptionalPackage(ReferenceBackend):
    name = "optional"
    def require(self):
        from sparse_mqa_testkit import MissingDependency
        raise MissingDependency("the optional backend needs fancylib: pip install fancylib")
'''

IMPORT_TYPO = '''
from sparse_mqa_testkit.backends.reference import ReferenceBacknd  # the typo

class Backend(ReferenceBacknd):
    name = "typo"
'''

DOWNSTREAM_TEST = '''
from hypothesis import given, settings
from sparse_mqa_testkit.cases.strategies import backend_cases

def test_fixtures(smqa_backend, smqa_case, smqa_oracle, smqa_checks):
    assert smqa_case.tensors["q"].device.type == smqa_backend.device
    dq, dkv, d_sink = smqa_backend.backward(**smqa_case.backward_args)
    ref_dq, _, _ = smqa_oracle.backward(smqa_case.case)
    assert dq.shape == tuple(ref_dq.shape)
    result = smqa_checks.tolerance(smqa_case.case)
    assert result.passed and result.ratio < 1

@settings(max_examples=3, database=None, deadline=None)
@given(case=backend_cases())
def test_my_property(smqa_backend, smqa_checks, case):
    smqa_checks.guards(case)
'''


@pytest.fixture
def downstream(pytester, monkeypatch):
    pytester.makepyfile(mykernels=BACKENDS, test_down=DOWNSTREAM_TEST)
    pytester.syspathinsert()
    # a downstream repo's own environment: not the profile or database this repo's CI exports
    monkeypatch.delenv("SMQA_PROFILE", raising=False)
    monkeypatch.delenv("SMQA_DATABASE", raising=False)
    monkeypatch.delenv("SMQA_BACKEND", raising=False)
    monkeypatch.setenv("SMQA_MAX_EXAMPLES", "2")
    return pytester


def test_backend_by_module_attr_with_the_fixtures(downstream):
    r = downstream.runpytest_inprocess("-v", "-p", "no:cacheprovider", "--smqa-backend", "mykernels:Mine")
    r.assert_outcomes(passed=3 + 1)  # test_fixtures x 3 drawn cases, test_my_property
    r.stdout.fnmatch_lines(["*test_fixtures?mykernels:Mine-case0? PASSED*",
                            "*test_my_property?mykernels:Mine? PASSED*",
                            "*sparse-mqa-testkit conformance*", "*my_property*mykernels:Mine*3*PASS*"])


def test_backend_by_entry_point(downstream):
    dist = downstream.path / "mykernels_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mykernels-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[sparse_mqa_testkit.backends]\nmine-ep = mykernels:Mine\n")
    from sparse_mqa_testkit.backends import available_backends

    assert "mine-ep" in available_backends()
    r = downstream.runpytest_inprocess("-v", "-p", "no:cacheprovider", "--smqa-backend", "mine-ep",
                                       "-k", "fixtures")
    r.assert_outcomes(passed=3)
    r.stdout.fnmatch_lines(["*test_fixtures?mine-ep-case0? PASSED*"])


def test_repeatable_and_comma_separated_backends_each_run_once(downstream):
    r = downstream.runpytest_inprocess("-v", "-p", "no:cacheprovider", "-k", "my_property",
                                       "--smqa-backend", "reference", "--smqa-backend", "mykernels:Mine,reference")
    r.assert_outcomes(passed=2)
    r.stdout.fnmatch_lines(["*test_my_property?reference? PASSED*", "*test_my_property?mykernels:Mine? PASSED*"])


def test_header_names_versions_backends_and_profile(downstream, monkeypatch):
    monkeypatch.setenv("SMQA_PROFILE", "ci")
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "--co", "--smqa-backend", "reference")
    r.stdout.fnmatch_lines(["sparse-mqa-testkit: backends reference; profile ci (2 examples/test, database none)",
                            "GPU: *driver*; CUDA *; torch *; tilelang *; cudnn-frontend *"])
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "--co", "--smqa-profile", "nightly")
    r.stdout.fnmatch_lines(["*profile nightly*"])


def test_bad_options_are_usage_errors(downstream):
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "--smqa-profile", "fast")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*--smqa-profile*invalid choice*"])
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "--smqa-backend", "nosuchbackend", "-k", "property")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    # once, as a usage error: not a fixture-setup traceback per test
    assert r.stderr.str().count("unknown backend 'nosuchbackend'") == 1
    assert "known: " in r.stderr.str() and r.stdout.str().count("nosuchbackend") <= 1


def test_a_backend_that_fails_to_import_is_an_error_with_where_it_broke(downstream):
    downstream.makepyfile(typo=IMPORT_TYPO)
    for route in (["--smqa-backend", "typo:Backend"], ["--pyargs", "sparse_mqa_testkit.property_tests",
                                                       "--smqa-backend", "typo:Backend"]):
        r = downstream.runpytest_inprocess("-p", "no:cacheprovider", *route)
        assert r.ret == pytest.ExitCode.USAGE_ERROR, r.stdout.str()
        err = r.stderr.str()
        assert "--smqa-backend typo:Backend: loading it raised ImportError: cannot import name 'ReferenceBacknd'" in err
        assert "typo.py:" in err  # the user's own frame
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "--smqa-backend", "mykernels:needs_missing_package")
    assert r.ret == pytest.ExitCode.USAGE_ERROR and "No module named 'no_such_kernel_package'" in r.stderr.str()


def test_a_missing_optional_package_skips_only_when_allowed(downstream):
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "--smqa-backend", "mykernels:NeedsOptionalPackage")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert "fancylib" in r.stderr.str() and "--smqa-allow-missing" in r.stderr.str()
    r = downstream.runpytest_inprocess("-rs", "-p", "no:cacheprovider", "--smqa-backend",
                                       "mykernels:NeedsOptionalPackage", "--smqa-allow-missing")
    r.assert_outcomes(skipped=4)
    r.stdout.fnmatch_lines(["*skipped (--smqa-allow-missing): the optional backend needs fancylib*"])


@pytest.mark.parametrize("env, value, allowed", [("SMQA_PROFILE", "bogus", "dev, ci, nightly"),
                                                 ("SMQA_MAX_EXAMPLES", "abc", "positive integer"),
                                                 ("SMQA_LIMITS", "Q=3", "B, S, Skv, H, L, work")])
def test_environment_typos_are_usage_errors_only_where_the_suite_is_used(downstream, monkeypatch, env, value,
                                                                          allowed):
    monkeypatch.setenv(env, value)
    downstream.makepyfile(test_unrelated="def test_plain():\n    assert True\n")
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "test_unrelated.py")
    assert r.ret == pytest.ExitCode.OK  # a repo that does not use the suite is left alone
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "test_down.py")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert env in r.stderr.str() and allowed in r.stderr.str() and "INTERNALERROR" not in r.stdout.str()


def test_an_unknown_backend_in_the_environment_is_named_and_only_where_the_suite_is_used(downstream, monkeypatch):
    monkeypatch.setenv("SMQA_BACKEND", "nosuch")
    downstream.makepyfile(test_unrelated="def test_plain():\n    assert True\n")
    for xdist in ((), ("-n", "2")):
        r = downstream.runpytest_inprocess("-p", "no:cacheprovider", *xdist, "test_unrelated.py")
        assert r.ret == pytest.ExitCode.OK, r.stderr.str()
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "test_down.py")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert "SMQA_BACKEND=nosuch: unknown backend 'nosuch'" in r.stderr.str()
    assert "--smqa-backend" not in r.stderr.str()


@NO_CUDA
def test_skip_reasons_on_a_cpu_only_machine(downstream):
    downstream.makepyfile(test_gpu='''
        import pytest

        @pytest.mark.gpu
        def test_needs_gpu():
            raise AssertionError("must not run without CUDA")
    ''')
    r = downstream.runpytest_inprocess("-rs", "-p", "no:cacheprovider", "--smqa-backend", "mykernels:OnGpu")
    r.assert_outcomes(skipped=1 + 4)
    r.stdout.fnmatch_lines([
        "*backend 'mykernels:OnGpu' (device cuda) needs a CUDA GPU*",
        "*this test needs a CUDA GPU: torch.cuda.is_available() is False*"])
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "--smqa-require-gpu", "test_gpu.py")
    r.assert_outcomes(errors=1)  # fails in setup: the test itself never runs
    r.stdout.fnmatch_lines(["*needs a CUDA GPU*--smqa-require-gpu*"])


def test_installed_suite_from_a_downstream_repo(downstream, monkeypatch):
    """--pyargs runs the installed suite; a failure names the check, the case and the replay command; the
    example database lands in the downstream repo, never in the installed package."""
    import sys

    import sparse_mqa_testkit

    # the suite's modules bake the profile in at import: import them afresh for this run (restored after)
    for name in [m for m in sys.modules if m.startswith("sparse_mqa_testkit.property_tests.")]:
        monkeypatch.delitem(sys.modules, name)
    pkg = __import__("pathlib").Path(sparse_mqa_testkit.__file__).parent
    before = {p for p in pkg.rglob("*") if ".hypothesis" in p.parts}
    out = downstream.path / "smqa.json"
    monkeypatch.setenv("SMQA_MAX_EXAMPLES", "30")
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs", "sparse_mqa_testkit.property_tests",
                                       "--smqa-backend", "mykernels:Broken", "--smqa-json", str(out),
                                       "-k", "tolerance and not forward")
    r.assert_outcomes(failed=1, passed=1)  # the explicit boundary cases (Skv <= 8) pass; the search finds it
    r.stdout.fnmatch_lines(["*tolerance check failed for backend 'broken'*",
                            "*sparse-mqa-check --backend mykernels:Broken --check tolerance --replay \"Case(*",
                            "*tolerance*mykernels:Broken*FAIL*"])
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["check"], r["outcome"]) for r in rows) == [("tolerance", "failed"), ("tolerance", "passed")]
    (failed,) = [r for r in rows if r["outcome"] == "failed"]
    assert failed["failure"]["repro"].startswith("sparse-mqa-check --backend mykernels:Broken --check tolerance")
    from sparse_mqa_testkit.cases import Case

    assert eval(failed["failure"]["case"], {"Case": Case}).Skv == 9  # shrunk to the smallest failing Skv
    assert (downstream.path / ".hypothesis" / "smqa").is_dir()
    assert {p for p in pkg.rglob("*") if ".hypothesis" in p.parts} == before


SHORT_DKV = '''
from sparse_mqa_testkit.backends.reference import ReferenceBackend

class Short(ReferenceBackend):
    name = "short"
    def backward(self, *args, **kwargs):
        dq, dkv, ds = super().backward(*args, **kwargs)
        return dq, dkv[:, :-1], ds
'''


def test_a_failure_without_a_measure_shows_no_target_score(downstream):
    downstream.makepyfile(shortkernels=SHORT_DKV)
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs", "sparse_mqa_testkit.property_tests",
                                       "--smqa-backend", "shortkernels:Short", "--smqa-check", "tolerance",
                                       "-k", "test_check and not boundaries")
    r.assert_outcomes(failed=1)
    out = r.stdout.str()
    assert "dkv: shape" in out and "1e+09" not in out and "Highest target score" not in out


def test_database_never_defaults_into_the_package(tmp_path, monkeypatch):
    monkeypatch.delenv("SMQA_DATABASE", raising=False)
    monkeypatch.delenv("SMQA_BACKEND", raising=False)
    pkg = profiles._package_dir()
    assert profiles.database_dir(cwd=pkg / "property_tests") is None
    assert profiles.database_dir(cwd=tmp_path) == tmp_path.resolve() / ".hypothesis" / "smqa"
    assert profiles.database_dir(tmp_path / "db") == (tmp_path / "db").resolve()
    assert profiles.profile_settings("ci").database is None
    assert profiles.profile_settings("ci", tmp_path / "db").database is not None
    s = profiles.profile_settings("ci")
    assert s.derandomize and s.deadline is None


def test_profiles_apply_to_the_suite_only():
    from hypothesis import Phase, settings

    default_before = settings.default
    nightly = profiles.profile_settings("nightly")
    assert settings.default is default_before
    assert Phase.target in nightly.phases
    assert Phase.target not in profiles.profile_settings("dev").phases
    with pytest.raises(ValueError, match="profile must be one of"):
        profiles.profile_settings("fast")


SLOW_BACKEND = '''
import time
from sparse_mqa_testkit.backends.reference import ReferenceBackend

class Slow(ReferenceBackend):
    name = "slow"
    def backward(self, *args, **kwargs):
        time.sleep(0.3)  # past Hypothesis's default 200 ms deadline
        return super().backward(*args, **kwargs)
'''

NO_SETTINGS_TEST = '''
from hypothesis import given
from sparse_mqa_testkit import backend_cases

@given(case=backend_cases())
def test_mine(smqa_checks, case):
    smqa_checks.tolerance(case)
'''


def test_a_downstream_given_test_gets_the_profile_without_asking(downstream, tmp_path):
    downstream.makepyfile(slowkernels=SLOW_BACKEND, test_mine=NO_SETTINGS_TEST)
    out = tmp_path / "r.json"
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "test_mine.py", "--smqa-backend",
                                       "slowkernels:Slow", "--smqa-json", str(out))
    r.assert_outcomes(passed=1)  # no DeadlineExceeded: the profile has no deadline
    (row,) = json.loads(out.read_text())["rows"]
    assert row["check"] == "mine" and row["cases"] == 2  # SMQA_MAX_EXAMPLES=2 from the profile


def test_fixture_rows_are_labelled_per_case(downstream, tmp_path):
    out = tmp_path / "r.json"
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "-k", "fixtures", "--smqa-backend", "reference",
                                       "--smqa-json", str(out))
    r.assert_outcomes(passed=3)
    assert sorted(x["check"] for x in json.loads(out.read_text())["rows"]) == \
        ["fixtures[case0]", "fixtures[case1]", "fixtures[case2]"]


def test_examples_are_keyed_per_backend(downstream, monkeypatch, tmp_path):
    """A failure one backend saved is not replayed on another: the same bug under a second name, run with the
    same database and one derandomized example (which passes on its own), passes."""
    downstream.makepyfile(alias=DQ_DOUBLED_SOURCE + "\nclass Alias(Broken):\n    name = 'alias'\n")
    db = tmp_path / "db"
    monkeypatch.setenv("SMQA_MAX_EXAMPLES", "30")
    args = ["-p", "no:cacheprovider", "--pyargs", "sparse_mqa_testkit.property_tests", "--smqa-database", str(db),
            "--smqa-check", "tolerance", "-k", "not boundaries"]
    r = downstream.runpytest_inprocess(*args, "--smqa-backend", "alias:Broken")
    r.assert_outcomes(failed=1)
    monkeypatch.setenv("SMQA_MAX_EXAMPLES", "1")
    r = downstream.runpytest_inprocess(*args, "--smqa-backend", "alias:Broken")
    r.assert_outcomes(failed=1)  # its own failure replays from the database
    r = downstream.runpytest_inprocess(*args, "--smqa-backend", "alias:Alias")
    r.assert_outcomes(passed=1)  # not the other backend's


PLANTED_TAIL = '''
from sparse_mqa_testkit.backends.reference import ReferenceBackend

class DropsTail(ReferenceBackend):
    """Declares no tiles, and drops every top-k slot past the first block of 64."""
    name = "drops-tail"
    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        idx = indices.clone()
        idx[..., 64:] = -1
        return super().backward(q, kv, out, grad_out, lse, attn_sink, idx, sm_scale, topk_length=topk_length)
'''


def test_an_undeclared_tile_bug_is_found_on_cpu_and_the_report_says_tiles_are_missing(downstream, monkeypatch):
    from sparse_mqa_testkit.tools import cli

    downstream.makepyfile(tailkernels=PLANTED_TAIL)
    monkeypatch.setenv("PYTHONPATH", f"{downstream.path}:{__import__('os').environ.get('PYTHONPATH', '')}")
    monkeypatch.chdir(downstream.path)
    assert cli.main(["--backend", "tailkernels:DropsTail", "--profile", "ci", "--check", "tolerance"]) == 1


LONG_TOPK = '''
from sparse_mqa_testkit.backends.reference import ReferenceBackend

class LongTopk(ReferenceBackend):
    """dq doubled for 100 <= L <= 120: past the CPU limit (40) and away from every common tile size."""
    name = "long-topk"
    tiles = {"head_group": 16, "query_chunk": 8, "topk_block": 16}
    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        dq, dkv, ds = super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                       topk_length=topk_length)
        return (dq * 2 if 100 <= indices.shape[2] <= 120 else dq), dkv, ds
'''


def test_limits_are_raised_from_outside(downstream, monkeypatch):
    from sparse_mqa_testkit.cases.limits import parse_limits

    assert parse_limits("L=130, H=20,work=9000000") == {"max_l": 130, "max_h": 20, "max_work": 9_000_000}
    with pytest.raises(ValueError, match=r"--smqa-limits: 'Q=3' is not SIZE=N with SIZE one of B, S, Skv, H, L"):
        parse_limits("Q=3")
    downstream.makepyfile(longkernels=LONG_TOPK)
    monkeypatch.setenv("SMQA_MAX_EXAMPLES", "40")
    args = ["-p", "no:cacheprovider", "--pyargs", "sparse_mqa_testkit.property_tests", "--smqa-check", "tolerance",
            "--smqa-profile", "ci", "--smqa-backend", "longkernels:LongTopk"]
    downstream.runpytest_inprocess(*args).assert_outcomes(passed=2)  # never drawn within the default limits
    r = downstream.runpytest_inprocess(*args, "--smqa-limits", "L=130,work=9000000")
    r.assert_outcomes(passed=1, failed=1)


def test_the_readme_test_file_runs_as_written(downstream, monkeypatch):
    """The complete downstream test file the README shows, verbatim, on a backend registered by module:attr."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if b.startswith("# tests/test_mine.py")]
    downstream.makepyfile(test_readme=block)
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "test_readme.py", "--smqa-backend", "mykernels:Mine")
    r.assert_outcomes(passed=1 + 3)  # the @given test, and the by-hand test once per drawn case
    # the same under xdist, the backend named by $SMQA_BACKEND: every row the table and the JSON show passed (a
    # passed setup is no error)
    out = downstream.path / "r.json"
    monkeypatch.setenv("SMQA_BACKEND", "mykernels:Mine")
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "-n", "2", "test_readme.py", "--smqa-json", str(out))
    r.assert_outcomes(passed=1 + 3)
    assert "ERROR" not in r.stdout.str()
    data = json.loads(out.read_text())  # written by the controller, with every worker's rows
    assert data["status"] == "finished" and not data["unfinished"]
    # one row: the @given test's (the by-hand test runs no check of the suite)
    assert [(x["check"], x["outcome"]) for x in data["rows"]] == [("tolerance_and_guards", "passed")]


def test_the_scale_tier_runs_only_when_asked(downstream, monkeypatch):
    import sys

    from sparse_mqa_testkit.cases import scale

    for name in [m for m in sys.modules if m.startswith("sparse_mqa_testkit.property_tests.")]:
        monkeypatch.delitem(sys.modules, name)
    suite = ("-p", "no:cacheprovider", "--pyargs", "sparse_mqa_testkit.property_tests", "--co", "-q",
             "--smqa-backend", "reference")
    r = downstream.runpytest_inprocess(*suite)
    assert "test_scale" not in r.stdout.str() and "test_check_boundaries" in r.stdout.str()
    r = downstream.runpytest_inprocess(*suite, "--smqa-scale")
    ids = [line for line in r.stdout.lines if "test_scale[" in line]
    assert len(ids) == len(scale.FIXED) + scale.DRAWN["dev"] and "test_check_boundaries" in r.stdout.str()
    assert any(scale.FIXED[0].describe() in line for line in ids)
    r = downstream.runpytest_inprocess(*suite, "--smqa-profile", "scale")
    lines = [line for line in r.stdout.lines if "::" in line]
    assert lines and all("test_scale[" in line for line in lines), "the scale profile runs the tier alone"
    assert len(lines) == len(scale.FIXED) + scale.DRAWN["scale"]
    # a CPU backend: skipped, saying why
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs", "sparse_mqa_testkit.property_tests",
                                       "-rs", "--smqa-backend", "reference", "--smqa-profile", "scale")
    r.assert_outcomes(skipped=len(lines))
    r.stdout.fnmatch_lines(["*the scale tier runs production sizes on a CUDA backend; 'reference' runs on cpu*"])
    # the compile pool is for drawn cases: a run of the tier alone never warms it up, a run with other tests does
    assert "[smqa] warm-up" not in r.stdout.str() + r.stderr.str()
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs", "sparse_mqa_testkit.property_tests",
                                       "--smqa-backend", "reference", "--smqa-scale", "-k", "test_scale")
    assert "[smqa] warm-up" not in r.stdout.str() + r.stderr.str()
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs", "sparse_mqa_testkit.property_tests",
                                       "--smqa-backend", "reference", "--smqa-scale", "-k", "test_scale or rejection")
    assert "[smqa] warm-up reference" in r.stdout.str() + r.stderr.str()


UNCAPTURABLE = '''
from sparse_mqa_testkit.backends.reference import ReferenceBackend

class Uncapturable(ReferenceBackend):
    name = "uncapturable"
    device = "cuda"
    graph_safe = False
    graph_unsafe_reason = "it reads topk_length on the host"

    def __init__(self):
        pass
'''


def test_execution_checks_show_as_skipped_with_the_reason(downstream, monkeypatch):
    for name in [m for m in sys.modules if m.startswith("sparse_mqa_testkit.property_tests.")]:
        monkeypatch.delitem(sys.modules, name)
    downstream.makepyfile(uncapturable=UNCAPTURABLE)
    execution = ["graph", "streams", "host_sync", "allocations", "repeats"]
    suite = ["-rs", "-p", "no:cacheprovider", "--pyargs", "sparse_mqa_testkit.property_tests",
             *[a for c in execution for a in ("--smqa-check", c)]]
    r = downstream.runpytest_inprocess(*suite, "--smqa-backend", "mykernels:Mine")
    r.assert_outcomes(skipped=2 * len(execution))  # the boundary examples and the drawn cases of each
    table = r.stdout.str()
    for check in execution:
        assert re.search(rf"{check} +mykernels:Mine +0 +- +SKIP \(CUDA only: backend 'mine' runs on cpu\)", table)
    r = downstream.runpytest_inprocess(*suite, "--smqa-backend", "uncapturable:Uncapturable", "-k", "graph")
    r.assert_outcomes(skipped=2)
    r.stdout.fnmatch_lines(["*SKIP (backend 'uncapturable' declares graph_safe = False: it reads topk_length on "
                            "the host)*"])


PROFILE_OPTIONS = '''
import os

def test_options(smqa_checks, smqa_plan):
    explicit = smqa_plan.boundaries.examples[0]
    assert smqa_checks.defaults("repeats", explicit) == {"repeats": int(os.environ["WANT_REPEATS"])}
    assert smqa_checks.defaults("repeats", explicit.replace(seed=987654)) == {"repeats": 4}  # a drawn case
    assert smqa_checks.defaults("tolerance", explicit) == {}
'''


@pytest.mark.parametrize("profile, repeats", [("ci", 4), ("nightly", 1000)])
def test_the_profile_gives_the_repeats_check_its_count(downstream, monkeypatch, profile, repeats):
    downstream.makepyfile(test_profile_options=PROFILE_OPTIONS)
    monkeypatch.setenv("WANT_REPEATS", str(repeats))
    r = downstream.runpytest_inprocess("-p", "no:cacheprovider", "test_profile_options.py", "--smqa-profile", profile,
                                       "--smqa-backend", "mykernels:Mine")
    r.assert_outcomes(passed=1)


def test_execution_checks_draw_fewer_cases(monkeypatch):
    """The drawn test of an execution check runs the profile's examples capped at EXECUTION_EXAMPLES; another
    check's, all of them."""
    from types import SimpleNamespace

    from hypothesis import given, strategies

    from sparse_mqa_testkit.harness import fixtures

    monkeypatch.delenv("SMQA_MAX_EXAMPLES", raising=False)
    runs = []

    @given(strategies.integers())
    def drawn(x):
        runs.append(x)

    state = SimpleNamespace(profile="ci", settings=profiles.profile_settings("ci"))
    for check, want in (("graph", profiles.EXECUTION_EXAMPLES["ci"]), ("tolerance", profiles.MAX_EXAMPLES["ci"])):
        runs.clear()
        item = SimpleNamespace(obj=drawn, callspec=SimpleNamespace(params={"smqa_check": check}),
                               module=SimpleNamespace(__name__="m"), name=f"test_check[{check}]")
        fixtures._hypothesis_settings(item, state)
        drawn()
        assert len(runs) == want, check
