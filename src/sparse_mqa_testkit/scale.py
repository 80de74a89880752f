"""The scale tier: a handful of production-shaped cases per CUDA backend, each checked for tolerance against
the device oracle and for bitwise determinism.

Small drawn cases never reach bugs that live at production sizes: 32-bit offsets past 2^31 elements, block
tails deep in a 2048-wide top-k loop, thousands of terms reaching one KV row. ``FIXED`` names the cases every
run has (one with q past 2^31 elements, a 128K cache with a 2048-wide top-k, hot rows with a fan-in of 10^5);
``scale_cases`` draws more inside ``LIMITS``. The tier does not shrink a failure (each example costs seconds
of device time, and a shrink would replay dozens): its replay line is the reproducer. What a case needs on the
device is estimated up front (``device_bytes``); a case that does not fit is skipped with the numbers.
"""

from __future__ import annotations

from hypothesis import strategies as st

from . import contract
from .cases import Case
from .strategies import cases, draw_examples

LIMITS = dict(B=8, S=8192, Skv=131072, L=2048)
HEADS = (64, 128)
WORK = 1 << 30  # B * S * H * L: the float64 oracle's work (~1e13 flop at 576 dims) stays seconds per case
DRAWN = {"dev": 1, "ci": 2, "scale": 2, "nightly": 6}  # drawn cases beside FIXED, per profile
DETERMINISM_REPEATS = 2  # runs compared bitwise at scale (each keeps its outputs on the device)

FIXED = (
    # q = 8 * 4096 * 128 * 576 = 2.4e9 elements, past 2^31: 32-bit offsets overflow here
    Case(B=8, S=4096, Skv=8192, H=128, L=16, Dqk=576, Dv=512, sink="finite", pattern="local", seed=1),
    # a 128K cache and a 2048-wide top-k: many KV blocks per row; gradients spanning 2^+-20
    Case(B=1, S=1024, Skv=131072, H=64, L=2048, Dqk=576, Dv=512, sink="finite", pattern="local",
         magnitude="spread", seed=2),
    # hot rows: 8 KV rows named by all 2 x 512 queries x 128 heads (fan-in 131072 each), mixed invalid slots
    Case(B=2, S=512, Skv=32768, H=128, L=2048, Dqk=576, Dv=512, sink="mixed", topk="random", invalid="mixed",
         pattern="hot", seed=3),
)


@st.composite
def scale_cases(draw, *, dims=contract.PRODUCTION_DIMS) -> Case:
    """A production-shaped case: H 64 or 128, B <= 8, S <= 8192, Skv <= 128K, L <= 2048 (often the full 2048),
    B * S * H * L <= ``WORK``; patterns, magnitudes, sinks and invalid slots drawn as everywhere."""
    modes = draw(cases(dims=dims, max_b=1, max_s=1, max_skv=1, max_h=1, max_l=1))  # every field but the sizes
    h = draw(st.sampled_from(HEADS))
    b = draw(st.integers(1, LIMITS["B"]))
    l_ = draw(st.sampled_from((LIMITS["L"], 1024, 512, 128)) | st.integers(1, LIMITS["L"]))
    s = draw(st.integers(1, max(1, min(LIMITS["S"], WORK // (b * h * l_)))))
    skv = draw(st.sampled_from((LIMITS["Skv"], 65536, 8192)) | st.integers(1, LIMITS["Skv"]))
    return modes.replace(B=b, S=s, Skv=skv, H=h, L=l_)


def plan(backend, profile: str, seed: int | None = None) -> list[Case]:
    """The tier's cases for ``backend``: the ``FIXED`` ones inside its domain, then ``DRAWN[profile]`` drawn
    ones (derandomized unless ``seed``)."""
    supports = getattr(backend, "supports", None)
    dims = tuple(d for d in map(tuple, getattr(backend, "dims", None) or contract.PRODUCTION_DIMS)
                 if d in contract.PRODUCTION_DIMS) or contract.PRODUCTION_DIMS

    def inside(c: Case) -> bool:
        return (c.Dqk, c.Dv) in dims and not (callable(supports) and supports(c) is not None)

    strategy = scale_cases(dims=dims).filter(inside)
    return [c for c in FIXED if inside(c)] + draw_examples(strategy, DRAWN.get(profile, 2), seed=seed)


def device_bytes(case: Case, *, repeats: int = DETERMINISM_REPEATS) -> int:
    """Device memory the tier needs for ``case`` at its peak, in bytes: the inputs (the reference's and the
    backend's copies), the float64 oracle's results and the bf16-output oracle's, the backend's outputs for
    ``repeats`` runs plus one, and the oracle's and the comparison's chunks."""
    from .checks.tolerance import COMPARE_BYTES
    from .device_oracle import CHUNK_BYTES

    B, S, H, Skv, L, Dqk, Dv = case.B, case.S, case.H, case.Skv, case.L, case.Dqk, case.Dv
    q, kv, o, rows = B * S * H * Dqk, B * Skv * Dqk, B * S * H * Dv, B * S * H
    inputs = 2 * (2 * q + 2 * kv + 2 * o + 4 * B * S * L) + 2 * o + 4 * rows  # twice, + the given out and lse
    oracle64 = 8 * (q + kv + o + rows)  # dq, dkv, out, lse in float64
    oracle32 = 4 * (q + o)  # the float32 oracle before its results are rounded to the kernel dtypes
    kernel = (repeats + 1) * (2 * q + 4 * kv + 2 * o + 4 * rows)  # dkv may be accumulated in float32
    terms = 8 * 8 * (rows + B * Skv)  # the error model's per-row terms
    return inputs + oracle64 + oracle32 + kernel + terms + 12 * CHUNK_BYTES + 6 * COMPARE_BYTES


def fits(case: Case, device) -> str | None:
    """None when ``case`` fits in the free memory of ``device``, else the reason with the numbers."""
    import torch

    need = device_bytes(case)
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(dev)
    if need <= free:
        return None
    gib = 1 << 30
    return (f"{case.describe()} needs ~{need / gib:.1f} GiB on {device}, {free / gib:.1f} GiB free of "
            f"{total / gib:.1f} GiB")

