"""``--isolate``: one case at a time in a child with a time limit, so a kernel that hangs on a boundary case (a
length <= 0 once deadlocked a shipped kernel) fails that case and the run goes on."""

from __future__ import annotations

import io

from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.tools import isolate

HANGS = '''
import os, time
from sparse_mqa_testkit.backends.reference import ReferenceBackend

class Hangs(ReferenceBackend):
    name = "hangs"
    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        if topk_length is not None and bool((topk_length < 0).any()):
            time.sleep(600)  # a deadlock
        if kv.shape[1] == 3:
            os._exit(7)  # a crash that takes the process down
        return super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length)
'''


def test_a_hang_and_a_crash_fail_their_cases_and_the_rest_run(tmp_path, monkeypatch):
    (tmp_path / "hanging.py").write_text(HANGS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    cases = [Case(seed=1), Case(S=8, L=6, topk="edges", seed=2), Case(Skv=3, seed=3), Case(seed=4)]
    out = io.StringIO()
    assert isolate.run("hanging:Hangs", cases, ["tolerance"], timeout=20, out=out) == 1
    text = out.getvalue()
    assert "PASS tolerance case 0" in text and "PASS tolerance case 3" in text
    assert "HANG: case 1 ran past 20 s: Case(S=8, L=6, topk='edges', seed=2)" in text
    assert "CRASH (exit 7) in case 2: Case(Skv=3, seed=3)" in text
    assert "4 cases, 2 failed or hung" in text
