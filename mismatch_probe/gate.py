"""`probe gate`: check metrics.json against upper limits, for CI (exit 0 pass, 1 exceeded, 2 bad input)."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from .errors import ProbeError
from .jsonfile import read_document, read_json
from .metrics import DEFAULT_THRESHOLDS, EXTREME_PREFIX, threshold_label
from .progress import stdout_console
from .report import build_report
from .rundir import Run


@dataclass(frozen=True)
class Check:
    reference: str
    candidate: str
    metric: str
    limit: float
    value: float | None
    status: str  # "pass", "fail" or "skipped" (the metric does not apply to this comparison, e.g. routing on a dense model)

    @property
    def comparison(self) -> str:
        return f"{self.reference} vs {self.candidate}"


def _number(text, where: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ProbeError(f"{where}: {text!r} is not a number") from None
    if isinstance(text, bool) or math.isnan(value):
        raise ProbeError(f"{where}: {text!r} is not a number")
    return value


def read_limits_toml(path: Path) -> dict[str, float]:
    """`[max]` table of metric = limit; quote keys with '@' or '.': "extreme_fraction@2" = 1e-3."""
    data = read_document(path, tomllib.loads, "TOML", (tomllib.TOMLDecodeError,))
    table = data.get("max")
    if not isinstance(table, dict) or not table:
        raise ProbeError(f'{path}: expected a [max] table, e.g. [max] k3_kl = 1e-3 and "extreme_fraction@2" = 1e-3')
    return {key: _number(value, f"{path}: [max] {key}") for key, value in table.items()}


def parse_limits(max_args: list[str], config: Path | None) -> dict[str, float]:
    limits = read_limits_toml(config) if config is not None else {}
    for arg in max_args:
        key, sep, value = arg.partition("=")
        if not sep or not key.strip():
            raise ProbeError(f"--max {arg!r}: expected KEY=VALUE, e.g. --max k3_kl=1e-3")
        limits[key.strip()] = _number(value.strip(), f"--max {key.strip()}")
    if not limits:
        raise ProbeError("no limits given: pass --max KEY=VALUE or --config limits.toml")
    return limits


def _threshold_of(key: str) -> float | None:
    try:
        return float(key.removeprefix(EXTREME_PREFIX)) if key.startswith(EXTREME_PREFIX) else None
    except ValueError:
        return None


def load_metrics(run: Run, pairs: list[str], limits: dict[str, float]) -> dict:
    """metrics.json of the run, computing the report first when there is none."""
    path = run.metrics_path
    if not path.is_file():
        run.manifest()  # a missing or broken run is reported as such, not as a missing report
        wanted = [threshold_label(t) for t in DEFAULT_THRESHOLDS]
        wanted += [key.removeprefix(EXTREME_PREFIX) for key in limits if _threshold_of(key) is not None]
        build_report(run.root, pairs=pairs or None, thresholds=wanted)
    metrics = read_json(path)
    if not isinstance(metrics.get("comparisons"), list):
        raise ProbeError(f"{path}: expected {{'schema_version': 1, 'comparisons': [...]}}")
    for i, comp in enumerate(metrics["comparisons"]):
        if not (
            isinstance(comp, dict) and isinstance(comp.get("reference"), str)
            and isinstance(comp.get("candidate"), str) and isinstance(comp.get("metrics"), dict)
        ):  # fmt: skip
            raise ProbeError(f"{path}: comparisons[{i}]: expected {{'reference': ..., 'candidate': ..., 'metrics': {{...}}}}")
    return metrics


def _resolve_key(key: str, valid: list[str], path: Path) -> str:
    if key in valid:
        return key
    t = _threshold_of(key)
    if t is not None:  # extreme_fraction@2.0 names the same metric as extreme_fraction@2
        same = [v for v in valid if _threshold_of(v) == t]
        if same:
            return same[0]
        computed = ",".join(v.removeprefix(EXTREME_PREFIX) for v in valid if v.startswith(EXTREME_PREFIX))
        raise ProbeError(
            f"{path}: no metric {key} (thresholds computed: {computed}); "
            f"re-run `probe report RUN --thresholds {computed},{key.removeprefix(EXTREME_PREFIX)}`"
        )
    raise ProbeError(f"--max {key}: unknown metric (valid keys: {', '.join(valid)})")


def evaluate(run_root, limits: dict[str, float], pairs: list[str] | None = None) -> list[Check]:
    run = Run(Path(run_root))
    pairs = pairs or []
    metrics = load_metrics(run, pairs, limits)
    path = run.metrics_path
    comparisons = metrics["comparisons"]
    if pairs:
        wanted = [run.parse_pair(p) for p in pairs]
        available = {(c["reference"], c["candidate"]): c for c in comparisons}
        missing = [f"{a}:{b}" for a, b in wanted if (a, b) not in available]
        if missing:
            have = ", ".join(f"{a}:{b}" for a, b in available) or "none"
            raise ProbeError(f"{path}: no comparison {', '.join(missing)} (available: {have}); re-run probe report --pair")
        comparisons = [available[p] for p in dict.fromkeys(wanted)]
    valid = list(dict.fromkeys(key for c in comparisons for key in c["metrics"]))
    resolved = {_resolve_key(key, valid, path): limit for key, limit in limits.items()}
    checks = []
    for comp in comparisons:
        for key, limit in resolved.items():
            value = comp["metrics"].get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ProbeError(
                    f"{path}: {comp['reference']} vs {comp['candidate']}: {key} is {value!r}, expected a number or null"
                )
            if value is None:
                status = "skipped"
            else:
                status = "pass" if float(value) <= limit else "fail"  # NaN compares False: fails
            checks.append(Check(comp["reference"], comp["candidate"], key, limit, value, status))
    return checks


def checks_json(checks: list[Check]) -> str:
    return json.dumps(
        {"passed": not any(c.status == "fail" for c in checks), "checks": [asdict(c) for c in checks]}, indent=2
    )


def write_junit(path: Path, checks: list[Check]) -> None:
    """One test case per (comparison, metric); skipped metrics are JUnit skips."""
    suite = ET.Element(
        "testsuite", name="probe gate", tests=str(len(checks)),
        failures=str(sum(c.status == "fail" for c in checks)), skipped=str(sum(c.status == "skipped" for c in checks)),
    )  # fmt: skip
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname=c.comparison, name=c.metric)
        if c.status == "fail":
            ET.SubElement(case, "failure", message=f"{c.metric} = {c.value:.6g} exceeds limit {c.limit:.6g}")
        elif c.status == "skipped":
            ET.SubElement(case, "skipped", message=f"{c.metric} does not apply to this comparison")
    tree = ET.ElementTree(ET.Element("testsuites"))
    tree.getroot().append(suite)
    try:
        tree.write(path, encoding="utf-8", xml_declaration=True)
    except OSError as exc:
        raise ProbeError(f"{path}: cannot write JUnit XML ({exc.strerror or exc})") from None


def print_checks(checks: list[Check], run) -> None:
    from rich.table import Table

    table = Table(title=f"gate: {run}")
    for name in ("comparison", "metric", "limit", "value", "result"):
        table.add_column(name, justify="right" if name in ("limit", "value") else "left")
    style = {"pass": "[green]pass[/]", "fail": "[bold red]FAIL[/]", "skipped": "[yellow]skipped[/]"}
    for c in checks:
        value = "—" if c.value is None else f"{c.value:.4g}"
        table.add_row(c.comparison, c.metric, f"{c.limit:.4g}", value, style[c.status])
    stdout_console().print(table)
