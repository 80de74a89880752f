# The repo's own test configuration: src/ on the path for an uninstalled checkout.
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "src"))
