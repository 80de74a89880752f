"""NumPy reference of the contract's forward and backward (float32 or float64 math).

How it stays exact and cheap:

- Canonical slots. Each row's slots are sorted by KV index with the invalid ones last, and the slot axis is
  cut to the longest row's count of valid slots. The oracle's results are therefore BITWISE independent of
  slot order, of appended invalid slots, of which invalid value a slot holds, and of extra query rows with no
  valid slot: the arithmetic is the same. (Not of the head count: H is a matmul dimension and BLAS picks its
  kernels by size, so padding heads changes results by rounding only.)
- Invalid slots are never used to address memory: they get exact zeros (an appended zero row, or a zero
  array the valid rows are copied into), so no value of kv outside the valid rows (a NaN, say) reaches a
  result, and 2**31-1 is harmless. A long kv cache with few slots is not copied or cast as a whole.
- Vectorised: one gather of the valid slots' KV rows, batched matmuls over rows (b, i), no Python loop over
  rows or slots. The backward stacks (q_h, [dO_h; 0]) per head to get scores and dP from one matmul, and
  (scale dS_h, P_h) to get each slot's dkv contribution from one matmul; Delta = <dO, out> is taken as
  sum_t P_t dP_t, which is the same quantity without recomputing out.
- dkv adds each kv row's contributions in (b, i, slot) order, from padded grids (see ``_segment_sum``):
  deterministic, exact in the asked dtype's arithmetic, no np.add.at and no cumulative-sum differences.
  d_sink is accumulated over rows in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import contract

_FLOAT_DTYPES = (np.float32, np.float64)
# dkv: one grid for all kv rows while it holds at most this many cells per contribution, else one per class
_ONE_GRID_SLACK = 2
_GATHER_BYTES = 1 << 20  # the grouped sum gathers about this much at a time


def to_numpy(x):
    """NumPy view of an input: arrays pass through; tensors go through their own ``.numpy()`` / ``__array__``."""
    if x is None or isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach"):  # torch or paddle: bf16 has no NumPy dtype, go through float32 (exact)
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            import ml_dtypes

            return x.float().numpy().astype(ml_dtypes.bfloat16)
        if str(x.dtype) == "paddle.bfloat16":  # paddle's .numpy() gives bf16 as its raw uint16 bits
            import ml_dtypes

            return x.numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    return np.asarray(x)


@dataclass
class _Call:
    """One call's validated inputs in the compute dtype, with the canonical slots gathered."""

    dims: contract.Dims
    dtype: np.dtype
    valid: np.ndarray  # [B, S, Lc] canonical slots: valid ones first
    rows: np.ndarray  # [B, S, Lc] flat KV row b*Skv + idx of each canonical slot (B*Skv for invalid)
    k: np.ndarray  # [B, S, Lc, Dqk] gathered kv rows, exact zeros on invalid slots
    q: np.ndarray  # [B, S, H, Dqk] as given (any float dtype): cast where it is used, saving a pass
    sink: np.ndarray | None  # [H]
    scale: float


def _prepare(q, kv, indices, d_v, attn_sink, topk_length, dtype, sm_scale, grad_out=None):
    dtype = _compute_dtype(dtype)
    sm_scale = contract.validate_sm_scale(sm_scale)
    q, kv, indices, attn_sink, topk_length, grad_out = map(to_numpy, (q, kv, indices, attn_sink, topk_length,
                                                                      grad_out))
    dims = contract.validate_shapes(q, kv, indices, d_v=d_v, attn_sink=attn_sink, topk_length=topk_length,
                                    grad_out=grad_out)
    B, S, Skv = dims.B, dims.S, dims.Skv
    valid = contract.valid_mask(indices, Skv, topk_length)  # [B, S, L]
    # canonical slots: sort each row's KV indices, invalid ones (key Skv) last; cut to the longest valid run
    key = np.where(valid, indices, Skv).astype(np.int64)
    key.sort(axis=-1)
    lc = max(int(valid.sum(-1).max()), 1)
    key = key[..., :lc]
    cvalid = key < Skv
    rows = np.where(cvalid, key + (np.arange(B, dtype=np.int64) * Skv)[:, None, None], B * Skv)
    # gather: invalid slots get exact zeros and read nothing. When kv has no more rows than there are slots,
    # cast it and append one zero row for the invalid slots to take; when kv is the larger (a long cache, few
    # slots), copy only the valid slots' rows into a zero array, never touching the rest of kv.
    kv_flat = kv.reshape(B * Skv, dims.Dqk)
    flat = rows.reshape(-1)
    if B * Skv <= flat.size:
        kv_c = kv_flat.astype(dtype, copy=False)
        k = np.take(np.concatenate([kv_c, np.zeros((1, dims.Dqk), dtype)]), flat, axis=0)
    else:
        k = np.zeros((flat.size, dims.Dqk), dtype)
        m = cvalid.reshape(-1)
        k[m] = kv_flat[flat[m]]
    k = k.reshape(B, S, lc, dims.Dqk)
    sink = None if attn_sink is None else attn_sink.astype(dtype, copy=False)
    call = _Call(dims=dims, dtype=dtype, valid=cvalid, rows=rows, k=k, q=q, sink=sink,
                 scale=sm_scale)
    return call, grad_out


def _compute_dtype(dtype) -> np.dtype:
    """float32 or float64, else ValueError naming ``dtype`` (np.dtype(None) would silently mean float64)."""
    try:
        dt = None if dtype is None else np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.type not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be float32 or float64, got {dt if dt is not None else repr(dtype)}")
    return dt


def _softmax(c: _Call, s):
    """Scores [B,S,H,Lc] (already scaled) -> (P, lse [B,S,H], p_sink or None) with the contract's conventions."""
    t = c.dtype.type
    s = np.where(c.valid[:, :, None, :], s, -np.inf)
    any_valid = c.valid[..., :1][:, :, None, :]  # canonical order: slot 0 valid iff the row has a valid slot
    m = np.where(any_valid[..., 0], s.max(-1), t(0))
    with np.errstate(divide="ignore"):
        lse = np.where(any_valid[..., 0], m + np.log(np.exp(s - m[..., None]).sum(-1)), t(np.inf)).astype(c.dtype)
    if c.sink is None:
        denom, p_sink = lse, None
    else:
        with np.errstate(invalid="ignore"):
            denom = np.logaddexp(lse, c.sink)  # inf + inf -> inf; -inf sink -> lse exactly
        # sink +inf: all mass on the sink (p_sink 1, P 0); empty row with finite sink: no mass, no gradient
        p_sink = contract.sink_probability(lse, c.sink).astype(c.dtype, copy=False)
    P = np.exp(s - denom[..., None]).astype(c.dtype, copy=False)  # -inf minus finite or +inf -> exactly 0
    return P, lse, p_sink


def forward(q, kv, indices, *, sm_scale, d_v, attn_sink=None, topk_length=None, dtype=np.float32):
    """Contract forward. Returns ``(out [B,S,H,Dv], lse [B,S,H])`` in ``dtype`` (lse natural-log, sink excluded)."""
    c, _ = _prepare(q, kv, indices, d_v, attn_sink, topk_length, dtype, sm_scale)
    s = np.matmul(c.q.astype(c.dtype, copy=False), np.swapaxes(c.k, -1, -2))
    s *= c.dtype.type(c.scale)
    P, lse, _ = _softmax(c, s)
    out = np.matmul(P, c.k[..., : c.dims.Dv])  # [B,S,H,Dv]
    return out.astype(c.dtype, copy=False), lse


def backward(q, kv, indices, grad_out, *, sm_scale, d_v, attn_sink=None, topk_length=None, dtype=np.float32):
    """Contract backward, recomputing the forward from the primal inputs.

    Returns ``(dq [B,S,H,Dqk], dkv [B,Skv,Dqk], d_sink [H] or None)`` in ``dtype``.
    """
    if grad_out is None:
        raise ValueError("grad_out is required, got None")
    c, go = _prepare(q, kv, indices, d_v, attn_sink, topk_length, dtype, sm_scale, grad_out=grad_out)
    d, t = c.dims, c.dtype.type
    H, Dqk, Dv = d.H, d.Dqk, d.Dv
    scale = t(c.scale)
    # a = (q_h, [dO_h; 0]) interleaved per head: one matmul against the gathered K gives scores and
    # dP = <dO, V>, and the same a is the right factor of the dkv contribution. Interleaving keeps each head's
    # pair adjacent in the contribution's head sum, so heads appended at the end only append exact zeros.
    a = np.zeros((d.B, d.S, H, 2, Dqk), c.dtype)
    a[:, :, :, 0] = c.q
    a[:, :, :, 1, :Dv] = go
    a = a.reshape(d.B, d.S, 2 * H, Dqk)
    sd = np.matmul(a, np.swapaxes(c.k, -1, -2))  # [B,S,2H,Lc]
    s = sd[:, :, 0::2] * scale
    dp = sd[:, :, 1::2]
    P, lse, p_sink = _softmax(c, s)
    # Delta = <dO, out> = sum_t P_t <dO, V_t>: the same quantity without recomputing out
    delta = np.einsum("bshl,bshl->bsh", P, dp)
    w = np.empty((d.B, d.S, H, 2, P.shape[-1]), c.dtype)  # (scale dS_h, P_h) interleaved like a
    ds = w[:, :, :, 0]
    np.multiply(P, dp - delta[..., None], out=ds)
    dq = np.matmul(ds, c.k)
    dq *= scale
    ds *= scale
    w[:, :, :, 1] = P
    w = w.reshape(d.B, d.S, 2 * H, -1)
    # each slot's dkv contribution scale dS^T q + P^T [dO; 0], written into a buffer with one zero row after it
    n = c.rows.size
    contrib = np.empty((n + 1, Dqk), c.dtype)
    contrib[n] = 0
    np.matmul(np.swapaxes(w, -1, -2), a, out=contrib[:n].reshape(d.B, d.S, -1, Dqk))
    dkv = _segment_sum(contrib, c)
    d_sink = None
    if c.sink is not None:
        # summed over rows strictly in order (accumulate, not the pairwise sum), so rows that carry nothing
        # (empty rows add exact zeros) cannot change a bit of it
        d_sink = -np.add.accumulate((p_sink * delta).reshape(-1, H), axis=0)[-1].astype(c.dtype)
    return dq.astype(c.dtype, copy=False), dkv, d_sink


def _segment_sum(contrib, c: _Call):
    """dkv[b, j] = sum of contrib rows over valid slots with flat row b*Skv + j, in (b, i, slot) order.

    ``contrib`` is [N + 1, Dqk], one row per canonical slot plus a zero row. The kv rows that are referenced
    are grouped by multiplicity class (1, 2, 3-4, 5-8, ...; one class when that wastes little); per class a grid
    [rows, class's max multiplicity] of contribution numbers (the zero row pads short lists) is gathered and reduced
    over the multiplicity axis. So the grid never holds more than twice the contributions however skewed the
    references, each sum starts from the row's first contribution and adds the others in order (sequentially when Dqk
    > 1, the reduced axis not
    being NumPy's inner loop; padding adds exact zeros): deterministic and exact in the dtype's arithmetic.
    (np.add.reduceat is not used: it does not add a segment's rows in order.)
    """
    d = c.dims
    n_rows = d.B * d.Skv
    flat_rows = c.rows.reshape(-1)
    n = flat_rows.size
    dkv = np.zeros((n_rows, d.Dqk), c.dtype)
    sel = np.flatnonzero(flat_rows < n_rows)
    if sel.size == 0:
        return dkv.reshape(d.B, d.Skv, d.Dqk)
    order = sel[np.argsort(flat_rows[sel], kind="stable")]  # contribution numbers, grouped by kv row
    r_sorted = flat_rows[order]
    first = np.empty(r_sorted.size, bool)
    first[0] = True
    np.not_equal(r_sorted[1:], r_sorted[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    used = r_sorted[starts]
    counts = np.diff(starts, append=r_sorted.size)
    row_of = np.cumsum(first) - 1  # per sorted contribution: its used row (integer counting, exact)
    rank = np.arange(r_sorted.size) - starts[row_of]  # and its place in that row's list
    mult = int(counts.max())
    if used.size * mult <= _ONE_GRID_SLACK * sel.size + 64:  # one grid, at most half padding: no classes
        groups = [(np.arange(used.size), row_of, rank, order, mult)]
    else:
        klass = np.ceil(np.log2(counts)).astype(np.int64)  # exact for the small ints counts are
        slot_in_class = np.empty(used.size, np.int64)
        groups = []
        for k in np.unique(klass):  # a loop over multiplicity classes: at most log2(N) + 1 of them
            members = np.flatnonzero(klass == k)
            slot_in_class[members] = np.arange(members.size)
            mine = klass[row_of] == k
            groups.append((members, slot_in_class[row_of[mine]], rank[mine], order[mine],
                           int(counts[members].max())))
    for members, at_row, at_rank, what, width in groups:
        grid = np.full((members.size, width), n, dtype=np.int64)  # n: the zero row
        grid[at_row, at_rank] = what
        # gathered a block of rows at a time: the same sums, without one large fresh array per call
        step = max(1, _GATHER_BYTES // (width * d.Dqk * contrib.itemsize))
        for r0 in range(0, members.size, step):
            g = grid[r0:r0 + step]
            dkv[used[members[r0:r0 + step]]] = np.take(contrib, g.reshape(-1), axis=0).reshape(
                g.shape[0], width, d.Dqk).sum(1)
    return dkv.reshape(d.B, d.Skv, d.Dqk)
