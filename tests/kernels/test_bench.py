"""``sparse-mqa-bench``: FLOP counts, shape plan, table/JSON formatting, and a tiny run on CPU."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sparse_mqa_kernels import bench  # noqa: E402
from sparse_mqa_kernels.bench import cli, report, shapes, timing  # noqa: E402
from sparse_mqa_kernels.bench.shapes import Shape  # noqa: E402
from sparse_mqa_testkit import oracle  # noqa: E402
from sparse_mqa_testkit.cases import Case  # noqa: E402
from sparse_mqa_testkit.cases.tensors import case_tensors  # noqa: E402

ANCHOR = Shape(S=4096, Skv=8192, H=64, L=2048)


def test_flop_counts():
    assert shapes.flops(ANCHOR, "forward") == 2 * 64 * 2048 * (576 + 512) * 4096
    assert shapes.flops(ANCHOR, "backward") == 2 * 64 * 2048 * (3 * 576 + 2 * 512) * 4096
    assert shapes.flops(Shape(S=8, Skv=16, H=2, L=4, B=3, Dqk=16, Dv=8), "backward") == 3 * 2 * 2 * 4 * 64 * 8
    # 1 ms for the anchor forward is 1.168 PFLOP/s
    assert shapes.tflops(ANCHOR, "forward", 1.0) == pytest.approx(shapes.flops(ANCHOR, "forward") / 1e9)


def test_shape_plan_covers_anchors_and_sweeps_once():
    plan = dict(shapes.plan_shapes())
    anchors = {s for s, g in plan.items() if "anchor" in g}
    assert {(s.H, s.L, s.S, s.Skv) for s in anchors} == {(h, l, 4096, 8192) for h in (64, 128) for l in (512, 2048)}
    assert sorted(s.S for s, g in plan.items() if "sweep_s" in g) == [1024, 2048, 4096, 8192]
    assert sorted(s.L for s, g in plan.items() if "sweep_l" in g) == [256, 512, 1024, 2048]
    assert plan[ANCHOR] == {"anchor", "sweep_s", "sweep_l"}
    assert len(plan) == 9  # 4 anchors + 3 new S points + 2 new L points


def _row(backend, direction="backward", ms=2.0, stable=True, drift=None, status="ok", shape=ANCHOR):
    r = report.row(direction, backend, shape, {"anchor"}, status=status, ms=ms if status == "ok" else None,
                   tflops=shapes.tflops(shape, direction, ms) if status == "ok" else None,
                   stable=stable if direction == "backward" else None, drift=drift or {},
                   reason=None if status == "ok" else "ImportError: nope")
    return r


def test_ratios_and_table():
    rows = [_row("tilelang", "forward", ms=1.0), _row("cudnn", ms=4.0, stable=False, drift={"dkv": 0.0312}),
            _row("tilelang", ms=5.0), _row("other", status="skipped")]
    report.add_ratios(rows)
    assert rows[1]["vs_cudnn"] == 1.0 and rows[2]["vs_cudnn"] == pytest.approx(1.25)
    assert rows[0]["vs_cudnn"] is None and rows[3]["vs_cudnn"] is None
    table = report.format_table(rows).splitlines()
    assert table[0] == "| dir | backend | shape | ms | TFLOP/s | vs cuDNN | bitwise stable |"
    assert "| backward | cudnn | B1 S4096 Skv8192 H64 L2048 | 4.000 |" in table[3]
    assert table[3].endswith("| 1.00x | no (dkv 0.031) |")
    assert table[4].endswith("| 1.25x | yes |")
    assert "skipped" in table[5] and "ImportError: nope" in table[5]
    expected = shapes.flops(ANCHOR, "backward") / 4e-3 / 1e12
    assert f"| {expected:.1f} |" in table[3]


def test_stability_reports_drift():
    fixed = (torch.ones(3), torch.zeros(2), None)
    assert timing.stability(lambda: fixed, 3) == (True, {})
    state = {"n": 0}

    def drifting():
        state["n"] += 1
        return torch.ones(3), torch.full((2,), 0.5 * state["n"]), None

    stable, drift = timing.stability(drifting, 3)
    assert not stable and drift == {"dkv": pytest.approx(1.0)}


@pytest.mark.parametrize("case", [
    Case(B=2, S=5, Skv=9, H=3, L=6, Dqk=16, Dv=8, sink="mixed", topk="random", invalid="mixed", seed=3),
    Case(B=1, S=4, Skv=7, H=2, L=5, Dqk=12, Dv=12, invalid="empty_rows", seed=4),
])
def test_backward_inputs_without_a_forward_are_the_oracles(case):
    t = case_tensors(case)
    out, lse = cli.oracle_primal(t)
    o64, l64 = oracle.forward(t["q"], t["kv"], t["indices"], sm_scale=t["sm_scale"], d_v=t["d_v"],
                              attn_sink=t["attn_sink"], topk_length=t["topk_length"], dtype=np.float64)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    np.testing.assert_array_equal(np.isposinf(lse.numpy()), np.isposinf(l64))
    fin = np.isfinite(l64)
    np.testing.assert_allclose(lse.numpy()[fin], l64[fin], rtol=1e-6, atol=1e-6)
    # out is the float64 oracle's rounded to bf16: within half a bf16 ulp (2^-8 relative at most)
    np.testing.assert_allclose(out.float().numpy(), o64, rtol=2**-8, atol=1e-30)


TINY = ["--device", "cpu", "--heads", "2", "--topk", "8", "--seq", "6", "--kv-len", "16", "--dims", "16,8",
        "--sweep-s", "4,6", "--sweep-l", "4,8", "--sweep-h", "2", "--sweep-at-l", "8", "--iters", "3",
        "--warmup", "1", "--sets", "2", "--repeats", "2"]


def test_tiny_cpu_run(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert bench.main(TINY + ["--backward", "reference,cudnn", "--forward", "reference", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    res = json.loads(path.read_text())
    assert res["device"] == "cpu" and res["settings"]["iters"] == 3
    assert res["partial"] is False and res["command"].startswith("sparse-mqa-bench --device cpu")
    rows = res["rows"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert {(r["direction"], r["backend"]) for r in ok} == {("forward", "reference"), ("backward", "reference")}
    assert len(ok) == 2 * 3  # unique shapes: S6 L8 (anchor and both sweeps), S4 L8 (sweep_s), S6 L4 (sweep_l)
    for r in ok:
        assert r["runs"] == 3 and r["ms"] > 0 and r["tflops"] > 0
        if r["direction"] == "backward":
            assert r["stable"] is True and r["primal_from"] == "reference"
    skipped = [r for r in rows if r["backend"] == "cudnn"]
    assert skipped and all(r["status"] == "skipped" for r in skipped)
    # on CPU the cudnn backend is skipped with the reason (its dependencies, or the device), never a crash
    assert all(r["reason"] for r in skipped)
    assert "| backward | reference |" in captured.out
    assert "backward reference" in captured.err  # progress lines


def test_skipped_backend_on_unknown_name(tmp_path):
    path = tmp_path / "r.json"
    bench.main(TINY + ["--backward", "no-such-backend", "--forward", "", "--sweep-s", "", "--sweep-l", "",
                       "--json", str(path), "--quiet"])
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["status"] == "skipped" and "no-such-backend" in rows[0]["reason"]


def test_plot_without_matplotlib_fails_before_running(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path = tmp_path / "r.json"
    with pytest.raises(SystemExit, match="--plot needs matplotlib.*pip install matplotlib"):
        bench.main(TINY + ["--backward", "reference", "--json", str(path), "--plot", str(tmp_path / "p.png")])
    assert not path.exists()


def test_from_json_and_plot(tmp_path, capsys):
    path = tmp_path / "r.json"
    bench.main(TINY + ["--backward", "reference", "--forward", "reference", "--json", str(path), "--quiet"])
    capsys.readouterr()
    bench.main(["--from-json", str(path)])
    assert "| forward | reference |" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    bench.main(["--from-json", str(path), "--plot", str(png)])
    assert png.stat().st_size > 0


@pytest.mark.parametrize("pattern", ["local", "hot"])
def test_index_patterns_are_the_testkits(pattern, tmp_path):
    shape = Shape(S=8, Skv=64, H=2, L=16, Dqk=16, Dv=8)
    x = shapes.make_inputs(shape, "cpu", seed=1, indices=pattern)
    idx = x["indices"]
    assert idx.shape == (1, 8, 16) and idx.dtype == torch.int32 and int(idx.max()) < 64
    if pattern == "hot":
        assert (idx[0, :, :8] == idx[0, :1, :8]).all(), "every query names the same hot rows first"
    else:
        pos = (torch.arange(8) + 1) * 64 // 8 - 1
        assert torch.equal(idx[0, :, 0], pos.to(torch.int32)), "each query's window starts at its position"
    assert torch.equal(idx, shapes.make_inputs(shape, "cpu", seed=1, indices=pattern)["indices"])
    path = tmp_path / "r.json"
    args = ["--backward", "reference", "--forward", "", "--indices", pattern, "--json", str(path)]
    assert bench.main(TINY + args) == 0
    assert json.loads(path.read_text())["settings"]["indices"] == pattern
    with pytest.raises(ValueError, match="indices must be one of random, local, hot, got 'causal'"):
        shapes.make_inputs(shape, "cpu", seed=1, indices="causal")


def test_rounds_take_turns_abba_and_rotate_each_backends_sets():
    log = []
    calls = {n: (lambda k, n=n: log.append((n, k))) for n in ("a", "b")}
    out = timing.time_rounds(calls, 2, 7, 3, "cpu", settle=1)
    assert [len(r) for r in out["a"]] == [3, 2, 2] and [len(r) for r in out["b"]] == [3, 2, 2]
    assert "".join(n for n, _ in log) == "aaaabbbb" + "bbbaaa" + "aaabbb"  # each turn: one untimed call first
    assert [k for n, k in log if n == "a"] == [0, 1, 0, 1, 0, 1, 0, 1, 0, 1]  # a backend's sets rotate on
    assert all(t >= 0 for r in out["b"] for t in r)


def test_ratio_range_over_rounds_in_the_table():
    rows = [_row("cudnn", ms=4.0), _row("tilelang", ms=6.0)]
    rows[0]["ms_rounds"], rows[1]["ms_rounds"] = [4.0, 5.0, 4.0], [6.0, 6.0, 6.4]
    report.add_ratios(rows)
    assert rows[1]["vs_cudnn"] == pytest.approx(1.5) and rows[1]["vs_cudnn_rounds"] == pytest.approx([1.2, 1.6])
    assert rows[0]["vs_cudnn"] == 1.0 and rows[0]["vs_cudnn_rounds"] is None
    table = report.format_table(rows).splitlines()
    assert table[2].endswith("| 1.00x | yes |") and table[3].endswith("| 1.50x (1.20-1.60) | yes |")
    rows = [_row("cudnn", ms=4.0), _row("tilelang", ms=6.0)]
    rows[0]["ms_rounds"], rows[1]["ms_rounds"] = [4.0], [6.0, 6.0]  # rounds that do not pair up give no range
    report.add_ratios(rows)
    assert rows[1]["vs_cudnn"] == pytest.approx(1.5) and rows[1]["vs_cudnn_rounds"] is None
    assert report.format_table(rows).splitlines()[3].endswith("| 1.50x | yes |")
    rows = [_row("cudnn", ms=4.0), _row("tilelang", ms=6.0)]
    rows[0]["ms_rounds"], rows[1]["ms_rounds"] = [4.0], [6.0]  # one round (the default): no range to show
    report.add_ratios(rows)
    assert rows[1]["vs_cudnn_rounds"] is None


def test_a_backend_that_raises_mid_rounds_is_reported_and_the_others_are_timed():
    shape = Shape(S=4, Skv=16, H=2, L=8, Dqk=16, Dv=8)
    inputs = [shapes.make_inputs(shape, "cpu", seed=k) for k in range(2)]
    primal = [cli.oracle_primal(x) for x in inputs]
    good = cli._load("reference", "cpu")[0]

    class Flaky:
        n = 0

        def backward(self, *args, **kw):
            self.n += 1
            if self.n > 3:
                raise RuntimeError("launch failed")
            return good.backward(*args, **kw)

    rows = cli._time_backwards({"flaky": Flaky(), "reference": good}, shape, {"anchor"}, inputs, primal, 1, 6, 3, 2,
                               "cpu")
    assert [r["backend"] for r in rows] == ["flaky", "reference"]
    assert rows[0]["status"] == "error" and rows[0]["reason"] == "RuntimeError: launch failed"
    assert rows[1]["status"] == "ok" and rows[1]["runs"] == 6 and len(rows[1]["ms_rounds"]) == 3
    assert rows[1]["stable"] is True
