"""Benchmark of our TileLang sparse-MQA forward (``sparse_mqa_kernels.forward``) on one GPU.

Default case: DeepSeek-V3.2 prefill shape B1 S4096 Skv8192 H64 L2048, Dqk/Dv 576/512, a finite sink, every
slot valid (distinct random indices per row). Times with CUDA events after warm-up (median of many runs) and,
in the same run, a peer: the same math in PyTorch (gather + bf16 matmuls + fp32 softmax). Before timing, the
first rows are checked against the testkit's device oracle (float64 on the GPU: relative L2 of out within
2.5x its bf16 rounding, lse within 5e-5 (1 + |lse|)), so the timed kernel is a correct one.

FLOP = 2 * B * S * H * L * (Dqk + Dv)  (scores and P V; softmax not counted).

    python benchmarks/bench_forward.py [--S 4096 --Skv 8192 --H 64 --L 2048 --dqk 576 --dv 512] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch

from sparse_mqa_kernels.bench import shapes, timing
from sparse_mqa_testkit import contract, device_oracle


def torch_peer(q, kv, idx, sm_scale, dv, attn_sink, chunk=1024):
    """The same forward in PyTorch (bf16 matmuls, fp32 softmax): the peer the kernel's speed is compared with."""
    B, S, H, _ = q.shape
    Skv = kv.shape[1]
    out = torch.empty(B, S, H, dv, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(B, S, H, dtype=torch.float32, device=q.device)
    for b in range(B):
        for s0 in range(0, S, chunk):
            ids = idx[b, s0:s0 + chunk].long()
            valid = contract.valid_mask(ids, Skv)
            g = kv[b][ids.clamp(0, Skv - 1)]
            s = torch.bmm(q[b, s0:s0 + chunk], g.transpose(1, 2)).float() * sm_scale
            s = s.masked_fill(~valid[:, None, :], -math.inf)
            l_ = torch.logsumexp(s, dim=-1)
            denom = l_ if attn_sink is None else torch.logaddexp(l_, attn_sink[None, :])
            p = torch.exp(s - denom[..., None]).bfloat16()
            out[b, s0:s0 + chunk] = torch.bmm(p, g[..., :dv])
            lse[b, s0:s0 + chunk] = l_
    return out, lse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--S", type=int, default=4096)
    ap.add_argument("--Skv", type=int, default=8192)
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--L", type=int, default=2048)
    ap.add_argument("--dqk", type=int, default=576)
    ap.add_argument("--dv", type=int, default=512)
    ap.add_argument("--no-sink", action="store_true")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--peer-iters", type=int, default=5)
    ap.add_argument("--check-rows", type=int, default=32)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    from sparse_mqa_kernels.forward import sparse_mqa_forward

    shape = shapes.Shape(B=a.B, S=a.S, Skv=a.Skv, H=a.H, L=a.L, Dqk=a.dqk, Dv=a.dv)
    x = shapes.make_inputs(shape, "cuda", seed=0, sink=not a.no_sink)
    q, kv, idx, sink, sm_scale = x["q"], x["kv"], x["indices"], x["attn_sink"], x["sm_scale"]

    def ours():
        return sparse_mqa_forward(q, kv, idx, sm_scale, a.dv, attn_sink=sink)

    out, lse = ours()
    torch.cuda.synchronize()
    rows = slice(0, a.check_rows)
    ref_out, ref_lse = device_oracle.forward(q[:1, rows], kv[:1], idx[:1, rows], sm_scale=sm_scale, d_v=a.dv,
                                             attn_sink=sink)
    ref_out, ref_lse = ref_out[0], ref_lse[0]
    o = out[0, rows].double()
    rounding = (ref_out.bfloat16().double() - ref_out).norm() / ref_out.norm()
    err = (o - ref_out).norm() / ref_out.norm()
    lse_err = ((lse[0, rows].double() - ref_lse).abs() / (1 + ref_lse.abs())).max()
    correct = bool(err <= 2.5 * rounding + 1e-4 and lse_err <= 5e-5)

    times = timing.time_calls(lambda k: ours(), 1, a.warmup, a.iters, "cuda")
    ms, ms_min = statistics.median(times), min(times)
    peer_ms = statistics.median(timing.time_calls(lambda k: torch_peer(q, kv, idx, sm_scale, a.dv, sink), 1, 1,
                                                 a.peer_iters, "cuda"))
    res = {
        "case": f"B{a.B} S{a.S} Skv{a.Skv} H{a.H} L{a.L} {a.dqk}/{a.dv} sink={'none' if a.no_sink else 'finite'}",
        "device": torch.cuda.get_device_name(),
        "ms_median": round(ms, 4), "ms_min": round(ms_min, 4), "iters": a.iters, "warmup": a.warmup,
        "tflops": round(shapes.tflops(shape, "forward", ms), 1),
        "peer_torch_ms_median": round(peer_ms, 3), "speedup_vs_torch": round(peer_ms / ms, 2),
        "check_rows": a.check_rows, "out_rel_l2": float(err), "out_bf16_rounding_rel_l2": float(rounding),
        "lse_scaled_abs_err": float(lse_err), "correct": correct,
    }
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
