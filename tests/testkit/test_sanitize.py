"""``--sanitize``: what compute-sanitizer reports is turned into findings with the kernel and the case; a tool
that is missing or cannot read the device is said, never a pass."""

from __future__ import annotations

import io
import re

from sparse_mqa_testkit import Case
from sparse_mqa_testkit.tools import cli, sanitize

MEMCHECK = """========= COMPUTE-SANITIZER
[smqa-sanitize] case 0: Case()
[smqa-sanitize] case 1: Case(H=65)
========= Invalid __global__ read of size 2 bytes
=========     at sparse_mqa_bwd_kernel(bfloat16_t *, int)+0x1a30
=========     by thread (3,0,0) in block (0,1,0)
=========     Address 0x7f0000001000 is out of bounds
=========
[smqa-sanitize] case 2: Case(L=17)
========= ERROR SUMMARY: 1 error
"""

RACECHECK = """========= COMPUTE-SANITIZER
[smqa-sanitize] case 0: Case()
========= Error: Race reported between Write access at sparse_mqa_fwd_kernel(float *)+0x200 in /t/k.cu:10
=========     and Read access at sparse_mqa_fwd_kernel(float *)+0x300 in /t/k.cu:12 [128 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""


def test_findings_name_the_tool_the_kernel_and_the_case():
    found, broken = sanitize.parse(MEMCHECK, "memcheck")
    assert broken is None and len(found) == 1
    f = found[0]
    assert (f.tool, f.case, f.kernel) == ("memcheck", 1, "sparse_mqa_bwd_kernel")
    assert "out of bounds" in f.text
    found, _ = sanitize.parse(RACECHECK, "racecheck")
    assert [(f.case, f.kernel) for f in found] == [(0, "sparse_mqa_fwd_kernel")]


def test_a_clean_run_has_no_findings_and_a_refused_device_is_said():
    clean = "========= COMPUTE-SANITIZER\n[smqa-sanitize] case 0: Case()\n========= ERROR SUMMARY: 0 errors\n"
    assert sanitize.parse(clean, "memcheck") == ([], None)
    _, broken = sanitize.parse("========= Error: Device not supported\n", "memcheck")
    assert broken and "Device not supported" in broken


def test_a_missing_tool_is_not_a_pass(monkeypatch):
    monkeypatch.setattr(sanitize, "find_tool", lambda: None)
    out = io.StringIO()
    assert sanitize.run("tilelang", [Case()], ("memcheck",), out=out) == sanitize.NOT_RUN
    assert "compute-sanitizer not found" in out.getvalue() and "NOT sanitized" in out.getvalue()


def test_a_cpu_backend_has_nothing_to_sanitize(capsys):
    assert cli.main(["--backend", "reference", "--sanitize"]) == sanitize.NOT_RUN
    assert "runs on the CPU" in capsys.readouterr().out
    assert cli.main(["--backend", "reference", "--sanitize", "memcheck,bogus"]) == 2
    assert "--sanitize bogus: choose from memcheck, racecheck, initcheck, synccheck" in capsys.readouterr().err


def test_replay_lines_name_the_tool():
    assert sanitize.replay_command("cudnn", "racecheck", Case(H=65)) == \
        'sparse-mqa-check --backend cudnn --sanitize racecheck --replay "Case(H=65)"'


FAKE_TOOL = '''#!{python}
# compute-sanitizer's stand-in: logs its own options, runs the program after them
import os, subprocess, sys
args = sys.argv[1:]
i = args.index("-m") - 1
with open(os.environ["FAKE_TOOL_LOG"], "a") as log:
    log.write(" ".join(args[:i]) + "\\n")
print("========= COMPUTE-SANITIZER", flush=True)
rc = subprocess.call(args[i:])
print("========= ERROR SUMMARY: 0 errors", flush=True)
sys.exit(rc)
'''

SLOW_ON_H3 = '''
import time
from sparse_mqa_testkit.backends.reference import ReferenceBackend

class SlowOnH3(ReferenceBackend):
    name = "slow-on-h3"
    sanitize_kernels = "mine_"
    def backward(self, q, *args, **kwargs):
        if q.shape[2] == 3:
            time.sleep(120)
        return super().backward(q, *args, **kwargs)
'''


def test_each_case_is_shown_as_it_starts_and_a_case_past_its_limit_is_named_with_the_tool(tmp_path, monkeypatch):
    import os
    import sys

    tool = tmp_path / "compute-sanitizer"
    tool.write_text(FAKE_TOOL.format(python=sys.executable))
    tool.chmod(0o755)
    (tmp_path / "slowmod.py").write_text(SLOW_ON_H3)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("FAKE_TOOL_LOG", str(tmp_path / "options.log"))
    monkeypatch.setattr(sanitize, "find_tool", lambda: str(tool))
    cases = [Case(H=2, seed=1), Case(H=3, seed=2), Case(B=2, H=4, seed=3), Case(H=4, seed=3)]
    out = io.StringIO()
    assert sanitize.run("slowmod:SlowOnH3", cases, ("racecheck",), out=out, case_limit=4) == sanitize.NOT_RUN
    text = out.getvalue()
    label = "sanitize slowmod:SlowOnH3 racecheck"
    # racecheck: one query of one batch per case (B=2 and B=1 of the same case are one case then)
    assert re.findall(rf"^{label}: (case \d/3): B1 S1 ", text, re.M) == ["case 1/3", "case 2/3", "case 3/3"]
    assert (f"{label}: case 2 (Case(S=1, H=3, seed=2)) ran past the 4 s limit per case under racecheck "
            "(SMQA_SANITIZE_CASE_LIMIT): stopped") in text
    assert f"{label}: 0 findings in 3 cases" in text and "NOT sanitized" in text
    options = (tmp_path / "options.log").read_text().splitlines()
    assert len(options) == 2  # the child started again after the stopped case
    # racecheck's deadlock timer is off: the per-case limit stops a hang (above)
    assert "--racecheck-report analysis --show-backtrace no --racecheck-deadlock-timeout 0 " in options[0]
    assert options[0].endswith("--kernel-name kns=mine_")
    out = io.StringIO()
    assert sanitize.run("slowmod:SlowOnH3", cases[:2], ("memcheck",), out=out, tool_limit=15) == sanitize.NOT_RUN
    assert re.search(r"cases [12] to 2 not finished within the 15 s limit of memcheck \(SMQA_SANITIZE_TOOL_LIMIT\): "
                     "NOT sanitized", out.getvalue()), out.getvalue()
    assert "kns=" not in (tmp_path / "options.log").read_text().splitlines()[-1]  # memcheck checks every kernel


def test_a_budget_is_shared_by_the_tool_runs_and_what_a_fast_run_leaves_goes_to_the_next():
    now = [0.0]
    budget = sanitize.Budget(540, runs=8, clock=lambda: now[0])
    assert budget.share() == 540 / 8
    now[0] = 14.0  # the first run took 14 s of its 67.5
    assert budget.share() == (540 - 14) / 7
    budget.skip(2)
    now[0] = 540.0 + 1
    assert budget.share() == 0.0  # spent: the run stops at once and names its cases as not sanitized
    assert sanitize.Budget(None, runs=4).share() is None


def test_the_cli_shares_one_budget_across_backends_and_names_it_when_it_stops_a_tool(monkeypatch):
    from sparse_mqa_testkit.tools import cli

    class Gpu:
        device = "cuda"

    limits = []

    def go(self, cmd, env, case_limit, tool_limit, limit_name="SMQA_SANITIZE_TOOL_LIMIT"):
        limits.append((self.label, round(tool_limit, 3), limit_name))
        return "", 0, [f"cases 1 to 1 not finished within the {tool_limit:.0f} s limit of {self.tool} ({limit_name})"]

    monkeypatch.setenv("SMQA_SANITIZE_BUDGET", "100")
    monkeypatch.setattr(sanitize, "find_tool", lambda: "/bin/true")
    monkeypatch.setattr(sanitize, "get_backend", lambda name: Gpu())
    monkeypatch.setattr(sanitize._ToolRun, "go", go)
    monkeypatch.setattr(cli, "load", lambda name: Gpu())
    monkeypatch.setattr(cli, "_cases", lambda backend, profile, replay: [Case(seed=1)])
    assert cli.sanitize(["a", "b"], "memcheck,synccheck", "dev") == sanitize.NOT_RUN
    # 4 runs share 100 s; each (here instant) leaves its time to the runs after it
    budget = "its share of SMQA_SANITIZE_BUDGET"
    assert [label for label, _, _ in limits] == [f"sanitize {b} {t}" for b in "ab" for t in ("memcheck", "synccheck")]
    assert [(round(limit), name) for _, limit, name in limits] == [(25, budget), (33, budget), (50, budget),
                                                                   (100, budget)]
    limits.clear()
    monkeypatch.setenv("SMQA_SANITIZE_TOOL_LIMIT", "30")  # the tighter of the two applies
    cli.sanitize(["a", "b"], "memcheck,synccheck", "dev")
    assert [(round(limit), name) for _, limit, name in limits] == [(25, budget)] + [
        (30, "SMQA_SANITIZE_TOOL_LIMIT")] * 3


def test_a_backend_that_cannot_run_leaves_the_others_theirs_and_a_finding_outranks_it(monkeypatch, capsys):
    from sparse_mqa_testkit.tools import cli

    class Gpu:
        device = "cuda"

    class Cpu:
        device = "cpu"

    ran = []
    monkeypatch.setattr(cli, "load", lambda name: {"missing": None, "oncpu": Cpu()}.get(name, Gpu()))
    monkeypatch.setattr(cli, "_cases", lambda backend, profile, replay: [Case(seed=1)])
    monkeypatch.setattr(sanitize, "run", lambda name, cases, tools, budget: ran.append(name) or 1)
    assert cli.sanitize(["found", "missing", "oncpu"], "memcheck", "dev") == 1  # the finding, not "not run"
    assert cli.sanitize(["missing", "found"], "memcheck", "dev") == 1
    assert ran == ["found", "found"]
    assert "sanitize oncpu: runs on the CPU" in capsys.readouterr().out
    assert cli.sanitize(["missing", "oncpu"], "memcheck", "dev") == sanitize.NOT_RUN
