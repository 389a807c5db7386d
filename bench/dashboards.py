"""Draw the chart's Grafana dashboards (charts/kvasir/dashboards) as PNGs, from the query results
of a real Prometheus that scraped a real engine and gateway under load, for docs/observability.md.

The data comes from tests/gateway/test_dashboards.py, which evaluates every panel's query and,
with KVASIR_DASHBOARD_DATA set, keeps the results:

    KVASIR_DASHBOARD_DATA=/tmp/dashboards .venv/bin/python -m pytest \\
        tests/gateway/test_dashboards.py -k panel
    .venv/bin/python bench/dashboards.py /tmp/dashboards docs/images

(`make dashboard-pictures` does both.)

One picture per dashboard, one small chart per panel in the dashboard's order, one line per
series (the panel's legend, with Grafana's {{label}} filled in), time in seconds from the start
of the load. It is what the on-call sees, without Grafana's styling.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

UNITS = {"s": "seconds", "percentunit": "fraction", "reqps": "requests/s", "short": ""}


def legend(template: str, metric: dict[str, str]) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), template)
    return " ".join(text.split()) or "value"


def draw(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_panel: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for target in data["targets"]:
        by_panel[target["panel"]].append(target)
    cols = 3
    rows = math.ceil(len(by_panel) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 2.9 * rows), squeeze=False)
    for ax, (title, targets) in zip(axes.flat, by_panel.items(), strict=False):
        for target in targets:
            for series in target["result"]:
                points = [(float(t) - data["start"], float(v)) for t, v in series["values"]]
                points = [(t, v) for t, v in points if v == v]
                if points:
                    ax.plot(*zip(*points, strict=True), linewidth=1.2,
                            label=legend(target["legend"], series["metric"]))
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(UNITS.get(targets[0]["unit"], targets[0]["unit"]), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if 0 < len(handles) <= 6:
            ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(by_panel):]:
        ax.axis("off")
    fig.suptitle(f"{data['title']} (seconds from the start of the test's load)", fontsize=12)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path, help="KVASIR_DASHBOARD_DATA of the test run")
    parser.add_argument("out", type=Path, help="folder of the PNGs (docs/images)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for path in sorted(args.data.glob("*.json")):
        target = args.out / f"dashboard-{path.stem}.png"
        draw(json.loads(path.read_text()), target)
        print(target)


if __name__ == "__main__":
    main()
