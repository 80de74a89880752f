"""NumPy reference of the contract's forward and backward (float32 or float64 math).

Vectorised: one gather of the valid slots' KV rows per call, batched matmuls over (b, i), and a sorted
segment sum for dkv (deterministic, no np.add.at). Invalid slots gather row 0 of their batch and are then
replaced by exact zeros with ``np.where`` (not multiplied by a mask), so a NaN anywhere outside the valid
rows never reaches a result, and no invalid index, 2**31-1 included, is ever used to address memory.
"""

from __future__ import annotations

import numpy as np

from .. import contract

_FLOAT_DTYPES = (np.float32, np.float64)


def to_numpy(x):
    """NumPy view of an input: arrays pass through; tensors go through their own ``.numpy()`` / ``__array__``."""
    if x is None or isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach"):  # torch: bf16 has no NumPy dtype, go through float32 (exact)
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            import ml_dtypes

            return x.float().numpy().astype(ml_dtypes.bfloat16)
        return x.numpy()
    return np.asarray(x)


def _prepare(q, kv, indices, d_v, attn_sink, topk_length, dtype, grad_out=None):
    dtype = np.dtype(dtype)
    if dtype.type not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    q, kv, indices, attn_sink, topk_length, grad_out = map(to_numpy, (q, kv, indices, attn_sink, topk_length,
                                                                      grad_out))
    dims = contract.validate_shapes(q, kv, indices, d_v=d_v, attn_sink=attn_sink, topk_length=topk_length,
                                    grad_out=grad_out)
    valid = contract.valid_mask(indices, dims.Skv, topk_length)  # [B, S, L]
    safe = np.where(valid, indices, 0).astype(np.int64)
    # kv rows per slot, [B, S, L, Dqk]; invalid slots are exact zeros
    kv_c = kv.astype(dtype, copy=False)
    gathered = kv_c[np.arange(dims.B)[:, None, None], safe]
    gathered = np.where(valid[..., None], gathered, dtype.type(0))
    q_c = q.astype(dtype, copy=False)
    sink = None if attn_sink is None else attn_sink.astype(dtype, copy=False)
    go = None if grad_out is None else grad_out.astype(dtype, copy=False)
    return dims, dtype, valid, safe, gathered, q_c, sink, go


def _probs(dims, dtype, valid, gathered, q, sm_scale, sink):
    """Scores -> (P [B,S,H,L], lse [B,S,H], p_sink [B,S,H] or None) with the contract's conventions."""
    s = np.matmul(q, np.swapaxes(gathered, -1, -2)) * dtype.type(sm_scale)  # [B,S,H,L]
    s = np.where(valid[:, :, None, :], s, -np.inf)
    any_valid = valid.any(-1)[:, :, None]  # [B,S,1]
    m = np.where(any_valid, s.max(-1), 0).astype(dtype)
    with np.errstate(divide="ignore"):
        lse = np.where(any_valid, m + np.log(np.exp(s - m[..., None]).sum(-1)), np.inf).astype(dtype)
    if sink is None:
        denom = lse
        p_sink = None
    else:
        with np.errstate(invalid="ignore"):
            denom = np.logaddexp(lse, sink)  # inf + inf -> inf; -inf sink -> lse
            p_sink = np.exp(sink - denom)
        # sink +inf: all mass on the sink (p_sink 1, P 0); empty row with finite sink: no gradient anyway
        p_sink = np.where(np.isposinf(sink), dtype.type(1), p_sink)
        p_sink = np.where(np.isposinf(lse) & ~np.isposinf(sink), dtype.type(0), p_sink).astype(dtype)
    P = np.exp(s - denom[..., None])  # -inf - anything finite or +inf -> 0
    P = np.where(valid[:, :, None, :], P, dtype.type(0)).astype(dtype)
    return P, lse, p_sink


def forward(q, kv, indices, *, sm_scale, d_v, attn_sink=None, topk_length=None, dtype=np.float32):
    """Contract forward. Returns ``(out [B,S,H,Dv], lse [B,S,H])`` in ``dtype`` (lse natural-log, sink excluded)."""
    sm_scale = contract.validate_sm_scale(sm_scale)
    dims, dtype, valid, _, gathered, qc, sink, _ = _prepare(q, kv, indices, d_v, attn_sink, topk_length, dtype)
    P, lse, _ = _probs(dims, dtype, valid, gathered, qc, sm_scale, sink)
    out = np.matmul(P, gathered[..., : dims.Dv])  # [B,S,H,Dv]
    return out.astype(dtype, copy=False), lse


def backward(q, kv, indices, grad_out, *, sm_scale, d_v, attn_sink=None, topk_length=None, dtype=np.float32):
    """Contract backward, recomputing the forward from the primal inputs.

    Returns ``(dq [B,S,H,Dqk], dkv [B,Skv,Dqk], d_sink [H] or None)`` in ``dtype``.
    """
    sm_scale = contract.validate_sm_scale(sm_scale)
    if grad_out is None:
        raise ValueError("grad_out is required, got None")
    dims, dtype, valid, safe, gathered, qc, sink, go = _prepare(q, kv, indices, d_v, attn_sink, topk_length,
                                                                dtype, grad_out=grad_out)
    scale = dtype.type(sm_scale)
    P, lse, p_sink = _probs(dims, dtype, valid, gathered, qc, sm_scale, sink)
    v = gathered[..., : dims.Dv]
    out = np.matmul(P, v)
    delta = np.einsum("bshd,bshd->bsh", go, out)  # [B,S,H]
    dp = np.matmul(go, np.swapaxes(v, -1, -2))  # [B,S,H,L]
    ds = P * (dp - delta[..., None])  # zero on invalid slots since P is
    dq = np.matmul(ds, gathered) * scale  # [B,S,H,Dqk]
    # per-slot contribution to its KV row, summed over heads: [B,S,L,Dqk]
    contrib = np.matmul(np.swapaxes(ds, -1, -2), qc) * scale
    contrib[..., : dims.Dv] += np.matmul(np.swapaxes(P, -1, -2), go)
    dkv = _scatter_rows(contrib, safe, valid, dims, dtype)
    d_sink = None
    if sink is not None:
        d_sink = -(p_sink * delta).sum(axis=(0, 1)).astype(dtype)
    return dq.astype(dtype, copy=False), dkv, d_sink


def _scatter_rows(contrib, safe, valid, dims, dtype):
    """dkv[b, j] = sum of contrib[b, i, t] over valid slots with idx = j, in a fixed (sorted) order."""
    dkv = np.zeros((dims.B * dims.Skv, dims.Dqk), dtype=dtype)
    flat_valid = valid.reshape(-1)
    if not flat_valid.any():
        return dkv.reshape(dims.B, dims.Skv, dims.Dqk)
    rows = (safe + (np.arange(dims.B) * dims.Skv)[:, None, None]).reshape(-1)[flat_valid]
    vals = contrib.reshape(-1, dims.Dqk)[flat_valid]
    order = np.argsort(rows, kind="stable")
    rows, vals = rows[order], vals[order]
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    dkv[rows[starts]] = np.add.reduceat(vals, starts, axis=0)
    return dkv.reshape(dims.B, dims.Skv, dims.Dqk)
