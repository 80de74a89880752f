"""The conformance suite, installed with the package:

    pytest --pyargs sparse_mqa_testkit.property_tests --smqa-backend NAME [--smqa-profile dev|ci|nightly]

Each test draws cases inside the backend's declared domain (``strategies.backend_cases``), runs a check of the
registry (``sparse_mqa_testkit.checks.CHECKS``) and records what it saw for the conformance table. Needs the
package's pytest plugin (loaded automatically when the package is installed).
"""
