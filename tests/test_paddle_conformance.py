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
