"""Tolerance from an error model: a kernel may be k times as far from the float64 oracle as a bf16 pipeline
has to be, plus a small floor.

Per tensor, over the entries the oracle has finite:
    error    = ||kernel - oracle64|| / ||oracle64||                        (relative L2)
    rounding = ||ref - oracle64|| / ||oracle64||    ref: float32 math rounded to the output's kernel dtype
    delta    = estimate of the error from Delta = <dO, out> formed with the bf16 out a backward is given
               (``delta_allowance``; 0 for out and lse)
    repeats  = estimate of the error from bf16 P and dS when several slots of one row name the same KV row:
               their roundings are then identical and add up instead of averaging (``repeat_allowance``;
               0 without duplicates, and for out, lse and d_sink)
    operands = the change of dq or dkv when P and sm_scale dS are rounded to bf16 before their products,
               computed on the case (``operand_rounding``; 0 for the others). Output rounding is about as large
               while a result's terms do not cancel (k was calibrated there); where they cancel it is the
               larger, and k applies to it instead
    allowed  = k * max(hypot(rounding, delta, repeats), operands) + floor
A zero oracle tensor (every row empty, every sink +inf, ...) has no scale: then all are absolute L2 norms.
A bf16 result within one ulp of the exact value everywhere passes too (the best a bf16 output can do, even
where the exact value is representable and ``rounding`` is 0). NaN / +inf / -inf positions must match the
oracle exactly; shapes, dtypes and devices must be the contract's.

Calibration (issue 3, 2026-11-30, S256 Skv512 H16 L128 576/512): bf16 rounding of the exact gradients costs
1.66e-3 relative L2; cuDNN's and TileLang's backward kernels on an H200 land at 2.26e-3 to 2.39e-3, about
1.4x, hence k = 2.5. The CPU emulation of such a kernel in tests/broken_backends.py (``EmulatedKernel``: P and
dS rounded to bf16 before their matmuls, Delta from the bf16 out, fp32 accumulation) lands at 2.32e-3 (dq)
and 2.35e-3 (dkv) on that shape, and there ``delta`` adds 2% to the bound (dq: allowed 4.24e-3 against
2.5 x 1.66e-3 = 4.15e-3). The operand term stays below the others on 576/512 cases (a survey of 60 drawn
cases: never the larger); on small dims it was the larger in 44 of 1200 cases, by 1.13x (median) to 1.8x.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from .. import contract
from .inputs import BACKWARD_OUTPUTS, FORWARD_OUTPUTS, as_f64, backend_inputs, call, has_forward, oracle_results
from .result import exception_summary, fmt_index, fmt_value, result

K_DEFAULT = 2.5

# Relative-L2 floors per tensor. A kernel rounds P and dS to bf16 before its matmuls: an error of the same
# order as the output rounding the model measures (the real kernels: 1.4x), which k covers on any
# tensor of more than a few elements. On a tensor of a handful of elements the output rounding can be nearly
# exact by luck while the intermediate rounding is not, so bf16 outputs also get SMALL_SAMPLE / sqrt(n): one
# 2^-7 relative unit spread over n elements (3.9e-3 at n = 4, 2.4e-4 at n = 1024, ~0 at production sizes).
# Survey with the emulation in tests/broken_backends.py (EmulatedKernel), 2026-11-30, whole model: 150 drawn
# 576/512 cases, worst ratio 0.87 (dkv), lse 0.04; 500 drawn small-dim cases, worst 0.90, except dkv with
# Dqk = 1 and Skv = 1 (one value summing every slot's dS with cancellation, no kernel has Dqk = 1): 3.6, and
# 1.03 (160 cases, one above 1) once ``repeat_allowance`` counted the coherent rounding of repeated rows.
FLOORS = {
    "dq": 1e-5,
    "dkv": 1e-5,
    "out": 1e-5,
    "d_sink": 1e-5,  # fp32 output: float32 math error ~1e-7; what a kernel adds comes from Delta (see below)
    "lse": 1e-5,     # fp32 exp/log (or exp2/log2 with approximate intrinsics): a few float32 ulps, 10x margin
}
SMALL_SAMPLE = 2.0 ** -7  # bf16 outputs only; divided by sqrt(number of finite elements)


def structural_problem(name: str, value, expected_shape, *, device: str | None = None) -> str | None:
    """Shape / dtype / device of one result against the contract, as a problem line (None when fine)."""
    want_dtype = contract.KERNEL_DTYPES[name]
    if value is None:
        return f"{name}: missing (got None), expected a {want_dtype} tensor of shape {tuple(expected_shape)}"
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        return f"{name}: expected a tensor, got {type(value).__name__}"
    shape = tuple(int(d) for d in value.shape)
    if shape != tuple(expected_shape):
        return f"{name}: shape {shape} is not the contract's {tuple(expected_shape)}"
    got = contract.dtype_name(value)
    if got != want_dtype:
        return f"{name}: dtype {got} is not the contract's {want_dtype}"
    if device is not None and hasattr(value, "device"):
        if str(value.device).split(":")[0] != str(device).split(":")[0]:
            return f"{name}: on device {value.device}, expected {device} like the inputs"
    return None


ULP_PASS = 1.5  # differences between bf16 values of one binade are whole ulps: < 1.5 means at most one


def bf16_ulp(x):
    """Spacing of bfloat16 values at |x| (float64 torch), at least the smallest subnormal 2^-133."""
    _, e = torch.frexp(x)
    ulp = torch.ldexp(torch.ones_like(x), (e - 8).to(torch.int32))
    return torch.where(x == 0, torch.full_like(x, 2.0 ** -133), ulp).clamp_min(2.0 ** -133)


def compare_tensor(name: str, kernel, oracle64, ref64, *, k: float = K_DEFAULT, floor: float | None = None,
                   extra: dict | None = None, operand: float = 0.0):
    """Compare one result with the float64 oracle under the error model.

    extra: absolute L2 errors of the bf16 model that output rounding does not show, by source
    ({"Delta": ``delta_allowance``, "repeated rows": ``repeat_allowance``}); they join the rounding error in
    quadrature before k applies. operand: absolute L2 error of rounding the operands of the result's products
    (``operand_rounding``); k applies to it instead where it is the larger.
    Returns (entry, problem): entry has error, allowed, ratio, reference_error, floor, k, mode, mismatches,
    numel, worst_index, worst_kernel, worst_oracle; problem is a message block or None when it passes.
    """
    a, o, r = as_f64(kernel), as_f64(oracle64), as_f64(ref64)
    extra = extra or {}
    if floor is None:
        n = max(int(torch.isfinite(o).sum()), 1)
        small = SMALL_SAMPLE / math.sqrt(n) if contract.KERNEL_DTYPES.get(name) == "bfloat16" else 0.0
        floor = FLOORS.get(name, 1e-5) + small
    floor = float(floor)
    entry = {"error": math.inf, "allowed": floor, "ratio": math.inf, "reference_error": 0.0, "floor": floor,
             "k": k, "numel": int(o.numel())}
    if a.shape != o.shape:
        return entry, f"{name}: shape {tuple(a.shape)} is not the oracle's {tuple(o.shape)}"
    # non-finite positions must match exactly, class by class
    for label, fn in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        ma, mo = fn(a), fn(o)
        bad = ma != mo
        if bool(bad.any()):
            idx = tuple(int(i) for i in torch.nonzero(bad)[0])
            entry.update(mismatches=int(bad.sum()), worst_index=idx, worst_kernel=float(a[idx]),
                         worst_oracle=float(o[idx]), mode="nonfinite")
            return entry, (f"{name}: {label} positions differ from the oracle at {int(bad.sum())} / {o.numel()} "
                           f"elements\n  first at index {fmt_index(idx)}: kernel {fmt_value(a[idx])}, "
                           f"oracle {fmt_value(o[idx])}")
    fin = torch.isfinite(o)
    d = torch.where(fin, a - o, torch.zeros((), dtype=torch.float64))
    oz = torch.where(fin, o, torch.zeros((), dtype=torch.float64))
    rz = torch.where(fin, r - o, torch.zeros((), dtype=torch.float64))
    n_fin = int(fin.sum())
    norm_o = float(torch.linalg.vector_norm(oz))
    if norm_o > 0:
        mode = "relative"
        err = float(torch.linalg.vector_norm(d)) / norm_o
        ref_err = float(torch.linalg.vector_norm(rz)) / norm_o
        extras = {src: v / norm_o for src, v in extra.items()}
        operand /= norm_o
    else:  # a zero reference has no scale: absolute L2 against the floor (on the error scale when known)
        mode = "absolute"
        err = float(torch.linalg.vector_norm(d))
        ref_err = float(torch.linalg.vector_norm(rz))
        extras = dict(extra)
    # the bf16 model's own error: output rounding and, independent of it, Delta from the bf16 out and
    # coherent operand rounding on repeated rows; or the operands' rounding where the result cancels
    model_err = max(math.hypot(ref_err, *extras.values()), operand)
    entry["operand_error"] = operand
    allowed = k * model_err + floor
    entry["delta_error"] = extras.get("Delta", 0.0)
    entry["repeat_error"] = extras.get("repeated rows", 0.0)
    # elementwise bound from the same model: allowed relative error on each element's own scale or the rms
    rms = norm_o / math.sqrt(max(n_fin, 1))
    bound = allowed * (oz.abs() + rms) if mode == "relative" else torch.full_like(oz, allowed)
    excess = d.abs() / bound.clamp_min(1e-300)
    mism = int((d.abs() > bound).sum())
    if o.numel():
        flat = int(torch.argmax(excess.reshape(-1)))
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(o.shape)))
    else:
        idx = ()
    ratio = err / allowed if allowed > 0 else (0.0 if err == 0 else math.inf)
    amax = tuple(int(i) for i in torch.unravel_index(torch.argmax(d.abs().reshape(-1)), tuple(o.shape))) \
        if o.numel() else ()
    ulps = None
    if contract.KERNEL_DTYPES.get(name) == "bfloat16" and n_fin:
        # A bf16 result within one ulp of the exact value everywhere is as good as a bf16 output gets, even
        # where the exact value is representable and the rounded oracle has no error at all (e.g. Skv = 1).
        ulps = float((d.abs() / bf16_ulp(torch.maximum(a.abs(), o.abs()))).masked_fill(~fin, 0).max())
        entry["max_ulps"] = ulps
        ratio = min(ratio, ulps / ULP_PASS)
    entry.update(error=err, allowed=allowed, ratio=ratio, reference_error=ref_err, mode=mode,
                 mismatches=mism, worst_index=idx,
                 worst_kernel=float(a[idx]) if o.numel() else math.nan,
                 worst_oracle=float(o[idx]) if o.numel() else math.nan)
    if ratio < 1 or err <= allowed:
        return entry, None
    what = "relative L2 error" if mode == "relative" else "absolute L2 error (oracle is all zero)"
    pct = 100.0 * mism / max(o.numel(), 1)
    parts = "".join(f", {src} {v:.3e}" for src, v in extras.items() if v)
    if operand:
        parts += f"; operands rounded {operand:.3e}" + (", the larger" if model_err == operand else "")
    msg = (f"{name}: {what} {err:.3e} > allowed {allowed:.3e} "
           f"(= {k:g} x bf16 model error {model_err:.3e} [output rounding {ref_err:.3e}{parts}] "
           f"+ floor {floor:.2e}); ratio {ratio:.3g}\n"
           f"  Mismatched elements: {mism} / {o.numel()} ({pct:.1f}%) "
           f"[bound per element: allowed x (|oracle| + rms(oracle))]\n"
           f"  Worst element at index {fmt_index(idx)}: kernel {fmt_value(a[idx])}, oracle {fmt_value(o[idx])} "
           f"(abs diff {fmt_value(abs(float(a[idx]) - float(o[idx])))}, "
           f"{fmt_value(float(excess.reshape(-1)[flat]))}x its bound)\n"
           f"  Greatest absolute difference: {fmt_value(d.abs().max())} at index {fmt_index(amax)}"
           + ("" if ulps is None else f"\n  Largest difference in bf16 ulps: {ulps:.3g} (a result within 1 ulp "
                                      "everywhere would pass)"))
    return entry, msg


def rounded_reference(name: str, f32_value):
    """The bf16-output oracle: float32 math rounded to the result's kernel dtype, as float64 torch."""
    t = as_f64(f32_value).to(torch.float32)
    return t.to(getattr(torch, contract.KERNEL_DTYPES[name])).to(torch.float64)


DELTA_COEF = 2.0 ** -9  # per element of out, bf16 rounding is <= 2^-9 relative (rms ~1.7e-3, as measured)


@lru_cache(maxsize=2)  # one case is checked at a time, and its float64 slot tensors can be large
def _case_terms(case) -> dict:
    """What the allowances share, computed once per case (float64 torch; read-only by convention).

    x: the case's inputs; f64: the oracle's float64 results; valid [B, S, L]; idx [B, S, L] (0 on invalid
    slots); K [B, S, L, Dqk] the slots' kv rows (zero on invalid slots, so no row a slot does not name reaches
    a sum); P [B, S, H, L] from the inputs and the oracle's lse (0 on invalid slots and empty rows); dS
    [B, S, H, L] = P (dP - Delta), without sm_scale; q, dO.
    """
    x = case.inputs()
    f64 = oracle_results(case)["f64"]
    valid = torch.from_numpy(contract.valid_mask(x["indices"], case.Skv, x["topk_length"]))
    idx = torch.where(valid, torch.from_numpy(x["indices"].astype(np.int64)), 0)
    K = torch.where(valid[..., None], as_f64(x["kv"])[torch.arange(case.B)[:, None, None], idx], 0.0)
    q = as_f64(x["q"])
    lse = as_f64(f64["lse"])
    s = torch.einsum("bshd,bsld->bshl", q, K) * case.scale
    denom = lse if x["attn_sink"] is None else torch.logaddexp(lse, as_f64(x["attn_sink"]).expand_as(lse))
    P = torch.where(valid[:, :, None, :] & torch.isfinite(denom)[..., None], torch.exp(s - denom[..., None]), 0.0)
    dO = as_f64(x["grad_out"])
    dP = torch.einsum("bshd,bsld->bshl", dO, K[..., : case.Dv])
    delta = (dO * as_f64(f64["out"])).sum(-1)
    dS = torch.nan_to_num(P * (dP - delta[..., None]), nan=0.0, posinf=0.0, neginf=0.0)
    return dict(x=x, f64=f64, valid=valid, idx=idx, K=K, P=P, dS=dS, q=q, dO=dO, lse=lse)


def delta_allowance(name: str, case, *, coef: float = DELTA_COEF) -> float:
    """Absolute L2 error a kernel may add by forming Delta = <dO, out> from the bf16 ``out`` it is given.

    The float64 oracle recomputes out exactly; a kernel reads the rounded one, so Delta is off by up to
    DELTA_COEF ||dO * out|| per row (e_Delta). That shifts dS_t by P_t dDelta, hence dq by sm_scale dDelta
    sum_t P_t kv_t, dkv row j by sm_scale dDelta q P summed over the slots naming j (one dDelta for all slots
    of a (query, head): repeated slots shift their row together, not independently) and d_sink by
    sum p_sink dDelta (rows of out independent, so their shifts add in L2). Small at production sizes (dq:
    0.19x the rounding error at the calibration shape; d_sink, a sum of p_sink Delta, is the exception: its
    float32 rounding is ~1e-7, so this term is its whole bound), it dominates wherever dS cancels (a peaked
    softmax, one valid slot, every slot on one row), which a purely relative tolerance misreads as a bug:
    without it the emulation failed dkv on 576/512 cases at up to 3x the bound.
    """
    if name not in ("dq", "dkv", "d_sink"):
        return 0.0
    t = _case_terms(case)
    f64, x, lse = t["f64"], t["x"], t["lse"]
    e_delta = torch.linalg.vector_norm(t["dO"] * as_f64(f64["out"]), dim=-1)  # [B, S, H]
    if name == "dq":
        m = case.scale * e_delta[..., None] * as_f64(f64["out_full"]).abs()
        return coef * float(torch.linalg.vector_norm(m))
    if name == "dkv":
        p2 = _grouped_square_sum(t["valid"], t["idx"], t["P"])  # [B, S, H]: sum over KV rows of (sum P)^2
        q2 = (t["q"] ** 2).sum(-1)
        return coef * case.scale * float(torch.sqrt((p2 * q2 * e_delta ** 2).sum()))
    if x["attn_sink"] is None:
        return 0.0
    p_sink = contract.sink_probability(lse, as_f64(x["attn_sink"]))
    return coef * float(torch.linalg.vector_norm(torch.linalg.vector_norm(p_sink * e_delta, dim=(0, 1))))


REPEAT_COEF = 2.0 ** -8  # one bf16 rounding, at most 2^-8 relative, counted once per repeated slot


def _row_groups(valid, idx):
    """Group id of each slot, [B * S * L]: the valid slots of one query row naming one KV row share an id;
    an invalid slot has an id of its own. Also the group sizes."""
    B, S, L = idx.shape
    row = torch.arange(B * S).reshape(B, S, 1).expand(B, S, L)
    span = (int(idx.max()) + 1) if idx.numel() else 1
    key = torch.where(valid, row * span + idx, -1 - torch.arange(B * S * L).reshape(B, S, L))
    _, inv, counts = torch.unique(key.reshape(-1), return_inverse=True, return_counts=True)
    return inv, counts


def _repeats(valid, idx):
    """For each slot, how many valid slots of its query row name the same KV row (0 on invalid slots)."""
    inv, counts = _row_groups(valid, idx)
    return torch.where(valid, counts[inv].reshape(idx.shape), 0)


def _grouped_square_sum(valid, idx, P):
    """[B, S, H]: sum over the KV rows a query row names of (sum of P over the slots naming that row)^2;
    sum_t P_t^2 when no row repeats."""
    B, S, H, L = P.shape
    inv, counts = _row_groups(valid, idx)
    sums = torch.zeros(len(counts), H, dtype=P.dtype).index_add_(0, inv, P.permute(0, 1, 3, 2).reshape(-1, H))
    owner = torch.zeros(len(counts), dtype=torch.long)  # the query row (b * S + s) of each group
    owner[inv] = torch.arange(B * S).repeat_interleave(L)
    return torch.zeros(B * S, H, dtype=P.dtype).index_add_(0, owner, sums ** 2).reshape(B, S, H)


def repeat_allowance(name: str, case, *, coef: float = REPEAT_COEF) -> float:
    """Absolute L2 error a kernel may add by rounding P and dS to bf16 when slots of one row repeat a KV row.

    A tensor-core backward feeds P and dS to its products in bf16. Slots of one (query, head) naming the same
    KV row have the same score, so the same P and dS and the same rounding error: m such slots put m times one
    rounding into that row's dkv (P^T dO and dS^T q) and into dq (dS kv), where independent roundings would
    give sqrt(m) times. k covers the independent part (calibrated on cases without duplicates); this is the
    excess, coef * sqrt(sum over slots of (m - 1) x^2 |y|^2) for x = P, dS and y = dO, q (dkv) or kv (dq),
    with coef one rounding's worst case. Zero when no row repeats; Skv = 1 (every slot on one row) and
    L > Skv are where it matters.
    """
    if name not in ("dq", "dkv"):
        return 0.0
    t = _case_terms(case)
    extra = (_repeats(t["valid"], t["idx"]) - 1).clamp_min(0).to(torch.float64)  # [B, S, L]
    if not bool((extra > 0).any()):
        return 0.0
    P, dS, K, do = t["P"], t["dS"], t["K"], t["dO"]
    w = extra[:, :, None, :]  # [B, S, 1, L]
    if name == "dkv":
        p_term = (w * P ** 2).sum(-1) * (do ** 2).sum(-1)
        s_term = case.scale ** 2 * (w * dS ** 2).sum(-1) * (t["q"] ** 2).sum(-1)
        return coef * float(torch.sqrt((p_term + s_term).sum()))
    kv2 = (K ** 2).sum(-1)[:, :, None, :]  # [B, S, 1, L]
    return coef * case.scale * float(torch.sqrt((w * dS ** 2 * kv2).sum()))


def operand_rounding(name: str, case) -> float:
    """Absolute L2 change of dq or dkv when P and sm_scale dS are rounded to bf16 before their products, as a
    tensor-core kernel's shared-memory tiles must be.

    While a result's terms add without cancelling, its own output rounding is about as large and k (calibrated
    on such cases) covers both. Where they cancel (nearly uniform P against gradients of both signs, as at a
    small Dqk or sm_scale), the operands' rounding is the larger error by far: ``compare_tensor`` applies k
    to whichever of the two is larger.
    """
    if name not in ("dq", "dkv"):
        return 0.0
    t = _case_terms(case)

    def rounding(x):
        return x.to(torch.bfloat16).to(torch.float64) - x

    e_ds = rounding(case.scale * t["dS"])
    if name == "dq":
        return float(torch.linalg.vector_norm(torch.einsum("bshl,bsld->bshd", e_ds, t["K"])))
    contrib = torch.einsum("bshl,bshd->bsld", e_ds, t["q"])
    contrib[..., : case.Dv] += torch.einsum("bshl,bshd->bsld", rounding(t["P"]), t["dO"])
    rows = (t["idx"] + case.Skv * torch.arange(case.B)[:, None, None])[t["valid"]]
    err = torch.zeros(case.B * case.Skv, case.Dqk, dtype=torch.float64).index_add_(0, rows, contrib[t["valid"]])
    return float(torch.linalg.vector_norm(err))


def compare_outputs(names, results: dict, case, *, k=K_DEFAULT, floor=None, device=None, sink_given=None):
    """Structure + error model for a set of named results. Returns (per_tensor, problems, worst_ratio)."""
    dims = case.dims
    ores = oracle_results(case)
    per_tensor, problems, worst = {}, [], 0.0
    floors = floor if isinstance(floor, dict) else {n: floor for n in names}
    for name in names:
        val = results.get(name)
        if name == "d_sink" and sink_given is not None:
            if not sink_given:
                if val is not None:
                    problems.append("d_sink: must be None when attn_sink is None, got a tensor")
                    per_tensor[name] = {"error": math.inf, "allowed": 0.0, "ratio": math.inf}
                    worst = math.inf
                continue
        prob = structural_problem(name, val, dims.shape(name), device=device)
        if prob:
            problems.append(prob)
            per_tensor[name] = {"error": math.inf, "allowed": 0.0, "ratio": math.inf, "problem": prob}
            worst = math.inf
            continue
        extra = {"Delta": delta_allowance(name, case), "repeated rows": repeat_allowance(name, case)}
        entry, prob = compare_tensor(name, val, ores["f64"][name], rounded_reference(name, ores["f32"][name]),
                                     k=k, floor=floors.get(name), extra=extra,
                                     operand=operand_rounding(name, case))
        per_tensor[name] = entry
        worst = max(worst, entry["ratio"])
        if prob:
            problems.append(prob)
    return per_tensor, problems, worst


def _unpack(out, n: int, what: str):
    if not isinstance(out, (tuple, list)) or len(out) != n:
        raise TypeError(f"{what} must return a tuple of {n} tensors, got {type(out).__name__}"
                        + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    return out


def check_backward_tolerance(backend, case, *, k: float = K_DEFAULT, floor=None):
    """dq, dkv, d_sink of ``backend.backward`` against the float64 oracle under the error model.

    floor: None (``FLOORS``), a number for every tensor, or {tensor: floor}.
    """
    check = "tolerance"
    try:
        t = backend_inputs(backend, case)
        dq, dkv, d_sink = _unpack(call(backend, "backward", t), 3, "backward")
    except Exception as exc:  # a crash is a failure, reported with where it came from
        return result(check, backend, case, [f"backward raised {exception_summary(exc)}"], ratio=math.inf,
                      per_tensor={})
    per_tensor, problems, worst = compare_outputs(
        BACKWARD_OUTPUTS, {"dq": dq, "dkv": dkv, "d_sink": d_sink}, case, k=k, floor=floor,
        device=getattr(backend, "device", None), sink_given=t["attn_sink"] is not None)
    return result(check, backend, case, problems, ratio=worst, per_tensor=per_tensor)


def check_forward_tolerance(backend, case, *, k: float = K_DEFAULT, floor=None):
    """out and lse of ``backend.forward`` against the float64 oracle; passes with a note if it has no forward."""
    check = "forward_tolerance"
    if not has_forward(backend):
        return result(check, backend, case, [], ratio=0.0, per_tensor={},
                      notes={"skipped": "backend has no forward"})
    try:
        t = backend_inputs(backend, case)
        out, lse = _unpack(call(backend, "forward", t), 2, "forward")
    except Exception as exc:
        return result(check, backend, case, [f"forward raised {exception_summary(exc)}"], ratio=math.inf,
                      per_tensor={})
    per_tensor, problems, worst = compare_outputs(FORWARD_OUTPUTS, {"out": out, "lse": lse}, case, k=k,
                                                  floor=floor, device=getattr(backend, "device", None))
    return result(check, backend, case, problems, ratio=worst, per_tensor=per_tensor)
