"""Design (a) of issue 26 (``benchmarks/rows_backend.py``) on CPU: its NumPy model holds the suite's tolerance on the
adversarial magnitudes the fixed-point study uses, with every term and row sum inside int32 (the model raises
otherwise), bitwise stable; the GPU backend refuses CPU tensors before any GPU work."""

import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch")

from sparse_mqa_testkit.cases import Case  # noqa: E402
from sparse_mqa_testkit.cases.tensors import case_tensors  # noqa: E402
from sparse_mqa_testkit.checks import check_backward_tolerance, check_determinism  # noqa: E402

HERE = pathlib.Path(__file__).parents[2] / "benchmarks"


def _benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ROWS = _benchmark("rows_backend")
STUDY = _benchmark("study_fixed_point")
MODEL = ROWS.RowsModelBackend()
# the study's adversarial modes at a smaller size (hot: 512 terms a row, heavy cancellation)
SMALL = dict(STUDY.SHAPE, S=32, Skv=128, L=32)
CASES = [Case(**{**SMALL, **STUDY.CASES[name], **({"S": 512, "Skv": 16} if name == "hot" else {})}, seed=i)
         for i, name in enumerate(("unit", "spread", "hot", "peaky", "far", "huge", "mixed"))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.pattern}-{c.magnitude}-{c.sink}-{c.invalid}")
def test_model_holds_tolerance_inside_int32(case):
    check_backward_tolerance(MODEL, case).raise_if_failed()


def test_model_is_bitwise_stable():
    check_determinism(MODEL, CASES[2]).raise_if_failed()


def test_gpu_backend_refuses_cpu_tensors_first():
    case = Case(B=1, S=2, Skv=8, H=2, L=4, Dqk=576, Dv=512)
    t = case_tensors(case)
    out = torch.zeros(1, 2, 2, 512, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 2)
    with pytest.raises(ValueError, match="q must be on a CUDA device, got cpu"):
        ROWS.RowsBackend().backward(t["q"], t["kv"], out, t["grad_out"], lse, t["attn_sink"], t["indices"],
                                    case.scale)
