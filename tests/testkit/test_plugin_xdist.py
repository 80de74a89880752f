"""xdist on GPU runners: the worker -> GPU mapping (faked device counts) and the pin in real xdist workers."""

import json

import pytest

from sparse_mqa_testkit.harness import gpu_workers
from sparse_mqa_testkit.harness.gpu_workers import auto_num_workers, gpu_for_worker, pin, visible_gpus, worker_index


@pytest.fixture(autouse=True)
def _worker_env(monkeypatch):
    """ci/gpu's worker knobs (it exports two workers per GPU and a precompile marker to wait for) are not these
    tests' setup; nor are the thread counts of the run these tests run in."""
    for name in (gpu_workers.PER_GPU_ENV, gpu_workers.CPU_WORKERS_ENV, gpu_workers.WAIT_ENV,
                 *gpu_workers.THREAD_VARS):
        monkeypatch.delenv(name, raising=False)




def test_visible_gpus_follow_the_device_count_and_cuda_visible_devices():
    assert visible_gpus({}, lambda: 0) == []
    assert visible_gpus({}, lambda: 2) == ["0", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}, lambda: 2) == ["3", "5"]
    # CUDA counts only the devices it can use; the list is cut to match
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"}, lambda: 1) == ["GPU-aa"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}, lambda: 0) == []


def test_one_worker_per_gpu_plus_cpu_workers_and_the_cpu_count_without():
    assert auto_num_workers(["0", "1"], cpu_count=16, env={}) == 2 + 6  # half the cores, less one per GPU
    assert auto_num_workers(["7"], cpu_count=16, env={}) == 1 + 7
    assert auto_num_workers(["7"], cpu_count=2, env={}) == 1 + 1  # always one CPU worker
    assert auto_num_workers(["7"], cpu_count=16, env={"SMQA_CPU_WORKERS": "0"}) == 1
    assert auto_num_workers([], cpu_count=16, env={}) is None  # xdist falls back to its CPU count
    with pytest.raises(pytest.UsageError, match="SMQA_CPU_WORKERS must be a count"):
        auto_num_workers(["0"], env={"SMQA_CPU_WORKERS": "many"})
    assert [gpu_workers.is_gpu_worker(f"gw{i}", ["3", "5"]) for i in range(4)] == [True, True, False, False]


def test_more_workers_per_gpu_on_request():
    assert gpu_workers.gpu_slots(["3", "5"], env={}) == ["3", "5"]
    slots = gpu_workers.gpu_slots(["3", "5"], env={"SMQA_WORKERS_PER_GPU": "2"})
    assert slots == ["3", "5", "3", "5"]  # consecutive GPU workers on different GPUs
    assert auto_num_workers(slots, cpu_count=16, env={}) == 4 + 4  # half the cores, less one per GPU worker
    assert [gpu_for_worker(f"gw{i}", slots) for i in range(6)] == ["3", "5", "3", "5", "3", "5"]
    assert [gpu_workers.is_gpu_worker(f"gw{i}", slots) for i in range(5)] == [True] * 4 + [False]
    for bad in ("0", "two"):
        with pytest.raises(pytest.UsageError, match="SMQA_WORKERS_PER_GPU must be a count of workers \\(1 or more\\)"):
            gpu_workers.gpu_slots(["0"], env={"SMQA_WORKERS_PER_GPU": bad})


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
    monkeypatch.setenv("SMQA_CPU_WORKERS", "0")
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


ROUTED = '''
import time
import pytest

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(4))
def test_on_gpu(i):
    pass

@pytest.mark.parametrize("i", range(10))
def test_on_cpu(i):
    time.sleep(0.3)

def test_suite(smqa_backend):
    pass
'''

ON_GPU = '''
from sparse_mqa_testkit.backends.reference import ReferenceBackend

class OnGpu(ReferenceBackend):
    name = "ongpu"
    device = "cuda"
    def __init__(self):
        pass
'''


def _run_routed(pytester, monkeypatch, **env):
    """ROUTED under ``-n auto`` with one (faked) GPU and ``env`` (the worker counts): the result, after its outcomes
    are checked, and {test: the worker that ran it}. Its 4 gpu-marked tests and the CUDA backend's suite test pass
    where CUDA is (a GPU runner), else they skip."""
    import re

    import torch

    monkeypatch.setattr(gpu_workers, "cuda_device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    pytester.makepyfile(test_routed=ROUTED, gpukernels=ON_GPU)
    pytester.syspathinsert()
    r = pytester.runpytest_inprocess("-n", "auto", "-v", "-p", "no:cacheprovider", "-p", "sparse_mqa_testkit.plugin",
                                     "--smqa-backend", "reference,gpukernels:OnGpu")
    on_gpu = 4 + 1
    r.assert_outcomes(**({"passed": 10 + 1 + on_gpu} if torch.cuda.is_available() else
                         {"passed": 10 + 1, "skipped": on_gpu}))
    ran = {m.group(2): m.group(1) for m in
           re.finditer(r"\[(gw\d)\] \[ *\d+%\] \w+ +test_routed\.py::(\S+)", r.stdout.str())}
    return r, ran


def test_gpu_tests_run_on_the_gpu_worker_and_cpu_tests_on_cpu_workers(pytester, monkeypatch):
    """-n auto with one (faked) GPU and two CPU workers: the gpu-marked tests and the suite's tests on a CUDA
    backend run on gw0, the GPU worker; the others on the CPU workers (gw0 takes some once its GPU work is done)."""
    r, ran = _run_routed(pytester, monkeypatch, SMQA_CPU_WORKERS="2")
    assert len(ran) == 4 + 10 + 2, r.stdout.str()
    gpu = {t: w for t, w in ran.items() if t.startswith("test_on_gpu") or "OnGpu" in t}
    assert len(gpu) == 5 and set(gpu.values()) == {"gw0"}
    assert all("@smqa-gpu:" in t for t in gpu)
    cpu = {t: w for t, w in ran.items() if t not in gpu}
    assert {"gw1", "gw2"} <= set(cpu.values()) and "test_suite[reference]" in cpu


def test_two_workers_on_one_gpu_run_its_groups_side_by_side(pytester, monkeypatch):
    """SMQA_WORKERS_PER_GPU=2 on one (faked) GPU: gw0 and gw1 are both GPU workers of GPU 0 and take one GPU group
    each (the gpu-marked module, the CUDA backend's suite tests); gw2 runs the CPU tests."""
    r, ran = _run_routed(pytester, monkeypatch, SMQA_CPU_WORKERS="1", SMQA_WORKERS_PER_GPU="2")
    r.stdout.fnmatch_lines(["*3 workers*", "gw0: CUDA_VISIBLE_DEVICES=0 *", "gw1: CUDA_VISIBLE_DEVICES=0 *"])
    on_gpu = {w for t, w in ran.items() if t.startswith("test_on_gpu")}
    suite = {w for t, w in ran.items() if "OnGpu" in t}
    assert len(on_gpu) == 1 and len(suite) == 1 and on_gpu | suite == {"gw0", "gw1"}, r.stdout.str()


def test_a_gpu_worker_waits_for_the_precompile_once(tmp_path):
    marker = tmp_path / "precompiled"
    said, naps = [], []

    def nap(_):
        naps.append(1)
        if len(naps) == 3:
            marker.touch()

    env = {"SMQA_GPU_WAIT": str(marker)}
    assert gpu_workers.wait_for_precompile("gw1", ["0"], env, said.append, nap) == 0.0  # a CPU worker: no wait
    assert gpu_workers.wait_for_precompile("gw0", ["0"], env, said.append, nap) >= 0.0
    assert len(naps) == 3 and said[0].startswith("[smqa] gw0: waiting for ") and "waited" in said[1]
    assert gpu_workers.wait_for_precompile("gw0", ["0"], env, said.append, nap) == 0.0 and len(naps) == 3
    env = {"SMQA_GPU_WAIT": str(tmp_path / "never"), "SMQA_GPU_WAIT_LIMIT": "0.2"}
    gpu_workers.wait_for_precompile("gw0", ["0"], env, said.append, lambda s: __import__("time").sleep(0.05))
    assert "starting without it" in said[-1]


def test_xdist_auto_without_gpus_uses_the_cpu_count(pytester, monkeypatch):
    # run inside a pinned GPU worker, this process sees CUDA_VISIBLE_DEVICES=<its GPU>: not this test's setup
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(gpu_workers, "cuda_device_count", lambda: 0)
    cfg = pytester.parseconfig("-n", "auto")
    from sparse_mqa_testkit import plugin

    assert plugin.pytest_xdist_auto_num_workers(cfg) is None
    monkeypatch.setattr(gpu_workers, "cuda_device_count", lambda: 3)
    monkeypatch.setenv("SMQA_CPU_WORKERS", "2")
    cfg = pytester.parseconfig("-n", "auto")
    assert plugin.pytest_xdist_auto_num_workers(cfg) == 3 + 2
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "5")  # an explicit count wins
    assert plugin.pytest_xdist_auto_num_workers(cfg) is None


def test_the_cores_are_shared_out_among_the_workers_threads():
    assert gpu_workers.worker_threads(8, cpu_count=16, env={}) == dict.fromkeys(gpu_workers.THREAD_VARS, "2")
    assert gpu_workers.worker_threads(3, cpu_count=2, env={}) == dict.fromkeys(gpu_workers.THREAD_VARS, "1")
    assert gpu_workers.worker_threads(2, cpu_count=16, env={"OMP_NUM_THREADS": "5"}) == {
        "OPENBLAS_NUM_THREADS": "8", "MKL_NUM_THREADS": "8"}  # the user's own setting stays
    assert gpu_workers.worker_threads(1, cpu_count=16, env={}) == {}
    assert gpu_workers.with_threads(["popen", "popen", "ssh=host"], cpu_count=6, env={"MKL_NUM_THREADS": "1"}) == [
        "popen//env:OMP_NUM_THREADS=2//env:OPENBLAS_NUM_THREADS=2"] * 2 + ["ssh=host"]


def test_xdist_workers_start_with_their_share_of_the_cores(pytester, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    pytester.makepyfile(test_threads='''
        import os
        import torch

        def test_threads():
            assert os.environ["OMP_NUM_THREADS"] == os.environ["OPENBLAS_NUM_THREADS"] == "1"
            assert torch.get_num_threads() == 1  # torch's own default: the core count
    ''')
    r = pytester.runpytest_inprocess("-n", "2", "-p", "no:cacheprovider", "-p", "sparse_mqa_testkit.plugin")
    r.assert_outcomes(passed=1)


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
