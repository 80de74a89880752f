"""What ``sparse-mqa-bench`` times: shapes, their FLOP counts, and input sets.

FLOP counts (B = 1 in the issue's formulas; multiplied by B here):
    forward  2 * H * L * (Dqk + Dv) * S * B
    backward 2 * H * L * (3 * Dqk + 2 * Dv) * S * B
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparse_mqa_testkit import contract
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.cases.draws import draw_indices
from sparse_mqa_testkit.cases.tensors import TorchDraws


@dataclass(frozen=True)
class Shape:
    S: int
    Skv: int
    H: int
    L: int
    B: int = 1
    Dqk: int = contract.DQK
    Dv: int = contract.DV

    @property
    def label(self) -> str:
        return f"B{self.B} S{self.S} Skv{self.Skv} H{self.H} L{self.L}"

    @property
    def dims(self) -> contract.Dims:
        return contract.Dims(B=self.B, S=self.S, H=self.H, Dqk=self.Dqk, Dv=self.Dv, Skv=self.Skv, L=self.L)


def flops(shape: Shape, direction: str) -> int:
    """Matmul FLOPs of one call: QK^T and PV forward; QK^T, dO V^T, dS K, dS^T Q and P^T dO backward."""
    per_dim = {"forward": shape.Dqk + shape.Dv, "backward": 3 * shape.Dqk + 2 * shape.Dv}[direction]
    return 2 * shape.H * shape.L * per_dim * shape.S * shape.B


def tflops(shape: Shape, direction: str, ms: float) -> float:
    return flops(shape, direction) / (ms * 1e-3) / 1e12


# ---- which shapes -----------------------------------------------------------------------------------------------

ANCHOR = dict(S=4096, Skv=8192)
ANCHOR_H = (64, 128)
ANCHOR_L = (512, 2048)
SWEEP_S = (1024, 2048, 4096, 8192)
SWEEP_L = (256, 512, 1024, 2048)


def plan_shapes(*, heads=ANCHOR_H, topks=ANCHOR_L, S=ANCHOR["S"], Skv=ANCHOR["Skv"], B=1, sweep_s=SWEEP_S,
                sweep_l=SWEEP_L, sweep_h=64, sweep_at_l=2048, Dqk=contract.DQK, Dv=contract.DV):
    """[(Shape, {groups})]: the anchor grid (H x L), the S sweep (at sweep_h, sweep_at_l) and the L sweep
    (at sweep_h, S); a shape that belongs to several groups is run once."""
    groups: dict[Shape, set] = {}
    for h in heads:
        for l in topks:
            groups.setdefault(Shape(S=S, Skv=Skv, H=h, L=l, B=B, Dqk=Dqk, Dv=Dv), set()).add("anchor")
    for s in sweep_s:
        groups.setdefault(Shape(S=s, Skv=Skv, H=sweep_h, L=sweep_at_l, B=B, Dqk=Dqk, Dv=Dv), set()).add("sweep_s")
    for l in sweep_l:
        groups.setdefault(Shape(S=S, Skv=Skv, H=sweep_h, L=l, B=B, Dqk=Dqk, Dv=Dv), set()).add("sweep_l")
    return list(groups.items())


# ---- inputs -----------------------------------------------------------------------------------------------------

INDICES = ("random", "local", "hot")  # the testkit's index patterns (sparse_mqa_testkit.cases.PATTERNS)


def make_inputs(shape: Shape, device, seed: int, sink: bool = False, indices: str = "random") -> dict:
    """One input set on ``device``: q, kv, grad_out bf16 N(0, 1); distinct random top-k indices per row, or the
    ``local`` (causal window plus far picks) or ``hot`` (a few rows every query names) pattern."""
    if indices not in INDICES:
        raise ValueError(f"indices must be one of {', '.join(INDICES)}, got {indices!r}")
    g = torch.Generator(device=device).manual_seed(seed)
    B, S, Skv, H, L = shape.B, shape.S, shape.Skv, shape.H, shape.L
    q = torch.randn(B, S, H, shape.Dqk, generator=g, device=device).to(torch.bfloat16)
    kv = torch.randn(B, Skv, shape.Dqk, generator=g, device=device).to(torch.bfloat16)
    grad_out = torch.randn(B, S, H, shape.Dv, generator=g, device=device).to(torch.bfloat16)
    idx = torch.empty(B, S, L, dtype=torch.int32, device=device)
    rows = max(1, (1 << 24) // Skv)  # argsort of random keys, a few rows at a time: distinct slots per row
    for b in range(B):
        for i in range(0, S, rows):
            n = min(rows, S - i)
            keys = torch.rand(n, Skv, generator=g, device=device)
            idx[b, i:i + n] = keys.argsort(dim=-1)[:, :L].to(torch.int32) if L <= Skv else \
                torch.randint(0, Skv, (n, L), generator=g, device=device, dtype=torch.int32)
    if indices != "random":
        case = Case(B=B, S=S, Skv=Skv, H=H, L=L, Dqk=shape.Dqk, Dv=shape.Dv, pattern=indices, seed=seed)
        idx = draw_indices(case, TorchDraws(g, device))
    attn_sink = torch.randn(H, generator=g, device=device) if sink else None
    return {"q": q, "kv": kv, "indices": idx, "grad_out": grad_out, "attn_sink": attn_sink, "topk_length": None,
            "sm_scale": 1.0 / math.sqrt(shape.Dqk), "d_v": shape.Dv}


# named shapes for --preset: the three the deterministic backward is measured at, and a small one
PRESETS = {
    "anchor": Shape(S=4096, Skv=8192, H=64, L=2048),
    "h128": Shape(S=4096, Skv=8192, H=128, L=2048),
    "l512": Shape(S=4096, Skv=8192, H=64, L=512),
    "small": Shape(S=512, Skv=2048, H=64, L=512),
}
