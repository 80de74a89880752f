"""pytest-xdist on GPU runners: one worker per visible GPU, each pinned to its own before CUDA starts.

The controller counts the GPUs it can see (``visible_gpus``) and, for ``-n auto``, starts that many workers
(the CPU count when there are none). Each worker then sets ``CUDA_VISIBLE_DEVICES`` to its own GPU in its
``pytest_configure``, before any test touches CUDA, so ``cuda:0`` in worker gwN is the Nth visible GPU.
More workers than GPUs share them round-robin.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping, MutableMapping

ENV = "CUDA_VISIBLE_DEVICES"


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


def auto_num_workers(gpus: list[str]) -> int | None:
    """Workers for ``-n auto``: one per GPU; None (xdist's CPU count) without GPUs."""
    return len(gpus) or None


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
