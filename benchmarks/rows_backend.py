"""Design (a) of issue 26 as a backend the suite can run (``--smqa-backend rows_backend:RowsBackend`` with this folder
on PYTHONPATH), built from the probes' kernels, so that the whole conformance suite and the scale tier judged it
before it moved into ``sparse_mqa_kernels`` (the ``tilelang`` backend's 64-head path, with the octave bound):

1. ``prepw`` (``probe_split_backward.py``): Delta and the bound's per-head factors A_h, B_h, one warp a (query, head);
2. ``lean4``: each KV row's bound as two int64 sums U_j = sum P A_h, W_j = sum P B_h (each with a fixed point fixed
   by the sums of A_h and of B_h over the call);
3. ``scales``: B_j = |V_j| U_j + W_j, F_j = 29 - ceil(log2 B_j), the row's scale 2**F_j and its inverse;
4. the ``tilelang`` backend's main kernel (``backward_ws``; ``48/sender2`` in the probes when these were measured): dq,
   and dkv rounded to int32 at each row's scale and summed with integer reductions (wrap-around addition, exact
   because the final sum fits);
5. ``convert``: dkv = bf16(int32 sum * 2**-F_j). d_sink as today's backward forms it (torch, fixed shapes).

``RowsModelBackend`` is design (a)'s arithmetic in NumPy on CPU (any dims): ``backward_model``'s kernel loop for the
terms, the bound of ``study_fixed_point.row_bound`` (lean4's, with its 2**-7 margin) per row, F_j, and the int32
sums, raising if a term or a row's final sum leaves int32 (the kernel would wrap silently), so the suite's cases
check on CPU that the bound holds wherever they reach.

``RowsExactBackend`` is the same with the bound pass that takes dP itself (``exact``: S and dP products, one int64
sum a row; ``vnorms`` and ``qvmax`` give each query's largest named |V_j| for its fixed point; ``scales1``), which the
CPU models show design (a) needs on hot rows of peaky logits; the suite's ci profile and scale tier pass on it at
576/512 on the H200. The octave bound pass that replaced the prep pass is the ``tilelang`` backend's own now
(``sparse_mqa_kernels.bwd_rows``); ``RowsModelOctaveBackend`` models it beside the others on CPU.

Every sum is integer or in a fixed order, so the result is bitwise stable. ``RowsBackend`` and
``RowsExactBackend`` declare Dqk 576 / Dv 512, where they have run through the suite. The forward is the ``tilelang``
backend's.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
from types import SimpleNamespace

import torch

from sparse_mqa_testkit import contract
from sparse_mqa_testkit.backends import BackendBase, MissingDependency
from sparse_mqa_testkit.backends.validate import check_backward_args

HERE = pathlib.Path(__file__).parent


@functools.lru_cache(maxsize=None)
def _probe(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class RowsBackend(BackendBase):
    name = "tilelang-rows"
    main = "48/ws"  # probe_wide_backward.py's variant: the tilelang backend's main kernel
    device = "cuda"
    deterministic = True
    graph_safe = True  # no host reads of the data; every kernel and torch op on the current stream
    dims = ((576, 512),)
    tiles = {"head_group": 64, "topk_block": 48}  # the main kernel's blocks; the bound pass's are 64 slots
    sanitize_kernels = "_kernel"

    def __init__(self):
        self._k = {}

    def require(self) -> None:
        try:
            import tilelang  # noqa: F401
        except ImportError as exc:
            raise MissingDependency(f"tilelang-rows needs TileLang 0.1.15 ({exc})") from exc

    # (role, probe kernel) of everything but the main kernel; the bound, |dP| <= |dO_h| |V_j|, is lean4's
    kernels = (("prep", "prepw"), ("bound", "lean4"), ("convert", "convert"), ("scales", "scales"))

    def _kernels(self, dims):
        if dims not in self._k:
            split = _probe("probe_split_backward")
            k = {name: split.compiled(which, dims=dims) for name, which in self.kernels}
            self._k[dims] = dict(k, main=split.WIDE.compiled(self.main, dims), split=split)
        return self._k[dims]

    def warmup(self, cases=None) -> list[str]:
        for dims in self.dims:
            self._kernels(dims)
        return [f"{which} {dqk}/{dv}" for dqk, dv in self.dims for _, which in (*self.kernels, ("", self.main))]

    def forward(self, q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None):
        from sparse_mqa_kernels.forward import sparse_mqa_forward

        return sparse_mqa_forward(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length)

    def workspace_bytes(self, case, direction: str = "backward") -> int:
        """An upper bound on what a backward call holds beside its outputs: the int32 dkv sums (4 a dkv element);
        per KV row U, W, |V_j|, scale and inverse (28); per (query, head) Delta, A_h, B_h, C_h, G_h, the kernel LSE
        and its torch temporaries, the sink probability and d_sink's product (72 in all); per query the head
        blocks' sums, VMax, the row ids and topk_length's stand-in; 64 KiB of scalars."""
        if direction == "forward":
            return 0
        B, S, Skv, H, Dqk = case.B, case.S, case.Skv, case.H, case.Dqk
        return (4 * B * Skv * Dqk + 28 * B * Skv + 4 * B * Dqk + 72 * B * S * H
                + 8 * B * S * -(-H // 8) + 12 * B * S + 4 * S + (64 << 10))

    def _prep(self, k, d, x, delta):
        """``prepw``: Delta into ``delta``; returns the bound's per-head factors A, B, C, G and the head blocks'
        sums."""
        A, Bc, C, Gm = (torch.empty(d.B, d.S, d.H, dtype=torch.float32, device=x.dev) for _ in range(4))
        sums = torch.empty(2, d.B, d.S, -(-d.H // 8), dtype=torch.float32, device=x.dev)
        k["prep"](x.q, x.out, x.grad_out, delta, A, Bc, C, Gm, sums, x.sm)
        return A, Bc, C, Gm, sums

    def _row_scales(self, k, d, x, delta, scale, inv):
        """Delta into ``delta``, each KV row's scale and inverse into ``scale``, ``inv``: prep, then ``lean4``'s two
        sums at their fixed points, then ``scales``."""
        A, Bc, _, _, sums = self._prep(k, d, x, delta)
        row_u = torch.zeros(d.B, d.Skv, dtype=torch.int64, device=x.dev)
        ex = k["split"].uw_fixed_points(sums)
        row_w = torch.zeros_like(row_u)
        k["bound"](x.q, x.kv, x.indices, x.tl, x.lse2, A, Bc, x.rows, ex, row_u, row_w, x.sm)
        k["scales"](x.kv, row_u, row_w, ex, scale, inv)

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        d = check_backward_args(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length,
                                supported_dims=self.dims, device_type="cuda")
        k = self._kernels((d.Dqk, d.Dv))
        sm = float(sm_scale)
        dev = q.device
        q, kv, out, grad_out, lse, indices = (t.contiguous() for t in (q, kv, out, grad_out, lse, indices))
        with torch.cuda.device(dev):
            tl = (torch.full((d.B, d.S), d.L, dtype=torch.int32, device=dev) if topk_length is None
                  else topk_length.contiguous())
            rows = torch.arange(d.S, dtype=torch.int32, device=dev)
            lse2 = contract.lse_to_base2(lse, attn_sink).contiguous()
            scale = torch.empty(d.B, d.Skv, dtype=torch.float32, device=dev)
            inv = torch.empty_like(scale)
            delta = torch.empty(d.B, d.S, d.H, dtype=torch.float32, device=dev)
            x = SimpleNamespace(q=q, kv=kv, out=out, grad_out=grad_out, indices=indices, tl=tl, lse2=lse2, rows=rows,
                                sm=sm, dev=dev)
            self._row_scales(k, d, x, delta, scale, inv)
            acc = torch.zeros(d.B, d.Skv, d.Dqk, dtype=torch.int32, device=dev)
            dq = torch.empty(d.B, d.S, d.H, d.Dqk, dtype=torch.bfloat16, device=dev)
            keep = torch.zeros(d.B, d.Dqk, dtype=torch.float32, device=dev)
            k["main"](q, kv, grad_out, indices, tl, lse2, delta, rows, dq, keep, scale, acc, sm)
            dkv = torch.empty(d.B, d.Skv, d.Dqk, dtype=torch.bfloat16, device=dev)
            k["convert"](acc, inv, dkv)
            d_sink = None
            if attn_sink is not None:
                d_sink = -(contract.sink_probability(lse, attn_sink) * delta).sum((0, 1))
        return dq, dkv, d_sink


class RowsExactBackend(RowsBackend):
    """``RowsBackend`` with the dP-exact bound pass (``exact``: S and dP products, one int64 sum a row, its fixed
    point from each query's largest named |V_j|): the bound design (a) needs."""

    name = "tilelang-rows-exact"
    kernels = (("prep", "prepw"), ("bound", "exact"), ("convert", "convert"), ("vnorms", "vnorms"),
               ("qvmax", "qvmax"), ("scales", "scales1"))

    def _row_scales(self, k, d, x, delta, scale, inv):
        """prep, each query's largest named |V_j| (``vnorms``, ``qvmax``) for the fixed point, ``exact``'s one sum
        a row, then ``scales1``."""
        _, _, C, Gm, sums = self._prep(k, d, x, delta)
        row_b = torch.zeros(d.B, d.Skv, dtype=torch.int64, device=x.dev)
        vnorm = torch.empty(d.B, d.Skv, dtype=torch.float32, device=x.dev)
        vmax = torch.empty(d.B, d.S, dtype=torch.float32, device=x.dev)
        k["vnorms"](x.kv, vnorm)
        k["qvmax"](x.indices, x.tl, vnorm, vmax)
        ex = k["split"].exact_fixed_point(sums, vmax)
        k["bound"](x.q, x.grad_out, x.kv, x.indices, x.tl, x.lse2, delta, C, Gm, x.rows, ex, row_b, x.sm)
        k["scales"](row_b, ex, scale, inv)


class RowsModelBackend(BackendBase):
    """Design (a)'s arithmetic in NumPy (see the module docstring), on CPU torch tensors. ``dp``: how the bound
    takes |dP| (``study_fixed_point.row_bound``): "norms" as ``lean4`` does (|dO_h| |V_j|), "exact" from dP itself
    (a second product in the bound pass)."""

    name = "tilelang-rows-model"
    device = "cpu"
    deterministic = True
    dims = None
    tiles = {"head_group": 16, "topk_block": 16}
    dp = "norms"
    octaves = False

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        import numpy as np

        from sparse_mqa_kernels import backward_model as bm
        from sparse_mqa_kernels import bwd_plan
        from sparse_mqa_testkit.convert import to_torch
        from sparse_mqa_testkit.oracle import round_bf16, to_numpy

        check_backward_args(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length)
        study = _probe("study_fixed_point")
        dev = q.device
        q, kv, out, go, lse, sink, idx, tl = map(to_numpy, (q, kv, out, grad_out, lse, attn_sink, indices,
                                                            topk_length))
        sm = float(sm_scale)
        B, S, H, Dqk = q.shape
        Dv = out.shape[-1]
        prep = bm.prepare(q, kv, out, go, lse, sink, idx, sm, tl)
        dq = np.zeros((B, S, prep.plan.padded_heads, Dqk), dtype=np.float32)
        blocks = list(bm.blocks(q, kv, go, lse, sink, idx, sm, tl, prep, dq))

        def terms(blk):  # this design's bound on a slot's term, up to a power of two with octaves
            t = study.row_bound(blk, kv, Dv, sm, self.dp) * np.float32(1.0 + 2.0**-7)
            return bwd_plan.octave_ceil(t) if self.octaves else t.astype(np.float64)

        exact, _ = bm.row_scaled_dkv(blocks, kv, Dv, sm, terms=terms)  # raises where an int32 sum would wrap
        dkv = round_bf16(exact).astype(np.float32)
        dq = round_bf16(dq[:, :, :H]).astype(np.float32)
        d_sink = None
        if sink is not None:
            from sparse_mqa_testkit import contract as c

            ps = c.sink_probability(np.asarray(lse, dtype=np.float32), np.asarray(sink, dtype=np.float32))
            d_sink = -(ps * prep.delta).sum((0, 1), dtype=np.float32)
        return (to_torch(dq, dev, torch.bfloat16), to_torch(dkv, dev, torch.bfloat16),
                None if d_sink is None else to_torch(d_sink, dev, torch.float32))


class RowsModelExactBackend(RowsModelBackend):
    """``RowsModelBackend`` with the bound's |dP| from dP itself (two products in the bound pass)."""

    name = "tilelang-rows-model-exact"
    dp = "exact"


class RowsModelOctaveBackend(RowsModelExactBackend):
    """``RowsModelExactBackend`` with each (query, slot) term of a row's bound rounded up to a power of two before the
    row's sum: a bound pass that counts its terms per octave and row (integer adds: no fixed point, so no prep pass
    to fix one) gives this bound, at most twice the exact-dP one."""

    name = "tilelang-rows-model-octave"
    octaves = True
