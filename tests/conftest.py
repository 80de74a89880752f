# Fixtures shared by the repo's own tests.
import pytest


@pytest.fixture(scope="module")
def paddle():
    """The paddle module, imported only by the tests that ask for it (skipped when paddlepaddle is absent)."""
    from sparse_mqa_testkit.paddle import frontend

    try:
        return frontend.import_paddle()
    except ImportError:
        pytest.skip("needs paddlepaddle (pip install '.[paddle]')")
