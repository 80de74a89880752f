"""sparse-mqa-check: replay, precompile, the main job on a broken backend, and a nightly run whose failure
becomes a reproducer, a ledger entry and a database entry the next plain run replays."""

import json

import pytest

from sparse_mqa_testkit.tools import cli, runner
from sparse_mqa_testkit.tools.nightly import run_nightly
from support import DQ_DOUBLED_SOURCE

BROKEN = DQ_DOUBLED_SOURCE


@pytest.fixture
def broken(tmp_path, monkeypatch):
    (tmp_path / "brokenkernels.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}")
    monkeypatch.chdir(tmp_path)
    return "brokenkernels:Broken"


def test_replay_passes_and_fails_with_the_message(broken, capsys):
    assert cli.main(["--backend", "reference", "--check", "tolerance", "--replay", "Case(H=3, seed=1)"]) == 0
    assert "PASS: tolerance on backend reference" in capsys.readouterr().out
    assert cli.main(["--backend", broken, "--check", "tolerance", "--replay", "Case(H=3, seed=1)"]) == 1
    out = capsys.readouterr().out
    assert "tolerance check failed for backend 'broken'" in out and "dq: relative L2 error" in out


def test_replay_of_a_check_that_does_not_apply_says_so(capsys):
    assert cli.main(["--backend", "reference", "--check", "graph", "--replay", "Case(H=3, seed=1)"]) == 1
    assert "SKIP: graph on backend reference: CUDA only: backend 'reference' runs on cpu" in capsys.readouterr().out
    assert cli.main(["--backend", "reference", "--check", "repeats", "--repeats", "1000", "--replay", "Case()"]) == 1
    assert "SKIP: repeats" in capsys.readouterr().out
    for args in (["--check", "tolerance", "--repeats", "9", "--replay", "Case()"], ["--repeats", "9"]):
        assert cli.main(["--backend", "reference", *args]) == 2
        assert "--repeats goes with --check repeats --replay" in capsys.readouterr().err


def test_replay_lines_name_the_backend_as_given_and_run_as_printed(broken, capsys):
    import shlex

    assert cli.main(["--backend", broken, "--check", "tolerance", "--replay", "Case(H=3, Skv=9, seed=1)"]) == 1
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("repro: ")]
    assert line.startswith(f"repro: sparse-mqa-check --backend {broken} --check tolerance --replay")
    argv = shlex.split(line.removeprefix("repro: "))
    assert argv[0] == "sparse-mqa-check" and cli.main(argv[1:]) == 1  # the printed line runs, and fails again
    assert capsys.readouterr().out == out


def test_a_repro_line_finds_a_backend_in_the_working_directory(tmp_path, monkeypatch, capsys):
    """Run as the console script (no working directory on sys.path, nothing on PYTHONPATH), the printed repro line
    still finds a ``module:attr`` backend in the directory it was printed in, as ``python -m`` and pytest would."""
    import os
    import sys

    (tmp_path / "localkernels.py").write_text(BROKEN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    monkeypatch.delitem(sys.modules, "localkernels", raising=False)
    assert cli.main(["--backend", "localkernels:Broken", "--check", "tolerance", "--replay", "Case(H=3, seed=1)"]) == 1
    assert "tolerance check failed for backend 'broken'" in capsys.readouterr().out
    assert sys.path[-1] == str(tmp_path)


@pytest.mark.parametrize("spec, why", [("no_such_module_xyz:B", "no module named 'no_such_module_xyz'"),
                                       ("sparse_mqa_testkit:NoSuchBackend", "has no attribute 'NoSuchBackend'"),
                                       ("nosuch", "unknown backend 'nosuch'; known: ")])
def test_a_backend_that_is_not_found_is_one_line(capsys, spec, why):
    assert cli.main(["--backend", spec, "--check", "tolerance", "--replay", "Case()"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"sparse-mqa-check: --backend {spec}: ") and why in err


def test_the_cli_names_its_own_flags_and_the_database_takes_redis_urls(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "optional.py").write_text(
        "from sparse_mqa_testkit import MissingDependency\n"
        "from sparse_mqa_testkit.backends.reference import ReferenceBackend\n"
        "class Needs(ReferenceBackend):\n    name = 'needs'\n    def require(self):\n"
        "        raise MissingDependency('needs fancylib: pip install fancylib')\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}")
    assert cli.main(["--backend", "optional:Needs", "--check", "guards"]) != 0
    out = capfd.readouterr()
    text = out.out + out.err
    assert "fancylib" in text and "--allow-missing" in text and "--smqa-" not in text
    assert "profile ?" not in text and "the suite did not run on backend optional:Needs" in text
    assert cli.main(["--backend", "optional:Needs", "--check", "guards", "--allow-missing"]) == 1
    out = capfd.readouterr().out
    assert "nothing was checked: backend 'optional:Needs' skipped (--allow-missing): needs fancylib" in out
    assert "redis://HOST:PORT" in cli.parser().format_help()


def test_replay_refuses_anything_but_a_case(capsys):
    assert cli.main(["--check", "tolerance", "--replay", "__import__('os')"]) == 2
    assert cli.main(["--replay", "Case()"]) == 2
    assert "--replay needs --check" in capsys.readouterr().err


PRECOMPILING = '''
from sparse_mqa_testkit.backends.reference import ReferenceBackend

class Compiles(ReferenceBackend):
    name = "compiles"
    def precompile(self, directory):
        (directory / "compiled.txt").write_text("fwd h64 sm_90a")
        return ["fwd h16 sm_90a", "fwd h64 sm_90a"]

class Crashes(ReferenceBackend):
    name = "crashes"
    def precompile(self, directory):
        return 1 / 0

class InParallel(ReferenceBackend):
    name = "in-parallel"
    def precompile(self, directory, jobs=1):
        return [f"fwd h64 sm_90a by {jobs} processes"]
'''


def test_precompile_reports_each_backend_and_lists_variants(tmp_path, monkeypatch, capsys):
    (tmp_path / "precompiling.py").write_text(PRECOMPILING)
    monkeypatch.syspath_prepend(str(tmp_path))
    cache = tmp_path / "cache"
    assert cli.main(["--precompile", str(cache), "--backend", "precompiling:Compiles"]) == 0
    out = capsys.readouterr().out
    assert "precompiling:Compiles: 2 kernel variants compiled" in out and "fwd h64 sm_90a" in out
    assert (cache / "compiled.txt").exists()  # the backend was handed the directory
    assert cli.main(["--precompile", str(cache), "--backend", "precompiling:Crashes", "--backend",
                     "precompiling:Compiles", "--backend", "no_such_module_xyz:B", "--backend", "reference"]) == 1
    out = capsys.readouterr().out
    assert "no_such_module_xyz:B: cannot be loaded" in out and "NOT precompiled" in out
    assert "reference: has no precompile(): nothing to compile ahead" in out and "(incomplete, see above)" in out
    assert "precompiling:Crashes: precompile() failed" in out and "ZeroDivisionError" in out
    assert "precompiling:Compiles: 2 kernel variants compiled" in out  # still compiled after the crash
    # --jobs reaches a backend whose precompile takes jobs (and only such a backend is said to use them)
    assert cli.main(["--precompile", str(cache), "--jobs", "3", "--backend", "precompiling:InParallel",
                     "--backend", "precompiling:Compiles"]) == 0
    out = capsys.readouterr().out
    assert "fwd h64 sm_90a by 3 processes" in out and "compiled in" in out and "s by 3 processes" in out
    assert out.count("by 3 processes") == 2  # the variant line and its backend's line, not the other backend's


def test_main_job_fails_on_a_broken_backend_with_table_and_json(broken, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("SMQA_MAX_EXAMPLES", "10")
    rc = cli.main(["--backend", broken, "--check", "tolerance", "--json", str(tmp_path / "r.json")])
    assert rc == 1
    out = capfd.readouterr().out
    assert "tolerance  brokenkernels:Broken" in out and "FAIL" in out
    assert "sparse-mqa-check: FAIL" in out
    assert "replay: sparse-mqa-check --backend brokenkernels:Broken --check tolerance" in out
    data = json.loads((tmp_path / "r.json").read_text())
    outcomes = sorted((r["check"], r["outcome"]) for r in data["rows"])
    assert outcomes == [("tolerance", "failed"), ("tolerance", "passed")]


def test_nightly_failure_becomes_reproducer_ledger_and_replays_from_the_database(broken, tmp_path, monkeypatch,
                                                                                  capfd):
    out = tmp_path / "night"
    rc = run_nightly([broken], budget=60, out=out, extra=["--smqa-check", "tolerance"])
    assert rc == 1
    printed = capfd.readouterr().out
    assert "[nightly] round 1:" in printed and "s left" in printed and "FAILURE tolerance" in printed
    (repro,) = out.glob("reproducer-*.txt")
    text = repro.read_text()
    assert "sparse-mqa-check --backend brokenkernels:Broken --check tolerance --replay \"Case(" in text
    assert "@example(case=Case(" in text
    patch = next(out.glob("reproducer-*.patch")).read_text()
    assert "+@example(case=Case(" in patch and "test_checks.py" in patch
    ledger = json.loads((out / "ledger.json").read_text())
    assert ledger[-1]["failures"] == 1 and ledger[-1]["ratios"]["brokenkernels:Broken"]["tolerance"]
    # the next plain run pointed at the same database replays the failure; without it, ci's one
    # derandomized example (the simplest case, Skv = 1) passes
    monkeypatch.setenv("SMQA_MAX_EXAMPLES", "1")
    rc, _ = runner.run_suite([broken], profile="ci", extra=["--smqa-check", "tolerance"])
    assert rc == 0
    rc, data = runner.run_suite([broken], profile="ci", database=out / "examples", extra=["--smqa-check", "tolerance"])
    assert rc == 1 and "failed" in {r["outcome"] for r in data["rows"]}


MINE_TEST = '''
from hypothesis import given
from sparse_mqa_testkit import backend_cases


@given(case=backend_cases())
def test_mine(smqa_checks, case):
    smqa_checks.tolerance(case)
'''


def test_a_nightly_failure_in_a_users_own_test_patches_that_test(broken, tmp_path, capfd):
    (tmp_path / "tests").mkdir()
    # a basename of its own: the nightly's in-process pytest leaves the module imported for later tests
    (tmp_path / "tests" / "test_nightly_mine.py").write_text(MINE_TEST)
    out = tmp_path / "night"
    assert run_nightly([broken], budget=60, out=out, extra=["-k", "test_mine", "tests/test_nightly_mine.py"]) == 1
    assert "FAILURE mine" in capfd.readouterr().out
    patch = next(out.glob("reproducer-*.patch")).read_text()
    assert "+++ ./tests/test_nightly_mine.py" in patch and "+@example(case=Case(" in patch
    assert "test_checks" not in patch


def test_nightly_pass_appends_to_the_ledger_and_compares_with_the_last_run(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "night"
    out.mkdir()
    (out / "ledger.json").write_text(json.dumps([{"date": "yesterday", "ratios": {}}]))
    assert run_nightly(["reference"], budget=5, out=out, extra=["--smqa-check", "tolerance"]) == 0
    printed = capfd.readouterr().out
    assert "[nightly] PASS: 1 rounds" in printed and "ledger reference tolerance: worst ratio" in printed
    ledger = json.loads((out / "ledger.json").read_text())
    assert len(ledger) == 2 and ledger[-1]["failures"] == 0 and ledger[-1]["examples"] > 0
    ratios = ledger[-1]["ratios"]["reference"]["tolerance"]
    assert ratios and all(v["max_ratio"] < 1 for v in ratios.values())
    assert not list(out.glob("reproducer-*"))
    # a creeping ratio is shown next to the last run's
    from sparse_mqa_testkit.tools.nightly import append_ledger

    for r in (0.25, 0.5):
        append_ledger(out / "ledger.json", {"reference": {"tolerance": {"sink finite": {"n": 5, "max_ratio": r}}}})
    assert "worst ratio 0.500 at 'sink finite' (last run 0.250)" in capfd.readouterr().out


def test_progress_lines_name_examples_failures_and_time_left(monkeypatch, capfd):
    import time

    from sparse_mqa_testkit.cases import Case
    from sparse_mqa_testkit.harness import recording

    monkeypatch.setenv(recording.PROGRESS_ENV, "0.001")
    monkeypatch.setenv(recording.DEADLINE_ENV, str(time.time() + 120))
    monkeypatch.setattr(recording, "_last_progress", [0.0])
    rec = recording.Recorder(check="tolerance", backend="reference")
    rec.add_case(Case())
    err = capfd.readouterr().err
    assert "[smqa] tolerance[reference]: 1 examples, 0 failures, 2.0 min left" in err


def test_a_main_job_that_checked_nothing_fails(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpuonly.py").write_text(
        "from sparse_mqa_testkit.backends.reference import ReferenceBackend\n"
        "class OnGpu(ReferenceBackend):\n    name = 'ongpu'\n    def __init__(self):\n"
        "        self.device = 'cuda'\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the child sees no GPU, whatever this machine has
    assert cli.main(["--backend", "gpuonly:OnGpu", "--check", "guards"]) == 1
    assert "nothing was checked: backend 'gpuonly:OnGpu' (device cuda) needs a CUDA GPU" in capfd.readouterr().out


HANGS = '''
import time
from sparse_mqa_testkit.backends.reference import ReferenceBackend

class Hangs(ReferenceBackend):
    """dq doubled (the first check fails at once); a forward that never returns (the next one never ends)."""
    name = "hangs"
    def backward(self, *args, **kwargs):
        dq, dkv, ds = super().backward(*args, **kwargs)
        return dq * 2, dkv, ds
    def forward(self, *args, **kwargs):
        while True:
            time.sleep(0.1)
'''


@pytest.mark.skipif(__import__("shutil").which("timeout") is None, reason="needs coreutils' timeout")
def test_a_run_stopped_by_timeout_leaves_what_finished(tmp_path):
    """`timeout -s TERM N sparse-mqa-check ... --json F`: the finished check's verdict and replay line were
    printed as it finished, and F is marked interrupted with that check complete and the others listed."""
    import os
    import subprocess
    import sys

    (tmp_path / "hangs.py").write_text(HANGS)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    path = tmp_path / "F.json"
    proc = subprocess.run(["timeout", "-s", "TERM", "25", sys.executable, "-m", "sparse_mqa_testkit", "--backend",
                           "hangs:Hangs", "--profile", "ci", "--json", str(path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 124, proc.stdout + proc.stderr
    out = proc.stdout
    assert "[smqa] FAIL test_check_boundaries[hangs:Hangs-tolerance]: 1 cases" in out
    assert "  replay: sparse-mqa-check --backend hangs:Hangs --check tolerance --replay \"Case(" in out
    assert "sparse-mqa-check: INTERRUPTED (by SIGTERM" in out and "unfinished (" in out
    data = json.loads(path.read_text())
    assert data["status"] == "interrupted"
    (row,) = data["rows"]
    assert row["check"] == "tolerance" and row["outcome"] == "failed" and row["cases"] == 1
    assert row["failure"]["repro"].startswith("sparse-mqa-check --backend hangs:Hangs --check tolerance")
    assert row["coverage"] and row["worst"]["tensor"] == "dq"
    unfinished = data["unfinished"]
    assert len(unfinished) >= 10 and row["nodeid"] not in unfinished  # the other checks' tests
    assert any("test_check_boundaries[hangs:Hangs-forward_tolerance]" in n for n in unfinished)


def test_list_backends_says_where_each_comes_from_and_whether_it_loads(capsys):
    assert cli.main(["--list-backends"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["name", "origin", "device", "loads", "here"]
    rows = {line.split()[0]: line for line in out[1:]}
    assert "built-in" in rows["reference"] and rows["reference"].rstrip().endswith("yes")
    assert "entry point sparse_mqa_kernels.backends:TileLangModelBackend" in rows["tilelang-model"]
    # a backend whose optional packages are absent says which, instead of failing the listing
    assert all(r.rstrip().endswith("yes") or " no: " in r for r in rows.values())
