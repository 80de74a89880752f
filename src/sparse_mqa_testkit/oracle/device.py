"""The contract's forward and backward in torch, on the inputs' device (float64 by default), a chunk of query
rows at a time so that memory stays bounded at production sizes.

The same math as the NumPy oracle (``oracle.host``), which stays the root of trust: the CPU
tests hold the two to ~1e-12 in float64 on drawn cases. This one exists for work the NumPy oracle cannot do in
time on a host: production-sized cases on a GPU.

- Invalid slots (the contract's rule) are never used to address memory: their gathered rows are replaced by
  exact zeros before any product, so NaN in an unreferenced KV row cannot reach a result.
- Empty rows give out = 0, lse = +inf and no gradient; a +inf sink takes all the mass; d_sink is
  -sum p_sink Delta with Delta = sum_t P_t <dO, V_t> (the same quantity as <dO, out>, without recomputing out).
- dkv adds every valid slot's contribution with ``index_add_``; on a GPU the order of those additions is the
  device's, which in float64 moves results by ~1e-16 relative.
"""

from __future__ import annotations

import math

import torch

from .. import contract

CHUNK_BYTES = 1 << 28  # per chunk of query rows: their gathered KV rows and per-head vectors, in the compute dtype


def _prepare(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, grad_out=None):
    dims = contract.validate_shapes(q, kv, indices, d_v=d_v, attn_sink=attn_sink, topk_length=topk_length,
                                    grad_out=grad_out)
    return dims, contract.validate_sm_scale(sm_scale)


def _chunks(dims, dtype, chunk_bytes):
    # a query row gathers L KV rows and holds H-row tensors (q, dO, dq) beside the [H, L] scores
    per_row = max(1, ((dims.L + 2 * dims.H) * dims.Dqk + 4 * dims.H * dims.L) * torch.finfo(dtype).bits // 8)
    n = max(1, chunk_bytes // per_row)
    for b in range(dims.B):
        for i in range(0, dims.S, n):
            yield b, i, min(dims.S, i + n)


def _slots(kv_b, idx, tl, dtype):
    """valid [n, L], safe indices [n, L] (0 where invalid) and K [n, L, Dqk] with exact zeros on invalid slots."""
    valid = contract.valid_mask(idx, kv_b.shape[0], tl)
    safe = torch.where(valid, idx.long(), 0)
    K = torch.where(valid[..., None], kv_b[safe].to(dtype), torch.zeros((), dtype=dtype, device=kv_b.device))
    return valid, safe, K


def _softmax(q, K, valid, scale, sink):
    """P [n, H, L], lse [n, H] (+inf for an empty row) and the normaliser logaddexp(lse, sink)."""
    s = torch.einsum("nhd,nld->nhl", q, K) * scale
    s = torch.where(valid[:, None, :], s, -math.inf)
    lse = torch.where(valid.any(-1)[:, None], torch.logsumexp(s, dim=-1), math.inf)
    denom = lse if sink is None else torch.where(torch.isposinf(lse) | torch.isposinf(sink), math.inf,
                                                 torch.logaddexp(lse, sink))
    return torch.exp(s - denom[..., None]), lse  # -inf - anything, or anything - inf: exactly 0


def forward(q, kv, indices, *, sm_scale, d_v, attn_sink=None, topk_length=None, dtype=torch.float64,
            chunk_bytes=CHUNK_BYTES):
    """Contract forward: ``(out [B,S,H,Dv], lse [B,S,H])`` in ``dtype`` on q's device (lse natural log, sink
    excluded, +inf for an empty row)."""
    dims, scale = _prepare(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    out = torch.empty(dims.shape("out"), dtype=dtype, device=q.device)
    lse = torch.empty(dims.shape("lse"), dtype=dtype, device=q.device)
    sink = None if attn_sink is None else attn_sink.to(dtype)
    for b, i, j in _chunks(dims, dtype, chunk_bytes):
        tl = None if topk_length is None else topk_length[b, i:j]
        valid, _, K = _slots(kv[b], indices[b, i:j], tl, dtype)
        P, lse[b, i:j] = _softmax(q[b, i:j].to(dtype), K, valid, scale, sink)
        out[b, i:j] = torch.einsum("nhl,nld->nhd", P, K[..., :d_v])
    return out, lse


def backward(q, kv, indices, grad_out, *, sm_scale, d_v, attn_sink=None, topk_length=None, dtype=torch.float64,
             chunk_bytes=CHUNK_BYTES):
    """Contract backward, recomputing the forward from the primal inputs: ``(dq [B,S,H,Dqk], dkv [B,Skv,Dqk],
    d_sink [H] or None)`` in ``dtype`` on q's device."""
    if grad_out is None:
        raise ValueError("grad_out is required, got None")
    dims, scale = _prepare(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, grad_out)
    dq = torch.empty(dims.shape("dq"), dtype=dtype, device=q.device)
    dkv = torch.zeros((dims.B * dims.Skv, dims.Dqk), dtype=dtype, device=q.device)
    sink = None if attn_sink is None else attn_sink.to(dtype)
    d_sink = None if sink is None else torch.zeros(dims.H, dtype=dtype, device=q.device)
    for b, i, j in _chunks(dims, dtype, chunk_bytes):
        tl = None if topk_length is None else topk_length[b, i:j]
        valid, safe, K = _slots(kv[b], indices[b, i:j], tl, dtype)
        qc, dO = q[b, i:j].to(dtype), grad_out[b, i:j].to(dtype)
        P, lse = _softmax(qc, K, valid, scale, sink)
        dP = torch.einsum("nhd,nld->nhl", dO, K[..., :d_v])
        delta = (P * dP).sum(-1)  # <dO, out>, without recomputing out
        dS = P * (dP - delta[..., None])
        dq[b, i:j] = torch.einsum("nhl,nld->nhd", dS, K) * scale
        contrib = torch.einsum("nhl,nhd->nld", dS, qc) * scale
        contrib[..., :d_v] += torch.einsum("nhl,nhd->nld", P, dO)
        dkv.index_add_(0, (b * dims.Skv + safe)[valid], contrib[valid])
        if sink is not None:
            d_sink -= (contract.sink_probability(lse, sink) * delta).sum(0)
    return dq, dkv.reshape(dims.B, dims.Skv, dims.Dqk), d_sink
