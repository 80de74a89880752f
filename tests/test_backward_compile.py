"""CPU CI: the deterministic backward compiles for sm_90a (explicit target, no GPU needed), and the generated
CUDA accumulates dkv only as int64 into the integer accumulator: no floating-point atomic or reduction."""

import re

import pytest

pytest.importorskip("tilelang")

from sparse_mqa_testkit.kernels import backward, bwd_plan  # noqa: E402

FLOAT_ATOMICS = ("atomicAdd(", "AtomicAddx2", "AtomicAddx4", "tma_store_add", "red.global.add.f",
                 "red.global.add.v", "red.global.add.noftz", "atom.global.add.f", ".add.f32", ".add.f16",
                 ".add.bf16", ".add.noftz")


@pytest.fixture(scope="module")
def source():
    assert backward.TARGET == {"kind": "cuda", "arch": "sm_90a"}
    return backward.kernel_source(bwd_plan.make_plan(1, 4096, 8192, 64, 2048, 576, 512).variant)


def test_compiles_for_sm90a(source):
    assert "sparse_mla_bwd_kernel" in source
    assert "int64_t* __restrict__ Acc" in source


def test_dkv_reduction_is_integer_only(source):
    for bad in FLOAT_ATOMICS:
        assert bad not in source, f"floating-point atomic or reduction {bad!r} in the generated CUDA"
    bulk = re.findall(r"cp\.reduce\.async\.bulk[\w:.]*", source)
    atomics = re.findall(r"\bAtomicAdd\(", source)
    assert bulk or atomics, "expected the dkv accumulation to use bulk reductions or atomics"
    assert set(bulk) <= {"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64"}, sorted(set(bulk))
    # every element-wise atomic adds a rounded int64 into the accumulator
    assert len(atomics) == len(re.findall(r"AtomicAdd\(\(&\(Acc\[", source))
    for m in re.finditer(r"AtomicAdd\(\(&\(Acc\[.*?\)\]\)\), (.*?)\);\n", source):
        assert m.group(1).startswith("((int64_t)"), m.group(1)[:80]
    if backward.REDUCE == "bulk":
        # the bulk reduction's destination is a row of the int64 accumulator
        assert re.search(r"smqa_bulk_add_u64\(.*?\(&\(Acc\[", source)


def _shared_ranges(src: str) -> dict:
    """name -> byte offset of each buffer carved out of the kernel's dynamic shared memory."""
    return {m.group(1): int(m.group(2)) for m in
            re.finditer(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", src)}


ANCHOR = bwd_plan.make_plan(1, 4096, 8192, 64, 2048, 576, 512).variant


@pytest.mark.parametrize("config", [dict(fused=True, drain=False), dict(fused=True, warp_stage=True)],
                         ids=["fused-undrained", "warp-stage"])
def test_other_configurations_reduce_integers_only(config):
    """The selectable kernel configurations (BENCHMARKS.md) keep the integer-only dkv path."""
    src = backward.kernel_source(ANCHOR, **config)
    for bad in FLOAT_ATOMICS:
        assert bad not in src, f"{config}: floating-point atomic or reduction {bad!r} in the generated CUDA"
    assert re.search(r"smqa_bulk_add_u64\(.*?\(&\(Acc\[", src), config


def test_undrained_staging_shares_no_memory():
    """With ``drain=False`` the last bulk reduction of a top-k block still reads its staging buffer while the
    next block runs, which is safe only if no other tile lives in that memory: the staging must come after
    every other buffer of the dynamic shared memory, at an offset of its own."""
    offsets = _shared_ranges(backward.kernel_source(ANCHOR, fused=True, drain=False))
    assert "stage" in offsets, sorted(offsets)
    others = {k: v for k, v in offsets.items() if k != "stage"}
    assert others and max(others.values()) < offsets["stage"], offsets
    assert len(set(offsets.values())) == len(offsets), f"buffers share an offset: {offsets}"


def test_warp_stage_waits_only_on_its_own_warp():
    """``warp_stage``: each warp stages the dkv columns its own mma fragment holds (the ownership test in the
    kernel must fold away: TileLang proved it from the layout) and the staging uses warp barriers only."""
    src = backward.kernel_source(ANCHOR, fused=True, warp_stage=True)
    staging = src[src.index("smqa_bulk_wait_read0();", src.index("for (int kb")):src.rindex("smqa_bulk_commit();")]
    assert "__syncwarp()" in staging
    assert "__syncthreads()" not in staging, "block-wide barrier inside the per-warp staging"
    assert ">> 5) ==" not in staging, "warp ownership of a dkv column was not proven at compile time"
