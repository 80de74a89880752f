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
