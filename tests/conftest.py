import os
import sys

# Test helpers (layout_utils) are imported by the spawned ranks too: keep their folder on sys.path.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))
