"""What a check compares a backend's results with, and the arguments it calls the backend with, for one case.

The float64 oracle is the truth (``exact``); float32 math rounded to each result's kernel dtype is the
bf16-output oracle whose error sets the tolerance (``rounded``); the error model's terms come with them. For a
CPU backend the NumPy oracle computes them on the host (the root of trust); for a CUDA backend, and for every
``large`` case, the device oracle does, on the backend's device. Each is computed once, when first needed; a
check builds one ``Expected`` per case and hands it to everything that needs it, and ``Expected.for_backend``
keeps the last two, so the several checks a test runs on one case (and guards' second case) share them.
"""

from __future__ import annotations

from functools import cached_property, lru_cache

import numpy as np
import torch

from .. import contract, oracle
from ..backends.spec import BackendSpec
from ..calls import Call
from ..cases.case import host_inputs
from ..cases.tensors import case_tensors
from ..convert import input_tensors, to_torch
from ..oracle import device as device_oracle
from .error_model import row_terms


def truth_device(backend_device, case) -> str:
    """Where a case's expected results are computed: the host for a CPU backend (NumPy), else the backend's
    device."""
    dev = str(backend_device or "cpu")
    return "cpu" if dev == "cpu" and not case.large else dev


class Expected:
    """A case on one device: ``inputs`` (torch tensors with kernel dtypes, sm_scale and d_v as numbers),
    ``exact`` (the float64 oracle's out, lse, dq, dkv, d_sink), ``rounded`` (the bf16-output oracle's) and
    ``terms`` (the error model's, per result and row)."""

    def __init__(self, case, device: str = "cpu"):
        self.case, self.device = case, str(device)
        self.on_host = self.device == "cpu" and not case.large
        self._host = host_inputs(case) if self.on_host else None
        self.inputs = input_tensors(self._host, self.device) if self.on_host else case_tensors(case, self.device)

    @classmethod
    def for_backend(cls, backend, case) -> "Expected":
        """The case's Expected where a backend's results are judged, one of the last two made (``forget()``
        drops them: a production-sized case's hold tens of GiB)."""
        return _kept(case, truth_device(BackendSpec.of(backend).device, case))

    def _oracle(self, dtype) -> dict:
        x = Call(self._host if self.on_host else self.inputs)
        if self.on_host:
            out, lse = oracle.forward(**x.oracle_args("forward"), dtype=dtype)
            dq, dkv, d_sink = oracle.backward(**x.oracle_args("backward"), dtype=dtype)
            return {k: to_torch(v, self.device) for k, v in dict(out=out, lse=lse, dq=dq, dkv=dkv,
                                                                  d_sink=d_sink).items()}
        out, lse = device_oracle.forward(**x.oracle_args("forward"), dtype=dtype)
        dq, dkv, d_sink = device_oracle.backward(**x.oracle_args("backward"), dtype=dtype)
        return dict(out=out, lse=lse, dq=dq, dkv=dkv, d_sink=d_sink)

    @cached_property
    def exact(self) -> dict:
        return self._oracle(np.float64 if self.on_host else torch.float64)

    @cached_property
    def rounded(self) -> dict:
        f32 = self._oracle(np.float32 if self.on_host else torch.float32)
        return {k: None if v is None else v.to(getattr(torch, contract.kernel_dtype(k))) for k, v in f32.items()}

    @cached_property
    def terms(self) -> dict:
        return row_terms(self.inputs, self.exact["out"])

    def call(self, device: str | None = None) -> Call:
        """The arguments a backend on ``device`` is called with, in its own copies: the case's inputs, and out
        and lse from the float64 oracle rounded to what a forward returns (out bfloat16, lse float32, natural
        log, sink excluded); an empty row's lse is +inf, or -inf for ``case.empty_lse="neg_inf"``."""
        dev = device or self.device
        t = {k: (v.to(dev, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in self.inputs.items()}
        lse = self.exact["lse"].to(dev, torch.float32)
        if self.case.empty_lse == "neg_inf":
            lse = torch.where(torch.isposinf(lse), -torch.inf, lse)
        t["out"] = self.exact["out"].to(dev).to(torch.bfloat16)
        t["lse"] = lse
        return Call(t)


@lru_cache(maxsize=2)
def _kept(case, device: str) -> Expected:
    return Expected(case, device)


def forget() -> None:
    """Drop the Expected objects ``Expected.for_backend`` keeps (and the device memory they hold)."""
    _kept.cache_clear()
