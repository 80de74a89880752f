"""The suite's drawn checks as one fixture-free Hypothesis test, for runners that set up no pytest fixture
(HypoFuzz): ``test_fuzz(smqa_target, data)``, one item per (backend, check), each keyed by its node id
(``sparse_mqa_testkit.harness.fuzzing``). Collected with ``--smqa-fuzz`` / ``SMQA_FUZZ=1`` and under HypoFuzz,
in place of ``test_check`` and ``test_check_outside_domain``:

    hypothesis fuzz -- --pyargs sparse_mqa_testkit.property_tests --smqa-backend NAME --smqa-database DB
    pytest --pyargs sparse_mqa_testkit.property_tests --smqa-backend NAME --smqa-fuzz --smqa-database DB
"""

from sparse_mqa_testkit.harness.fuzzing import fuzz_test

test_fuzz = fuzz_test()
