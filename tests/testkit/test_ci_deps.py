"""ci/test_deps.py: a missing test dependency stops ci/cpu and ci/gpu before the tests, named."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "ci" / "test_deps.py"


@pytest.fixture(scope="module")
def deps():
    spec = importlib.util.spec_from_file_location("ci_test_deps", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_test_requirement_has_its_module(deps):
    reqs = deps.test_extra()
    assert "libcst" in reqs and "hypothesis[redis]" in reqs
    assert set(reqs) <= set(deps.MODULES), f"give each `test` requirement its module in {SCRIPT}: {reqs}"


def test_a_missing_module_is_named_with_the_install_line(deps, capsys):
    absent = {"libcst", "redis"}

    def find(name):
        return None if name in absent else object()

    assert deps.missing(["libcst", "hypothesis[redis]", "ruff"], find) == \
        ["libcst (module libcst)", "hypothesis[redis] (module redis)"]
    assert deps.main(find) == 1
    err = capsys.readouterr().err
    assert "the repo's tests need libcst (module libcst), hypothesis[redis] (module redis)" in err
    assert "pip install -e '.[gpu,test]'" in err
    assert deps.main(lambda name: object()) == 0 and capsys.readouterr().err == ""
