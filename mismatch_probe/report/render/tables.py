"""The tables of report/index.html: metrics (comparisons as rows, sortable by a click on a header),
sides, and flattened manifests. Every cell is escaped text."""

from __future__ import annotations

import json
from html import escape

from mismatch_probe.frames.bootstrap import CI_SUFFIX, ci_key
from mismatch_probe.report import numbers
from mismatch_probe.report.keys.catalogue import declared, rank
from mismatch_probe.report.keys.metric_key import GROUPS
from mismatch_probe.report.policy.kind import is_policy

GROUP_TITLES = dict(
    zip(
        GROUPS,
        (
            "Probability",
            "Extreme tokens and clipping",
            "Routing",
            "Correction what-ifs",
            "verl's rollout-correction statistics",
            "Counts",
            "Policy staleness (new policy against its θ_old pass)",
        ),
    )
)
MAX_COLUMNS = 7  # metric columns per table: wider tables would scroll sideways at 1280 px (verl's long keys)

# Sorts the rows of a table.sortable by the clicked column (data-sort holds the number; empty cells last).
SORT_SCRIPT = """<script>
document.querySelectorAll("table.sortable").forEach((table) => {
  table.querySelectorAll("thead th").forEach((th, column) => {
    th.addEventListener("click", () => {
      const ascending = th.getAttribute("aria-sort") !== "ascending";
      table.querySelectorAll("thead th").forEach((other) => other.removeAttribute("aria-sort"));
      th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
      const key = (row) => row.cells[column].dataset.sort ?? row.cells[column].textContent;
      const rows = Array.from(table.tBodies[0].rows);
      rows.sort((a, b) => {
        const x = key(a), y = key(b);
        if (x === "" || y === "") return (x === "") - (y === "");
        const order = isNaN(x) || isNaN(y) ? x.localeCompare(y) : Number(x) - Number(y);
        return ascending ? order : -order;
      });
      rows.forEach((row) => table.tBodies[0].appendChild(row));
    });
  });
});
</script>"""


def fmt(value) -> str:
    """Plain text of a cell: floats as report/numbers.py writes them; ints (ids, positions) as they are."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return numbers.value(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def breakable(text: str) -> str:
    """Escaped, with break opportunities after _ @ / so long key and side names wrap instead of widening."""
    out = escape(text)
    for mark in ("_", "@", "/"):
        out = out.replace(mark, mark + "<wbr>")
    return out


def table(header: list[str], rows: list[list], css_class: str = "") -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{escape(fmt(v))}</td>'
            if isinstance(v, (int, float)) and j
            else f"<td>{escape(fmt(v))}</td>"
            for j, v in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f'<table class="{css_class}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def value_html(metrics: dict, key: str) -> str:
    """`value` and, beneath it, `[low, high]` where the key has a 95% interval."""
    value, ci = metrics.get(key), metrics.get(ci_key(key))
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return escape(fmt(value))
    if not ci:
        return escape(numbers.value(value))
    return f'{escape(numbers.value(value))}<span class="ci">{escape(numbers.interval(ci, value))}</span>'


def metric_cell(metrics: dict, key: str) -> str:
    value = metrics.get(key)
    sort = f"{value:.17g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""
    return f'<td class="num" data-sort="{sort}">{value_html(metrics, key)}</td>'


def metric_groups(comparisons: list[dict]) -> list[tuple[str, list[str]]]:
    """(title, keys) of each metrics table; every metric key of the comparisons lands in exactly one."""
    present = list(dict.fromkeys(k for c in comparisons for k in c["metrics"] if not k.endswith(CI_SUFFIX)))
    present.sort(key=rank)  # catalogue order; a family's keys as the report made them
    group = {k: entry.group if (entry := declared(k)) else "other" for k in present}
    out = []
    for name, title in (*GROUP_TITLES.items(), ("other", "Other")):
        keys = [k for k in present if group[k] == name and any(c["metrics"].get(k) is not None for c in comparisons)]
        for start in range(0, len(keys), MAX_COLUMNS):
            out.append((title, keys[start : start + MAX_COLUMNS]))
    return out


def metrics_tables(comparisons: list[dict]) -> str:
    """One table per group of keys. Policy comparisons are rows of the policy tables only, and engine
    comparisons of the others: each table holds the comparisons its keys describe."""
    parts = []
    for title, keys in metric_groups(comparisons):
        policy_table = title == GROUP_TITLES["policy"]
        rows = "".join(
            f'<tr><td class="label" data-sort="{i:04d}"><a href="#comparison-{i}">{breakable(c["reference"])} → '
            f"{breakable(c['candidate'])}</a></td>" + "".join(metric_cell(c["metrics"], k) for k in keys) + "</tr>"
            for i, c in enumerate(comparisons)
            if is_policy(c) == policy_table
        )
        if not rows:
            continue
        head = '<th class="label">comparison</th>' + "".join(f"<th>{breakable(k)}</th>" for k in keys)
        parts.append(
            f'<h3>{escape(title)}</h3><table class="sortable metrics"><thead><tr>{head}</tr></thead>'
            f"<tbody>{rows}</tbody></table>"
        )
    return "\n".join(parts)


def flatten(value, prefix: str = "") -> list[tuple[str, str]]:
    """A nested manifest value as (dotted key, plain text) rows: no JSON braces for a reader to parse."""
    if isinstance(value, dict):
        return [row for key, item in value.items() for row in flatten(item, f"{prefix}.{key}" if prefix else str(key))]
    if isinstance(value, list):
        return [(prefix, ", ".join(fmt(v) for v in value) if value else "(empty)")]
    return [(prefix, fmt(value))]


def manifest_table(obj: dict) -> str:
    rows = "".join(f"<tr><td>{breakable(key)}</td><td>{escape(text)}</td></tr>" for key, text in flatten(obj))
    return f'<table class="manifest"><tbody>{rows}</tbody></table>'
