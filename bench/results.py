"""What every benchmark in bench/ does last: write its result as JSON and its plot as PNG."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def write_results(result: dict, out: Path, plot: Callable[[dict, Path], None]) -> None:
    """out.json holds `result`; plot(result, out.png) draws it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
