"""``sparse-mqa-bench``: forward and backward backends timed side by side (``cli``), on shapes and inputs
(``shapes``), timed and judged for stability (``timing``), reported as a table and plots (``report``); ``ptx`` holds
the inline-PTX reductions that only the benchmark scripts compile."""

from .cli import main, run

__all__ = ["main", "run"]
