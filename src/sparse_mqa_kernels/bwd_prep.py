"""What the deterministic backward needs before its main kernel, in one pass over q, out and dO (TileLang).

Per query row and head: Delta = <out, dO> (float32 sums), and the row's term of the fixed-point bound
``mass (c Vmax max|q| |dO| + max|dO|)`` (``bwd_plan.DS_BOUND_FACTOR``, ``backward_model.dkv_bound``; mass: the
probability the row's slots hold, the rest is the sink's), summed over the row's heads. One thread block per query
row reads its rows once; the sums run in a fixed order (tree reductions, no atomics), so Delta and the bound are
bitwise the same on every run. The host adds the per-row partial bounds with a torch sum on a fixed shape.

Why a kernel: the same quantities as float32 torch expressions read and write q, out and dO about twelve times
over (BENCHMARKS.md has both timings).
"""

# No ``from __future__ import annotations``: TileLang evaluates the kernel's parameter annotations.

import functools

from .target import EXECUTION_BACKEND, TARGET

HEADS_PER_STEP = 4  # rows per step; each of the 128 threads holds 4 columns of each (Dv 512)
THREADS = 128


def build_program(dqk: int, dv: int):
    """TileLang prim_func for head dims (Dqk, Dv); batch, rows and heads are symbolic."""
    import tilelang.language as T

    HB = HEADS_PER_STEP
    tail = dqk - dv  # q's columns past Dv fold onto the first ones (layouts want power-of-two row lengths)
    assert 0 <= tail <= dv
    batch, seq_len, heads = T.dynamic("batch, seq_len, heads")
    bf16, f32 = T.bfloat16, T.float32

    @T.prim_func
    def sparse_mqa_bwd_prep(
        Q: T.Tensor([batch, seq_len, heads, dqk], bf16),
        O: T.Tensor([batch, seq_len, heads, dv], bf16),
        dO: T.Tensor([batch, seq_len, heads, dv], bf16),
        Vmax: T.Tensor([1], f32),
        Mass: T.Tensor([batch, seq_len, heads], f32),
        Delta: T.Tensor([batch, seq_len, heads], f32),
        Bound: T.Tensor([batch, seq_len], f32),
        c: f32,
    ):
        with T.Kernel(seq_len, batch, threads=THREADS) as (bx, by):
            o = T.alloc_fragment([HB, dv], f32)
            g = T.alloc_fragment([HB, dv], f32)
            g2 = T.alloc_fragment([HB, dv], f32)
            q = T.alloc_fragment([HB, dv], f32)
            delta = T.alloc_fragment([HB], f32)
            gn2 = T.alloc_fragment([HB], f32)
            gmax = T.alloc_fragment([HB], f32)
            mass = T.alloc_fragment([HB], f32)
            qmax = T.alloc_fragment([HB], f32)
            terms = T.alloc_shared([HB], f32)  # per position in a step, summed over the steps in order
            tx = T.get_thread_binding()
            vmax = Vmax[0]
            for i in T.Parallel(HB):
                terms[i] = 0.0
            for hs in T.serial(T.ceildiv(heads, HB)):
                h0 = hs * HB
                # rows past H load as zero: they add 0 to the bound and write nothing
                for i, d in T.Parallel(HB, dv):
                    o[i, d] = T.if_then_else(h0 + i < heads, T.cast(O[by, bx, h0 + i, d], f32), 0.0)
                    g[i, d] = T.if_then_else(h0 + i < heads, T.cast(dO[by, bx, h0 + i, d], f32), 0.0)
                for i, d in T.Parallel(HB, dv):
                    q[i, d] = T.if_then_else(h0 + i < heads, T.abs(T.cast(Q[by, bx, h0 + i, d], f32)), 0.0)
                if tail > 0:
                    for i, d in T.Parallel(HB, dv):
                        if d < tail:
                            q[i, d] = T.max(q[i, d], T.if_then_else(
                                h0 + i < heads, T.abs(T.cast(Q[by, bx, h0 + i, dv + d], f32)), 0.0))
                for i, d in T.Parallel(HB, dv):
                    g2[i, d] = g[i, d] * g[i, d]
                    o[i, d] = o[i, d] * g[i, d]
                    g[i, d] = T.abs(g[i, d])
                T.reduce_sum(o, delta, dim=1)
                T.reduce_sum(g2, gn2, dim=1)
                T.reduce_max(g, gmax, dim=1)
                T.reduce_max(q, qmax, dim=1)
                for i in T.Parallel(HB):
                    mass[i] = T.if_then_else(h0 + i < heads, Mass[by, bx, T.min(h0 + i, heads - 1)], 0.0)
                for i in T.Parallel(HB):
                    if h0 + i < heads:
                        Delta[by, bx, h0 + i] = delta[i]
                    terms[i] += mass[i] * (c * vmax * qmax[i] * T.sqrt(gn2[i]) + gmax[i])
            T.sync_threads()
            if tx == 0:
                total = T.alloc_var(f32)
                total = 0.0
                for i in T.serial(HB):
                    total += terms[i]
                Bound[by, bx] = total

    return sparse_mqa_bwd_prep


def describe(dqk: int, dv: int) -> str:
    return f"sparse_mqa_bwd_prep Dqk={dqk} Dv={dv}"


@functools.lru_cache(maxsize=None)
def compiled(dqk: int, dv: int):
    import tilelang

    return tilelang.compile(build_program(dqk, dv), out_idx=None, target=TARGET,
                            execution_backend=EXECUTION_BACKEND)
