"""CPU CI: the forward kernel compiles for sm_90a (explicit target, nvcc) and its CUDA has the contract's shape.

Structural checks on the generated source: the only reads of KV are the producer's cp.async copies, and they sit
inside ``if (ok)`` where ``ok`` is the contract's rule (``0 <= idx < Skv``) computed only for slots below
``n_valid = min(topk_length, L)``; the consumer masks invalid slots to -inf; stores are guarded by the head count.
Also: bad arguments are rejected with a ValueError naming them before any compile or GPU work.
"""

from __future__ import annotations

import re
import shutil

import pytest

from sparse_mqa_kernels import fwd_plan

pytest.importorskip("tilelang")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile for sm_90a")


def _blocks(src: str):
    """(line, headers of the enclosing brace blocks) for every line of C source."""
    stack, out, closed = [], [], ""
    for line in src.splitlines():
        out.append((line, list(stack)))
        for ch in line:
            if ch == "{":
                # "} else {" opens the else of the block just closed: keep that block's condition in view
                stack.append(f"else of {closed}" if "else" in line else line)
            elif ch == "}" and stack:
                closed = stack.pop()
    return out


@pytest.fixture(scope="module")
def source():
    from sparse_mqa_kernels import forward

    key = fwd_plan.variant_key(576, 512, has_sink=True, has_topk_length=True)
    kernel = forward.compiled(key)
    assert forward.TARGET == {"kind": "cuda", "arch": "sm_90a"}
    return kernel.get_kernel_source()


@needs_nvcc
def test_kv_is_read_only_under_the_contracts_validity_rule(source):
    lines = _blocks(source)
    kv_reads = [(ln, hdrs) for ln, hdrs in lines if re.search(r"\bKV\[", ln)]
    assert kv_reads, "no KV access found in the generated kernel"
    for ln, hdrs in kv_reads:
        assert "cp_async" in ln, f"KV read outside the producer's cp.async: {ln.strip()}"
        assert any(re.search(r"if \(\(bool\)ok\)", h) for h in hdrs), f"cp.async not guarded by ok: {ln.strip()}"
    ok_sets = [(ln, hdrs) for ln, hdrs in lines if re.match(r"\s*ok = .*idx", ln)]
    assert ok_sets, "validity flag ok is never computed from idx"
    for ln, hdrs in ok_sets:
        idx = r"idx\w*(\[\w+\])?"
        assert re.search(rf"\(0 <= {idx}\)", ln) and re.search(rf"\({idx} < seq_kv\)", ln), ln.strip()
        assert "n_valid" in ln or any("n_valid" in h for h in hdrs), f"validity ignores slot < n_valid: {ln}"
    # the index itself is read only for slots below n_valid = min(topk_length, L)
    idx_reads = [(ln, hdrs) for ln, hdrs in lines if re.search(r"\bIndices\[", ln)]
    assert idx_reads and all(any("n_valid" in h for h in hdrs) for _, hdrs in idx_reads)
    assert re.search(r"n_valid = min\(\w+, topk\)", source) and "TopkLen[" in source


@needs_nvcc
def test_invalid_slots_are_masked_to_minus_inf_after_the_scores(source):
    lines = _blocks(source)
    masked = [i for i, (ln, hdrs) in enumerate(lines)
              if re.search(r"-CUDART_INF_F", ln) and any("valid_shared" in h for h in hdrs)]
    assert masked, "no -inf select under a valid_shared test"
    first_gemm = next(i for i, (ln, _) in enumerate(lines) if "wgmma_ss" in ln)
    assert all(i > first_gemm for i in masked)


@needs_nvcc
def test_stores_are_guarded_by_the_head_count(source):
    stores = [(ln, hdrs) for ln, hdrs in _blocks(source) if re.search(r"^\s*(\*\(uint4\*\)\(Out|Lse\[)", ln)]
    assert stores, "no stores of Out or Lse found"
    for ln, hdrs in stores:
        assert any("heads" in h for h in hdrs), f"store not guarded by the head count: {ln.strip()[:120]}"


@needs_nvcc
def test_sizes_are_symbolic(source):
    """B, S, Skv, H and L are kernel arguments, so changing them reuses the compiled variant."""
    sig = re.search(r"__global__ void __launch_bounds__\(384, 1\) sparse_mqa_fwd_kernel\(([^)]*)\)", source)
    assert sig, "kernel signature not found"
    for name in ("int batch", "int heads", "int seq_kv", "int seq_len", "int topk", "float scale2"):
        assert name in sig.group(1)


def test_precompile_covers_every_variant(monkeypatch):
    from sparse_mqa_kernels import forward

    seen = []
    monkeypatch.setattr(forward, "compiled", lambda key: seen.append(key))
    descs = forward.precompile()
    assert seen == fwd_plan.all_variants()
    assert descs == [k.describe() for k in fwd_plan.all_variants()]


def test_bad_arguments_are_rejected_before_gpu_work():
    torch = pytest.importorskip("torch")
    from sparse_mqa_kernels.forward import sparse_mqa_forward

    q = torch.zeros(1, 2, 3, 576, dtype=torch.bfloat16)
    kv = torch.zeros(1, 10, 576, dtype=torch.bfloat16)
    idx = torch.zeros(1, 2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be bfloat16, got float16"):
        sparse_mqa_forward(q.half(), kv, idx, 0.1, 512)
    with pytest.raises(ValueError, match="attn_sink must be float32"):
        sparse_mqa_forward(q, kv, idx, 0.1, 512, attn_sink=torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="topk_length must have rank 2"):
        sparse_mqa_forward(q, kv, idx, 0.1, 512, topk_length=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="not supported"):
        sparse_mqa_forward(q, kv, idx, 0.1, 256)
    with pytest.raises(ValueError, match="sm_scale must be finite"):
        sparse_mqa_forward(q, kv, idx, float("nan"), 512)
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        sparse_mqa_forward(q, kv, idx, 0.1, 512)
