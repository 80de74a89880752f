"""Comparison: what a case's results are judged against (``Expected``), the error model's terms, the measure
of a result, its allowance, the verdict and the message; and bitwise comparison. The checks import it."""

from .bitwise import bitwise_equal, difference
from .expected import Expected, truth_device
from .model import FLOORS, K_DEFAULT
from .verdict import compare_outputs, compare_tensor, structural_problem

__all__ = ["Expected", "FLOORS", "K_DEFAULT", "bitwise_equal", "compare_outputs", "compare_tensor", "difference",
           "structural_problem", "truth_device"]
