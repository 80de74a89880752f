"""xdist on GPU runners: the worker -> GPU mapping (faked device counts) and the pin in real xdist workers."""

import json

import pytest

from sparse_mqa_testkit.harness import gpu_workers
from sparse_mqa_testkit.harness.gpu_workers import auto_num_workers, gpu_for_worker, pin, visible_gpus, worker_index


def test_visible_gpus_follow_the_device_count_and_cuda_visible_devices():
    assert visible_gpus({}, lambda: 0) == []
    assert visible_gpus({}, lambda: 2) == ["0", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}, lambda: 2) == ["3", "5"]
    # CUDA counts only the devices it can use; the list is cut to match
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"}, lambda: 1) == ["GPU-aa"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}, lambda: 0) == []


def test_one_worker_per_gpu_and_the_cpu_count_without():
    assert auto_num_workers(["0", "1"]) == 2
    assert auto_num_workers(["7"]) == 1
    assert auto_num_workers([]) is None  # xdist falls back to its CPU count


def test_workers_map_round_robin_and_the_controller_pins_nothing():
    gpus = ["3", "5"]
    assert [gpu_for_worker(f"gw{i}", gpus) for i in range(5)] == ["3", "5", "3", "5", "3"]
    assert gpu_for_worker("master", gpus) is None
    assert gpu_for_worker("gw1", []) is None
    assert worker_index("gw12") == 12 and worker_index("") is None


def test_pin_sets_cuda_visible_devices():
    env = {"CUDA_VISIBLE_DEVICES": "3,5"}
    assert pin("gw1", ["3", "5"], env) == "5"
    assert env["CUDA_VISIBLE_DEVICES"] == "5"
    env = {}
    assert pin("master", ["0"], env) is None and env == {}


def test_xdist_auto_starts_one_worker_per_gpu_each_pinned(pytester, monkeypatch):
    """-n auto with two (faked) GPUs: two workers, gw0 on GPU 3 and gw1 on GPU 5, pinned before any test."""
    monkeypatch.setattr(gpu_workers, "cuda_device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setenv("PIN_OUT", str(pytester.path / "pins"))
    (pytester.path / "pins").mkdir()
    pytester.makepyfile(test_pins='''
        import json, os, pathlib, sys
        import pytest

        @pytest.mark.parametrize("i", range(8))
        def test_record(i, worker_id):
            cuda_started = "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()
            path = pathlib.Path(os.environ["PIN_OUT"]) / f"{worker_id}-{i}.json"
            path.write_text(json.dumps([worker_id, os.environ.get("CUDA_VISIBLE_DEVICES"), cuda_started]))
    ''')
    # -p: the plugin also where the package is on PYTHONPATH but not installed (no pytest11 entry point)
    r = pytester.runpytest_inprocess("-n", "auto", "-p", "no:cacheprovider", "-p", "sparse_mqa_testkit.plugin")
    r.assert_outcomes(passed=8)
    r.stdout.fnmatch_lines(["*2 workers*", "*xdist workers and their GPUs*",
                            "gw0: CUDA_VISIBLE_DEVICES=3 -> CUDA not used by its tests",
                            "gw1: CUDA_VISIBLE_DEVICES=5 -> CUDA not used by its tests"])
    seen = {}
    for f in (pytester.path / "pins").iterdir():
        worker, visible, started = json.loads(f.read_text())
        assert not started
        seen.setdefault(worker, set()).add(visible)
    assert seen == {"gw0": {"3"}, "gw1": {"5"}}


def test_xdist_auto_without_gpus_uses_the_cpu_count(pytester, monkeypatch):
    # run inside a pinned GPU worker, this process sees CUDA_VISIBLE_DEVICES=<its GPU>: not this test's setup
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(gpu_workers, "cuda_device_count", lambda: 0)
    cfg = pytester.parseconfig("-n", "auto")
    from sparse_mqa_testkit import plugin

    assert plugin.pytest_xdist_auto_num_workers(cfg) is None
    monkeypatch.setattr(gpu_workers, "cuda_device_count", lambda: 3)
    cfg = pytester.parseconfig("-n", "auto")
    assert plugin.pytest_xdist_auto_num_workers(cfg) == 3
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "5")  # an explicit count wins
    assert plugin.pytest_xdist_auto_num_workers(cfg) is None


@pytest.mark.gpu
def test_a_worker_computes_on_its_own_gpu_only(request, worker_id):
    """On a GPU runner under `pytest -n auto`: this worker sees exactly the GPU it was pinned to, and keeps it
    busy for a moment (so the utilisation log of ci/gpu shows every GPU working)."""
    import time

    import torch

    winput = getattr(request.config, "workerinput", None)
    gpus = (winput or {}).get("smqa_gpus") or []
    if gpus:
        import os

        assert os.environ["CUDA_VISIBLE_DEVICES"] == gpu_for_worker(worker_id, gpus)
        assert torch.cuda.device_count() == 1
    a = (torch.randn(4096, 4096, device="cuda") / 64).to(torch.bfloat16)
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        b = a @ a
        torch.cuda.synchronize()
    assert b.device.type == "cuda" and bool(torch.isfinite(b.float()).all())
    p = torch.cuda.get_device_properties(0)
    request.node.user_properties.append(("gpu", f"{worker_id}: {p.name}"))
