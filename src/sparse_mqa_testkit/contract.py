"""The contract of absorbed-MQA sparse attention: the one source of truth.

Everything in this package (the oracle, the validators, the strategies, the checks) and the kernels of
``sparse_mqa_kernels`` import its shapes, dtypes, the invalid-index rule and the LSE convention from here.
Framework-agnostic: the validators read only ``.shape`` and ``.dtype`` (NumPy arrays, torch or paddle
tensors); the rule helpers compute on NumPy arrays or torch tensors, in their own kind and dtype.

Shapes
    q            [B, S, H, Dqk]   query rows; H heads share one latent
    kv           [B, Skv, Dqk]    one latent per KV position: K = kv, V = kv[..., :Dv], 1 <= Dv <= Dqk
    indices      [B, S, L]        top-k slots, integers local to each batch
    topk_length  [B, S]           optional: slots t >= topk_length[b, i] are invalid
    attn_sink    [H]              optional per-head sink logit (natural log, NOT scaled by sm_scale)
    out          [B, S, H, Dv]
    lse          [B, S, H]        natural log, sink EXCLUDED
    grad_out     [B, S, H, Dv]

Validity (the invalid-index rule)
    Slot t of row (b, i) is valid iff ``0 <= indices[b, i, t] < Skv`` and (no topk_length or
    ``t < topk_length[b, i]``). Every other value (-1, Skv, -2**31, 2**31-1, ...) is invalid and is never read.
    Duplicate indices count once per slot. A topk_length <= 0 makes the row empty; one > L limits nothing.

Forward, per row (b, i) and head h
    s_t   = sm_scale * <q, kv[idx_t]>                   (valid t only)
    lse   = ln sum_valid exp(s_t)                         (+inf for an empty row)
    P_t   = exp(s_t - logaddexp(lse, sink))               (sink None means -inf)
    out   = sum_t P_t V[idx_t]
    Sink +inf gives out = 0; an empty row (no valid slot) gives out = 0, lse = +inf and no gradient. Every finite
    sink is a finite sink, up to float32's largest: one of 3e38 takes all the mass (p_sink = 1, in float32 too),
    one of -3e38 none; neither is +-inf, and nothing may turn NaN on the way (sink * log2(e) overflows float32).
    lse = +inf (not -inf) for empty rows is deliberate: exp(s - lse) is then 0 and the backward needs no branch.
    A backward also takes -inf as an empty row's lse (the log of zero mass, cuDNN frontend's generic
    convention) and treats it exactly as +inf: zero gradients from the row and nothing to d_sink.

Backward, for cotangent dO
    Delta  = <dO, out>
    dS_t   = P_t (<dO, V[idx_t]> - Delta)
    dq     = sm_scale sum_t dS_t kv[idx_t]
    dkv[j] = sum over valid slots with idx = j of (sm_scale dS_t q + P_t [dO; 0])
    d_sink[h] = -sum_{b,i} p_sink Delta,   p_sink = exp(sink - logaddexp(lse, sink))

Kernel dtypes: q, kv, out, grad_out bfloat16; lse, attn_sink, d_sink float32; indices, topk_length int32.
``ARGUMENTS`` holds all of this as data, one entry per argument and result (layout, dtype, where each call
takes it, its rows, its rejection entries): validators, the call object (``calls.Call``), rejection entries and
the per-row measures derive from it. Kernels that keep a base-2 LSE with the sink folded in convert with
``lse_to_base2`` / ``lse_from_base2``;
``valid_mask``, ``invalid_values`` and ``sink_probability`` are the rules above as code (NumPy or torch).
"""

from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass

import numpy as np

# Production sizes (DeepSeek-V3.2 absorbed MLA): 512 latent + 64 rope dims; V is the first 512.
DQK = 576
DV = 512
# Production head dims (Dqk, Dv): DeepSeek-V3.2's 576/512 and the rope-free 512/512. The oracle takes any.
PRODUCTION_DIMS = ((576, 512), (512, 512))

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)

# ---- the arguments and results of a kernel call, as data ------------------------------------------------------
KEYWORD = "keyword"  # a call takes the argument by keyword (after the positional ones), default None


@dataclass(frozen=True)
class Argument:
    """One argument or result of the kernels' calls. Validators, rejection entries, the call object, the inputs a
    check builds and the per-row measures all derive from ``ARGUMENTS``: a new input is one entry here.

    layout: the ``Dims`` fields of its shape (() for a scalar). dtype: the kernel dtype, or "float" / "int" for a
    scalar. optional: None means absent. takes: (direction, position or ``KEYWORD``) for each call that takes it.
    returns: (direction, index in the result tuple) for each call that returns it. oracle: the oracle's calls that
    take it (the oracle recomputes out and lse). rows: how many leading dims name one row (per-row measures).
    own_dim: the dim whose size only this argument sets (its wrong-size rejection entry). bad_dtypes: dtypes it
    must be refused in. other_device: a rejection entry puts it on another device than q. fill: for an optional
    argument a case leaves out, the value of a valid stand-in (a number, or a Dims field name). with_arg: a result
    that is None exactly when that argument is None.
    """

    name: str
    layout: tuple = ()
    dtype: str = "float"
    optional: bool = False
    takes: tuple = ()
    returns: tuple = ()
    oracle: tuple = ()
    rows: int = 0
    own_dim: int | None = None
    bad_dtypes: tuple = ()
    other_device: bool = False
    fill: float | str | None = None
    with_arg: str | None = None

    @property
    def is_tensor(self) -> bool:
        return bool(self.layout)

    @property
    def layout_text(self) -> str:
        return "[" + ", ".join(self.layout) + "]"

    def position(self, direction: str):
        """Its place in ``direction``'s call: an int, ``KEYWORD``, or None when that call does not take it."""
        return dict(self.takes).get(direction)


BOTH = ("backward", "forward")
_BF16_BAD = ("float16", "float32")
_F32_BAD = ("bfloat16", "float64")
_I32_BAD = ("int64", "float32")

ARGUMENTS = (
    Argument("q", ("B", "S", "H", "Dqk"), "bfloat16", takes=(("backward", 0), ("forward", 0)), oracle=BOTH,
             rows=3, own_dim=3, bad_dtypes=_BF16_BAD),
    Argument("kv", ("B", "Skv", "Dqk"), "bfloat16", takes=(("backward", 1), ("forward", 1)), oracle=BOTH, rows=2,
             own_dim=2, bad_dtypes=_BF16_BAD, other_device=True),
    Argument("out", ("B", "S", "H", "Dv"), "bfloat16", takes=(("backward", 2),), returns=(("forward", 0),), rows=3,
             own_dim=2, bad_dtypes=_BF16_BAD),
    Argument("grad_out", ("B", "S", "H", "Dv"), "bfloat16", takes=(("backward", 3),), oracle=("backward",), rows=3,
             own_dim=2, bad_dtypes=_BF16_BAD, other_device=True),
    Argument("lse", ("B", "S", "H"), "float32", takes=(("backward", 4),), returns=(("forward", 1),), rows=3,
             own_dim=2, bad_dtypes=_F32_BAD),
    Argument("attn_sink", ("H",), "float32", optional=True, takes=(("backward", 5), ("forward", KEYWORD)),
             oracle=BOTH, rows=1, own_dim=0, bad_dtypes=_F32_BAD, fill=0.0),
    Argument("indices", ("B", "S", "L"), "int32", takes=(("backward", 6), ("forward", 2)), oracle=BOTH, rows=2,
             own_dim=0, bad_dtypes=_I32_BAD, other_device=True),
    Argument("sm_scale", (), "float", takes=(("backward", 7), ("forward", 3)), oracle=BOTH),
    Argument("d_v", (), "int", takes=(("forward", 4),), oracle=BOTH),
    Argument("topk_length", ("B", "S"), "int32", optional=True, takes=(("backward", KEYWORD), ("forward", KEYWORD)),
             oracle=BOTH, rows=2, own_dim=1, bad_dtypes=_I32_BAD, fill="L"),
    Argument("dq", ("B", "S", "H", "Dqk"), "bfloat16", returns=(("backward", 0),), rows=3),
    Argument("dkv", ("B", "Skv", "Dqk"), "bfloat16", returns=(("backward", 1),), rows=2),
    Argument("d_sink", ("H",), "float32", optional=True, returns=(("backward", 2),), rows=1, with_arg="attn_sink"),
)
# the arguments that fix a call's sizes: q gives B, S, H, Dqk; kv gives Skv; indices gives L (and d_v, Dv)
SIZED_BY = ("q", "kv", "indices")
# name -> kernel dtype of every tensor argument and result, as ``ARGUMENTS`` declares them
KERNEL_DTYPES = {a.name: a.dtype for a in ARGUMENTS if a.is_tensor}

_INDEX: dict = {}


def _table() -> dict:
    """name -> Argument for the current ``ARGUMENTS`` (rebuilt when the tuple is replaced, as a test may)."""
    if _INDEX.get("of") is not ARGUMENTS:
        _INDEX.clear()
        _INDEX.update(of=ARGUMENTS, by_name={a.name: a for a in ARGUMENTS})
    return _INDEX["by_name"]


def argument(name: str) -> Argument:
    """The table entry for ``name``; KeyError naming the known ones otherwise."""
    try:
        return _table()[name]
    except KeyError:
        raise KeyError(f"{name!r} is not an argument or result of the contract; known: "
                       f"{', '.join(_table())}") from None


def kernel_dtype(name: str) -> str:
    """The dtype a kernel takes or returns ``name`` in ('bfloat16', 'float32', 'int32')."""
    return argument(name).dtype


def inputs_of(direction: str) -> tuple[str, ...]:
    """The names ``direction`` ("backward" or "forward") takes, positional ones in order, then keywords."""
    taken = [a for a in ARGUMENTS if a.position(direction) is not None]
    positional = sorted((a for a in taken if a.position(direction) != KEYWORD), key=lambda a: a.position(direction))
    return tuple(a.name for a in positional) + tuple(a.name for a in taken if a.position(direction) == KEYWORD)


def results_of(direction: str) -> tuple[str, ...]:
    """The names ``direction`` returns, in the order of its result tuple."""
    out = sorted((dict(a.returns)[direction], a.name) for a in ARGUMENTS if direction in dict(a.returns))
    return tuple(name for _, name in out)


def oracle_inputs(direction: str) -> tuple[str, ...]:
    """The names the oracle's ``direction`` takes (it recomputes out and lse from the primal inputs)."""
    return tuple(a.name for a in ARGUMENTS if direction in a.oracle)


def signature(direction: str) -> inspect.Signature:
    """``direction``'s call signature (``Backend.backward`` / ``Backend.forward``), from the table."""
    params = []
    for name in inputs_of(direction):
        if argument(name).position(direction) == KEYWORD:
            params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None))
        else:
            params.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD))
    return inspect.Signature(params)


@dataclass(frozen=True)
class Dims:
    """Sizes of one call, read off validated arguments."""

    B: int
    S: int
    H: int
    Dqk: int
    Dv: int
    Skv: int
    L: int

    def shape(self, name: str) -> tuple[int, ...]:
        """The contract's shape of argument or result ``name``."""
        return tuple(getattr(self, d) for d in argument(name).layout)


def dtype_name(x) -> str:
    """'bfloat16', 'float32', 'int32', ... for a NumPy array, torch or paddle tensor (or a dtype)."""
    if isinstance(x, type) and issubclass(x, np.generic):  # np.float32 and friends: a class, its .dtype a descriptor
        x = np.dtype(x)
    dt = getattr(x, "dtype", x)
    if isinstance(dt, np.dtype):  # fast path (str() of a NumPy dtype runs Python code)
        return dt.name
    name = str(dt)
    # torch.bfloat16 -> bfloat16, paddle.float32 -> float32; numpy/ml_dtypes print the bare name
    return name.rsplit(".", 1)[-1]


def _is_int_dtype(name: str) -> bool:
    return name.startswith(("int", "uint"))


def _is_float_dtype(name: str) -> bool:
    return name.startswith(("float", "bfloat")) or name in ("half", "double")


def _shape(x) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def _require_rank(name: str, x, rank: int, layout: str) -> None:
    if x is None:
        raise ValueError(f"{name} is required, got None")
    if not hasattr(x, "shape"):
        raise ValueError(f"{name} must be an array or tensor, got {type(x).__name__}")
    if len(x.shape) != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {_shape(x)}")


def _require_shape(name: str, x, expected: tuple[int, ...], layout: str) -> None:
    if _shape(x) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)} {layout}, got {_shape(x)}")


def validate_shapes(q, kv, indices, *, d_v: int, **given) -> Dims:
    """Check ranks and sizes of every given argument against the contract; return the call's ``Dims``.

    ``given``: any other tensor argument of the table by name (attn_sink, topk_length, out, grad_out, lse, ...);
    None is skipped. Raises ValueError naming the first offending argument.
    """
    for name in given:
        if not argument(name).is_tensor or name in SIZED_BY:
            raise TypeError(f"validate_shapes() takes tensor arguments besides q, kv, indices; got {name!r}")
    for name, x in (("q", q), ("kv", kv), ("indices", indices)):
        a = argument(name)
        _require_rank(name, x, len(a.layout), a.layout_text)
    B, S, H, Dqk = _shape(q)
    _, Skv, _ = _shape(kv)
    L = _shape(indices)[2]
    if isinstance(d_v, bool) or not isinstance(d_v, (int, np.integer)):
        raise ValueError(f"d_v must be an int, got {type(d_v).__name__}")
    d_v = int(d_v)
    if min(B, S, H, Dqk) < 1:
        raise ValueError(f"q must have every size >= 1, got shape {_shape(q)}")
    if kv.shape[0] != B or kv.shape[2] != Dqk:
        raise ValueError(f"kv must have shape ({B}, Skv, {Dqk}) [B, Skv, Dqk] to match q, got {_shape(kv)}")
    if Skv < 1:
        raise ValueError(f"kv must have Skv >= 1, got shape {_shape(kv)}")
    if indices.shape[:2] != q.shape[:2]:
        raise ValueError(f"indices must have shape ({B}, {S}, L) [B, S, L] to match q, got {_shape(indices)}")
    if L < 1:
        raise ValueError(f"indices must have L >= 1 slots, got shape {_shape(indices)}")
    if not 1 <= d_v <= Dqk:
        raise ValueError(f"d_v must satisfy 1 <= d_v <= Dqk = {Dqk}, got {d_v}")
    dims = Dims(B=B, S=S, H=H, Dqk=Dqk, Dv=d_v, Skv=Skv, L=L)
    for name, x in given.items():
        if x is None:
            continue
        a = argument(name)
        _require_rank(name, x, len(a.layout), a.layout_text)
        _require_shape(name, x, dims.shape(name), a.layout_text)
    for name, x in (("q", q), ("kv", kv), ("indices", indices), *given.items()):
        if x is None:
            continue
        got = dtype_name(x)
        if _is_int_dtype(kernel_dtype(name)) and not _is_int_dtype(got):
            raise ValueError(f"{name} must be an integer array, got {got}")
        if not _is_int_dtype(kernel_dtype(name)) and not _is_float_dtype(got):
            raise ValueError(f"{name} must be a floating-point array, got {got}")
    return dims


def validate_kernel_dtypes(**tensors) -> None:
    """Check each given tensor against its kernel dtype by its argument name (None is skipped).

    Raises ValueError such as ``grad_out must be bfloat16, got float16``.
    """
    for name, x in tensors.items():
        if x is None:
            continue
        want = kernel_dtype(name)
        got = dtype_name(x)
        if got != want:
            raise ValueError(f"{name} must be {want}, got {got}")


def validate_sm_scale(sm_scale) -> float:
    """sm_scale must be a finite real number (DeepSeek's is 1/sqrt(192) times a YaRN factor)."""
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating, np.integer)):
        raise ValueError(f"sm_scale must be a float, got {type(sm_scale).__name__}")
    if not math.isfinite(float(sm_scale)):
        raise ValueError(f"sm_scale must be finite, got {sm_scale}")
    return float(sm_scale)


def _namespace(x):
    """NumPy, or torch for a torch tensor: the rule helpers below take either and answer in the same kind."""
    return sys.modules["torch"] if type(x).__module__.partition(".")[0] == "torch" else np


def valid_mask(indices, s_kv: int, topk_length=None):
    """The invalid-index rule as a boolean [B, S, L] mask (a NumPy array, or a tensor on the indices' device)."""
    xp = _namespace(indices)
    idx = indices if xp is not np else np.asarray(indices)
    mask = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        if xp is np:
            slot, tl = np.arange(idx.shape[-1]), np.asarray(topk_length)
        else:
            slot, tl = xp.arange(idx.shape[-1], device=idx.device), topk_length
        mask &= slot < tl[..., None]
    return mask


def referenced_rows(indices, topk_length, s_kv: int):
    """[B, Skv] bool: the KV rows some valid slot names (the invalid-index rule), a NumPy array or a torch tensor
    like ``indices``, without a host sync. A row no slot names must change no bit of the results, however large
    the garbage it holds (our backward's fixed point takes its Vmax over these rows; the guards check poisons the
    others)."""
    xp = _namespace(indices)
    valid = valid_mask(indices, s_kv, topk_length)
    B = indices.shape[0]
    if xp is np:
        base = (np.arange(B, dtype=np.int64) * s_kv)[:, None, None]
        flat = np.where(valid, np.asarray(indices, dtype=np.int64) + base, B * s_kv).reshape(-1)
        mask = np.zeros(B * s_kv + 1, dtype=bool)
        mask[flat] = True
    else:  # 9 bytes per slot beside valid_mask's own: one int64 copy of the indices, edited in place
        flat = indices.to(xp.int64)
        flat.add_((xp.arange(B, dtype=xp.int64, device=indices.device) * s_kv).view(B, 1, 1))
        flat.masked_fill_(~valid, B * s_kv)
        mask = xp.zeros(B * s_kv + 1, dtype=xp.bool, device=indices.device).scatter_(0, flat.view(-1), True)
    return mask[:-1].reshape(B, s_kv)


def invalid_values(s_kv: int) -> dict[str, tuple[int, ...]]:
    """Representative invalid indices, by kind, that a kernel must never read through (the cases draw these).

    out_of_range: past either end of the cache, including the int32 extremes; sentinel: what an indexer pads a
    row with (-1, Skv, or INT32_MAX).
    """
    return {"out_of_range": (s_kv, s_kv + 1, 2**31 - 1, -(2**31), -2), "sentinel": (-1, s_kv, 2**31 - 1)}


def sink_probability(lse, attn_sink):
    """The sink's probability per [B, S, H]: exp(sink - logaddexp(lse, sink)), in the inputs' dtype.

    A +inf sink takes all the mass (1); an empty row (lse = +inf, or -inf) gives its sink none (0) unless the
    sink is +inf too. NumPy arrays or torch tensors; attn_sink [H] broadcasts against lse [B, S, H].
    """
    xp = _namespace(lse)
    if xp is np:
        lse, attn_sink = np.asarray(lse), np.asarray(attn_sink)
    with np.errstate(invalid="ignore", over="ignore"):
        p = xp.exp(attn_sink - xp.logaddexp(lse, attn_sink))
        p = xp.where(xp.isposinf(attn_sink), 1.0, p)
        return xp.where(xp.isinf(lse) & ~xp.isposinf(attn_sink), 0.0, p)


# ---- the base-2, sink-folded LSE that TileLang kernels keep -------------------------------------------------

def lse_to_base2(lse, attn_sink=None):
    """Contract LSE (natural log, sink excluded, [B, S, H]) -> kernel LSE: log2(sum exp(s) + exp(sink)).

    In the inputs' dtype (NumPy or torch). An empty row (lse = +inf, or -inf) becomes +inf, so
    exp2(s * log2e - lse2) is 0 in the kernel too; so does a row whose sink is +inf, or a finite sink past
    float32's range in base 2 (3e38 * log2(e) overflows to +inf: the sink holds all the mass either way).
    """
    xp = _namespace(lse)
    if xp is np:
        lse = np.asarray(lse)
    lse = xp.where(xp.isneginf(lse), math.inf, lse)
    if attn_sink is not None:
        with np.errstate(invalid="ignore"):
            folded = xp.logaddexp(lse, attn_sink)
        lse = xp.where(xp.isposinf(lse) | xp.isposinf(attn_sink), math.inf, folded)
    with np.errstate(over="ignore"):
        return lse * LOG2E


def lse_from_base2(lse2, attn_sink=None):
    """Kernel LSE (base 2, sink folded in) -> contract LSE (natural log, sink excluded), float64 NumPy.

    Inverse of ``lse_to_base2`` wherever it is invertible: with a sink of +inf the row's own mass is lost
    and the result is NaN there; +inf (empty row) maps back to +inf.
    """
    lse = np.asarray(lse2, dtype=np.float64) * LN2
    if attn_sink is None:
        return lse
    sink = np.broadcast_to(np.asarray(attn_sink, dtype=np.float64), lse.shape)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # ln(e^m - e^sink) = m + log1p(-e^(sink - m)); -inf sink leaves m unchanged
        res = lse + np.log1p(-np.exp(sink - lse))
    res = np.where(np.isneginf(sink), lse, res)
    res = np.where(np.isposinf(lse) & ~np.isposinf(sink), np.inf, res)
    return np.where(np.isposinf(sink), np.nan, res)
