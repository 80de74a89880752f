"""Our deterministic TileLang backward on a GPU: the conformance checks (tolerance vs the float64 oracle,
bitwise determinism in a hostile environment, guards, rejection) over the contract's boundaries, plus
agreement with the NumPy model of the same algorithm and a padded-head out-of-bounds probe."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tilelang")

from sparse_mqa_testkit import contract  # noqa: E402
from sparse_mqa_testkit.backends.base import BackendBase  # noqa: E402
from sparse_mqa_testkit.cases import Case  # noqa: E402
from sparse_mqa_testkit.checks import check_backward_tolerance, check_determinism, check_guards, check_rejection  # noqa: E402
from support import case_args  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class BackwardOnly(BackendBase):
    """The ``tilelang`` backend's backward alone, so these checks measure this kernel and not the forward."""

    name = "tilelang-backward"
    device = "cuda"
    deterministic = True
    dims = contract.PRODUCTION_DIMS

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        from sparse_mqa_kernels.backward import sparse_mqa_backward

        return sparse_mqa_backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                   topk_length=topk_length)


BACKEND = BackwardOnly()

_CASES = []
for _i, (_dims, _h, _l, _sink, _topk, _invalid, _dup) in enumerate([
    ((576, 512), 1, 1, "none", "none", "none", False),
    ((576, 512), 1, 33, "finite", "random", "holes", True),
    ((576, 512), 8, 65, "mixed", "none", "empty_rows", False),
    ((576, 512), 15, 31, "pos_inf", "random", "out_of_range", True),
    ((576, 512), 16, 32, "neg_inf", "none", "tails", False),
    ((576, 512), 17, 100, "mixed", "random", "mixed", True),
    ((576, 512), 64, 97, "finite", "random", "empty_rows", True),
    ((576, 512), 128, 129, "mixed", "none", "holes", False),
    ((512, 512), 17, 70, "finite", "random", "mixed", True),
    ((512, 512), 64, 64, "none", "none", "none", False),
    # 16-head groups at Dqk 512 over two top-k blocks: the staging once shared q's memory (NaN dq)
    ((512, 512), 1, 33, "none", "none", "none", False),
    ((512, 512), 16, 70, "finite", "random", "holes", True),
]):
    _CASES.append(Case(B=2, S=13, Skv=300, H=_h, L=_l, Dqk=_dims[0], Dv=_dims[1], sink=_sink, topk=_topk,
                       invalid=_invalid, duplicates=_dup, seed=100 + _i))
# L > Skv (every row referenced many times), and one tiny Skv
_CASES.append(Case(B=1, S=7, Skv=5, H=33, L=40, Dqk=576, Dv=512, sink="finite", duplicates=True, seed=7))
# -inf as an empty row's lse (cuDNN frontend's convention) with -inf sinks: zero gradients, finite d_sink
_CASES.append(Case(B=2, S=13, Skv=300, H=64, L=70, Dqk=576, Dv=512, sink="mixed", invalid="empty_rows",
                   empty_lse="neg_inf", seed=8))
_IDS = [c.describe().replace(" ", "_") for c in _CASES]


@pytest.mark.parametrize("case", _CASES, ids=_IDS)
def test_tolerance(case):
    check_backward_tolerance(BACKEND, case).raise_if_failed()


@pytest.mark.parametrize("case", [_CASES[i] for i in (1, 5, 7, 12)], ids=[_IDS[i] for i in (1, 5, 7, 12)])
def test_determinism_hostile(case):
    check_determinism(BACKEND, case, repeats=4, hostile=True).raise_if_failed()


@pytest.mark.parametrize("case", [_CASES[i] for i in (2, 3, 6)], ids=[_IDS[i] for i in (2, 3, 6)])
def test_guards(case):
    check_guards(BACKEND, case).raise_if_failed()


def test_rejection():
    check_rejection(BACKEND, _CASES[5]).raise_if_failed()


def test_production_sized_determinism_and_model_agreement():
    """A mid-sized case: bitwise stable over repeats on the default and a side stream, and close to the
    NumPy model of the same algorithm (same plan and fixed point; tensor-core summation order differs)."""
    from sparse_mqa_kernels.backward_model import model_backward

    case = Case(B=1, S=64, Skv=2048, H=64, L=256, Dqk=576, Dv=512, sink="finite", invalid="holes", seed=3)
    t = case_args(BACKEND, case)

    def call():
        return BACKEND.backward(t["q"], t["kv"], t["out"], t["grad_out"], t["lse"], t["attn_sink"],
                                t["indices"], t["sm_scale"], topk_length=t["topk_length"])

    ref = [x.clone() for x in call()]
    side = torch.cuda.Stream()
    for k in range(4):
        if k % 2:
            with torch.cuda.stream(side):
                got = call()
            torch.cuda.current_stream().wait_stream(side)
        else:
            got = call()
        torch.cuda.synchronize()
        for name, a, b in zip(("dq", "dkv", "d_sink"), ref, got):
            assert torch.equal(a, b), f"{name} differs on run {k}"
    dq_m, dkv_m, ds_m, _ = model_backward(*(t[k].cpu() if t[k] is not None else None
                                            for k in ("q", "kv", "out", "grad_out", "lse", "attn_sink",
                                                      "indices")), t["sm_scale"])
    for name, a, m in (("dq", ref[0], dq_m), ("dkv", ref[1], dkv_m), ("d_sink", ref[2], ds_m)):
        a = a.float().cpu().numpy().astype(np.float64)
        rel = np.linalg.norm(a - m) / max(np.linalg.norm(m), 1e-30)
        assert rel < 4e-3, f"{name}: kernel vs model relative L2 {rel:.3e}"


@pytest.mark.parametrize("H", [1, 8, 15, 33])
def test_padded_heads_never_read_out_of_bounds(H):
    """q, dO, lse, out of H heads (padded to a head group: 16, or 64 for the warp-specialised body) sit
    directly before NaN guard memory: a read past head H - 1 would put NaN into the results."""
    case = Case(B=1, S=4, Skv=64, H=H, L=40, Dqk=576, Dv=512, sink="finite", seed=H)
    t = case_args(BACKEND, case)

    def guarded(x):
        n = x.numel()
        buf = torch.full((n + 4096,), math.nan, dtype=torch.float32, device=x.device).to(x.dtype)
        buf[:n] = x.reshape(-1)
        return buf[:n].view(x.shape)

    for name in ("q", "grad_out", "lse", "out"):
        t[name] = guarded(t[name])
    dq, dkv, d_sink = BACKEND.backward(t["q"], t["kv"], t["out"], t["grad_out"], t["lse"], t["attn_sink"],
                                       t["indices"], t["sm_scale"])
    for name, x in (("dq", dq), ("dkv", dkv), ("d_sink", d_sink)):
        assert torch.isfinite(x).all(), f"{name} has non-finite values: a read past head {H - 1}"


def test_query_chunks_match_one_launch():
    """Several launches (query chunks) give the same dq, dkv and d_sink bits as one (d_sink is one reduction over
    the whole call's terms)."""
    from sparse_mqa_kernels.backward import sparse_mqa_backward
    from sparse_mqa_kernels.bwd_plan import BackwardConfig

    case = Case(B=2, S=23, Skv=300, H=17, L=70, Dqk=576, Dv=512, sink="finite", topk="random",
                invalid="holes", seed=5)
    t = case_args(BACKEND, case)
    args = (t["q"], t["kv"], t["out"], t["grad_out"], t["lse"], t["attn_sink"], t["indices"], t["sm_scale"])
    chunked = BackwardConfig(max_query_chunk=5)
    one = sparse_mqa_backward(*args, topk_length=t["topk_length"])
    many = sparse_mqa_backward(*args, topk_length=t["topk_length"], config=chunked)
    assert all(torch.equal(a, b) for a, b in zip(one, many))
    again = sparse_mqa_backward(*args, topk_length=t["topk_length"], config=chunked)
    assert all(torch.equal(a, b) for a, b in zip(many, again))


class SingleRole(BackwardOnly):
    """64-head groups on the single-role body (int64 sums at one scale a call), the cross-check of the default."""

    name = "tilelang-backward-single-role"

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        from sparse_mqa_kernels.backward import sparse_mqa_backward
        from sparse_mqa_kernels.bwd_plan import BackwardConfig

        return sparse_mqa_backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length,
                                   config=BackwardConfig(single_role=True))


@pytest.mark.parametrize("case", [_CASES[i] for i in (6, 7, 9, 13)], ids=[_IDS[i] for i in (6, 7, 9, 13)])
def test_both_kernel_bodies_pass_and_chunks_change_no_bit(case):
    """64-head groups: the warp-specialised body (int32 at a scale per KV row) gives the same dq, dkv and d_sink bits
    over one launch and several (its row scales come from every chunk's bound before any term is added; d_sink is
    one reduction over the call), and the single-role body, the same products with int64 sums at one scale a call
    and Delta summed in another order, passes the tolerance check on the same case."""
    from sparse_mqa_kernels.backward import sparse_mqa_backward
    from sparse_mqa_kernels.bwd_plan import BackwardConfig

    t = case_args(BACKEND, case)
    args = (t["q"], t["kv"], t["out"], t["grad_out"], t["lse"], t["attn_sink"], t["indices"], t["sm_scale"])
    one = sparse_mqa_backward(*args, topk_length=t["topk_length"])
    many = sparse_mqa_backward(*args, topk_length=t["topk_length"], config=BackwardConfig(max_query_chunk=4))
    assert all(a is b or torch.equal(a, b) for a, b in zip(one, many))  # d_sink is None, or equal
    check_backward_tolerance(SingleRole(), case).raise_if_failed()


_STORED = [_CASES[i] for i in (6, 7, 9, 12, 13)] + [
    # rows of one, two and four bound-pass blocks, the main kernel's last block past a row's last one (L 100: 64 + 36
    # slots, 48-slot blocks to 144); 33 heads: a padded group
    Case(B=2, S=9, Skv=300, H=33, L=100, Dqk=576, Dv=512, sink="finite", topk="random", invalid="holes", seed=45),
    Case(B=1, S=40, Skv=500, H=64, L=200, Dqk=512, Dv=512, sink="none", topk="random", invalid="tails", seed=46),
]


@pytest.mark.parametrize("case", _STORED, ids=lambda c: c.describe().replace(" ", "_"))
def test_stored_p_and_ds_change_no_bit(case):
    """64-head groups: the main kernel reading P and dS that the bound pass stored (the default where
    ``pds_budget`` allows) gives the dq, dkv and d_sink bits of it forming them itself (``pds_budget=0``): the same
    products of the same operands, rounded to bf16 in one place or the other. Signed zeros and NaN placement count
    as equal here (a slot no valid row backs has P = +0 stored, +-0 formed)."""
    from sparse_mqa_kernels import bwd_plan
    from sparse_mqa_kernels.backward import sparse_mqa_backward
    from sparse_mqa_kernels.bwd_plan import BackwardConfig

    assert bwd_plan.make_plan(case.B, case.S, case.Skv, case.H, case.L, case.Dqk, case.Dv).stored_pds
    t = case_args(BACKEND, case)
    args = (t["q"], t["kv"], t["out"], t["grad_out"], t["lse"], t["attn_sink"], t["indices"], t["sm_scale"])
    stored = sparse_mqa_backward(*args, topk_length=t["topk_length"])
    formed = sparse_mqa_backward(*args, topk_length=t["topk_length"], config=BackwardConfig(pds_budget=0))
    for name, a, b in zip(("dq", "dkv", "d_sink"), stored, formed):
        if a is None or b is None:
            assert a is b, name
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m, n=name: f"{n}: {m}")
    assert int((stored[1] != 0).sum()) > 0


@pytest.mark.parametrize("H, dims, sink", [(1, (576, 512), False), (17, (576, 512), True), (64, (512, 512), True)])
def test_prep_pass_matches_its_formulas(H, dims, sink):
    """``bwd_prep``: Delta = <out, dO> to float32 summation error, the fixed-point exponent F the largest with
    G 2**F <= 2**(ACC_BITS - HEADROOM_BITS) for G = sum over rows of m (c Vmax max|q| |dO| + max|dO|), m the
    slot mass 1 / (1 + e^(sink - lse)) (computed here in float64; one head's sink takes all but ~e^-30),
    heads past H (a step of 4 heads is padded at H = 1, 17) adding nothing; bitwise repeats."""
    from sparse_mqa_kernels import backward, bwd_plan

    Dqk, Dv = dims
    g = torch.Generator(device="cuda").manual_seed(H)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    B, S, sm_scale = 2, 37, 0.07
    q, out, go, kv = rnd(B, S, H, Dqk, scale=3.0), rnd(B, S, H, Dv), rnd(B, S, H, Dv, scale=1e-3), rnd(B, 50, Dqk)
    lse = torch.randn(B, S, H, device="cuda", generator=g) * 2
    attn_sink = None
    if sink:
        attn_sink = torch.randn(H, device="cuda", generator=g)
        attn_sink[0] = 30.0
    L = 8
    indices = torch.randint(0, 40, (B, S, L), device="cuda", generator=g).to(torch.int32)  # rows 40-49 unnamed
    indices[0, 0, 0] = -1
    tl = torch.full((B, S), L, dtype=torch.int32, device="cuda")
    kv[:, 45] = 1e4  # a row no slot names: no part of the bound
    delta, fx, F = backward._prep(q, kv, out, go, lse, attn_sink, indices, tl, sm_scale, Dv)
    again = backward._prep(q, kv, out, go, lse, attn_sink, indices, tl, sm_scale, Dv)
    assert all(torch.equal(a, b) for a, b in zip((delta, fx, F), again))
    ref = (out.double() * go.double()).sum(-1)
    bound = (out.double().abs() * go.double().abs()).sum(-1)
    assert ((delta.double() - ref).abs() <= 1e-6 * bound + 1e-30).all()
    vmax = kv[..., :Dv].double().norm(dim=-1)[contract.referenced_rows(indices, tl, kv.shape[1])].max()
    mass = 1.0 if attn_sink is None else torch.sigmoid(lse.double() - attn_sink.double())
    G = (mass * (abs(sm_scale) * bwd_plan.DS_BOUND_FACTOR * vmax * q.double().abs().amax(-1) * go.double().norm(dim=-1)
                 + go.double().abs().amax(-1))).sum().item()
    top = 2.0 ** (bwd_plan.ACC_BITS - bwd_plan.HEADROOM_BITS)
    f = int(F.item())
    assert fx.item() == 2.0 ** f
    assert G * 2.0 ** f <= top * (1 + 1e-5) and G * 2.0 ** (f + 1) > top * (1 - 1e-5), (G, f)


@pytest.mark.parametrize("garbage", [1e30, float("nan")])
def test_garbage_in_unreferenced_kv_rows_changes_no_bit(garbage):
    """The fixed point's scale comes from the KV rows valid slots name: unused rows of a paged cache holding huge
    finite garbage (or NaN) change neither the bits nor the precision of dkv."""
    case = Case(B=2, S=16, Skv=600, H=64, L=64, Dqk=576, Dv=512, sink="finite", invalid="holes", seed=31)
    t = case_args(BACKEND, case)
    args = lambda kv: (t["q"], kv, t["out"], t["grad_out"], t["lse"], t["attn_sink"], t["indices"],  # noqa: E731
                       t["sm_scale"])
    ref = BACKEND.backward(*args(t["kv"]))
    unused = ~contract.referenced_rows(t["indices"], None, case.Skv)
    assert bool(unused.any())
    kv = t["kv"].clone()
    kv[unused] = garbage
    got = BACKEND.backward(*args(kv))
    for name, a, b in zip(("dq", "dkv", "d_sink"), ref, got):
        assert torch.equal(a, b), f"{name} changed with garbage {garbage} in rows no slot names"


def test_views_at_odd_addresses_change_no_bit():
    """Inputs that are views starting one element into their storage (contiguous, but not on the 16-byte boundary
    the kernels' row copies need) give the same bits as the same values at aligned addresses, for the forward and
    the backward, with no device fault."""
    from sparse_mqa_kernels.forward import sparse_mqa_forward

    case = Case(B=2, S=9, Skv=200, H=64, L=70, Dqk=576, Dv=512, sink="finite", topk="random", seed=41)
    t = case_args(BACKEND, case)

    def odd(x):
        buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
        view = buf[1:].view(x.shape)
        view.copy_(x)
        assert view.data_ptr() % 16 != 0
        return view

    names = ("q", "kv", "out", "grad_out", "lse", "attn_sink", "indices", "topk_length")
    shifted = {k: odd(t[k]) if k in names else t[k] for k in t}
    for a in (t, shifted):
        a["fwd"] = sparse_mqa_forward(a["q"], a["kv"], a["indices"], a["sm_scale"], case.Dv,
                                      attn_sink=a["attn_sink"], topk_length=a["topk_length"])
    for a, b in zip(t["fwd"], shifted["fwd"]):
        assert torch.equal(a, b), "forward"
    grads = [BACKEND.backward(a["q"], a["kv"], a["out"], a["grad_out"], a["lse"], a["attn_sink"], a["indices"],
                              a["sm_scale"], topk_length=a["topk_length"]) for a in (t, shifted)]
    for name, a, b in zip(("dq", "dkv", "d_sink"), *grads):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("stored", [False, True], ids=["formed", "stored"])
def test_bound_pass_splits_change_no_bit(stored):
    """The bound pass with rows split over several blocks (``BwdPlan.bound_split``'s launch; pieces of one or two
    top-k blocks, an empty last piece, no whole rows) gives Delta, the kernel LSE, p_sink Delta, the octave counts
    and (``stored``) P and dS bitwise equal to one block a row: the counts are integer adds, a row's first piece
    alone writes the per-head values, and each piece its own blocks' P and dS, every slot of them (0 past the valid
    ones), and nothing past a row's last block."""
    from sparse_mqa_kernels import bwd_plan, bwd_rows

    case = Case(B=2, S=9, Skv=300, H=64, L=200, Dqk=576, Dv=512, sink="finite", topk="random", invalid="holes",
                seed=43)
    t = case_args(BACKEND, case)
    plan = bwd_plan.make_plan(case.B, case.S, case.Skv, case.H, case.L, case.Dqk, case.Dv)
    bound = bwd_rows.compiled(576, 512, stored)[0]
    rows = torch.arange(case.S, dtype=torch.int32, device="cuda")
    nb = -(-case.L // bwd_plan.BOUND_BLOCK)
    marker = 2.0**100  # what the kernel never writes here: P <= 1, and dS of these inputs is far smaller

    def run(whole, pieces, per):
        per_head = [torch.full((case.B, case.S, case.H), math.nan, dtype=torch.float32, device="cuda")
                    for _ in range(3)]
        hist = torch.zeros((case.B, case.Skv, bwd_plan.OCTAVES), dtype=torch.int32, device="cuda")
        pds = (torch.full((plan.pds_bytes() // 2,), marker, dtype=torch.bfloat16, device="cuda") if stored
               else t["q"].view(-1))
        bound(t["q"], t["out"], t["grad_out"], t["kv"], t["indices"], t["topk_length"], t["lse"], t["attn_sink"],
              rows, *per_head, hist, pds, float(t["sm_scale"]), 1, plan.pds_len if stored else 0, whole, pieces, per)
        return (*per_head, hist) + ((pds,) if stored else ())

    ref = run(case.S, 1, nb)
    assert all(torch.isfinite(r).all() for r in ref[:3]) and int(ref[3].sum()) > 0
    if stored:  # written exactly up to each row's last bound-pass block, 0 on the slots past its valid ones
        pds = ref[4].view(2, case.B, case.S, case.H, plan.pds_len).float()
        n_valid = t["topk_length"].clamp(0, case.L).long()
        end = (n_valid + bwd_plan.BOUND_BLOCK - 1) // bwd_plan.BOUND_BLOCK * bwd_plan.BOUND_BLOCK
        slot = torch.arange(plan.pds_len, device="cuda")
        written = (slot < end[..., None, None])[None].expand_as(pds)
        assert bool((pds[written] != marker).all()) and bool((pds[~written] == marker).all())
        past = (slot >= n_valid[..., None, None])[None].expand_as(pds) & written
        assert bool(past.any()) and bool((pds[past] == 0).all())
        assert bool((pds[0][written[0]] > 0).any())
    for split in [(0, nb, 1), (5, 2, 2), (8, 3, 2), (0, 1, nb)]:
        got = run(*split)
        assert all(torch.equal(g, r) for g, r in zip(got, ref)), f"split (whole, pieces, per) = {split}"


@pytest.mark.parametrize("sink", ["none", "finite", "neg_inf", "pos_inf", "mixed", "huge", "far"])
def test_bound_pass_forms_the_contracts_kernel_lse_and_sink_terms(sink):
    """The bound pass's kernel LSE and p_sink Delta are the contract's (``lse_to_base2``, ``sink_probability``, as
    torch forms them) to float32 rounding, with every infinity and zero where the contract puts it: empty rows (lse
    +-inf), +inf sinks, sinks past float32 in base 2; every head of two head groups (H = 65) written."""
    from sparse_mqa_kernels import bwd_plan, bwd_rows

    case = Case(B=2, S=6, Skv=70, H=65, L=60, Dqk=576, Dv=512, sink=sink, topk="random", invalid="empty_rows",
                seed=44)
    t = case_args(BACKEND, case)
    lse = t["lse"].clone()
    lse[0, 1, :3] = -math.inf  # the other empty-row convention beside the case's +inf
    has_sink = t["attn_sink"] is not None
    sink_t = t["attn_sink"] if has_sink else lse.view(-1)  # the backend's stand-in: read, ignored by the flag
    bound = bwd_rows.compiled(576, 512)[0]
    rows = torch.arange(case.S, dtype=torch.int32, device="cuda")
    delta, lse2, sink_delta = (torch.full((case.B, case.S, case.H), math.nan, dtype=torch.float32, device="cuda")
                               for _ in range(3))
    hist = torch.zeros((case.B, case.Skv, bwd_plan.OCTAVES), dtype=torch.int32, device="cuda")
    bound(t["q"], t["out"], t["grad_out"], t["kv"], t["indices"], t["topk_length"], lse, sink_t, rows, delta, lse2,
          sink_delta, hist, t["q"].view(-1), float(t["sm_scale"]), int(has_sink), 0, case.S, 1, 1)
    want = contract.lse_to_base2(lse, t["attn_sink"])
    assert torch.isinf(want).any()
    torch.testing.assert_close(lse2, want, rtol=2**-22, atol=0)
    if has_sink:
        want = contract.sink_probability(lse, t["attn_sink"]) * delta
        torch.testing.assert_close(sink_delta, want, rtol=2**-21, atol=0)
    else:
        assert torch.isnan(sink_delta).all(), "no sink: p_sink Delta is not written"
