"""``target.kernel_ready``: what every kernel launch is handed (contiguous, 16-byte aligned), on CPU tensors."""

import pytest

torch = pytest.importorskip("torch")

from sparse_mqa_kernels.target import ALIGN_BYTES, kernel_ready  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32])
def test_kernel_ready_copies_only_what_the_kernels_cannot_read(dtype):
    base = torch.arange(64, dtype=torch.float32).to(dtype)
    assert kernel_ready(base) is base  # aligned and contiguous: no copy
    odd = base[1:33]  # contiguous, one element into its storage
    assert odd.data_ptr() % ALIGN_BYTES != 0
    got = kernel_ready(odd)
    assert got.data_ptr() % ALIGN_BYTES == 0 and got.is_contiguous() and torch.equal(got, odd)
    strided = base.view(8, 8).t()
    got = kernel_ready(strided)
    assert got.is_contiguous() and got.data_ptr() % ALIGN_BYTES == 0 and torch.equal(got, strided)
