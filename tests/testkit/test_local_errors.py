"""Row-by-row tolerance at production sizes: a bug confined to one KV row or one head hides inside the whole
result's relative L2 (one row of 8192 moves it by ~1e-4) and must still fail, naming the row."""

from __future__ import annotations

import pytest
import torch

from sparse_mqa_testkit.backends.reference import ReferenceBackend
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.checks import check_backward_tolerance
from sparse_mqa_testkit.compare import Expected
from support import EmulatedKernel

# production head dims and cache length; few queries keep the host oracle quick
CASE = Case(S=32, Skv=8192, H=16, L=256, Dqk=576, Dv=512, sink="finite", pattern="local", seed=11)


class Planted(ReferenceBackend):
    """The reference with ``tensor[index] *= factor`` after its backward."""

    def __init__(self, tensor, index, factor):
        super().__init__()
        self.tensor, self.index, self.factor = tensor, index, factor
        self.name = f"{tensor}{list(index)}x{factor}"

    def backward(self, *args, **kw):
        r = dict(zip(("dq", "dkv", "d_sink"), super().backward(*args, **kw)))
        t = r[self.tensor].double()
        t[self.index] *= self.factor
        r[self.tensor] = t.to(r[self.tensor].dtype)
        return r["dq"], r["dkv"], r["d_sink"]


def _typical_referenced_row():
    norms = Expected(CASE).exact["dkv"][0].norm(dim=-1)
    used = torch.nonzero(norms > 0).flatten()
    return int(used[torch.argsort(norms[used])[len(used) // 2]])


def test_a_plausible_kernel_passes_at_production_size():
    res = check_backward_tolerance(EmulatedKernel(), CASE)
    assert res.passed, res.message


@pytest.mark.parametrize("factor", [1.02, 1.05])
def test_one_kv_row_off_by_a_few_percent_fails_and_names_the_row(factor):
    row = _typical_referenced_row()
    res = check_backward_tolerance(Planted("dkv", (0, row), factor), CASE)
    assert not res.passed
    entry = res.per_tensor["dkv"]
    assert entry["whole_ratio"] < 1, "the whole result's measure alone would have missed it"
    assert entry["worst_row"]["index"] == (0, row) and entry["rows_over"] == 1
    assert f"1 of 8192 rows over their allowance; the worst, row (0, {row}) (b, KV row)" in res.message


def test_one_head_of_dq_off_by_a_few_percent_fails_and_names_it():
    res = check_backward_tolerance(Planted("dq", (slice(None), slice(None), 5), 1.03), CASE)
    assert not res.passed
    entry = res.per_tensor["dq"]
    assert entry["worst_row"]["index"][2] == 5 and entry["rows_over"] == CASE.S
    assert "(b, query, head)" in res.message
