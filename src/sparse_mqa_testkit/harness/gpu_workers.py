"""pytest-xdist on GPU runners: a worker per visible GPU, each pinned to its own before CUDA starts, and CPU
workers beside them for the tests that need no GPU.

The controller counts the GPUs it can see (``visible_gpus``) and, for ``-n auto``, starts one worker per GPU
(``$SMQA_WORKERS_PER_GPU`` per GPU: ``gpu_slots``) plus ``cpu_workers`` more (the CPU count when there are no
GPUs). Each worker sets ``CUDA_VISIBLE_DEVICES`` in its ``pytest_configure``, before any test touches CUDA: gwN for
N < slots is a GPU worker of slot N's GPU, the CPU workers share the GPUs round-robin (a test that uses CUDA only
when it is there still finds it). More than one worker per GPU lets two GPU groups (say two backends) run at once
where the tests' host side (drawing, the oracle) leaves the GPU idle.

Routing (``-n`` with the default ``--dist load``): each worker tags the tests a GPU worker must run with an
``xdist_group`` (``gpu_group``: a ``gpu``-marked test by its module, a suite test on a CUDA backend by the backend,
so each backend warms up once) and the controller's ``GpuFirstScheduling`` hands those groups to GPU workers only
and every other test to the CPU workers; a GPU worker takes CPU tests once no GPU group is left. With
``$SMQA_GPU_WAIT`` naming a file, a GPU worker starts its first test once the file exists (ci/gpu: when the kernel
precompile running beside the CPU tests is done).

Threads: every worker's NumPy BLAS and torch would start a thread per core, so N workers on N cores run N^2
threads; the controller starts the workers with the cores shared out among them (``with_threads``).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping

import pytest

from .fixtures import uses_suite
from .state import selected

ENV = "CUDA_VISIBLE_DEVICES"
CPU_WORKERS_ENV = "SMQA_CPU_WORKERS"
PER_GPU_ENV = "SMQA_WORKERS_PER_GPU"
WAIT_ENV = "SMQA_GPU_WAIT"
WAIT_LIMIT_ENV = "SMQA_GPU_WAIT_LIMIT"  # seconds a GPU worker waits for $SMQA_GPU_WAIT (default 900)
GROUP = "smqa-gpu"
_STARTED = pytest.StashKey[bool]()


THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def worker_threads(workers: int, cpu_count: int | None = None, env: Mapping[str, str] | None = None) -> dict:
    """The thread counts ``workers`` xdist workers start with: the cores shared out, at least one each, for each
    of ``THREAD_VARS`` the user has not set (empty with one worker or fewer)."""
    env = os.environ if env is None else env
    if workers <= 1:
        return {}
    each = str(max(1, (cpu_count or os.cpu_count() or 1) // workers))
    return {name: each for name in THREAD_VARS if not env.get(name)}


def with_threads(tx: list[str], cpu_count: int | None = None, env: Mapping[str, str] | None = None) -> list[str]:
    """xdist's worker specs (``--tx``) with ``worker_threads`` set in each local worker's environment (execnet sets
    it before the worker imports anything)."""
    extra = "".join(f"//env:{k}={v}" for k, v in worker_threads(len(tx), cpu_count, env).items())
    return [spec + extra if spec.split("//")[0] == "popen" else spec for spec in tx]


def cuda_device_count() -> int:
    """GPUs torch can see here (0 without torch or CUDA). Called in the controller only."""
    try:
        import torch
    except ImportError:
        return 0
    try:
        return int(torch.cuda.device_count())
    except Exception:  # a broken driver reads as no GPU, which the gpu marker then reports
        return 0


def visible_gpus(env: Mapping[str, str] | None = None,
                 device_count: Callable[[], int] | None = None) -> list[str]:
    """The GPU ids to hand to workers, as ``CUDA_VISIBLE_DEVICES`` entries.

    ``device_count`` is how many GPUs CUDA sees (it already honours ``CUDA_VISIBLE_DEVICES``); the entries are
    taken from ``CUDA_VISIBLE_DEVICES`` when it is set (ids or UUIDs), else ``0..n-1``.
    """
    env = os.environ if env is None else env
    n = (device_count or cuda_device_count)()
    if n <= 0:
        return []
    listed = env.get(ENV)
    if listed is None:
        return [str(i) for i in range(n)]
    entries = [x.strip() for x in listed.split(",") if x.strip()]
    return entries[:n]


def _count(env: Mapping[str, str], name: str, least: int) -> int | None:
    given = env.get(name, "").strip()
    if not given:
        return None
    if not given.isdigit() or int(given) < least:
        raise pytest.UsageError(f"{name} must be a count of workers ({least} or more), got {given!r}")
    return int(given)


def gpu_slots(gpus: list[str], env: Mapping[str, str] | None = None) -> list[str]:
    """The GPU of each GPU worker: ``gpus`` repeated ``$SMQA_WORKERS_PER_GPU`` times (default 1), so consecutive
    workers land on different GPUs."""
    per = _count(os.environ if env is None else env, PER_GPU_ENV, 1) or 1
    return list(gpus) * per


def worker_index(worker_id: str) -> int | None:
    """gw3 -> 3; None for the controller or a non-xdist run."""
    m = re.fullmatch(r"gw(\d+)", worker_id or "")
    return int(m.group(1)) if m else None


def gpu_for_worker(worker_id: str, gpus: list[str]) -> str | None:
    """The GPU a worker pins: round-robin over ``gpus``; None when there are none or it is not a worker."""
    i = worker_index(worker_id)
    if i is None or not gpus:
        return None
    return gpus[i % len(gpus)]


def cpu_workers(gpus: list[str], cpu_count: int | None = None, env: Mapping[str, str] | None = None) -> int:
    """CPU workers beside the GPU ones (``gpus``: one entry per GPU worker): ``$SMQA_CPU_WORKERS``, else half the
    cores less one per GPU worker, at least one (the other cores serve the GPU workers' host side and the
    compilers of a precompile running beside)."""
    given = _count(os.environ if env is None else env, CPU_WORKERS_ENV, 0)
    if given is not None:
        return given
    return max(1, (cpu_count or os.cpu_count() or 2) // 2 - len(gpus))


def auto_num_workers(gpus: list[str], cpu_count: int | None = None,
                     env: Mapping[str, str] | None = None) -> int | None:
    """Workers for ``-n auto``: one per GPU worker (``gpus``, as ``gpu_slots`` gives them) plus ``cpu_workers``;
    None (xdist's CPU count) without GPUs."""
    return len(gpus) + cpu_workers(gpus, cpu_count, env) if gpus else None


def is_gpu_worker(worker_id: str, gpus: list[str]) -> bool:
    """gwN with N below the count of GPU workers (``gpus``, as ``gpu_slots`` gives them)."""
    i = worker_index(worker_id)
    return i is not None and i < len(gpus)


def gpu_group(item, cuda_backends) -> str | None:
    """The xdist group of a test only a GPU worker may run: a ``gpu``-marked test by its module, a suite test on a
    CUDA backend (one of ``cuda_backends``, the run's names) by that backend; None for any other."""
    if item.get_closest_marker("gpu") is not None:
        return f"{GROUP}:{getattr(getattr(item, 'module', None), '__name__', item.nodeid.split('::')[0])}"
    backend = getattr(getattr(item, "callspec", None), "params", {}).get("smqa_backend")
    return f"{GROUP}:{backend}" if backend in cuda_backends else None


def tag_gpu_tests(config, items) -> None:
    """In a routing xdist worker: each test only a GPU worker may run gets its ``xdist_group``."""
    if not (getattr(config, "workerinput", None) or {}).get("smqa_route"):
        return
    cuda = set()
    if any(uses_suite(i) for i in items):
        try:
            cuda = {n for n, spec in selected(config).specs.items() if spec.is_cuda}
        except pytest.UsageError:
            pass  # the suite's fixtures report it
    for item in items:
        group = gpu_group(item, cuda)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


def make_scheduler(config, log, gpus: list[str]):
    """xdist's group scheduling, with the GPU groups sent to GPU workers only (``GpuFirstScheduling``)."""
    from xdist.scheduler import LoadGroupScheduling

    class GpuFirstScheduling(LoadGroupScheduling):
        """A GPU worker takes the next GPU group, else the next other test; a CPU worker the next other test, and a
        GPU group only when no GPU worker is left (one crashed)."""

        def _assign_work_unit(self, node) -> None:
            if not self.workqueue:
                return
            on_gpu = [s for s in self.workqueue if s.startswith(GROUP + ":")]
            other = [s for s in self.workqueue if not s.startswith(GROUP + ":")]
            if is_gpu_worker(node.gateway.id, gpus):
                scope = (on_gpu or other)[0]
            elif other:
                scope = other[0]
            elif not any(is_gpu_worker(n.gateway.id, gpus) for n in self.nodes):
                scope = on_gpu[0]
            else:
                return  # only GPU groups are left: this CPU worker idles until the run ends
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return GpuFirstScheduling(config, log)


def before_first_test(config, say) -> None:
    """Once per xdist worker, before its first test: a GPU worker waits for ``$SMQA_GPU_WAIT``."""
    winput = getattr(config, "workerinput", None)
    if winput is None or config.stash.get(_STARTED, False):
        return
    config.stash[_STARTED] = True
    wait_for_precompile(winput.get("workerid", ""), list(winput.get("smqa_gpus") or []), say=say)


def wait_for_precompile(worker_id: str, gpus: list[str], env: Mapping[str, str] | None = None, say=print,
                        sleep=time.sleep) -> float:
    """In a GPU worker with ``$SMQA_GPU_WAIT`` set: wait (at most ``$SMQA_GPU_WAIT_LIMIT`` seconds) until that
    file exists; returns the seconds waited."""
    env = os.environ if env is None else env
    path = env.get(WAIT_ENV)
    if not path or not is_gpu_worker(worker_id, gpus) or os.path.exists(path):
        return 0.0
    limit = float(env.get(WAIT_LIMIT_ENV) or 900)
    say(f"[smqa] {worker_id}: waiting for {path} (the kernel precompile) before its first GPU test")
    t0 = time.monotonic()
    while not os.path.exists(path) and time.monotonic() - t0 < limit:
        sleep(0.5)
    waited = time.monotonic() - t0
    say(f"[smqa] {worker_id}: waited {waited:.0f} s" + ("" if os.path.exists(path) else
                                                        f", past {limit:.0f} s: starting without it"))
    return waited


def pin(worker_id: str, gpus: list[str], env: MutableMapping[str, str] | None = None) -> str | None:
    """Pin this worker to its GPU via ``CUDA_VISIBLE_DEVICES``; returns the GPU id (None if nothing pinned).

    Raises RuntimeError when CUDA is already initialised in this process: the pin would silently not apply.
    """
    env = os.environ if env is None else env
    gpu = gpu_for_worker(worker_id, gpus)
    if gpu is None:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and env is os.environ and torch.cuda.is_initialized():
        raise RuntimeError(f"xdist worker {worker_id}: CUDA was initialised before the GPU pin "
                           f"({ENV}={gpu}); something imported at conftest time touched CUDA")
    env[ENV] = gpu
    return gpu
