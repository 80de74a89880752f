"""sparse-mqa-testkit: reference oracle and conformance suite for absorbed-MQA sparse attention backward kernels.

See ``sparse_mqa_testkit.contract`` for the contract every piece of this package imports.
"""

__version__ = "0.1.0"
