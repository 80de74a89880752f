"""The suite inside pytest: the run's state, fixtures, recording, the conformance table, profiles, xdist GPU
workers, and the one module that touches Hypothesis's private APIs. ``sparse_mqa_testkit.plugin`` wires them to
pytest's hooks."""
