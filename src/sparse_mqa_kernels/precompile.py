"""Every TileLang kernel variant compiled into one cache directory, in one process or by a pool of them.

nvcc is CPU-bound and each variant compiles on its own, so N processes compile the variants up to N times faster.
The pool's processes are spawned, each importing TileLang with the cache directory already in its environment.
TileLang 0.1.15's disk cache takes concurrent writers: a process stages each entry in a directory of its own and
renames it into place in one step, and a writer that finds the entry complete drops its copy
(``tilelang.cache.kernel_cache.KernelCache._save_kernel_to_disk``), so every process writes into the same
directory.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

from sparse_mqa_testkit import contract

from . import bwd_plan, bwd_prep, bwd_rows, fwd_plan


def variants() -> list[tuple[str, object]]:
    """Every variant as (kind, key), the longest compiles first so a pool ends together: the forward's, the
    backward's, the 64-head path's row-scale kernels, the prep pass's."""
    return ([("forward", k) for k in fwd_plan.all_variants()] + [("backward", k) for k in bwd_plan.all_variants()]
            + [("rows", (*d, stored)) for d in contract.PRODUCTION_DIMS for stored in (False, True)]
            + [("prep", d) for d in contract.PRODUCTION_DIMS])


def describe(task) -> str:
    kind, key = task
    if kind in ("prep", "rows"):
        return (bwd_prep if kind == "prep" else bwd_rows).describe(*key)
    return key.describe()


def compile_variant(task) -> str:
    """Compile one variant into the current TILELANG_CACHE_DIR (or load it from there); its description and the
    seconds it took."""
    from . import backward, forward

    kind, key = task
    t0 = time.monotonic()
    if kind == "forward":
        forward.compiled(key)
    elif kind == "backward":
        backward.compiled(key)
    elif kind == "rows":
        bwd_rows.compiled(*key)
    else:
        bwd_prep.compiled(*key)
    return f"{describe(task)} ({time.monotonic() - t0:.1f} s)"


def compile_all(directory, jobs: int = 1) -> list[str]:
    """Every variant into the cache ``directory``, by ``jobs`` processes (1: in this one)."""
    os.environ["TILELANG_CACHE_DIR"] = str(directory)  # read by TileLang when it is imported (here and in the pool)
    tasks = variants()
    if jobs <= 1:
        return [compile_variant(t) for t in tasks]
    with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(compile_variant, tasks))
