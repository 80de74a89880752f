"""What a production-sized case needs on the device when the scale tier checks it, estimated before it runs."""

from __future__ import annotations

import torch

from ..compare.measure import COMPARE_BYTES
from ..oracle.device import CHUNK_BYTES

DETERMINISM_REPEATS = 2  # runs compared bitwise at scale (each keeps its outputs on the device)


def device_bytes(case, *, repeats: int = DETERMINISM_REPEATS) -> int:
    """Device memory the tier needs for ``case`` at its peak, in bytes: the inputs (the expected results' and the
    backend's copies), the float64 oracle's results and the bf16-output oracle's, the backend's outputs for
    ``repeats`` runs plus one, and the oracle's and the comparison's chunks."""
    B, S, H, Skv, L, Dqk, Dv = case.B, case.S, case.H, case.Skv, case.L, case.Dqk, case.Dv
    q, kv, o, rows = B * S * H * Dqk, B * Skv * Dqk, B * S * H * Dv, B * S * H
    inputs = 2 * (2 * q + 2 * kv + 2 * o + 4 * B * S * L) + 2 * o + 4 * rows  # twice, + the given out and lse
    oracle64 = 8 * (q + kv + o + rows)  # dq, dkv, out, lse in float64
    oracle32 = 4 * (q + o)  # the float32 oracle before its results are rounded to the kernel dtypes
    kernel = (repeats + 1) * (2 * q + 4 * kv + 2 * o + 4 * rows)  # dkv may be accumulated in float32
    terms = 8 * 8 * (rows + B * Skv)  # the error model's per-row terms
    return inputs + oracle64 + oracle32 + kernel + terms + 12 * CHUNK_BYTES + 6 * COMPARE_BYTES


def fits(case, device) -> str | None:
    """None when ``case`` fits in the free memory of ``device``, else the reason with the numbers."""
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
