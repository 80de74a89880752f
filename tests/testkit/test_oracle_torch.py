"""An independent cross-check: float64 torch autograd of a dense masked forward written plainly here.

The dense forward scores every (row, head, kv position) and weights position j by the COUNT of the row's valid
slots that point at it (duplicates count once per slot), with the sink as one extra logit per head. It shares
nothing with the oracle but the contract: no sorting, no gather, no hand-written backward.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from support import every_feature, run, small_cases

torch = pytest.importorskip("torch", reason="the cross-check needs torch (CPU is enough)")


def dense_reference(x: dict):
    """out, lse, dq, dkv, d_sink by torch autograd of the dense masked forward (float64)."""
    f64 = dict(dtype=torch.float64)
    q = torch.tensor(x["q"].astype(np.float64), requires_grad=True)
    kv = torch.tensor(x["kv"].astype(np.float64), requires_grad=True)
    idx = torch.tensor(x["indices"].astype(np.int64))
    B, S, H, _ = q.shape
    Skv, L, dv = kv.shape[1], idx.shape[2], x["d_v"]

    valid = (idx >= 0) & (idx < Skv)
    if x["topk_length"] is not None:
        valid &= torch.arange(L) < torch.tensor(x["topk_length"].astype(np.int64))[..., None]
    count = torch.zeros(B, S, Skv, **f64)  # slots of row (b, i) that point at kv row j
    count.scatter_add_(2, torch.where(valid, idx, 0), valid.to(torch.float64))
    present = count > 0  # [B, S, Skv]
    empty = ~present.any(-1)  # [B, S]

    scores = torch.einsum("bshd,bjd->bshj", q, kv) * x["sm_scale"]
    logits = torch.where(present[:, :, None, :], scores + torch.log(count)[:, :, None, :], -torch.inf)

    sink_np = x["attn_sink"]
    sink = None if sink_np is None else torch.tensor(sink_np.astype(np.float64), requires_grad=True)
    if sink is None:
        sink_logit = torch.full((H,), -torch.inf, **f64)
        live = torch.ones(H, dtype=torch.bool)
    else:
        # a +inf sink takes all the mass: those heads attend to nothing (out 0, no gradient at all)
        live = ~torch.isposinf(sink)
        sink_logit = torch.where(live, sink, 0.0)
    # an empty row gets a dummy logit 0 so the normaliser stays finite; its real weights are exp(-inf) = 0
    dummy = torch.where(empty, 0.0, -torch.inf)[:, :, None, None].expand(B, S, H, 1)
    z = torch.logsumexp(torch.cat([logits, sink_logit.expand(B, S, H)[..., None], dummy], -1), -1)
    P = torch.exp(logits - z[..., None]) * live[:, None]  # [B, S, H, Skv]
    out = torch.einsum("bshj,bjd->bshd", P, kv[..., :dv])
    lse = torch.where(empty[..., None], torch.inf, torch.logsumexp(logits, -1))

    out.backward(torch.tensor(x["grad_out"].astype(np.float64)))
    d_sink = None if sink is None else sink.grad.numpy()
    return {"out": out.detach().numpy(), "lse": lse.detach().numpy(), "dq": q.grad.numpy(),
            "dkv": kv.grad.numpy(), "d_sink": d_sink}


@settings(max_examples=250, deadline=None)
@given(case=small_cases())
@every_feature
def test_oracle_matches_dense_torch_autograd(case):
    x = case.inputs()
    got, want = run(x), dense_reference(x)
    for k in ("out", "lse", "dq", "dkv", "d_sink"):
        if want[k] is None:
            assert got[k] is None, f"{k}: expected None (no sink), got an array"
            continue
        assert not np.isnan(got[k]).any(), f"{k} has NaN"
        # +inf lse exactly on the empty rows; everything else finite and equal to float64 rounding
        np.testing.assert_array_equal(np.isposinf(got[k]), np.isposinf(want[k]), err_msg=f"{k}: +inf positions")
        # gradients are linear in grad_out: their absolute floor scales with it (the spread magnitude reaches 2^20)
        go = float(np.abs(x["grad_out"].astype(np.float64)).max(initial=0)) if k in ("dq", "dkv", "d_sink") else 1.0
        np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-11 * max(go, 1.0), err_msg=k)
