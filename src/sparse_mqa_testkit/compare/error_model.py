"""What a bf16 tensor-core kernel's results may be off by, beside their own output rounding: per row of each
result, computed in float64 torch on the oracle's device, a chunk of query rows at a time.

Rows: a (query, head) of dq, a KV row (b, j) of dkv, a head of d_sink. For each, the squared absolute error of
    delta    Delta = <dO, out> formed from the bf16 ``out`` a backward is given: the exact shift. dDelta =
             <dO, bf16(out) - out> per (query, head) moves dS_t by -P_t dDelta, so dq by -sm_scale dDelta
             sum_t P_t kv_t, dkv row j by -sm_scale sum over (query, head) of dDelta q times P summed over the
             slots naming j (repeated slots move their row together), and d_sink by the sum of p_sink dDelta
    repeat   slots of one (query, head) naming one KV row share a score, hence the same bf16 rounding of P and
             dS: m such slots carry m times one rounding where independent ones would give sqrt(m) times; the
             excess, ``REPEAT_COEF`` sqrt(sum over slots of (m - 1) x^2 |y|^2), x = P, dS and y = dO, q or kv
    operand  the change of dq, dkv (or a forward's out) when P and sm_scale dS are rounded to bf16 before
             their products, as a tensor-core kernel's shared-memory tiles must be, computed on the case's own
             values; at least the expected size of those roundings (``SIGMA`` per slot, independent)
``row_terms(..., terms=...)`` keeps only the named terms (a test leaves one out to show which case needs it).
Beside them, ``unsummed``: the squared norm a row would have if the terms it sums did not cancel: within a
slot, dS_t's float32 dot products dP_t and Delta with every product in absolute value (float32 dot products
are accurate relative to that, not to their sum), and across slots in quadrature, as random signs add. A row
whose exact value is about zero (every slot naming one KV row, so dP_t = Delta) still carries the float32
rounding of dP_t - Delta: the tolerance's floor applies to this norm.
"""

from __future__ import annotations

import torch

from .. import contract
from ..oracle.device import CHUNK_BYTES, _chunks, _slots, _softmax

REPEAT_COEF = 2.0 ** -8  # one bf16 rounding, at most 2^-8 relative, counted once per repeated slot
SIGMA = 2.0 ** -8 / 3 ** 0.5  # a bf16 rounding's standard deviation, relative: uniform within +-2^-8
ALL_TERMS = ("delta", "repeat", "operand")


def group_slots(valid, idx):
    """Group id of each slot [n, L]: the valid slots of one query row naming one KV row share an id; an
    invalid slot has an id of its own. Returns (ids [n * L], group sizes)."""
    n, L = idx.shape
    row = torch.arange(n, device=idx.device)[:, None].expand(n, L)
    span = int(idx.max()) + 1 if idx.numel() else 1
    key = torch.where(valid, row * span + idx, -1 - torch.arange(n * L, device=idx.device).reshape(n, L))
    _, inv, counts = torch.unique(key.reshape(-1), return_inverse=True, return_counts=True)
    return inv, counts


def _bf16_error(x):
    return x.to(torch.bfloat16).to(torch.float64) - x


def row_terms(inputs: dict, out64, *, terms: tuple = ALL_TERMS, chunk_bytes: int = CHUNK_BYTES) -> dict:
    """{result: {term: squared absolute error per row}} (float64 on the inputs' device) for dq, dkv, d_sink
    and out (whose only term is the operands': P rounded before P V).

    inputs: the case's tensors (q, kv, indices, topk_length, attn_sink, grad_out, sm_scale, d_v); out64: the
    float64 oracle's out on them; terms: the terms in force (the others are zero).
    """
    in_force = terms
    q, kv, idx_all, go = inputs["q"], inputs["kv"], inputs["indices"], inputs["grad_out"]
    tl_all, sink, scale, dv = inputs["topk_length"], inputs["attn_sink"], float(inputs["sm_scale"]), inputs["d_v"]
    B, S, H, Dqk = q.shape
    Skv, L = kv.shape[1], idx_all.shape[2]
    dev, f64 = q.device, torch.float64
    zeros = {"dq": torch.zeros((B, S, H), dtype=f64, device=dev), "out": torch.zeros((B, S, H), dtype=f64, device=dev),
             "dkv": torch.zeros((B * Skv,), dtype=f64, device=dev),
             "d_sink": torch.zeros((H,), dtype=f64, device=dev)}
    terms = {name: {t: z.clone() for t in ALL_TERMS + ("unsummed",)} for name, z in zeros.items()}
    operand_dkv = torch.zeros((B * Skv, Dqk), dtype=f64, device=dev)  # summed error vectors of each KV row
    delta_dkv = torch.zeros_like(operand_dkv)
    delta_sink = torch.zeros((H,), dtype=f64, device=dev)
    unsummed_dkv = torch.zeros((B * Skv,), dtype=f64, device=dev)
    expected_dkv = torch.zeros((B * Skv,), dtype=f64, device=dev)
    sink64 = None if sink is None else sink.to(f64)
    dims = contract.Dims(B=B, S=S, H=H, Dqk=Dqk, Dv=dv, Skv=Skv, L=L)
    for b, i, j in _chunks(dims, f64, chunk_bytes):
        tl = None if tl_all is None else tl_all[b, i:j]
        valid, rows, K = _slots(kv[b], idx_all[b, i:j], tl, f64)  # [n, L], [n, L], [n, L, Dqk]
        qc, dO, out = q[b, i:j].to(f64), go[b, i:j].to(f64), out64[b, i:j]
        P, lse = _softmax(qc, K, valid, scale, sink64)
        dP = torch.einsum("nhd,nld->nhl", dO, K[..., :dv])
        delta = (dO * out).sum(-1)
        dS = torch.nan_to_num(P * (dP - delta[..., None]), nan=0.0, posinf=0.0, neginf=0.0)
        e_delta = (dO * (out.to(torch.bfloat16).to(f64) - out)).sum(-1)  # [n, H]: what the bf16 out moves Delta by
        p_sink = None if sink64 is None else contract.sink_probability(lse, sink64)
        q2, dO2, k2 = (qc ** 2).sum(-1), (dO ** 2).sum(-1), (K ** 2).sum(-1)[:, None, :]  # [n, H], [n, H], [n, 1, L]

        def slot_squares(ds):
            """Per slot, the squared size of its term in dq and in dkv [n, H, L] for a dS of ``ds``."""
            return scale ** 2 * ds ** 2 * k2, P ** 2 * dO2[..., None] + scale ** 2 * ds ** 2 * q2[..., None]

        inv, counts = group_slots(valid, rows)
        repeats = torch.where(valid, (counts[inv] - 1).reshape(valid.shape), 0).to(f64)  # [n, L]
        kv_row = b * Skv + rows  # [n, L]
        # delta
        out_full = torch.einsum("nhl,nld->nhd", P, K)  # sum_t P_t kv_t over every column
        terms["dq"]["delta"][b, i:j] = scale ** 2 * e_delta ** 2 * (out_full ** 2).sum(-1)
        shift = scale * torch.einsum("nhl,nhd->nld", P * e_delta[..., None], qc)
        delta_dkv.index_add_(0, kv_row[valid], shift[valid])
        if p_sink is not None:
            delta_sink += (p_sink * e_delta).sum(0)
        # unsummed: dS_t's parts with every product in absolute value (float32 dot products are accurate
        # relative to sum |dO_d v_d|, not to their sum)
        dP_abs = torch.einsum("nhd,nld->nhl", dO.abs(), K[..., :dv].abs())
        delta_abs = (dO.abs() * out.abs()).sum(-1)
        dq_slot, dkv_slot = slot_squares(P * (dP_abs + delta_abs[..., None]))
        terms["dq"]["unsummed"][b, i:j] = dq_slot.sum(-1)
        unsummed_dkv.index_add_(0, kv_row[valid], dkv_slot.sum(1)[valid])
        if p_sink is not None:
            terms["d_sink"]["unsummed"] += ((p_sink * delta_abs) ** 2).sum(0)
        # repeat
        dq_slot, dkv_slot = slot_squares(dS)
        w = repeats[:, None, :]
        terms["dq"]["repeat"][b, i:j] = REPEAT_COEF ** 2 * (w * dq_slot).sum(-1)
        terms["dkv"]["repeat"].index_add_(0, kv_row[valid], REPEAT_COEF ** 2 * (w * dkv_slot).sum(1)[valid])
        # operand
        e_ds, e_p = _bf16_error(scale * dS), _bf16_error(P)
        terms["dq"]["operand"][b, i:j] = (torch.einsum("nhl,nld->nhd", e_ds, K) ** 2).sum(-1)
        terms["out"]["operand"][b, i:j] = (torch.einsum("nhl,nld->nhd", e_p, K[..., :dv]) ** 2).sum(-1)
        contrib = torch.einsum("nhl,nhd->nld", e_ds, qc)
        contrib[..., :dv] += torch.einsum("nhl,nhd->nld", e_p, dO)
        operand_dkv.index_add_(0, kv_row[valid], contrib[valid])
        # the same roundings' expected size, slots independent: a row of a few elements can see far less
        # rounding on the oracle's own values than a kernel's slightly different ones get
        terms["dq"]["operand"][b, i:j] = torch.maximum(terms["dq"]["operand"][b, i:j], SIGMA ** 2 * dq_slot.sum(-1))
        expected = SIGMA ** 2 * (P ** 2 * (K[..., :dv] ** 2).sum(-1)[:, None, :]).sum(-1)
        terms["out"]["operand"][b, i:j] = torch.maximum(terms["out"]["operand"][b, i:j], expected)
        expected_dkv.index_add_(0, kv_row[valid], SIGMA ** 2 * dkv_slot.sum(1)[valid])
    terms["dkv"]["operand"] = torch.maximum((operand_dkv ** 2).sum(-1), expected_dkv)
    terms["dkv"]["delta"] = (delta_dkv ** 2).sum(-1)
    terms["d_sink"]["delta"] = delta_sink ** 2
    terms["dkv"]["unsummed"] = unsummed_dkv
    terms["dkv"] = {t: v.reshape(B, Skv) for t, v in terms["dkv"].items()}
    for per_term in terms.values():
        for t in ALL_TERMS:
            if t not in in_force:
                per_term[t].zero_()
    return terms
