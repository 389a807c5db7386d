"""Make the server test harness importable from here (helpers.py comes from tests/engine)."""

import sys
from pathlib import Path

_SERVER = str(Path(__file__).parents[1] / "server")
if _SERVER not in sys.path:
    sys.path.insert(0, _SERVER)
