"""What the repo's tests share: CPU backends for testing the checks themselves (one plausible kernel emulation
that must pass, deliberately broken backends with one bug each that a named check must catch, downstream
module sources for subprocess runs); for the execution checks a correct backend that computes on the device
(``DeviceTorch``) and one planted bug per check; ``LiveBytes``, what torch code allocates; the oracle proof tests'
helpers, and call and bitwise helpers.

The emulation (``EmulatedKernel``) does in torch what a bf16 tensor-core kernel does: fp32 scores from bf16
inputs, a base-2 LSE with the sink folded in, P and dS rounded to bf16 before their matmuls, Delta from the
bf16 ``out``, dkv accumulated in fp32 in a scheduling-dependent order. It is the evidence that the tolerance
model does not reject a legitimate kernel; the broken backends are the evidence that it rejects real bugs.
"""


from __future__ import annotations

import math
import socket
import weakref

import numpy as np
import torch
from hypothesis import example
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sparse_mqa_testkit import contract, oracle
from sparse_mqa_testkit.backends.base import BackendBase
from sparse_mqa_testkit.backends.reference import ReferenceBackend
from sparse_mqa_testkit.backends.validate import check_backward_args, check_forward_args
from sparse_mqa_testkit.calls import Call
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.cases.strategies import cases
from sparse_mqa_testkit.compare import Expected

LOG2E = contract.LOG2E

# Source of a downstream module for the tests that run the CLI or the plugin in a subprocess: dq doubled once
# the cache has 9 rows or more (a second KV tile mishandled), so the simplest case (Skv = 1) and the suite's
# explicit boundary cases (Skv <= 8) pass, and a failure needs searching (or the example database).
def _doubled_source(name: str, tensor: str) -> str:
    """A downstream module whose backend returns ``tensor`` (dq or dkv) doubled once the cache has 9 rows."""
    ret = {"dq": "(dq * 2 if kv.shape[1] >= 9 else dq), dkv, ds",
           "dkv": "dq, (dkv * 2 if kv.shape[1] >= 9 else dkv), ds"}
    return f'''
from sparse_mqa_testkit.backends.reference import ReferenceBackend

class Broken(ReferenceBackend):
    name = "{name}"
    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        dq, dkv, ds = super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                       topk_length=topk_length)
        return {ret[tensor]}
'''


DQ_DOUBLED_SOURCE = _doubled_source("broken", "dq")

# Source of a downstream module with a kernel that compiles per shape, as cuDNN's DSA backward does: the reference
# backend that "compiles" (sleeps) once per (H, L, topk given) and logs every key it is called with to
# $COMPILE_LOG; and the same with a bug planted in one boundary class (dq doubled when L is one past a tile).
COMPILING_SOURCE = '''
import os, time
from sparse_mqa_testkit.backends.reference import ReferenceBackend

class Compiling(ReferenceBackend):
    name = "compiling"
    tiles = {"head_group": 16, "topk_block": 16}
    compile_keys = ("H", "L", "topk_given")

    def __init__(self):
        super().__init__()
        self.compiled = set()

    def _compile(self, q, indices, topk_length):
        key = (int(q.shape[2]), int(indices.shape[2]), topk_length is not None)
        with open(os.environ["COMPILE_LOG"], "a") as log:
            log.write(f"{key}\\n")
        if key not in self.compiled:
            time.sleep(0.02)
            self.compiled.add(key)

    def warmup(self, cases):
        for c in cases:  # one call per pooled key, before the checks
            self._compile(type("Q", (), {"shape": (c.B, c.S, c.H)}), type("I", (), {"shape": (c.B, c.S, c.L)}),
                          None if c.topk == "none" else True)

    def forward(self, q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None):
        res = super().forward(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length)
        self._compile(q, indices, topk_length)  # after validation: a refused call compiles nothing
        return res

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        res = super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length)
        self._compile(q, indices, topk_length)
        return res

class PlantedAboveTile(Compiling):
    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        dq, dkv, ds = super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                       topk_length=topk_length)
        return (dq * 2 if indices.shape[2] % 16 == 1 else dq), dkv, ds
'''


def _bf16(x):
    return x.to(torch.bfloat16).to(torch.float32)


def _gather(q, kv, indices, topk_length):
    """valid [B,S,L], K [B,S,L,Dqk] (fp32, zeros on invalid slots via where), safe indices."""
    B, Skv = kv.shape[0], kv.shape[1]
    idx = indices.long()
    valid = (idx >= 0) & (idx < Skv)
    if topk_length is not None:
        valid &= torch.arange(idx.shape[-1]) < topk_length.long()[..., None]
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    K = kv.float()[torch.arange(B)[:, None, None], safe]
    K = torch.where(valid[..., None], K, torch.zeros((), dtype=torch.float32))
    return valid, K, safe


def _base2_lse(s2, valid, sink):
    """Kernel LSE: log2(sum exp2(s2) + exp2(sink * log2e)), +inf for empty rows and +inf sinks."""
    s2 = torch.where(valid[:, :, None, :], s2, torch.tensor(-math.inf))
    any_valid = valid.any(-1)[:, :, None]
    m = torch.where(any_valid, s2.amax(-1), torch.zeros(()))
    own = torch.where(any_valid, m + torch.log2(torch.exp2(s2 - m[..., None]).sum(-1)), torch.tensor(math.inf))
    if sink is None:
        return own, own
    sk = (sink.float() * LOG2E)[None, None, :].expand_as(own)
    hi = torch.maximum(own, sk)
    folded = torch.where(torch.isinf(hi), hi, hi + torch.log2(torch.exp2(own - hi) + torch.exp2(sk - hi)))
    return own, folded


class EmulatedKernel(BackendBase):
    """A plausible bf16 kernel (not a bug): must pass tolerance; its dkv order drifts unless ``deterministic``.

    accumulate: "fp32" (atomics in fp32 in a random order, then one rounding) or "bf16" (atomics straight into
    a bf16 buffer in a random order: the order changes the bits).
    """

    name = "emulated-kernel"
    device = "cpu"
    deterministic = False
    tiles = {"head_group": 16}

    def __init__(self, accumulate: str = "fp32", seed: int | None = None, lse_is_base2: bool = False):
        self.accumulate = accumulate
        self.gen = torch.Generator().manual_seed(seed if seed is not None else 1234)
        self.lse_is_base2 = lse_is_base2  # the bug of reading a natural LSE as the kernel's base-2 one

    def forward(self, q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None):
        check_forward_args(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length)
        valid, K, _ = _gather(q, kv, indices, topk_length)
        s2 = torch.matmul(q.float(), K.transpose(-1, -2)) * (sm_scale * LOG2E)
        own, folded = _base2_lse(s2, valid, attn_sink)
        P = torch.where(valid[:, :, None, :], torch.exp2(s2 - folded[..., None]), torch.zeros(()))
        out = torch.matmul(_bf16(P), K[..., :d_v])
        return out.to(torch.bfloat16), (own * contract.LN2).to(torch.float32)

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        dims = check_backward_args(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                   topk_length=topk_length)
        valid, K, safe = _gather(q, kv, indices, topk_length)
        qf, do, V = q.float(), grad_out.float(), K[..., : dims.Dv]
        s2 = torch.matmul(qf, K.transpose(-1, -2)) * (sm_scale * LOG2E)
        lse = torch.where(torch.isneginf(lse), math.inf, lse)  # the contract: -inf is an empty row's lse too
        lse2 = lse.float() if self.lse_is_base2 else lse.float() * LOG2E
        if attn_sink is not None:  # fold the sink in, base 2, as the forward kept it
            sk = (attn_sink.float() * LOG2E)[None, None, :].expand_as(lse2)
            hi = torch.maximum(lse2, sk)
            lse2 = torch.where(torch.isinf(hi), hi, hi + torch.log2(torch.exp2(lse2 - hi) + torch.exp2(sk - hi)))
        P = torch.where(valid[:, :, None, :], torch.exp2(s2 - lse2[..., None]), torch.zeros(()))
        delta = (do * out.float()).sum(-1)  # from the bf16 out, as a kernel reads it
        dp = torch.matmul(do, V.transpose(-1, -2))
        dS = P * (dp - delta[..., None])
        dSb, Pb = _bf16(dS), _bf16(P)
        dq = torch.matmul(dSb, K) * sm_scale
        contrib = torch.matmul(dSb.transpose(-1, -2), qf) * sm_scale  # [B,S,L,Dqk], summed over heads
        contrib[..., : dims.Dv] += torch.matmul(Pb.transpose(-1, -2), do)
        dkv = self._scatter(contrib, safe, valid, dims)
        d_sink = None
        if attn_sink is not None:
            sink = attn_sink.float()[None, None, :]
            p_sink = torch.exp2(sink * LOG2E - lse2)
            p_sink = torch.where(torch.isposinf(sink), torch.ones(()), p_sink)
            p_sink = torch.where(torch.isposinf(lse2) & ~torch.isposinf(sink), torch.zeros(()), p_sink)
            d_sink = -(p_sink * delta).sum((0, 1))
        return dq.to(torch.bfloat16), dkv, d_sink

    def _scatter(self, contrib, safe, valid, dims):
        rows = (safe + (torch.arange(dims.B) * dims.Skv)[:, None, None]).reshape(-1)[valid.reshape(-1)]
        vals = contrib.reshape(-1, dims.Dqk)[valid.reshape(-1)]
        perm = torch.randperm(rows.numel(), generator=self.gen)  # the order atomics happen to land in
        rows, vals = rows[perm], vals[perm]
        if self.accumulate == "fp32":
            acc = torch.zeros(dims.B * dims.Skv, dims.Dqk, dtype=torch.float32)
            for r, v in zip(rows.tolist(), vals):  # one add at a time: the order sets the rounding
                acc[r] += v
            return acc.reshape(dims.B, dims.Skv, dims.Dqk).to(torch.bfloat16)
        acc = torch.zeros(dims.B * dims.Skv, dims.Dqk, dtype=torch.bfloat16)
        for r, v in zip(rows.tolist(), vals):
            acc[r] = (acc[r].float() + v).to(torch.bfloat16)
        return acc.reshape(dims.B, dims.Skv, dims.Dqk)


# ---- one bug each ----------------------------------------------------------------------------------------

class FlippedSinkGrad(ReferenceBackend):
    """d_sink with the wrong sign."""

    name = "broken-flipped-sink"

    def backward(self, *args, **kw):
        dq, dkv, d_sink = super().backward(*args, **kw)
        return dq, dkv, None if d_sink is None else -d_sink


class MinusOneAsZero(ReferenceBackend):
    """Reads index -1 as row 0 (a clamp instead of a skip)."""

    name = "broken-minus-one"

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        indices = torch.where(indices == -1, torch.zeros_like(indices), indices)
        return super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length)


class TopkIgnored(ReferenceBackend):
    """Takes topk_length and drops it."""

    name = "broken-topk-ignored"

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        return super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=None)


class Base2LseForward(ReferenceBackend):
    """Forward returns the kernel's base-2, sink-folded LSE where the contract's natural one is due."""

    name = "broken-base2-lse-forward"

    def forward(self, q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None):
        out, lse = super().forward(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length)
        lse2 = lse.double() * LOG2E
        if attn_sink is not None:
            sk = attn_sink.double() * LOG2E
            lse2 = torch.where(torch.isposinf(lse2), lse2, torch.logaddexp2(lse2, sk.expand_as(lse2)))
        return out, lse2.float()


def base2_lse_backward():
    """Backward that reads the natural LSE it is given as base 2."""
    b = EmulatedKernel(lse_is_base2=True)
    b.name = "broken-base2-lse-backward"
    return b


class Float16Accepted(ReferenceBackend):
    """Casts whatever floating dtype it gets instead of rejecting it."""

    name = "broken-float16-accepted"

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        q, kv, out, grad_out = (t.to(torch.bfloat16) for t in (q, kv, out, grad_out))
        return super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length)


def random_order_dkv():
    """dkv accumulated by bf16 atomics in a random order, while claiming determinism."""
    b = EmulatedKernel(accumulate="bf16", seed=7)
    b.name, b.deterministic = "broken-random-order-dkv", True
    return b


class HeadGroupDropped(ReferenceBackend):
    """Loops over H // 16 full head groups: the heads of a last partial group get dq = 0."""

    name = "broken-head-group"
    tiles = {"head_group": 16}

    def backward(self, *args, **kw):
        dq, dkv, d_sink = super().backward(*args, **kw)
        H = dq.shape[2]
        dq = dq.clone()
        dq[:, :, (H // 16) * 16:] = 0
        return dq, dkv, d_sink


class StaleRow(ReferenceBackend):
    """Keeps its dq buffer across calls and skips query rows with no valid slot (an early exit that forgets to
    write zeros): such a row shows whatever an earlier call left there."""

    name = "broken-stale-row"

    def __init__(self, device: str = "cpu"):
        super().__init__(device)
        self._buf = {}

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        dq, dkv, d_sink = super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                           topk_length=topk_length)
        buf = self._buf.setdefault(tuple(dq.shape), torch.zeros_like(dq))
        valid, _, _ = _gather(q, kv, indices, topk_length)
        rows = valid.any(-1)  # [B, S]
        buf[rows] = dq[rows]
        return buf, dkv, d_sink


class MaskMultiply(ReferenceBackend):
    """Gathers clamped rows and multiplies by the mask instead of selecting: NaN in an unreferenced row leaks."""

    name = "broken-mask-multiply"

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        dq, dkv, d_sink = super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                           topk_length=topk_length)
        valid, _, _ = _gather(q, kv, indices, topk_length)
        clamped = indices.long().clamp(0, kv.shape[1] - 1)
        rows = kv.float()[torch.arange(kv.shape[0])[:, None, None], clamped]  # [B,S,L,Dqk]
        leak = (rows * (~valid)[..., None].float()).sum(2)  # 0 unless a masked-off row holds NaN / inf
        dq = (dq.float() + leak[:, :, None, :] * 0).to(torch.bfloat16)
        return dq, dkv, d_sink


# ---- one bug each, in a boundary class the suite draws since issue 22 ---------------------------------------------

class NegativeLengthReadsAll(ReferenceBackend):
    """Takes a negative topk_length as "no limit" (a kernel that read topk_idxs[-64 + row] for it)."""

    name = "broken-negative-length"

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        if topk_length is not None:
            topk_length = torch.where(topk_length < 0, indices.shape[-1], topk_length).to(torch.int32)
        return super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length)


class HugeSinkNaN(ReferenceBackend):
    """p_sink = exp2(sink log2(e) - lse2) in float32 with +-inf sinks handled, but a finite sink of 3e38 overflows
    to inf in sink log2(e) and in lse2: inf - inf = NaN in d_sink."""

    name = "broken-huge-sink"

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        dq, dkv, d_sink = super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                           topk_length=topk_length)
        if attn_sink is None:
            return dq, dkv, d_sink
        sink = attn_sink.float()[None, None, :]
        lse2 = contract.lse_to_base2(lse.float(), attn_sink.float())
        p = torch.exp2(sink * LOG2E - lse2)
        p = torch.where(torch.isposinf(sink), torch.ones(()), torch.where(torch.isneginf(sink), 0.0, p))
        p = torch.where(torch.isinf(lse), torch.zeros(()), p)  # empty rows
        delta = (grad_out.float() * out.float()).sum(-1)
        return dq, dkv, -(p * delta).sum((0, 1))


class FarSinkOverflow(ReferenceBackend):
    """p_sink = e^sink / (e^sink + e^lse) in float32, +-inf sinks handled: a sink of +400 (or 3e38) is inf / inf."""

    name = "broken-far-sink"

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        dq, dkv, d_sink = super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                           topk_length=topk_length)
        if attn_sink is None:
            return dq, dkv, d_sink
        sink, lse_ = attn_sink.float()[None, None, :], lse.float()
        p = torch.exp(sink) / (torch.exp(sink) + torch.exp(torch.where(torch.isinf(lse_), -torch.inf, lse_)))
        p = torch.where(torch.isposinf(sink), torch.ones(()), torch.where(torch.isneginf(sink), 0.0, p))
        p = torch.where(torch.isinf(lse_), torch.zeros(()), p)
        delta = (grad_out.float() * out.float()).sum(-1)
        return dq, dkv, -(p * delta).sum((0, 1))


def _first_tile_masked(indices, kv, topk_length, tile):
    """[B, S]: rows whose first ``tile`` slots are all invalid while a later one is valid."""
    valid, _, _ = _gather(None, kv, indices, topk_length)
    return ~valid[..., :tile].any(-1) & valid[..., tile:].any(-1)


class LeadingTileNaN(ReferenceBackend):
    """An online softmax whose running max starts at -inf: a fully invalid first top-k tile of 16 gives
    exp(-inf - -inf) = NaN for the row (its later slots valid)."""

    name = "broken-leading-tile"
    tiles = {"topk_block": 16}

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        dq, dkv, d_sink = super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                           topk_length=topk_length)
        bad = _first_tile_masked(indices, kv, topk_length, 16)
        return torch.where(bad[..., None, None], torch.nan, dq.float()).to(dq.dtype), dkv, d_sink


class StopsAtAnInvalidTile(ReferenceBackend):
    """Ends a row at its first fully invalid top-k tile of 16 after the first ("the rest is padding"): the valid
    slots after a whole invalid tile in the middle are dropped."""

    name = "broken-middle-tile"
    tiles = {"topk_block": 16}

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        valid, _, _ = _gather(None, kv, indices, topk_length)
        L = indices.shape[-1]
        keep = torch.ones_like(valid)
        for k in range(1, (L + 15) // 16):
            dead = ~valid[..., 16 * k:16 * (k + 1)].any(-1, keepdim=True)  # [B, S, 1]
            later = torch.arange(L) >= 16 * k
            keep &= ~(dead & later)
        indices = torch.where(keep, indices, -1).to(torch.int32)
        return super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length)


class QueryPairSharesTopk(ReferenceBackend):
    """Packs two queries into one 64-row tile when H <= 32 and loads only the first query's top-k for both."""

    name = "broken-query-pair"
    tiles = {"head_group": 64}

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        if q.shape[2] <= 32 and q.shape[1] > 1:
            indices = indices.clone()
            n = indices.shape[1] // 2
            indices[:, 1:2 * n:2] = indices[:, 0:2 * n:2]
            if topk_length is not None:
                topk_length = topk_length.clone()
                topk_length[:, 1:2 * n:2] = topk_length[:, 0:2 * n:2]
        return super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length)


class Float16Exp(ReferenceBackend):
    """Holds exp(s) in float16 before normalising: a logit past 11.09 overflows, inf / inf = NaN in its row."""

    name = "broken-float16-exp"

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        dq, dkv, d_sink = super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                           topk_length=topk_length)
        valid, K, _ = _gather(q, kv, indices, topk_length)
        s = torch.matmul(q.float(), K.transpose(-1, -2)) * sm_scale  # [B, S, H, L]
        over = (torch.isinf(torch.exp(s).half()) & valid[:, :, None, :]).any(-1)  # [B, S, H]
        return torch.where(over[..., None], torch.nan, dq.float()).to(dq.dtype), dkv, d_sink


class Bf16ScaleOnOddHeads(BackendBase):
    """A float32 backward with sm_scale rounded to bf16 for the odd heads (a per-head scale table kept in bf16). It
    recomputes P from the lse it is given, so each logit's error 2^-9 |s| scales P by e^(2^-9 |s|): at logits of a
    few hundred P is off by half or more, at logits of 5 by 1 %, inside a bf16 kernel's error."""

    name = "broken-bf16-scale"
    device = "cpu"
    deterministic = True

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        dims = check_backward_args(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                   topk_length=topk_length)
        rounded = float(torch.tensor(sm_scale).to(torch.bfloat16))
        scale = torch.where(torch.arange(dims.H) % 2 == 1, rounded, float(sm_scale))[None, None, :, None]
        valid, K, safe = _gather(q, kv, indices, topk_length)
        qf, do = q.float(), grad_out.float()
        s = torch.matmul(qf, K.transpose(-1, -2)) * scale  # [B, S, H, L]
        lse = torch.where(torch.isinf(lse), math.inf, lse.float())
        denom = lse if attn_sink is None else torch.logaddexp(lse, attn_sink.float())
        P = torch.where(valid[:, :, None, :], torch.exp(s - denom[..., None]), 0.0)
        P = torch.nan_to_num(P, nan=0.0)
        delta = (do * out.float()).sum(-1)
        dS = P * (torch.matmul(do, K[..., :dims.Dv].transpose(-1, -2)) - delta[..., None])
        dq = torch.matmul(dS * scale, K)
        contrib = torch.matmul((dS * scale).transpose(-1, -2), qf)  # [B, S, L, Dqk]
        contrib[..., :dims.Dv] += torch.matmul(P.transpose(-1, -2), do)
        rows = (safe + (torch.arange(dims.B) * dims.Skv)[:, None, None]).reshape(-1)[valid.reshape(-1)]
        dkv = torch.zeros(dims.B * dims.Skv, dims.Dqk).index_add_(0, rows, contrib.reshape(-1, dims.Dqk)
                                                                  [valid.reshape(-1)])
        d_sink = None
        if attn_sink is not None:
            d_sink = -(contract.sink_probability(lse, attn_sink.float()) * delta).sum((0, 1))
        return (dq.to(torch.bfloat16), dkv.reshape(dims.B, dims.Skv, dims.Dqk).to(torch.bfloat16), d_sink)


class DropsLastSlotOfPartialTile(ReferenceBackend):
    """Declares 64-slot top-k blocks and never runs a partial block of one slot (a tail loop one short): the trial
    of a new kernel author's first hour."""

    name = "broken-partial-tile"
    tiles = {"head_group": 16, "topk_block": 64}

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        L = indices.shape[-1]
        if L % 64 == 1:
            indices = indices.clone()
            indices[..., L - 1] = -1
        return super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length)


# the bug -> its backend, for the boundary classes of issue 22 (tests/testkit/test_case_classes.py)
CLASS_BUGS = {
    "topk length <= 0": NegativeLengthReadsAll,
    "sink huge": HugeSinkNaN,
    "sink far": FarSinkOverflow,
    "invalid leading": LeadingTileNaN,
    "invalid middle": StopsAtAnInvalidTile,
    "query tile": QueryPairSharesTopk,
    "magnitude peaky": Float16Exp,
    "magnitude peaky (sm_scale)": Bf16ScaleOnOddHeads,
    "L above tile": DropsLastSlotOfPartialTile,
}


BROKEN = {
    "flipped_sink": FlippedSinkGrad,
    "minus_one_as_zero": MinusOneAsZero,
    "topk_ignored": TopkIgnored,
    "base2_lse_forward": Base2LseForward,
    "base2_lse_backward": base2_lse_backward,
    "float16_accepted": Float16Accepted,
    "random_order_dkv": random_order_dkv,
    "head_group_dropped": HeadGroupDropped,
    "stale_row": StaleRow,
    "mask_multiply": MaskMultiply,
}

# ---- CUDA backends for the execution checks ------------------------------------------------------------------
# A correct one (DeviceTorch) that every execution check must pass, and one planted bug per check. The reference
# backend cannot serve: it computes with NumPy on the host, so every call copies to the host (a sync) and back.

def _gather_on_device(kv, indices, topk_length):
    """valid [B,S,L], K [B,S,L,Dqk] float32 with exact zeros on invalid slots, safe indices (0 where invalid)."""
    B, Skv = kv.shape[0], kv.shape[1]
    valid = contract.valid_mask(indices, Skv, topk_length)
    safe = torch.where(valid, indices.long(), 0)
    K = kv.float()[torch.arange(B, device=kv.device)[:, None, None], safe]
    return valid, torch.where(valid[..., None], K, 0.0), safe


def _probabilities(qf, K, valid, sm_scale, attn_sink):
    """P [B,S,H,L] and the row's own lse [B,S,H] (+inf when empty), from products summed in a fixed order."""
    s = (qf[:, :, :, None, :] * K[:, :, None, :, :]).sum(-1) * sm_scale
    s = torch.where(valid[:, :, None, :], s, -math.inf)
    lse = torch.where(valid.any(-1)[:, :, None], torch.logsumexp(s, -1), math.inf)
    denom = lse
    if attn_sink is not None:
        sink = attn_sink.float()
        denom = torch.where(torch.isposinf(lse) | torch.isposinf(sink), math.inf, torch.logaddexp(lse, sink))
    return torch.exp(s - denom[..., None]), lse


FIXED_POINT_BITS = 60  # dkv's int64 sum: |any partial sum| <= sum |contributions| <= 2**60


def _fixed_point_sum(contrib, rows, n_rows):
    """sum of contrib [N, D] (float32) into n_rows rows by ``rows`` [N], in int64 at 2**-F from a bound on the
    device: integer additions give the same bits in any order, atomics included."""
    c = contrib.double()
    G = c.abs().sum()
    F = torch.clamp(FIXED_POINT_BITS - torch.ceil(torch.log2(G)), -120, 120)
    F = torch.where(G == 0, 120.0, torch.where(torch.isfinite(G), F, 0.0))
    acc = torch.zeros((n_rows, c.shape[1]), dtype=torch.int64, device=c.device)
    acc.index_add_(0, rows, torch.round(c * torch.exp2(F)).to(torch.int64))
    return acc.double() * torch.exp2(-F)


class DeviceTorch(BackendBase):
    """The contract in torch on the inputs' device, as a capturable kernel must be: float32 math from the kernel
    dtypes, no host read of any data, every op on the current stream, nothing allocated beyond ``workspace_bytes``,
    dkv summed in int64 fixed point, so bitwise deterministic. Its tensors are small ([B,S,H,L,Dqk] products): for
    test cases, not production sizes."""

    name = "device-torch"
    deterministic = True

    def __init__(self, device: str = "cuda"):
        self.device = device

    def forward(self, q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None):
        check_forward_args(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length)
        valid, K, _ = _gather_on_device(kv, indices, topk_length)
        P, lse = _probabilities(q.float(), K, valid, sm_scale, attn_sink)
        out = (P[..., None] * K[:, :, None, :, :d_v]).sum(-2)
        return out.to(torch.bfloat16), lse

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        dims = check_backward_args(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length)
        valid, K, safe = _gather_on_device(kv, indices, topk_length)
        qf, dO = q.float(), grad_out.float()
        P, own_lse = _probabilities(qf, K, valid, sm_scale, attn_sink)  # recomputed: lse is not trusted
        dP = (dO[:, :, :, None, :] * K[:, :, None, :, :dims.Dv]).sum(-1)
        delta = (P * dP).sum(-1)
        dS = P * (dP - delta[..., None])
        dq = (dS[..., None] * K[:, :, None, :, :]).sum(-2) * sm_scale
        contrib = (dS[..., None] * qf[:, :, :, None, :]).sum(2) * sm_scale
        contrib[..., :dims.Dv] += (P[..., None] * dO[:, :, :, None, :]).sum(2)
        contrib = torch.where(valid[..., None], contrib, 0.0)
        rows = (safe + (torch.arange(dims.B, device=q.device) * dims.Skv)[:, None, None]).reshape(-1)
        dkv = _fixed_point_sum(contrib.reshape(-1, dims.Dqk), rows, dims.B * dims.Skv)
        d_sink = None
        if attn_sink is not None:
            d_sink = -(contract.sink_probability(own_lse, attn_sink.float()) * delta).sum((0, 1))
        return dq.to(torch.bfloat16), dkv.reshape(dims.B, dims.Skv, dims.Dqk).to(torch.bfloat16), d_sink

    def workspace_bytes(self, case, direction: str = "backward") -> int:
        return device_torch_workspace(case.dims)


def device_torch_workspace(dims) -> int:
    """``DeviceTorch``'s declared workspace: twice the bound on what its code allocates (a CPU test holds it to
    that bound), which leaves room for the reductions' device scratch, plus 1 MiB."""
    return 2 * device_torch_host_bytes(dims) + (1 << 20)


def device_torch_host_bytes(dims) -> int:
    """A bound on what ``DeviceTorch``'s code asks torch for beside its outputs: one [B,S,H,L,Dqk] float32 product at
    a time, a few [B,S,H,L] tensors (scores, P, dP, dS), the gathered rows and contributions (float32, float64,
    int64), the fixed-point sum over the cache (int64, float64 twice), [B,S,H] rows, scalars."""
    five = 4 * dims.B * dims.S * dims.H * dims.L * dims.Dqk
    four = 4 * dims.B * dims.S * dims.H * dims.L
    slots = dims.B * dims.S * dims.L
    return (five + 8 * four + 40 * slots * dims.Dqk + 24 * dims.B * dims.Skv * dims.Dqk
            + 64 * dims.B * dims.S * dims.H + 4096)


class SyncsOnHost(DeviceTorch):
    """Looks at a value on the host inside the call (``.item()``): a sync, an error under sync debug mode."""

    name = "broken-item-sync"

    def backward(self, q, *args, **kw):
        if float(q.abs().amax().item()) > 3e38:  # a finiteness guard on the host
            raise ValueError("q must be finite")
        return super().backward(q, *args, **kw)


class DefaultStreamFill(DeviceTorch):
    """Zero-fills its dkv on ``torch.cuda.default_stream()`` and accumulates into it on the current stream (cuDNN
    frontend PR #429): right while the current stream is the default one, all zero when the caller's is another."""

    name = "broken-default-stream-fill"

    def backward(self, *args, **kw):
        dq, dkv, d_sink = super().backward(*args, **kw)
        out = torch.empty_like(dkv)
        with torch.cuda.stream(torch.cuda.default_stream(dkv.device)):
            out.zero_()
        out.add_(dkv)
        return dq, out, d_sink


class HostPlan(DeviceTorch):
    """Plans on the host from topk_length once per buffer (a plan cache keyed by its address): the plan a capture
    finds is the one made from the warm-up's values, and the replay keeps it when new lengths are copied in."""

    name = "broken-host-plan"

    def __init__(self, device: str = "cuda"):
        super().__init__(device)
        self.plans = {}

    def backward(self, *args, topk_length=None, **kw):
        if topk_length is not None:
            key = (topk_length.data_ptr(), tuple(topk_length.shape))
            if key not in self.plans:
                self.plans[key] = torch.tensor(topk_length.tolist(), dtype=torch.int32, device=topk_length.device)
            topk_length = self.plans[key]
        return super().backward(*args, topk_length=topk_length, **kw)


class ScratchPerCall(DeviceTorch):
    """Takes a scratch buffer of its own per call, beyond the workspace it declares."""

    name = "broken-scratch-per-call"
    SCRATCH = 1 << 20

    def backward(self, *args, **kw):
        q = args[0]
        dims = Call.bind("backward", *args, **kw).dims
        scratch = torch.empty(device_torch_workspace(dims) + self.SCRATCH, dtype=torch.uint8, device=q.device)
        res = super().backward(*args, **kw)
        del scratch
        return res


class OneIn257(DeviceTorch):
    """Every 257th backward call flips the last bit of one dkv element (a race that loses once in a few hundred
    calls), counted from its construction so that a test knows which call it is."""

    name = "broken-one-in-257"
    PERIOD = 257

    def __init__(self, device: str = "cuda"):
        super().__init__(device)
        self.calls = 0

    def backward(self, *args, **kw):
        dq, dkv, d_sink = super().backward(*args, **kw)
        self.calls += 1
        if self.calls % self.PERIOD == 0:
            dkv.view(torch.int16).view(-1)[:1] ^= 1
        return dq, dkv, d_sink


# the execution check each planted bug must fail
EXECUTION_BUGS = {"host_sync": SyncsOnHost, "streams": DefaultStreamFill, "graph": HostPlan,
                  "allocations": ScratchPerCall, "repeats": OneIn257}


# A second downstream module broken elsewhere (dkv doubled once the cache has 9 rows or more), for the tests of a
# database two runners share: each must see the other's failure.
DKV_DOUBLED_SOURCE = _doubled_source("broken-dkv", "dkv")


# ---- what host code allocates ---------------------------------------------------------------------------------
class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors torch code creates inside the block (views and in-place results excluded), live and at
    their peak, on any device: ``with LiveBytes() as m: ...; m.peak``. It sees every tensor the code asks torch for,
    not the scratch a kernel takes internally (a CUDA reduction's staging, say)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes = {}

    def _freed(self, key) -> None:
        self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        given = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()  # one Python object per storage: it dies with the storage
            key = storage._cdata
            if key in given or key in self.sizes:
                continue
            self.sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key)
        return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- calling backends ------------------------------------------------------------------------------------------
def case_call(backend, case) -> Call:
    """The arguments the checks would call ``backend`` with on ``case`` (inputs, oracle out and lse)."""
    return Expected.for_backend(backend, case).call(getattr(backend, "device", "cpu"))


def case_args(backend, case) -> dict:
    """``case_call``'s arguments as a plain dict (for tests that edit them)."""
    return dict(case_call(backend, case).args)


def backward_of(backend, case) -> dict:
    """``backend``'s backward results on ``case`` by name (dq, dkv, d_sink)."""
    return case_call(backend, case).results(backend, "backward")


def benchmark_module(name: str):
    """A script of ``benchmarks/`` as a module, by path (the folder is not a package)."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_as(monkeypatch, name: str, backend) -> None:
    """For this test, the training-step entry points (``sparse_mqa_kernels.autograd``) load ``backend`` for the
    registered name ``name`` (a stand-in); other names load as before."""
    from sparse_mqa_kernels import autograd

    current = autograd.backend
    monkeypatch.setattr(autograd, "backend", lambda n: backend if n == name else current(n))


# ---- the oracle proof tests ------------------------------------------------------------------------------------
# Small sizes: every proof test runs hundreds of cases on one CPU core.
SMALL = dict(max_b=2, max_s=6, max_skv=12, max_h=5, max_l=10)


# Finite differences need a smooth softmax: peaky logits (a few hundred) and sinks of 1e38 are proved against the
# float64 oracle and the device oracle instead (tests/testkit/test_case_classes.py).
SMOOTH = dict(sink_modes=("none", "finite", "neg_inf", "pos_inf", "mixed"), magnitudes=("unit", "spread"))


def small_cases(**kw):
    """Cases (configuration + seed) small enough for float64 finite differences and dense torch autograd, in the
    smooth modes (``SMOOTH``)."""
    return cases(**{**SMALL, **SMOOTH, **kw})


# Cases with every feature (mixed / +inf sinks, topk_length, far out-of-range values, duplicates, empty rows), so
# each run covers them whatever Hypothesis draws.
FEATURE_CASES = (
    Case(B=2, S=5, Skv=7, H=3, L=9, Dqk=16, Dv=8, sink="mixed", topk="random", invalid="mixed", duplicates=True,
         seed=10),
    Case(B=2, S=6, Skv=9, H=4, L=6, Dqk=24, Dv=16, sink="finite", topk="random", invalid="empty_rows",
         duplicates=True, seed=2),
    Case(B=1, S=4, Skv=5, H=2, L=8, Dqk=5, Dv=3, sink="pos_inf", invalid="out_of_range", duplicates=True,
         sm_scale=0.5, seed=2),
)


def every_feature(test):
    """``@example`` each of ``FEATURE_CASES`` on a ``@given(case=...)`` test."""
    for case in reversed(FEATURE_CASES):
        test = example(case=case)(test)
    return test


def kwargs(x: dict) -> dict:
    """The oracle's keyword arguments in an inputs dict (all but the tensors it takes by position)."""
    return {k: v for k, v in Call(x).oracle_args("backward").items() if k not in ("q", "kv", "indices", "grad_out")}


def run(x: dict, dtype=np.float64) -> dict:
    """Forward and backward of the oracle on an inputs dict (as ``Case.inputs()`` makes)."""
    call = Call(x)
    out, lse = oracle.forward(**call.oracle_args("forward"), dtype=dtype)
    dq, dkv, d_sink = oracle.backward(**call.oracle_args("backward"), dtype=dtype)
    return {"out": out, "lse": lse, "dq": dq, "dkv": dkv, "d_sink": d_sink}


def assert_bitwise(got: dict, want: dict, what: str, keys=None) -> None:
    """np.array_equal on every result (NaN never equal), with the first differing position in the message."""
    for k in keys or want:
        a, b = got[k], want[k]
        if a is None or b is None:
            assert a is None and b is None, f"{what}: {k} is {a!r} vs {b!r}"
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {k} {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        if not np.array_equal(a, b):
            diff = np.argwhere(~((a == b) | (np.isnan(a) & np.isnan(b))))
            pos = tuple(diff[0])
            raise AssertionError(f"{what}: {k} differs at {len(diff)} / {a.size} positions, first {pos}: "
                                 f"{a[pos]!r} vs {b[pos]!r}")
