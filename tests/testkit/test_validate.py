"""backends.validate: a kernel that runs only on CUDA refuses CPU tensors by name, before any GPU work."""

import pytest

from sparse_mqa_testkit.backends.reference import ReferenceBackend
from sparse_mqa_testkit.backends.validate import check_backward_args, check_forward_args
from sparse_mqa_testkit.cases import Case
from support import case_args


def test_device_type_is_required_only_when_asked():
    t = case_args(ReferenceBackend(), Case(Dqk=576, Dv=512))
    fwd = (t["q"], t["kv"], t["indices"], t["sm_scale"], t["d_v"])
    bwd = (t["q"], t["kv"], t["out"], t["grad_out"], t["lse"], t["attn_sink"], t["indices"], t["sm_scale"])
    assert check_forward_args(*fwd).Dqk == 576 and check_backward_args(*bwd).Dv == 512
    with pytest.raises(ValueError, match=r"^q must be on a CUDA device, got cpu$"):
        check_forward_args(*fwd, device_type="cuda")
    with pytest.raises(ValueError, match=r"^q must be on a CUDA device, got cpu$"):
        check_backward_args(*bwd, device_type="cuda")
