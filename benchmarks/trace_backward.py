"""Where the 64-head backward's two large kernels spend their time, thread block by thread block: builds of
``sparse_mqa_bwd_ws`` and ``sparse_mqa_bwd_bound`` that stamp ``%globaltimer`` at fixed points
(``backward_ws.TRACE_SLOTS``, ``bwd_rows.TRACE_SLOTS``) run on one call's inputs, and each block's stamps are
summarised: the main kernel's prologue (q and dO in shared memory), first gather, fill (when WG1 starts), drain after
WG0's last block and dq stores; the bound pass's prologue, Delta and loop, and each of its warpgroups' SM cycles a
block in each phase of its loop (``bwd_rows.TRACE_PHASES``); for both, the gaps between blocks on one SM and the last
wave.

    python benchmarks/trace_backward.py anchor l512      # on a GPU; the production bound pass and row scales first

A traced build differs from the backend's only by the stamps and where they go (head 0's dq row, which it does not
store; the bound pass's Delta, a scratch one here); each pair is timed first, so what the stamps cost is seen. The
backend's builds have no stamps (tests/kernels/test_backward_compile.py).
"""
import sys

import numpy as np

from sparse_mqa_kernels.backward_ws import TRACE_SLOTS as SLOTS
from sparse_mqa_kernels.bwd_rows import TRACE_PHASES as BOUND_PHASES
from sparse_mqa_kernels.bwd_rows import TRACE_SLOTS as BOUND_SLOTS

BOUND_ALL = BOUND_SLOTS + tuple(name for role in BOUND_PHASES for name in role)


def _waves(start, end, smid) -> dict:
    """The kernel's shape over the SMs (µs): its span, the gap between consecutive blocks on an SM, and its tail."""
    gaps, per_sm, sm_done = [], [], []
    for sm in np.unique(smid):
        on = np.flatnonzero(smid == sm)
        on = on[np.argsort(start[on])]
        per_sm.append(len(on))
        gaps += list(start[on[1:]] - end[on[:-1]])
        sm_done.append(end[on[-1]])
    span0, span1 = start.min(), end.max()
    idle_from = np.sort(np.asarray(sm_done))  # when each SM finished its last block
    return {
        "kernel span": (span1 - span0) * 1e-3,
        "gap between blocks on an SM": float(np.median(gaps)) * 1e-3 if gaps else 0.0,
        "SMs": len(per_sm), "blocks per SM (min/max)": (min(per_sm), max(per_sm)),
        # the tail: from the first SM that runs out of work to the kernel's end
        "tail after the first SM goes idle": (span1 - idle_from[0]) * 1e-3,
        "tail after half the SMs are idle": (span1 - idle_from[len(idle_from) // 2]) * 1e-3,
    }


def _medians(phases: dict) -> dict:
    return {k: float(np.median(v)) * 1e-3 for k, v in phases.items()}


def summarise(stamps: np.ndarray) -> dict:
    """The main kernel's [blocks, len(SLOTS)] int64 stamps (ns) -> the median of each phase (µs), and its waves."""
    t = {name: stamps[:, i].astype(np.float64) for i, name in enumerate(SLOTS)}
    end = np.maximum.reduce([t["wg0_end"], t["wg1_end"], t["sender_end"]])
    blocks = np.maximum(t["blocks"], 1)
    return {**_medians({
        "block": end - t["start"],
        "prologue (q, dO landed)": t["query_ready"] - t["start"],
        "first gather after that": t["first_block"] - t["query_ready"],
        "fill (WG1's first product)": t["wg1_first"] - t["start"],
        "WG0 loop, per top-k block": (t["wg0_loop_end"] - t["first_block"]) / blocks,
        "drain (end after WG0's loop)": end - t["wg0_loop_end"],
        "sender after WG1's loop": t["sender_end"] - t["wg1_loop_end"],
        "WG0 dq store": t["wg0_end"] - t["wg0_loop_end"],
        "WG1 dq store": t["wg1_end"] - t["wg1_loop_end"],
    }), **_waves(t["start"], end, t["smid"])}


def summarise_bound(stamps: np.ndarray) -> dict:
    """The bound pass's stamps (``bwd_rows.TRACE_SLOTS``, then ``TRACE_PHASES``) -> the median of each phase (µs),
    its waves, then each warpgroup's cycles a block in each phase of its loop (medians over the thread blocks; the
    producer gathers every block but the first)."""
    t = {name: stamps[:, i].astype(np.float64) for i, name in enumerate(BOUND_ALL)}
    blocks = np.maximum(t["blocks"], 1)
    cycles = {f"{name} (cycles a block)": t[name] / (np.maximum(blocks - 1, 1) if name.startswith("prod") else blocks)
              for role in BOUND_PHASES for name in role}
    return {**_medians({
        "block": t["loop_end"] - t["start"],
        "prologue (q, dO, out and block 0 landed)": t["query_ready"] - t["start"],
        "Delta, max|q|, max|dO|": t["prep_done"] - t["query_ready"],
        "to the loop": t["loop_start"] - t["prep_done"],
        "loop, per 64-slot block": (t["loop_end"] - t["loop_start"]) / blocks,
    }), **_waves(t["start"], t["loop_end"], t["smid"]),
        **{k: float(np.median(v)) for k, v in cycles.items()}}


def _format(name: str, out: dict) -> str:
    lines = [f"== {name}"]
    for k, v in out.items():
        lines.append(f"  {k:42s} {v:10.2f}" if isinstance(v, float) else f"  {k:42s} {v}")
    return "\n".join(lines)


def main(argv) -> int:
    import tilelang
    import torch

    from sparse_mqa_kernels import backward, backward_ws, bwd_plan, bwd_rows
    from sparse_mqa_kernels.bench.cli import _load
    from sparse_mqa_kernels.bench.shapes import PRESETS, make_inputs
    from sparse_mqa_kernels.target import EXECUTION_BACKEND, TARGET, sm_count
    from sparse_mqa_testkit.calls import Call

    for preset in argv or ["anchor", "l512"]:
        shape = PRESETS[preset]
        x = make_inputs(shape, "cuda", seed=0, sink=True)
        fwd, _ = _load("tilelang", "cuda")
        f_args, f_kw = Call(x).for_("forward")
        out, lse = fwd.forward(*f_args, **f_kw)
        q, kv, do, idx = x["q"], x["kv"], x["grad_out"], x["indices"]
        sm_scale = float(x["sm_scale"])
        B, S, H, Dqk = q.shape
        Dv, Skv = do.shape[-1], kv.shape[1]
        plan = bwd_plan.make_plan(B, S, Skv, H, idx.shape[-1], Dqk, Dv)
        key = plan.key()
        traced = tilelang.compile(backward_ws.build_program(key, trace=True), out_idx=None, target=TARGET,
                                  execution_backend=EXECUTION_BACKEND)
        tl = torch.full((B, S), idx.shape[-1], dtype=torch.int32, device="cuda")
        rows = torch.arange(S, dtype=torch.int32, device="cuda")
        bound, scales, _ = bwd_rows.compiled(Dqk, Dv, plan.stored_pds)
        pds, pds_len = backward.stored_pds_buffer(plan, q)
        delta, lse2, sink_delta = (torch.empty((B, S, H), dtype=torch.float32, device="cuda") for _ in range(3))
        hist = torch.zeros((B, Skv, bwd_plan.OCTAVES), dtype=torch.int32, device="cuda")
        split = plan.bound_split(S, sm_count(0))

        def bound_args(d, l2, h):  # Delta, the kernel LSE and the octave counts go to d, l2 and h
            return (q, out, do, kv, idx, tl, lse, x["attn_sink"], rows, d, l2, sink_delta, h, pds, sm_scale, 1, pds_len,
                    *split)

        bound(*bound_args(delta, lse2, hist))
        scale, inv = (torch.empty((B, Skv), dtype=torch.float32, device="cuda") for _ in range(2))
        scales(hist, scale, inv)
        acc = torch.zeros((B, Skv, Dqk), dtype=torch.int32, device="cuda")
        dq = torch.empty((B, S, H, Dqk), dtype=torch.bfloat16, device="cuda")
        args = (q, kv, do, idx, tl, lse2, delta, rows, scale, dq, acc, pds, sm_scale, pds_len)
        ms = {}
        for name, kernel in (("backend's", backward.compiled(key)), ("traced", traced)):  # what the stamps cost
            kernel(*args)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                kernel(*args)
            stop.record()
            torch.cuda.synchronize()
            ms[name] = start.elapsed_time(stop) / 5
        traced(*args)  # the run whose stamps are read
        torch.cuda.synchronize()
        stamps = dq[:, :, 0, :4 * len(SLOTS)].contiguous().view(torch.int64).reshape(-1, len(SLOTS)).cpu().numpy()
        print(_format(f"main kernel, {preset} {shape.label}: {len(stamps)} thread blocks, "
                      f"{torch.cuda.get_device_name()}; " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()),
                      summarise(stamps)), flush=True)
        # the bound pass's traced build writes its stamps over Delta: a scratch Delta and histogram
        traced_bound = tilelang.compile(bwd_rows.build_bound(Dqk, Dv, trace=True, stored=plan.stored_pds), out_idx=None,
                                        target=TARGET,
                                        execution_backend=EXECUTION_BACKEND)
        scratch, lse2b, hist2 = torch.empty_like(delta), torch.empty_like(lse2), torch.zeros_like(hist)
        ms = {}
        for name, kernel, d in (("backend's", bound, delta), ("traced", traced_bound, scratch)):
            kernel(*bound_args(d, lse2b, hist2))
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                kernel(*bound_args(d, lse2b, hist2))
            stop.record()
            torch.cuda.synchronize()
            ms[name] = start.elapsed_time(stop) / 5
        traced_bound(*bound_args(scratch, lse2b, hist2))
        torch.cuda.synchronize()
        n = len(BOUND_ALL)
        bstamps = scratch[:, :, :2 * n].contiguous().view(torch.int64).reshape(-1, n).cpu().numpy()
        print(_format(f"bound pass, {preset}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()),
                      summarise_bound(bstamps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
