"""The tools around the suite: ``sparse-mqa-check`` (``cli``), the child-pytest runner, nightly fuzzing and
compute-sanitizer runs."""
