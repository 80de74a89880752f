"""``--sanitize``: what compute-sanitizer reports is turned into findings with the kernel and the case; a tool
that is missing or cannot read the device is said, never a pass."""

from __future__ import annotations

import io

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
