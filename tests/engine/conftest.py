"""Make tests/engine/helpers.py importable as `helpers` from every engine test directory."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
