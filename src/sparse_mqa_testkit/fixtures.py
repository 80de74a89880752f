"""What the plugin's fixtures hand a test: a drawn case with its tensors, the oracle, and the checks bound to
the test's backend and recorder."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import oracle
from .cases import Case
from .checks.inputs import backend_inputs
from .checks.registry import get_check
from .recording import Recorder, run_check


@dataclass
class DrawnCase:
    """A case and its torch tensors on the backend's device, with ``out``/``lse`` from the float64 oracle
    rounded to kernel dtypes (what a forward returns), ready for ``backend.backward(**drawn.backward_args)``."""

    case: Case
    tensors: dict

    @property
    def backward_args(self) -> dict:
        t = self.tensors
        return {k: t[k] for k in ("q", "kv", "out", "grad_out", "lse", "attn_sink", "indices", "sm_scale",
                                  "topk_length")}

    @property
    def forward_args(self) -> dict:
        t = self.tensors
        return {k: t[k] for k in ("q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length")}


def drawn_case(backend, case: Case) -> DrawnCase:
    return DrawnCase(case, backend_inputs(backend, case))


class Oracle:
    """The NumPy oracle on a case: ``oracle.forward(case)`` -> (out, lse), ``oracle.backward(case)`` ->
    (dq, dkv, d_sink), float64 unless ``dtype`` says otherwise."""

    def forward(self, case: Case, dtype=np.float64):
        x = case.inputs()
        return oracle.forward(x["q"], x["kv"], x["indices"], sm_scale=x["sm_scale"], d_v=x["d_v"],
                              attn_sink=x["attn_sink"], topk_length=x["topk_length"], dtype=dtype)

    def backward(self, case: Case, dtype=np.float64):
        x = case.inputs()
        return oracle.backward(x["q"], x["kv"], x["indices"], x["grad_out"], sm_scale=x["sm_scale"],
                               d_v=x["d_v"], attn_sink=x["attn_sink"], topk_length=x["topk_length"], dtype=dtype)


class Checks:
    """The checks bound to one backend and one test's recorder: ``smqa_checks.tolerance(case)`` runs,
    records and raises ``CheckFailure`` on failure, and returns the ``CheckResult``."""

    def __init__(self, backend, recorder: Recorder | None = None):
        self.backend, self.recorder = backend, recorder

    def __repr__(self) -> str:
        return f"<checks for backend {getattr(self.backend, 'name', '?')}>"

    def run(self, check: str, case: Case, **options):
        return run_check(check, self.backend, case, recorder=self.recorder, **options)

    def __getattr__(self, check: str):
        if check.startswith("_"):
            raise AttributeError(check)
        try:
            name = get_check(check).name  # an unknown name fails here, not when called
        except ValueError as e:
            raise AttributeError(str(e)) from None
        return lambda case, **options: self.run(name, case, **options)


class BoundCheck:
    """One registry check bound to a backend and a test's recorder: ``smqa_check(case)``."""

    def __init__(self, name: str, checks: Checks):
        self.name, self.checks = name, checks

    @property
    def recorder(self) -> Recorder | None:
        return self.checks.recorder

    def __call__(self, case: Case, **options):
        return self.checks.run(self.name, case, **options)

    def __repr__(self) -> str:
        return f"<check {self.name} for backend {getattr(self.checks.backend, 'name', '?')}>"
