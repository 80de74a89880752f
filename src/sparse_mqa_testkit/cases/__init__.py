"""Case generation: ``Case`` (a small frozen configuration plus a seed), its arrays, the Hypothesis strategies
that draw it near a backend's tiles, the explicit boundary examples, compile pools, run plans and the scale
tier."""

from .case import (
                   EMPTY_LSE_MODES,
                   INVALID_MODES,
                   LARGE,
                   MAGNITUDES,
                   ORDERS,
                   PATTERNS,
                   SINK_MODES,
                   SPREAD_BITS,
                   TOPK_MODES,
                   Case,
)

__all__ = ["Case", "EMPTY_LSE_MODES", "INVALID_MODES", "LARGE", "MAGNITUDES", "ORDERS", "PATTERNS", "SINK_MODES",
           "SPREAD_BITS", "TOPK_MODES"]
