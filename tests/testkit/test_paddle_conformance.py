"""The conformance checks on the ``reference`` backend driven through the Paddle frontend.

The checks speak torch; ``through_paddle("reference")`` turns every call into torch -> paddle (DLPack) ->
``PaddleBackend`` (validation on the paddle tensors) -> torch backend -> paddle -> torch, so each input and
each result crosses the frontend both ways (``test_paddle_backend`` shows that the backend is handed tensors
decoded from paddle's).
"""

import pytest

from sparse_mqa_testkit.cases import Case


@pytest.fixture(scope="module")
def backend():
    from sparse_mqa_testkit.paddle import frontend
    from sparse_mqa_testkit.paddle.backend import through_paddle

    try:
        frontend.import_paddle()
    except ImportError:
        pytest.skip("needs paddlepaddle (pip install '.[paddle]')")

    return through_paddle("reference")


CASES = [
    Case(seed=11),
    Case(sink="finite", topk="random", invalid="mixed", duplicates=True, seed=12),
    Case(B=2, S=5, Skv=9, H=3, L=11, Dqk=12, Dv=12, sink="mixed", invalid="empty_rows", order="sorted", seed=13),
    Case(S=3, Skv=6, H=5, L=4, Dqk=10, Dv=3, sink="pos_inf", topk="random", invalid="out_of_range", seed=14),
]


def _checks():
    from sparse_mqa_testkit import checks

    return [checks.check_backward_tolerance, checks.check_forward_tolerance, checks.check_determinism,
            checks.check_guards]


@pytest.mark.parametrize("check", range(4), ids=["tolerance", "forward_tolerance", "determinism", "guards"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.describe())
def test_reference_through_paddle_passes(backend, check, case):
    res = _checks()[check](backend, case)
    res.raise_if_failed()
    assert res.passed


@pytest.mark.parametrize("case", CASES[1:3], ids=lambda c: c.describe())
def test_reference_through_paddle_rejects_every_registry_entry(backend, case):
    from sparse_mqa_testkit.checks import check_rejection

    res = check_rejection(backend, case)
    res.raise_if_failed()
    assert res.notes["entries"] > 0


# ---- the checks still bite through the frontend ------------------------------------------------------------

def _flipped_sink():
    from sparse_mqa_testkit.backends.reference import ReferenceBackend

    class FlippedSink(ReferenceBackend):
        name = "flipped-sink"

        def backward(self, *args, **kw):
            dq, dkv, d_sink = super().backward(*args, **kw)
            return dq, dkv, -d_sink

    return FlippedSink()


def _jittery():
    """Claims determinism, but each call bumps a different dkv entry (a stand-in for a racy accumulation)."""
    from sparse_mqa_testkit.backends.reference import ReferenceBackend

    class Jittery(ReferenceBackend):
        name = "jittery"
        calls = 0

        def backward(self, *args, **kw):
            dq, dkv, d_sink = super().backward(*args, **kw)
            Jittery.calls += 1
            dkv.view(-1)[(Jittery.calls * 7) % dkv.numel()] += 1
            return dq, dkv, d_sink

    return Jittery()


def test_a_wrong_gradient_fails_tolerance_through_paddle(backend):
    from sparse_mqa_testkit.checks import check_backward_tolerance
    from sparse_mqa_testkit.paddle.backend import through_paddle

    res = check_backward_tolerance(through_paddle(_flipped_sink()), CASES[1].replace(sink="finite"))
    assert not res.passed and "d_sink" in res.message


def test_run_to_run_drift_fails_determinism_through_paddle(backend):
    from sparse_mqa_testkit.checks import check_determinism
    from sparse_mqa_testkit.paddle.backend import through_paddle

    res = check_determinism(through_paddle(_jittery()), CASES[0])
    assert not res.passed and "dkv" in res.message


# ---- a backend that speaks paddle natively, checked through TorchFacing ------------------------------------

class PaddleNativeReference:
    """A Paddle kernel stand-in with no torch inside: contract validation and the oracle on paddle tensors."""

    name = "paddle-native-reference"
    device = "cpu"
    deterministic = True
    tiles: dict = {}
    dims = None

    def supports(self, case):
        return None

    def forward(self, q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None):
        import numpy as np

        from sparse_mqa_testkit import oracle
        from sparse_mqa_testkit.backends.validate import check_forward_args
        from sparse_mqa_testkit.paddle.frontend import from_numpy

        check_forward_args(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length)
        out, lse = oracle.forward(q, kv, indices, sm_scale=sm_scale, d_v=d_v, attn_sink=attn_sink,
                                  topk_length=topk_length, dtype=np.float32)
        return from_numpy(oracle.round_bf16(out)), from_numpy(np.asarray(lse, np.float32))

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        import numpy as np

        from sparse_mqa_testkit import oracle
        from sparse_mqa_testkit.backends.validate import check_backward_args
        from sparse_mqa_testkit.paddle.frontend import from_numpy

        dims = check_backward_args(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length)
        dq, dkv, d_sink = oracle.backward(q, kv, indices, grad_out, sm_scale=sm_scale, d_v=dims.Dv,
                                          attn_sink=attn_sink, topk_length=topk_length, dtype=np.float32)
        return (from_numpy(oracle.round_bf16(dq)), from_numpy(oracle.round_bf16(dkv)),
                None if d_sink is None else from_numpy(np.asarray(d_sink, np.float32)))


@pytest.mark.parametrize("case", CASES[1:3], ids=lambda c: c.describe())
def test_a_paddle_native_backend_passes_through_torch_facing(backend, case):
    import torch

    from sparse_mqa_testkit import checks
    from sparse_mqa_testkit.backends import get_backend
    from sparse_mqa_testkit.paddle.backend import TorchFacing
    from support import case_args

    native = TorchFacing(PaddleNativeReference())
    for check in (checks.check_backward_tolerance, checks.check_forward_tolerance, checks.check_determinism,
                  checks.check_guards, checks.check_rejection):
        check(native, case).raise_if_failed()
    # and it is the torch reference, bit for bit
    t = case_args(native, case)
    args = (t["q"], t["kv"], t["out"], t["grad_out"], t["lse"], t["attn_sink"], t["indices"], t["sm_scale"])
    want = get_backend("reference").backward(*args, topk_length=t["topk_length"])
    got = native.backward(*args, topk_length=t["topk_length"])
    for w, g in zip(want, got):
        assert (w is None and g is None) or (w.dtype == g.dtype and torch.equal(w, g))
