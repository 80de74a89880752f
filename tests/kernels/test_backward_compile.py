"""CPU CI: the deterministic backward compiles for sm_90a (explicit target, no GPU needed), and the generated
CUDA accumulates dkv only as int64 into the integer accumulator: no floating-point atomic or reduction."""

import re

import pytest

pytest.importorskip("tilelang")

from sparse_mqa_kernels import backward, bwd_plan  # noqa: E402
from support import benchmark_module  # noqa: E402

FLOAT_ATOMICS = ("atomicAdd(", "AtomicAddx2", "AtomicAddx4", "tma_store_add", "red.global.add.f",
                 "red.global.add.v", "red.global.add.noftz", "atom.global.add.f", ".add.f32", ".add.f16",
                 ".add.bf16", ".add.noftz")


ANCHOR = bwd_plan.make_plan(1, 4096, 8192, 64, 2048, 576, 512).key()
ANCHOR_FORMED = bwd_plan.make_plan(1, 4096, 8192, 64, 2048, 576, 512, pds_budget=0).key()  # forms P and dS itself
SMALL_GROUP = bwd_plan.make_plan(1, 64, 128, 16, 64, 576, 512).key()
ANCHOR_SINGLE = bwd_plan.make_plan(1, 4096, 8192, 64, 2048, 576, 512).key(single_role=True)


@pytest.fixture(scope="module", params=[ANCHOR, ANCHOR_FORMED], ids=["stored", "formed"])
def source(request):
    """The 64-head main kernel at the anchor, reading stored P and dS, and forming them itself."""
    assert backward.TARGET == {"kind": "cuda", "arch": "sm_90a"}
    assert request.param.stored_pds == (request.param is ANCHOR)
    return backward.kernel_source(request.param)


def _body(src: str) -> str:
    return src[src.index('extern "C" __global__'):]


def test_compiles_for_sm90a(source):
    assert "sparse_mqa_bwd_ws_kernel" in source
    assert "int* __restrict__ Acc" in source and "float* __restrict__ RowScale" in source
    # the timing probe's stamps (benchmarks/trace_backward.py) are in its own build only
    assert "globaltimer" not in source and "smqa_put" not in source and "stamps" not in source


def test_dkv_reduction_is_integer_only(source):
    """The 64-head body adds dkv as int32 only: its one reduction is the sender's red.add.u32 (in its prelude), no
    bulk reduction, no float atomic."""
    for bad in FLOAT_ATOMICS:
        assert bad not in source, f"floating-point atomic or reduction {bad!r} in the generated CUDA"
    assert "AtomicAdd" not in source and "atomicAdd" not in source
    assert set(re.findall(r"\b(?:red|atom)\.[\w.]+", source)) == {"red.relaxed.gpu.global.add.u32"}
    assert "cp.reduce.async.bulk" not in source
    helpers = set(re.findall(r"((?:sparse_mqa|smqa)_\w+)[(<]", _body(source))) - {"sparse_mqa_bwd_ws_kernel"}
    # the sender's reds, dq's stores and the stored P and dS loads
    assert helpers - {"smqa_ld16"} == {"smqa_send_block", "smqa_store_rows"}, helpers


def test_dq_leaves_as_whole_sectors_of_the_real_heads(source):
    """dq goes out only through ``smqa_store_rows``: WG0's columns [0, N0) and WG1's [N0, Dqk), every row below the
    group's real head count (none skipped: only a traced build's stamps keep head 0's row), each quad's fragment
    words transposed by shuffles so that a thread stores 16 consecutive bytes of one row."""
    from sparse_mqa_kernels import backward_ws

    body = _body(source)
    calls = re.findall(r"smqa_store_rows<(\d+)>\((acc_dq[01]), \(&\(dQ\[(.*?)\]\)\), 576, (\d), "
                       r"min\(\(heads - \(\(\(int\)blockIdx\.z\) \* 64\)\), 64\), ", body)
    n0, n1 = str(backward_ws.N0), str(576 - backward_ws.N0)
    assert [(n, acc, r0) for n, acc, _, r0 in calls] == [(n0, "acc_dq0", "0"), (n1, "acc_dq1", "0")], calls
    assert not calls[0][2].endswith(f"(int64_t){n0})") and calls[1][2].endswith(f"+ (int64_t){n0})")
    assert "dQ +" not in body and not re.search(r"dQ\[[^]]*\] =", body), "dq stored elsewhere too"
    helper = source[source.index("void smqa_store_rows("):source.index("void smqa_mbar_arrive(")]
    assert helper.count("__shfl_xor_sync(0xffffffffu, give, s)") == 1 and "if (row >= r0 && row < nrows)" in helper
    assert "*reinterpret_cast<int4*>(d + static_cast<long long>(row) * ld + 8 * (4 * m + q))" in helper


def test_only_valid_rows_are_sent(source):
    """A slot's KV row reaches the sender only through ``idx_shared``, which holds -1 unless the contract's validity
    rule holds (valid prefix, 0 <= index < Skv), for the first block (gathered before the loop) and every later one;
    the sender skips negative rows."""
    body = _body(source)
    assert re.search(r"row_j = \(\(int\*\)idx_shared\)\[", body)
    staged = re.findall(r"\(\(int\*\)stage\)\[[^]]+\] = (row_j\w*);", body)
    assert staged and all(v == "row_j" or f"int {v} = row_j;" in body for v in staged), staged  # (a macro's copy)
    stores = re.findall(r"if \((.*)\) \{\s*(condval_\d+) = (idx_[nr]\[r_\d+\]);\s*\} else \{\s*\2 = -1;\s*\}"
                        r"\s*\(\(int\*\)idx_shared\)\[[^]]+\] = \2;", body)
    assert len(stores) == 2 == body.count("((int*)idx_shared)[((r_"), \
        "every idx_shared store holds the row only where the rule holds"
    for guard, _, idx in stores:
        name = re.sub(r"^\(\(bool\)(\w+)\)$", r"\1", guard)  # a flag set just before: read its rule
        rule = re.findall(rf"\b{name} = (.*);", body)[-1] if re.fullmatch(r"\w+", name) else guard
        assert all(t in rule for t in ("< n_valid", f"0 <= {idx}", f"{idx} < seq_kv")), f"validity rule: {rule}"
    assert "p[i] = acc + static_cast<long long>(r) * D + lane;" in source and "if (p[i] >= acc)" in source


def test_sender_calls_every_block_unguarded(source):
    """The sender's call is the whole body of its block loop: TileLang wraps a call in a bounds check when an
    ``address_of`` index may leave its buffer (an index past ``topk`` at the last block did), and a sender that
    skipped a block would leave WG1 waiting for its reads forever."""
    body = _body(source)
    loop = r"for \(int (kb_\d+) = 0; \1 < \(\(n_valid \+ \d+\) / \d+\); \+\+\1\) \{\s*smqa_send_block<.*?\);\s*\}"
    assert re.search(loop, body, re.S), "the sender's block loop holds its call and nothing else"


def _tma_query(body: str, dqk: int = 576, dv: int = 512, q_parts=None) -> int:
    """q and dO come by TMA on one mbarrier (one elected thread expects each tile's bytes and issues its copies, and
    arrives with dO's), never through registers or cp.async; returns where the wait for them is. ``q_parts``: the
    columns of each of q's buffers, in order (default: one buffer of dqk)."""
    bar = re.search(r"(\w+)\[0\]\.expect_transaction\(", body).group(1)
    q = "".join(rf"{bar}\[0\]\.expect_transaction\({64 * cols * 2}\);.*tl::tma_load\(Q_desc, {bar}\[0\].*"
                for cols in q_parts or (dqk,))
    assert re.search(q + rf"{bar}\[0\]\.arrive_and_expect_tx\({64 * dv * 2}\);.*tl::tma_load\(dO_desc, {bar}\[0\]",
                     body, re.S)
    assert "*(uint4*)(Q + " not in body and "*(uint4*)(dO + " not in body
    assert not re.search(r"cp_async\w*<16>\(\(&\(\(\(bfloat16_t\*\)(Q|dO)_shared", body)
    wait = re.search(r"(\w+)\[0\]\.wait\(0\);", body[body.index("tl::tma_load(dO_desc"):])
    assert wait
    return body.index("tl::tma_load(dO_desc") + wait.start()


def test_query_rows_arrive_by_tma(source):
    """q and dO come by TMA; WG0 reads its first block's indices and sends that block's copies while they fly; every
    thread waits for q and dO alone before the first product (k_ready tracks the block)."""
    body = _body(source)
    wait = _tma_query(body)
    first_gather = body.index("tl::cp_async_gs_conditional<16>((&(((bfloat16_t*)KV_shared)")
    assert body.index("= Indices[") < body.index("tl::tma_load(Q_desc") < first_gather < wait < body.index("wgmma")
    assert "cp_async_wait" not in body[:wait]


@pytest.mark.parametrize("dqk", [576, 512])
def test_bound_gather_copies_a_row_from_one_source_address(dqk):
    """The bound pass gathers a KV row's pieces with one ``smqa_cp_row`` call a row (``bwd_rows.CP_ROW_PRELUDE``):
    the source is the thread's first 16 bytes of the row, the other dqk / 64 pieces lie at 128-byte immediate offsets
    from it, and each destination is an address tile 0's layout gives, V's columns in its V buffer and the rest in its
    second one, moved to the block's tile by that tile's offsets (``smqa_tile_off``: one copy of the code for every
    tile). No KV row travels any other way."""
    from sparse_mqa_kernels import bwd_rows

    src = bwd_rows.compiled(dqk, 512)[0].get_kernel_source()
    body = _body(src)
    calls = re.findall(r"smqa_cp_row<(\d+), (\d+)>\(\(&\(KV\[(.*?)\]\)\), off\[0\], off\[1\], (.*?)\);\n", body)
    assert len(calls) == 2  # block 0 (offsets 0), then the loop's
    for n, nv, index, dst in calls:
        assert (int(n), int(nv)) == (dqk // 64, 8) and dst.count("(&(") == dqk // 64
        assert re.findall(r"\(bfloat16_t\*\)(\w+)\)\[", dst) == ["Va"] * 8 + ["Ra"] * (dqk // 64 - 8)
        assert index.endswith("(((int64_t)((int)threadIdx.x)) & (int64_t)7) * (int64_t)8))"), index
    offsets = re.findall(r"off\[(\d)\] = (?:smqa_tile_off\(\(\w+ % 3\), \(&\(\(\(bfloat16_t\*\)(\w+)\)|(0);)", body)
    assert offsets.count(("0", "", "0")) == 1 and offsets.count(("1", "", "0")) == 2  # block 0: no offsets
    assert ("0", "Va", "") in offsets and (("1", "Ra", "") in offsets) == (dqk > 512)
    assert "cp_async_gs" not in body and "KV[" not in re.sub(r"smqa_cp_row<\d+, \d+>\(\(&\(KV\[", "", body)
    assert '"l"(s + 128 * u)' in src and "cp.async.cg.shared.global [%0], [%1], 16;" in src


def test_sender_waits_by_the_global_chunk_count():
    """WG1 waits for the sender's read of the chunk before with the parity of the query's chunk count so far
    (``backward_ws.read_parity``): with the block's count alone Dqk 512 (8 chunks) hung on the H200."""
    for dqk, nch in ((576, 9), (512, 8)):
        key = bwd_plan.make_plan(1, 64, 128, 64, 64, dqk, 512).key()
        waits = re.findall(r"bar_read\[0\]\.wait\(\(\(\(kb_1 \* (\d+)\) \+ (\d+)\) & 1\)\)",
                           backward.kernel_source(key))
        assert waits == [(str(nch), str(c + 1)) for c in range(nch)], (dqk, waits)


@pytest.mark.parametrize("dqk", [576, 512])
@pytest.mark.parametrize("stored", [False, True], ids=["formed", "stored"])
def test_wg1_frees_kv_once_its_dq_product_is_done(dqk, stored):
    """WG1 issues its dq product (the only one that reads the KV tile) and chunk 0's two products together and frees
    KV once at most those two are pending (wgmma groups complete in order); then a chunk is staged once its products
    are done. Formed: a chunk's products go out just before its wait (``wait_wgmma<0>``). Stored: chunk c + 1's go
    out before chunk c's wait, which leaves them pending (``wait_wgmma<n>``, n = chunk c + 1's products), so KV is
    freed at ``wait_wgmma<4>`` (chunk 1's two pending too), and P and dS once the last chunk's products are done,
    before it is staged. A wait for fewer groups, or an arrive before the wait, would let WG0 gather over a tile or
    write P and dS over those being read, or stage a chunk whose products are still in flight."""
    nch = dqk // 64
    budget = bwd_plan.DEFAULT_PDS_BUDGET if stored else 0
    key = bwd_plan.make_plan(1, 64, 128, 64, 64, dqk, 512, pds_budget=budget).key()
    assert key.stored_pds == stored
    body = _body(backward.kernel_source(key))
    start = body.index("bar_p[0].wait((kb_1 & 1));")
    loop = body[start:body.index("warpgroup_reg_dealloc", start)]  # to the sender's branch
    commits = [m.start() for m in re.finditer(r"tl::warpgroup_commit_batch\(\);", loop)]
    free = loop.index("bar_k_free[0].arrive();")
    assert "KV_shared" in loop[:commits[0]] and "KV_shared" not in loop[commits[0]:], "only the dq product reads KV"
    groups = [1] + [2] * (nch - (dqk > 512)) + [1] * (dqk > 512)  # dq's, then each chunk's (576: the last has one)
    assert len(commits) == sum(groups) and "warpgroup_wait" not in loop
    # the wait before each chunk's staging (bar_staged's arrive ends each): how many groups it leaves pending
    staged = [m.start() for m in re.finditer(r"bar_staged\[0\]\.arrive\(\);", loop)]
    assert len(staged) == nch
    waits = [int(re.findall(r"tl::wait_wgmma<(\d+)>\(\);", loop[:at])[-1]) for at in staged]
    ahead = [0] * nch if not stored else [groups[c + 2] if c + 1 < nch else 0 for c in range(nch)]
    assert waits == ahead, waits
    for c, at in enumerate(staged):  # and every group of chunk c was committed before that wait
        done = len([x for x in commits if x < at]) - ahead[c]
        assert done == sum(groups[:c + 2]), (c, done)
    # P and dS are free once the block's last product is done: formed after the last staging, stored before it
    release = loop.index("bar_pds_free[0].arrive();")
    assert loop.count("bar_pds_free[0].arrive();") == 1 and release > commits[-1]
    assert (release < staged[-1]) == stored and release > staged[-2]
    assert re.search(r"tl::wait_wgmma<0>\(\);\s*bar_pds_free\[0\]\.arrive\(\);", loop[staged[-2]:]) or not stored
    before = len([c for c in commits if c < free])
    assert before == (3 if not stored else 5)
    assert re.search(rf"tl::wait_wgmma<{before - 1}>\(\);\s*bar_k_free\[0\]\.arrive\(\);", loop)


def _unguarded_reductions(src: str) -> list[str]:
    """Bulk reductions into Acc whose destination row is not checked ``0 <= row`` just before (an invalid
    slot's index must never become an address). Every reduction must name its row buffer recognisably."""
    lines = src.splitlines()
    bad, seen = [], 0
    for i, line in enumerate(lines):
        if "sparse_mqa_bulk_add_u64((" not in line:
            continue
        m = re.search(r"Acc\[\(*\(int64_t\)\(*(?:\(int\*\))?(\w+)\)?\[", line)
        assert m, f"cannot tell which row this reduction writes: {line.strip()[:120]}"
        seen += 1
        name = m.group(1)
        if not any(f"0 <= {name}[" in prev or f"0 <= ((int*){name})[" in prev for prev in lines[max(0, i - 4):i]):
            bad.append(line.strip()[:120])
    assert seen, "no bulk reduction found"
    return bad


def _shared_ranges(src: str) -> dict:
    """name -> byte offset of each buffer carved out of the kernel's dynamic shared memory."""
    return {m.group(1): int(m.group(2)) for m in
            re.finditer(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", src)}


@pytest.mark.parametrize("key", [ANCHOR_SINGLE, SMALL_GROUP], ids=["single-role-64-heads", "single-role-16-heads"])
def test_single_role_body_reduces_integers_only(key):
    """The single-role body (16/32-head groups, and single_role) keeps the integer-only dkv path too."""
    assert not key.warp_specialized
    src = backward.kernel_source(key)
    for bad in FLOAT_ATOMICS:
        assert bad not in src, f"{key}: floating-point atomic or reduction {bad!r} in the generated CUDA"
    assert "AtomicAdd" not in src
    assert re.search(r"sparse_mqa_bulk_add_u64\(.*?\(&\(Acc\[", src), key
    assert not _unguarded_reductions(src)


@pytest.mark.parametrize("key", [k for k in bwd_plan.all_variants() if not k.warp_specialized] + [ANCHOR_SINGLE],
                         ids=lambda k: f"Dqk{k.dqk}-hg{k.head_group}-bi{k.topk_block}")
def test_single_role_body_shares_no_shared_memory(key):
    """q, dO and the KV tile live across the top-k loop; a shared-memory merge once gave the int64 staging q's
    address (Dqk 512, 16-head groups: NaN dq from the second top-k block on, found by the suite on an H200)."""
    offsets = _shared_ranges(backward.kernel_source(key))
    assert {"Q_shared", "dO_shared", "KV_shared", "stage"} <= set(offsets), offsets
    assert len(set(offsets.values())) == len(offsets), offsets


def test_warp_specialised_roles_are_separate(source):
    """The 64-head body: three roles with their own register budgets (setmaxnreg.inc draws only on what
    setmaxnreg.dec released in the block: a budget over the launch's 168 per thread would hang), and no two
    shared-memory buffers at one address (the allocator cannot see that the roles run concurrently)."""
    from sparse_mqa_kernels import backward_ws

    assert ANCHOR.warp_specialized
    body = _body(source)
    alloc = re.findall(r"warpgroup_reg_alloc<(\d+)>", body)
    dealloc = re.findall(r"warpgroup_reg_dealloc<(\d+)>", body)
    nreg = backward_ws.NREG_STORED if "smqa_ld16" in body else backward_ws.NREG
    assert alloc == [str(n) for n in nreg[:2]] and dealloc == [str(nreg[2])], (alloc, dealloc)
    assert "__launch_bounds__(384, 1)" in body and sum(nreg) == 3 * 168
    offsets = _shared_ranges(source)
    assert {"Q_shared", "dO_shared", "KV_shared", "P_shared", "dS_shared", "stage"} <= set(offsets), offsets
    assert len(set(offsets.values())) == len(offsets), offsets


def test_variant_keys_choose_the_body():
    """64-head groups run the warp-specialised body, 16- and 32-head groups the single-role one, and
    ``single_role`` puts a 64-head group on the single-role body (the cross-check of the GPU tests)."""
    keys = bwd_plan.all_variants()
    assert {k.head_group for k in keys if k.warp_specialized} == {64}
    assert all(not k.warp_specialized for k in keys if k.head_group < 64)
    assert not ANCHOR_SINGLE.warp_specialized and ANCHOR_SINGLE != ANCHOR
    assert "warp-specialised" in ANCHOR.describe() and "single-role" in ANCHOR_SINGLE.describe()


def test_bound_trace_build_times_each_phase():
    """The bound pass's timing-probe build (``trace=True``, ``benchmarks/trace_backward.py``) reads the SM clock once
    before each warpgroup's loop and once at the end of each of its phases (``bwd_rows.TRACE_PHASES``), and puts one
    int64 a stamp and a phase; the backend's build reads no clock."""
    import tilelang

    from sparse_mqa_kernels import bwd_rows
    from sparse_mqa_kernels.target import EXECUTION_BACKEND, TARGET

    traced = tilelang.compile(bwd_rows.build_bound(576, 512, trace=True), out_idx=None, target=TARGET,
                              execution_backend=EXECUTION_BACKEND).get_kernel_source()
    body = _body(traced)
    phases = sum(len(role) for role in bwd_rows.TRACE_PHASES)
    assert body.count("smqa_clk()") == len(bwd_rows.TRACE_PHASES) + phases
    assert body.count("smqa_put(") == len(bwd_rows.TRACE_SLOTS) + phases
    assert "smqa_clk" not in bwd_rows.compiled(576, 512)[0].get_kernel_source()


@pytest.mark.parametrize("dims", [(576, 512), (512, 512)], ids=["576", "512"])
def test_row_scale_kernels_compile_without_float_atomics(dims):
    """``bwd_rows``: the bound pass runs S (WG0) and dP (WG1) as [64 heads x 64 slots] wgmma with q and dO in
    registers (only register-A products: for each of the three KV tiles, S over V's columns and over the rest, dP
    over V's), copies q (in two buffers) and dO by TMA and waits for them before its prologue forms and writes Delta
    (and with it the kernel LSE it formed from lse and the sink, and p_sink Delta where there is a sink), and counts
    each slot's bound with one integer add (``smqa_octave_add``: red.add.u32), into its row's octave counts only,
    after a fixed-order sum over heads (``smqa_col_sums``); shared memory fits an sm_90 block (two tiles over q and
    dO, each tile's hand-over over its V buffer).
    The row scales use no atomic; the conversion rounds float64 to bf16 once (cvt.rn.bf16.f64)."""
    from sparse_mqa_kernels import bwd_rows
    from sparse_mqa_kernels.target import SMEM_LIMIT

    dqk, dv = dims
    bound, scales, convert = (k.get_kernel_source() for k in bwd_rows.compiled(*dims))
    body = _body(bound)
    assert "sparse_mqa_bwd_bound_kernel" in body
    assert "wgmma_ss<" not in body
    products = re.findall(r"for \(int (ki\w*) = 0; \1 < (\d+); \+\+\1\) \{\s*tl::wgmma_rs<[^,]+, [^,]+, [^,]+, (\d+), "
                          r"(\d+), 16, [^>]*>\(reinterpret_cast<const uint32_t\*>\((\w+) \+", body)
    rope = dqk - dv
    assert sorted((int(n), m, k, a) for _, n, m, k, a in products) == sorted(
        ([(dv // 16, "64", "64", "q_v")] + [(rope // 16, "64", "64", "q_r")] * (rope > 0)
         + [(dv // 16, "64", "64", "do_f")]) * bwd_rows.TILES)
    assert set(re.findall(r"(smqa_\w+)\(", body)) == {"smqa_octave_add", "smqa_col_sums", "smqa_tile", "smqa_tile_off",
                                                       "smqa_ex_put", "smqa_ex_mul", "smqa_lse2", "smqa_sink_prob"}
    # the hand-over: WG0 puts P, WG1 multiplies its factor by it, in the block's tile (a select of the three)
    tiles = r"smqa_tile\(\(\w+ % 3\), \(&\(\(\(bfloat16_t\*\)Va\)\[0\]\)\), \(&\(\(\(bfloat16_t\*\)Vb\)\[0\]\)\), " \
            r"\(&\(\(\(bfloat16_t\*\)Vc\)\[0\]\)\)\)"
    assert re.search(r"smqa_ex_put\(" + tiles + r", acc, \(\(int\)threadIdx\.x\)\)", body)
    assert re.search(r"smqa_ex_mul\(accp, " + tiles + r", \(\(\(int\)threadIdx\.x\) - 128\)\)", body)
    assert "globaltimer" not in bound and "stamps" not in body  # the timing probe's build only
    assert set(re.findall(r"smqa_octave_add\(\(&\((\w+)\[", body)) == {"Hist"}
    assert set(re.findall(r"\b(?:red|atom)\.[\w.]+", bound)) == {"red.relaxed.gpu.global.add.u32"}
    wait = _tma_query(body, *dims, q_parts=(dv, rope) if rope else (dv,))
    assert wait < body.index("Delta[") < body.index("wgmma_rs")  # q and dO before Delta, both before the products
    # a row split over blocks (bwd_plan.bound_split): its first piece (top-k block 0) alone writes Delta
    assert re.search(r"&& \((condval_\d+) == 0\)\) \{\s*if \(\(s_i < seq_len\) && \(0 <= s_i\)\) \{\s*Delta\[", body)
    first = body[body.index("Delta["):body.index("warpgroup_reg_alloc", wait)]
    assert re.search(r"Lse2\[.*\] = \(\(float\*\)lse2_s\)\[", first)
    assert re.search(r"if \(has_sink\) \{.*SinkDelta\[.*\] = \(smqa_sink_prob\(", first, re.S)
    assert "int per_piece, int pieces" in body and "int whole" in body
    assert "tl::warp_reduce_sum" in body
    # WG0 and WG1 meet only at mbarriers: no named barrier in their loops (the producer's share of the prologue has)
    wg0 = body.index("warpgroup_reg_alloc", wait)
    wg1 = body.index("warpgroup_reg_alloc", wg0 + 1)
    producer = body.index("warpgroup_reg_dealloc", wg1)
    ids = [set(re.findall(r"__sync_thread_partial\((\d+), 128\)", part))
           for part in (body[wg0:wg1], body[wg1:producer], body[:wg0] + body[producer:])]
    assert not ids[0] and not ids[1] and ids[2], ids
    assert not re.search(r"__sync_thread_partial\(\d+, (?!128\))", body)
    # q's buffers land where tile b goes, dO where tile c goes (T.view): the tiles' buffers, q's and dO's among them
    assert re.search(r"tma_load\(Q_desc, \w+\[0\], \(&\(\(\(bfloat16_t\*\)Vb\)", body)
    assert not rope or re.search(r"tma_load\(Q_desc, \w+\[0\], \(&\(\(\(bfloat16_t\*\)Rb\)", body)
    assert re.search(r"tma_load\(dO_desc, \w+\[0\], \(&\(\(\(bfloat16_t\*\)Vc\)", body)
    shared = r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);"
    offsets = {m[0]: int(m[1]) for m in re.findall(shared, body)}
    sizes = {**{"V" + t: 64 * dv * 2 for t in "abc"}, **{"R" + t: 64 * rope * 2 for t in "abc" if rope},
             "red_s": 4 * 64 * 4, "rows_s": bwd_rows.ROW_LISTS * 64 * 4, "delta_s": 256, "c_s": 256, "g_s": 256,
             "lse2_s": 256}
    assert set(offsets) == set(sizes) and max(offsets[b] + sizes[b] for b in sizes) <= SMEM_LIMIT
    for src in (scales, convert):
        assert "atomic" not in src.lower() and "red." not in src
    assert "cvt.rn.bf16.f64" in convert and "smqa_store_bf16_f64((&(dKV[" in _body(convert)


def test_prep_pass_compiles_without_atomics():
    """``bwd_prep`` (Delta and the fixed-point bound per query row): fixed-order sums, no atomic of any kind,
    both head dims of the contract."""
    from sparse_mqa_kernels import bwd_prep
    from sparse_mqa_testkit import contract

    for dqk, dv in contract.PRODUCTION_DIMS:
        src = bwd_prep.compiled(dqk, dv).get_kernel_source()
        assert "sparse_mqa_bwd_prep_kernel" in src
        assert "atomic" not in src.lower() and "red.global" not in src
        assert re.search(r"float\* __restrict__ Delta", src) and re.search(r"float\* __restrict__ Bound", src)


def test_reduction_benchmark_compiles_and_pads_to_its_occupancy():
    """``benchmarks/bench_reduce.py`` (the reduction floors behind issues 6 and 26's BENCHMARKS numbers): its
    kernel compiles for sm_90a, sends rows only with its config's bulk reduction (.add.u64, .add.f32 for the
    float32 configs, .add.u32 for the int32 ones), and its shared memory admits exactly the blocks per SM the config
    names; a register config sends with its own red.global flavour only."""
    mod = benchmark_module("bench_reduce")
    assert mod.parse("16x2/3w256") == (16, 2, 3, 256, "int64") and mod.parse("8x1/2f32")[-1] == "float32"
    assert mod.parse("16x4/1i32") == (16, 4, 1, 576, "int32")
    for config in ("8x2/1", "8x2/3", "8x2/3f32", "8x2/3i32"):
        kernel = mod.build(*mod.parse(config), 132)
        src = kernel.get_kernel_source()
        dtype = mod.parse(config)[-1]
        sends = set(re.findall(r"(sparse_mqa_bulk_add_\w+)\(\(", src))
        assert sends == {mod.SEND[dtype]}, sends
        assert "AtomicAdd" not in src
        # (TIR prints no dtype for float32, its default)
        typed = "" if dtype == "float32" else f', "{dtype}"'
        words = int(re.search(rf'sblock_alloc_buffer\(\((\d+),\){typed}, scope="shared.dyn"',
                              str(kernel.adapter.ir_module)).group(1))
        per_sm = mod.parse(config)[2]
        # an SM has 228 KB of shared memory and each block also takes 1 KB of it
        size = words * mod.ESIZE[dtype]
        assert (228 * 1024) // (size + 1024) == per_sm, (config, size)
    # the red: configs send every term with one red.global.add from registers, no bulk copy and no atomicAdd
    assert mod.parse("red:frag-u32/2") == ("red", "frag", 2, 576, "int32")
    with pytest.raises(ValueError, match="unknown register pattern"):
        mod.parse("red:line-u64/1")
    for config, call in (("red:frag-u64/1", "smqa_red_u64"), ("red:smem-u32/1", "smqa_red_u32"),
                         ("red:tfrag-u32/2", "smqa_red_u32"), ("red:v4-f32/1", "smqa_red_v4_f32")):
        src = mod.build(*mod.parse(config), 132).get_kernel_source()
        body = src[src.index("red_reduce_kernel("):]
        assert set(re.findall(r"(smqa_red_\w+|sparse_mqa_bulk_add_\w+)\(\(", body)) == {call}, config
        assert "AtomicAdd" not in body and "atomicAdd" not in body


def test_wide_probe_compiles_in_cudnns_shape():
    """``benchmarks/probe_wide_backward.py`` (issue 26's probe): each variant compiles for sm_90a with two 128-thread
    warpgroups and S / dP as 64 x BI wgmma tiles; 64-slot blocks fill shared memory with Q, dO, the KV block, P and
    dS only (cuDNN's tiles); a sending variant sends only with its own operation, and none uses a float atomic; ``ws``
    is the tilelang backend's main kernel."""
    mod = benchmark_module("probe_wide_backward")
    with pytest.raises(ValueError, match="no shared memory for staging"):
        mod.build_program(64, "bulk")
    for variant, sends in (("64/none", set()), ("48/bulk", {"sparse_mqa_bulk_add_u32"}),
                           ("48/line", {"smqa_red_u32"}), ("48/ws", {"smqa_send_block"})):
        src = mod.compiled(variant).get_kernel_source()
        body = src[src.index('extern "C" __global__'):]
        bi = variant.split("/")[0]
        shapes = set(re.findall(r"wgmma_ss<[^,]+, [^,]+, [^,]+, (\d+), (\d+), 16", body))
        assert ("64", bi) in shapes, (variant, shapes)
        assert set(re.findall(r"((?:sparse_mqa|smqa)_\w+_u32|smqa_send_\w+)[(<]", body)) == sends, variant
        assert "atomicAdd" not in body and "AtomicAdd" not in body
        threads = 384 if variant.endswith("ws") else 256
        assert f"__launch_bounds__({threads}, 1)" in body, variant
    assert mod.compiled("48/ws").get_kernel_source() == backward.kernel_source(ANCHOR_FORMED)


def test_design_a_kernels_compile():
    """Design (a) of issue 26 as ``benchmarks/rows_backend.py`` runs it: ``prepw`` sums each (query, head) in one
    warp (no atomics); ``lean4`` runs S^T alone as [64 slots x 64 heads] tiles, one accumulator per warpgroup, and adds
    each slot's two bound sums to its row's U and W only with red.add.u64 (no |V_j| read); ``scales`` uses no
    atomics. All of them build for Dqk 512 / Dv 512 as well; so does the dP-exact bound pass for 576 / 512. (The
    octave bound pass, the conversion and the main kernel are the ``tilelang`` backend's now: the tests above.)"""
    split = benchmark_module("probe_split_backward")
    bodies = {}
    for which in ("prepw", "lean4", "scales"):
        src = split.compiled(which).get_kernel_source()
        bodies[which] = src[src.index('extern "C" __global__'):]
        assert "atomicAdd" not in bodies[which] and "AtomicAdd" not in bodies[which], which
    assert "warp_reduce_sum" in bodies["prepw"] and "warp_reduce_max" in bodies["prepw"]
    body = bodies["lean4"]
    assert set(re.findall(r"((?:sparse_mqa|smqa)_\w+)\(\(", body)) == {"smqa_red_u64"}
    assert set(re.findall(r"smqa_red_u64\(\(&\((Row[UW])\[", body)) == {"RowU", "RowW"}
    assert "VNorm" not in body
    assert set(re.findall(r"wgmma_ss<[^,]+, [^,]+, [^,]+, (\d+), (\d+), 16", body)) == {("64", "64")}
    assert set(re.findall(r"wgmma_ss<[^>]*>\([^;]*\(acc(\d)\b", body)) == {"0", "1"}
    # the other production dims build too
    for which in ("prepw", "lean4", "scales"):
        assert "atomicAdd" not in split.compiled(which, dims=(512, 512)).get_kernel_source(), which
    # the dP-exact bound pass: S^T and dP^T as [64 slots x 32 heads] tiles (each warpgroup half the heads), one
    # int64 sum a row; its helpers use no atomics
    src = split.compiled("exact").get_kernel_source()
    body = src[src.index('extern "C" __global__'):]
    assert set(re.findall(r"wgmma_ss<[^,]+, [^,]+, [^,]+, (\d+), (\d+), 16", body)) == {("64", "32")}
    assert set(re.findall(r"smqa_red_u64\(\(&\((Row\w+)\[", body)) == {"RowB"}
    assert "atomicAdd" not in body
    for which in ("vnorms", "qvmax", "scales1"):
        assert "atomicAdd" not in split.compiled(which).get_kernel_source(), which


def test_stored_bound_pass_writes_p_and_ds_through_the_tile_before_freeing_it():
    """The ``stored`` bound pass: WG0 packs P and writes it out (``smqa_rows_out``: staged past the hand-over, its
    named barrier, whole rows) after it arrives on ``pfull``, WG1 dS after it arrives on ``sums``; each then arrives
    on the tile's ``free``, which counts both warpgroups (128 each). The calls are unguarded statements (a skipped
    one would leave its warpgroup's other threads at the named barrier). The formed build writes neither."""
    from sparse_mqa_kernels import bwd_rows

    body = _body(bwd_rows.compiled(576, 512, True)[0].get_kernel_source())
    outs = list(re.finditer(r"\n( *)smqa_rows_out\(smqa_at\(smqa_tile\(\((i_\d+) % 3\).*?\), (\d+)\), pk, Pds, .*?, "
                            r"(\d+)\);\n\1bar_free\[\(\2 % 3\)\]\.arrive\(\);", body))
    assert [(int(m.group(3)), int(m.group(4))) for m in outs] == list(zip(bwd_rows.PDS_STAGE, bwd_rows.PDS_BARRIERS))
    assert body.count("smqa_rows_out(") == 2 and body.count("smqa_pack(pk, ") == 2
    wg0, wg1 = (m.start() for m in outs)
    assert body.rindex("bar_pfull[0].arrive();", 0, wg0) > body.rindex("smqa_ex_put(", 0, wg0)
    assert body.rindex("bar_sums[0].arrive();", 0, wg1) > body.rindex("smqa_col_sums(", 0, wg1)
    assert re.findall(r"bar_free\[\d\]\.init\((\d+)\)", body) == ["256"] * bwd_rows.TILES
    formed = _body(bwd_rows.compiled(576, 512)[0].get_kernel_source())
    assert "smqa_rows_out(" not in formed and "Pds[" not in formed and "smqa_pack(" not in formed
    assert re.findall(r"bar_free\[\d\]\.init\((\d+)\)", formed) == ["128"] * bwd_rows.TILES


def test_stored_main_kernel_reads_p_and_ds_instead_of_forming_them():
    """The ``stored_pds`` main kernel loads the block's P and dS (``smqa_ld16``, zeros on padded heads and past the
    row's last bound-pass block) and forms neither: no exp2, no Lse2 or Delta read, two fewer products a block than
    the build that forms them."""
    stored, formed = (_body(backward.kernel_source(k)) for k in (ANCHOR, ANCHOR_FORMED))
    loads = re.findall(r"smqa_ld16\(\(&\(\w+\[.*?\]\)\), Pds, (.*?)\);\n", stored)
    assert len(loads) == 2, loads  # P and dS, in a loop over the thread's pieces
    for cond in loads:
        assert "< heads)" in cond and "((n_valid + 63) >> 6)" in cond, cond
    assert "exp2" not in stored and "Lse2[" not in stored and "Delta[" not in stored
    assert "smqa_ld16(" not in formed and "exp2" in formed
    gemms = [len(re.findall(r"wgmma_(?:ss|rs)<", b)) for b in (stored, formed)]
    assert gemms[1] - gemms[0] == 2, gemms
