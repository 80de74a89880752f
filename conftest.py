# The repo's own test configuration: only what the package's pytest plugin provides.
# src/ on the path and the plugin listed, so an uninstalled checkout runs too (an installed one loads the
# plugin through its pytest11 entry point, registered under the same name, so it is not loaded twice).
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "src"))

pytest_plugins = ["sparse_mqa_testkit.plugin"]
