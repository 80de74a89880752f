"""Nightly fuzzing on HypoFuzz (tools/hypofuzz_nightly.py). What needs HypoFuzz runs the pinned release of the
`fuzz` extra (pyproject.toml) in a virtual environment of its own, which keeps this machine's packages but needs
an older Hypothesis than CI installs; it is built once (pip, from PyPI) under $SMQA_HYPOFUZZ_CACHE, else
~/.cache/sparse-mqa-testkit, and without network access to PyPI those tests skip, saying so.

HypoFuzz finds a planted bug and plain pytest replays it from the shared database; a failure pytest found is the
first thing HypoFuzz replays; a correct backend fuzzed as long finds nothing; the dashboard answers on loopback;
``bash ci/nightly`` runs its campaign on HypoFuzz; and the engine says what to install when it cannot run.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import os
import signal
import site
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from sparse_mqa_testkit.harness import hypothesis_compat, profiles
from sparse_mqa_testkit.harness.fuzzing import fuzz_test
from sparse_mqa_testkit.tools import cli, hypofuzz_nightly, runner
from sparse_mqa_testkit.tools.hypofuzz_nightly import fuzz_args
from support import DQ_DOUBLED_SOURCE, free_port

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
CACHE_ENV = "SMQA_HYPOFUZZ_CACHE"
# pip's words for "PyPI cannot be reached" (anything else that fails is a failure of the pins)
OFFLINE = ("Failed to establish a new connection", "Temporary failure in name resolution", "Network is unreachable",
           "Name or service not known", "No route to host", "ConnectTimeout", "Read timed out", "ProxyError",
           "Could not fetch URL")
FUZZ_SECONDS = 60  # at most: the planted bug is found in about 10 s on a loaded 2-core machine, start-up included
BUG = "support:TopkIgnored"  # tests/support.py's BROKEN["topk_ignored"]
TOLERANCE = ["-k", "test_fuzz and tolerance and not forward"]  # the drawn tolerance check only


def fuzz_pins() -> list[str]:
    """The `fuzz` extra's requirements, read from pyproject.toml (one line there)."""
    line = next(x for x in (REPO / "pyproject.toml").read_text().splitlines() if x.startswith("fuzz = ["))
    return ast.literal_eval(line.split("=", 1)[1].strip())


@pytest.fixture(scope="session")
def hypofuzz_venv() -> Path:
    """A venv with this environment's packages and the `fuzz` extra's pins (built once per environment and pin
    set, under a lock for xdist's workers)."""
    pins = fuzz_pins()
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sparse-mqa-testkit")
    venv = cache / ("hypofuzz-" + hashlib.sha256("\n".join([sys.prefix, sys.version, *pins]).encode()).hexdigest()[:12])
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / (venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = venv / "smqa-pins.txt"
        if not marker.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", "--system-site-packages", str(venv)], check=True)
            see_this_environment(venv)
            # not quiet: pip names an unreachable index only in its warnings
            done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", *pins],
                                  capture_output=True, text=True)
            out = done.stdout + done.stderr
            if done.returncode != 0 and any(w in out for w in OFFLINE):
                reason = next(line for line in out.splitlines() if any(w in line for w in OFFLINE))
                pytest.skip(f"building the HypoFuzz venv needs PyPI, which this machine cannot reach: {reason}")
            assert done.returncode == 0, f"pip install {' '.join(pins)} into {venv} failed:\n{out[-4000:]}"
            marker.write_text("\n".join(pins))
    return venv


def see_this_environment(venv: Path) -> None:
    """When this interpreter is itself a venv, --system-site-packages shows the new one only the base
    interpreter's packages: add this one's site directories after the new venv's own (its Hypothesis wins)."""
    if sys.prefix == sys.base_prefix:
        return
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    lines = [f"import site; site.addsitedir({d!r})" for d in site.getsitepackages()]
    (Path(purelib) / "_smqa_outer_site.pth").write_text("\n".join(lines) + "\n")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A downstream working directory with a broken backend module; the repo's planted bugs importable."""
    (tmp_path / "brokenkernels.py").write_text(DQ_DOUBLED_SOURCE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(tmp_path)
    for name in ("SMQA_PROFILE", "SMQA_DATABASE", "SMQA_BACKEND", "SMQA_FUZZ", "SMQA_MAX_EXAMPLES"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def shared_database(request, workdir) -> str:
    """The fleet's Redis when redis-server is installed, else a directory."""
    try:
        return request.getfixturevalue("redis_url")
    except pytest.skip.Exception:
        return str(workdir / "shared")


def nodeids(args: list[str]) -> dict[str, str]:
    """backend-check -> node id, as pytest (and so HypoFuzz) collects the fuzz entry with ``args``."""
    done = subprocess.run([sys.executable, "-m", "pytest", *args, "--collect-only", "-q"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return {n.split("[", 1)[1].rstrip("]"): n for n in done.stdout.splitlines() if "::test_fuzz[" in n}


def key(nodeid: str) -> bytes:
    return hypothesis_compat.example_key(fuzz_test(nodeid.encode()))


def reports(db, nodeid: str) -> list[dict]:
    """HypoFuzz's progress reports for a test (its own entries beside the test's key)."""
    return [json.loads(v) for v in db.fetch(key(nodeid) + b".hypofuzz.reports")]


def replayed(db, nodeid: str) -> bool:
    """HypoFuzz met a failing input while replaying the database, before it generated any (status 3:
    Hypothesis's INTERESTING)."""
    return any(r["phase"] == "replay" and r["status_counts"]["3"] for r in reports(db, nodeid))


def fuzz(venv: Path, args: list[str], seconds: float, *, workers: int = 2, port: int | None = None,
         log: Path) -> subprocess.Popen:
    """``hypothesis fuzz`` from the venv under ``timeout``, in a session of its own, with a dashboard on ``port``."""
    dash = ["--host", "127.0.0.1", "--port", str(port)] if port else ["--no-dashboard"]
    with open(log, "w") as out:
        return subprocess.Popen(["timeout", "-k", "5", str(seconds), str(venv / "bin" / "hypothesis"), "fuzz", "-n",
                                 str(workers), *dash, "--", *args], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish(proc: subprocess.Popen, *, now: bool = False) -> None:
    """Wait for ``timeout`` to stop HypoFuzz (or stop it ``now``), then kill what is left of its session."""
    if not now:
        proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # HypoFuzz's workers, should any have outlived their hub
    except ProcessLookupError:
        pass
    proc.wait()


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read().decode()


def test_the_engine_says_what_to_install_when_hypofuzz_cannot_run(monkeypatch, capsys):
    versions = {"hypofuzz": None, "hypothesis": (6, 170, 17)}
    monkeypatch.setattr(hypofuzz_nightly, "_version", lambda dist: versions[dist])
    assert cli.main(["--budget", "5", "--engine", "hypofuzz"]) == 2
    assert "the HypoFuzz engine needs HypoFuzz: pip install 'sparse-mqa-testkit[fuzz]'" in capsys.readouterr().err
    versions["hypofuzz"] = (25, 4, 8)
    assert hypofuzz_nightly.engine_problem() == (
        "hypofuzz 25.4.8 breaks with hypothesis 6.170.17 (it needs < 6.133.2): " + hypofuzz_nightly.INSTALL
        + ", in a virtual environment of its own if the rest must keep a newer Hypothesis")
    versions["hypothesis"] = (6, 133, 1)
    assert hypofuzz_nightly.engine_problem() is None
    versions.update(hypofuzz=(25, 11, 1), hypothesis=(6, 157, 1))
    assert "needs < 6.157.1" in hypofuzz_nightly.engine_problem()
    monkeypatch.setenv("SMQA_ENGINE", "hypofuz")
    assert cli.main(["--budget", "5"]) == 2
    assert "SMQA_ENGINE must be one of ours, hypofuzz, got 'hypofuz'" in capsys.readouterr().err


def test_one_fuzzing_process_per_gpu_each_pinned_else_one_on_the_cpus(monkeypatch):
    monkeypatch.setattr(hypofuzz_nightly.gpu_workers, "visible_gpus", lambda: ["0", "GPU-5f2e"])
    procs = hypofuzz_nightly.fuzz_processes(["--pyargs", "x"])
    assert [(n, cmd[1:6], env) for n, cmd, env in procs] == [
        ("gpu0", ["fuzz", "--no-dashboard", "-n", "1", "--"], {"CUDA_VISIBLE_DEVICES": "0"}),
        ("gpuGPU-5f2e", ["fuzz", "--no-dashboard", "-n", "1", "--"], {"CUDA_VISIBLE_DEVICES": "GPU-5f2e"})]
    monkeypatch.setattr(hypofuzz_nightly.gpu_workers, "visible_gpus", lambda: [])
    monkeypatch.setenv("SMQA_FUZZ_WORKERS", "3")
    ((name, cmd, env),) = hypofuzz_nightly.fuzz_processes(["--pyargs", "x"])
    assert name == "cpu" and cmd[1:] == ["fuzz", "--no-dashboard", "-n", "3", "--", "--pyargs", "x"] and env == {}
    monkeypatch.setenv("SMQA_FUZZ_WORKERS", "many")
    with pytest.raises(ValueError, match="SMQA_FUZZ_WORKERS must be a positive integer"):
        hypofuzz_nightly.fuzz_processes([])


def test_hypofuzz_finds_a_planted_bug_pytest_replays_it_and_each_replays_the_others(hypofuzz_venv, workdir,
                                                                                    request, monkeypatch):
    db_spec = shared_database(request, workdir)
    # read back through the shared database alone: Redis beside a fresh local directory, or the directory
    elsewhere = f"{workdir / 'elsewhere'},{db_spec}" if db_spec.startswith("redis://") else db_spec
    backends = [BUG, "brokenkernels:Broken", "reference"]
    args = fuzz_args(backends, profile="ci", database=db_spec, extra=TOLERANCE)
    # pytest first: it finds the other broken backend's bug (dq doubled once Skv >= 9)
    rc, data = runner.run_suite(["brokenkernels:Broken"], profile="ci", database=db_spec,
                                extra=["--smqa-fuzz", *TOLERANCE])
    (seeded,) = [r["nodeid"] for r in data["rows"] if r["outcome"] == "failed"]
    assert rc == 1 and seeded.endswith("test_fuzz[brokenkernels:Broken-tolerance]")
    bug, correct = (seeded.replace("brokenkernels:Broken", b) for b in (BUG, "reference"))

    # HypoFuzz until it has found the planted bug, replayed pytest's find and answered on its dashboard (the
    # correct backend fuzzed all along, in the other process)
    port, shared = free_port(), profiles.example_database(elsewhere)
    proc = fuzz(hypofuzz_venv, args, FUZZ_SECONDS, port=port, log=workdir / "hypofuzz.log")
    answered, found, deadline = None, False, time.monotonic() + FUZZ_SECONDS
    while not (answered and found) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            answered = answered or (get(f"http://127.0.0.1:{port}/"),
                                    get(f"http://127.0.0.1:{port}/api/collected_tests/"))
        except OSError:
            pass
        found = bool(list(shared.fetch(key(bug)))) and replayed(shared, seeded)
    finish(proc, now=True)
    log = (workdir / "hypofuzz.log").read_text()
    assert answered is not None, f"the dashboard never answered on 127.0.0.1:{port}; its log:\n{log[-3000:]}"
    (status, page), (_, collected) = answered
    assert status == 200 and "HypoFuzz" in page and bug in collected and correct in collected
    assert list(shared.fetch(key(bug))), f"HypoFuzz saved no failure for {bug} in {db_spec}; its log:\n{log[-3000:]}"
    assert not list(shared.fetch(key(correct))), "HypoFuzz reported a failure on the correct backend"
    assert reports(shared, correct), "HypoFuzz never ran the correct backend's test"
    assert replayed(shared, seeded), f"HypoFuzz did not replay the failure pytest saved for {seeded}"

    # plain pytest (CI's Hypothesis) replays what HypoFuzz found: one derandomized example passes without the
    # database, and fails from it (a fresh local directory beside the shared database, when it is Redis)
    only = ["--smqa-fuzz", *TOLERANCE]
    monkeypatch.setenv("SMQA_MAX_EXAMPLES", "1")
    rc, _ = runner.run_suite([BUG], profile="ci", extra=only)
    assert rc == 0
    rc, data = runner.run_suite([BUG, "reference"], profile="ci", database=elsewhere, extra=only)
    outcomes = {r["nodeid"]: r["outcome"] for r in data["rows"]}
    assert rc == 1 and outcomes == {bug: "failed", correct: "passed"}, outcomes


def test_ci_nightly_runs_its_campaign_on_hypofuzz(hypofuzz_venv, workdir):
    """``SMQA_ENGINE=hypofuzz bash ci/nightly``: HypoFuzz for the budget, then a reproducer and the ledger."""
    night = workdir / "night"
    env = dict(os.environ, SMQA_ENGINE="hypofuzz", SMQA_BACKEND=BUG, SMQA_NIGHTLY_DIR=str(night),
               SMQA_NIGHTLY_SLOW="0", SMQA_FUZZ_WORKERS="2", PATH=f"{hypofuzz_venv / 'bin'}:{os.environ['PATH']}")
    done = subprocess.run(["bash", str(REPO / "ci" / "nightly"), "30"], env=env, capture_output=True, text=True,
                          timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-4000:]
    assert "[nightly] engine hypofuzz 25.4.8" in out and "dashboard: http://127.0.0.1:" in out
    # an ignored topk_length fails tolerance, guards and rejection: each one found is a reproducer
    repros = {p.name.removeprefix("reproducer-support_TopkIgnored-").removesuffix(".txt"): p.read_text()
              for p in (night / "out").glob("reproducer-*.txt")}
    assert repros and set(repros) <= {"tolerance", "guards", "rejection"}, out[-4000:]
    for check, text in repros.items():
        assert f"sparse-mqa-check --backend {BUG} --check {check} --replay \"Case(" in text
        assert "@example(case=Case(" in text
    (entry,) = json.loads((night / "ledger.json").read_text())
    assert entry["engine"] == "hypofuzz" and entry["failures"] == len(repros) and entry["examples"] > 0
    assert entry["ratios"][BUG]["tolerance"], "the ledger has no ratios from HypoFuzz's search"


@pytest.mark.slow
def test_a_correct_backend_fuzzed_for_two_minutes_fails_nothing(hypofuzz_venv, workdir):
    args = fuzz_args(["reference"], profile="nightly", database=str(workdir / "db"))
    ids = nodeids(args)
    proc = fuzz(hypofuzz_venv, args, 120, log=workdir / "hypofuzz.log")
    finish(proc)
    db = profiles.example_database(workdir / "db")
    log = (workdir / "hypofuzz.log").read_text()[-3000:]
    ran = {name.removeprefix("reference-") for name, nodeid in ids.items() if reports(db, nodeid)}
    assert ran == {"tolerance", "forward_tolerance", "determinism", "rejection", "guards"}, log
    assert not [n for n in ids.values() if list(db.fetch(key(n)))], log
