"""docs/metrics.md's tables as data, for the tests that hold /metrics to them.

The docs are the one place the metric list lives: each table row is `| metric | type | labels |
series | what | since |`. A row is exported when /metrics has the family with the type the row
says, and every sample of it carries exactly the row's labels (besides a histogram's `le`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"

FROM_THE_START = "from the start"
PER_HANDLER = "per handler, once requested"
PER_TENANT = "per tenant, once it sends"
PER_TENANT_REFUSED = "per tenant, once refused"
SPECULATIVE = "with --speculative-config"
KV_TRANSFER = "with --kv-transfer-config"
SERIES = {FROM_THE_START, PER_HANDLER, PER_TENANT, PER_TENANT_REFUSED, SPECULATIVE, KV_TRANSFER}
# Rows whose families exist only when their flag is given.
OPTIONAL_SERIES = {SPECULATIVE, KV_TRANSFER}

_ROW = re.compile(r"^\| `([^`]+)` \| (\w+) \| ([^|]*) \| ([^|]+) \|")


@dataclass(frozen=True)
class DocumentedMetric:
    name: str  # as a dashboard writes it: a counter with its `_total`
    type: str
    labels: frozenset[str]
    series: str

    @property
    def family(self) -> str:
        """The family name prometheus_client's parser gives (a counter's without `_total`)."""
        return self.name.removesuffix("_total") if self.type == "counter" else self.name


def documented_metrics() -> list[DocumentedMetric]:
    rows = []
    for line in DOC.read_text().splitlines():
        if (match := _ROW.match(line)) is None:
            continue
        name, kind, labels, series = (group.strip() for group in match.groups())
        assert series in SERIES, f"docs/metrics.md, {name}: unknown series {series!r}"
        rows.append(DocumentedMetric(name, kind, frozenset(re.findall(r"`([^`]+)`", labels)),
                                     series))
    assert len({row.name for row in rows}) == len(rows), "a metric listed twice"
    return rows


@dataclass(frozen=True)
class Family:
    type: str
    label_sets: frozenset[frozenset[str]]  # of its samples, `le` left out

    @property
    def has_series(self) -> bool:
        return bool(self.label_sets)


def exported_families(page: str) -> dict[str, Family]:
    out: dict[str, Family] = {}
    for family in text_string_to_metric_families(page):
        label_sets = frozenset(frozenset(set(s.labels) - {"le"}) for s in family.samples)
        out[family.name] = Family(family.type, label_sets)
    return out


def problems(page: str, rows: list[DocumentedMetric], *, need_series: set[str]) -> list[str]:
    """What on the page contradicts the rows: a family missing or of another type, a sample
    with other labels, or no series for a row whose `series` is in `need_series`."""
    families = exported_families(page)
    found = []
    for row in rows:
        family = families.get(row.family)
        if family is None:
            found.append(f"{row.name}: not exported")
            continue
        if family.type != row.type:
            found.append(f"{row.name}: a {family.type}, documented as a {row.type}")
        for labels in family.label_sets - {row.labels}:
            found.append(f"{row.name}: labels {sorted(labels)}, documented {sorted(row.labels)}")
        if row.series in need_series and not family.has_series:
            found.append(f"{row.name}: no series ({row.series})")
    return found
