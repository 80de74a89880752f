"""The modules the repo's tests need beyond the package's own dependencies (the `test` extra in pyproject.toml),
and which of them this Python lacks. ci/cpu and ci/gpu run it first, so a missing one stops the run at once,
named, instead of failing one test minutes in.

    python ci/test_deps.py     # exit status 1, naming each missing module and the install line
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# the module each requirement of the `test` extra is imported as (a test checks every requirement has one)
MODULES = {"libcst": "libcst", "hypothesis[redis]": "redis", "ruff": "ruff"}
INSTALL = "pip install -e '.[test]' (on a GPU runner: pip install -e '.[gpu,test]')"


def test_extra(pyproject: Path = PYPROJECT) -> list[str]:
    """The requirements of the `test` extra, without their version bounds (``hypothesis[redis]``, ``libcst``)."""
    block = re.search(r"^test\s*=\s*\[(.*?)\]\s*$", pyproject.read_text(), re.M | re.S)
    if block is None:
        raise ValueError(f"{pyproject}: no `test = [...]` extra under [project.optional-dependencies]")
    return [re.split(r"[<>=!~;\s]", req, maxsplit=1)[0] for req in re.findall(r'"([^"]+)"', block.group(1))]


def missing(requirements, find=importlib.util.find_spec) -> list[str]:
    """Each requirement whose module ``find`` cannot locate, as ``requirement (module)``."""
    return [f"{req} (module {MODULES[req]})" for req in requirements if find(MODULES[req]) is None]


def main(find=importlib.util.find_spec) -> int:
    gone = missing(test_extra(), find)
    if gone:
        print(f"the repo's tests need {', '.join(gone)}, which this Python ({sys.executable}) lacks: {INSTALL}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
