"""One kernel call's arguments by contract name: the one way the suite (checks, fixtures, the Paddle frontend,
the bench, the adapters) calls a backend, in the manner of PyTorch OpInfo's ``SampleInput``.

The positional order, the keywords and the result names come from ``contract.ARGUMENTS``, so a new contract
input reaches every caller without any of them naming it.
"""

from __future__ import annotations

from . import contract


class Call:
    """``args``: name -> tensor (None when an optional argument is absent) or number (sm_scale, d_v)."""

    def __init__(self, args: dict):
        self.args = dict(args)

    @classmethod
    def bind(cls, direction: str, *args, **kwargs) -> "Call":
        """The Call of a protocol-style ``backend.backward(...)`` / ``forward(...)`` invocation (for wrappers that
        take the protocol's signature and hand the call on)."""
        bound = contract.signature(direction).bind(*args, **kwargs)
        bound.apply_defaults()
        return cls(bound.arguments)

    def __getitem__(self, name: str):
        return self.args[name]

    def get(self, name: str, default=None):
        return self.args.get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self.args

    def __repr__(self) -> str:
        parts = [f"{k}={tuple(v.shape)}" if hasattr(v, "shape") else f"{k}={v!r}" for k, v in self.args.items()]
        return f"Call({', '.join(parts)})"

    @property
    def dims(self) -> contract.Dims:
        """The call's sizes, read off q, kv and indices (and d_v, else out's last size); not validated."""
        q, kv, idx = self.args["q"], self.args["kv"], self.args["indices"]
        d_v = self.args.get("d_v")
        if d_v is None:
            d_v = int(self.args["out"].shape[-1])
        B, S, H, Dqk = (int(x) for x in q.shape)
        return contract.Dims(B=B, S=S, H=H, Dqk=Dqk, Dv=int(d_v), Skv=int(kv.shape[1]), L=int(idx.shape[2]))

    def replace(self, **changes) -> "Call":
        return Call({**self.args, **changes})

    def map_tensors(self, fn) -> "Call":
        """A Call with ``fn(name, tensor)`` in place of every tensor argument (None and numbers stay)."""
        return Call({k: (fn(k, v) if _is_tensor(k, v) else v) for k, v in self.args.items()})

    def tensors(self) -> dict:
        """The tensor arguments that are present, by name."""
        return {k: v for k, v in self.args.items() if _is_tensor(k, v)}

    def for_(self, direction: str) -> tuple[tuple, dict]:
        """(positional, keywords) for ``direction``: every positional argument, and each keyword one that is
        present (a backend need not know an optional input the case leaves out)."""
        names = contract.inputs_of(direction)
        missing = [n for n in names if n not in self.args and contract.argument(n).position(direction)
                   != contract.KEYWORD]
        if missing:
            raise KeyError(f"a {direction} call needs {', '.join(missing)}")
        positional = tuple(self.args[n] for n in names if contract.argument(n).position(direction) != contract.KEYWORD)
        keywords = {n: self.args[n] for n in names if contract.argument(n).position(direction) == contract.KEYWORD
                    and self.args.get(n) is not None}
        return positional, keywords

    def invoke(self, backend, direction: str):
        """``backend.backward(...)`` or ``backend.forward(...)`` on these arguments, as it returned."""
        positional, keywords = self.for_(direction)
        return getattr(backend, direction)(*positional, **keywords)

    def results(self, backend, direction: str) -> dict:
        """``invoke``'s results by name (dq, dkv, d_sink or out, lse); TypeError when it does not return a tuple
        of as many."""
        names = contract.results_of(direction)
        out = self.invoke(backend, direction)
        if not isinstance(out, (tuple, list)) or len(out) != len(names):
            raise TypeError(f"{direction} must return a tuple of {len(names)} tensors ({', '.join(names)}), got "
                            f"{type(out).__name__}" + (f" of length {len(out)}" if isinstance(out, (tuple, list))
                                                       else ""))
        return dict(zip(names, out))

    def oracle_args(self, direction: str) -> dict:
        """The keyword arguments of the oracle's ``direction`` (``oracle.forward(**call.oracle_args(...))``)."""
        return {n: self.args.get(n) for n in contract.oracle_inputs(direction)}


def _is_tensor(name: str, value) -> bool:
    return value is not None and hasattr(value, "shape") and contract.argument(name).is_tensor
