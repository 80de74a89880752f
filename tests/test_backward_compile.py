"""CPU CI: the deterministic backward compiles for sm_90a (explicit target, no GPU needed), and the generated
CUDA accumulates dkv only with integer atomics into the int64 accumulator: no floating-point atomic anywhere."""

import re

import pytest

pytest.importorskip("tilelang")

from sparse_mqa_testkit.kernels import backward, bwd_plan  # noqa: E402


@pytest.fixture(scope="module")
def source():
    assert backward.TARGET == {"kind": "cuda", "arch": "sm_90a"}
    return backward.kernel_source(bwd_plan.make_plan(1, 4096, 8192, 64, 2048, 576, 512).variant)


def test_compiles_for_sm90a(source):
    assert "sparse_mla_bwd_kernel" in source
    assert "int64_t* __restrict__ Acc" in source


def test_dkv_has_no_floating_point_atomic(source):
    calls = re.findall(r"\b(\w*[Aa]tomic\w*|red\.global[\w.]*)\s*\(?", source)
    calls = [c for c in calls if c not in ("atomic",)]
    assert calls, "expected the dkv accumulation to use atomics"
    # every atomic call is the templated AtomicAdd, and each one targets the int64 accumulator
    assert set(calls) <= {"AtomicAdd"}, f"unexpected atomic intrinsics: {sorted(set(calls))}"
    for m in re.finditer(r"AtomicAdd\(\(&\((\w+)\[", source):
        assert m.group(1) == "Acc", f"atomic add into {m.group(1)}, not the int64 accumulator"
    n_atomic = len(re.findall(r"AtomicAdd\(", source))
    assert n_atomic == len(re.findall(r"AtomicAdd\(\(&\(Acc\[", source))
    # what is added is an int64 (rounded fixed point), never a float
    for m in re.finditer(r"AtomicAdd\(\(&\(Acc\[.*?\)\]\)\), (\(\(int64_t\).*?)\);", source):
        assert m.group(1).startswith("((int64_t)")
    for bad in ("atomicAdd(", "AtomicAddx2", "AtomicAddx4", "red.global.add.f32", "red.global.add.v",
                "atom.global.add.f32", "atomicAdd_block"):
        assert bad not in source, f"floating-point or vector atomic {bad!r} in the generated CUDA"
