import os
import sys

# Ranks spawned by tests/harness.py import test modules by their package path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
