# Fixtures shared by the repo's own tests; tests/support.py is importable from every test folder.
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def paddle():
    """The paddle module, imported only by the tests that ask for it (skipped when paddlepaddle is absent)."""
    from sparse_mqa_testkit.paddle import frontend

    try:
        return frontend.import_paddle()
    except ImportError:
        pytest.skip("needs paddlepaddle (pip install '.[paddle]')")
