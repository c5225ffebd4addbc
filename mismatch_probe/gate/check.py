"""`probe gate`: check metrics.json against upper limits, for CI (exit 0 pass, 1 exceeded, 2 bad input)."""

from __future__ import annotations

import json
import shlex
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from mismatch_probe.errors import ProbeError
from mismatch_probe.frames.bootstrap import CI_SUFFIX
from mismatch_probe.gate.drift import DRIFT, drift_checks
from mismatch_probe.gate.findings import refused
from mismatch_probe.gate.history import HISTORY, history_checks, history_keys
from mismatch_probe.gate.scope import default_scope, say_left_out
from mismatch_probe.gate.stats import baseline_keys, interval_of, regression, upper_end
from mismatch_probe.gate.trust import (
    check_limit,
    kind_differences,
    require_compared,
    summary_counts,
    unknown_key,
)
from mismatch_probe.jsonfile import read_document, write_text_atomic
from mismatch_probe.progress import console
from mismatch_probe.report.keys.catalogue import declared
from mismatch_probe.report.keys.families import EXTREME_FRACTION
from mismatch_probe.report.keys.levels import DEFAULT_THRESHOLDS, threshold_label
from mismatch_probe.report.keys.request import report_command
from mismatch_probe.report.metrics_file import pair_labels, read_metrics
from mismatch_probe.report.numbers import times, value, with_interval
from mismatch_probe.report.verdict.bands import read_bands
from mismatch_probe.rundir.layout import Run


@dataclass(frozen=True)
class Check:
    reference: str
    candidate: str
    metric: str
    limit: float
    value: float | None
    status: (
        str  # "pass", "fail" or "skipped" (the metric does not apply to this comparison, e.g. routing on a dense model)
    )
    ci95: list[float] | None = None
    # what was compared: "value", "ci95_upper" (--use-ci-upper), "baseline" (--baseline), "drift" (--max-drift)
    # or "history" (--history: the limit is the largest upper end among the history runs)
    checked: str = "value"
    baseline: float | None = None
    baseline_ci95: list[float] | None = None
    step: int | None = None  # a drift's first step after the change

    @property
    def comparison(self) -> str:
        return f"{self.reference} vs {self.candidate}"


def _number(text, where: str) -> float:
    """A limit as given: a number (then checked to be usable as a limit)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ProbeError(f"{where}: {text!r} is not a number") from None
    if isinstance(text, bool):
        raise ProbeError(f"{where}: {text!r} is not a number")
    return check_limit(value, where)


def read_limits_toml(path: Path) -> dict[str, float]:
    """`[max]` table of metric = limit; quote keys with '@' or '.': "extreme_fraction@2" = 1e-3."""
    data = read_document(path, tomllib.loads, "TOML", (tomllib.TOMLDecodeError,))
    if "bands" in data:  # the bands `probe report --bands` reads from the same file: checked here too
        read_bands(path)
    table = data.get("max")
    if not isinstance(table, dict) or not table:
        raise ProbeError(f'{path}: expected a [max] table, e.g. [max] k3_kl = 1e-3 and "extreme_fraction@2" = 1e-3')
    return {key: _number(value, f"{path}: [max] {key}") for key, value in table.items()}


def parse_limits(max_args: list[str], config: Path | None, required: bool = True) -> dict[str, float]:
    limits = read_limits_toml(config) if config is not None else {}
    for arg in max_args:
        key, sep, value = arg.partition("=")
        if not sep or not key.strip():
            raise ProbeError(f"--max {arg!r}: expected KEY=VALUE, e.g. --max k3_kl=1e-3")
        limits[key.strip()] = _number(value.strip(), f"--max {key.strip()}")
    if not limits and required:
        raise ProbeError(
            "no limits given: pass --max KEY=VALUE, --config limits.toml, --baseline OTHER_RUN, --max-drift R or --history DIR"
        )
    return limits


def _threshold_of(key: str) -> float | None:
    level = EXTREME_FRACTION.level_of(key)
    try:
        return None if level is None else float(level)
    except ValueError:
        return None


def load_metrics(run: Run, pairs: list[str], limits: dict[str, float]) -> dict:
    """metrics.json of the run, computing the report first when there is none."""
    path = run.metrics_path
    if not path.is_file():
        run.manifest()  # a missing or broken run is reported as such, not as a missing report
        wanted = [threshold_label(t) for t in DEFAULT_THRESHOLDS]
        wanted += [EXTREME_FRACTION.level_of(key) for key in limits if _threshold_of(key) is not None]
        from mismatch_probe.report.build import build_report  # the whole report stack, only when it must run

        build_report(run.root, pairs=pairs or None, thresholds=wanted)
    return read_metrics(path, run.root)


def _resolve_key(key: str, valid: list[str], path: Path, run: Run) -> str:
    if key in valid:
        return key
    t = _threshold_of(key)
    if t is not None:  # extreme_fraction@2.0 names the same metric as extreme_fraction@2
        same = [v for v in valid if _threshold_of(v) == t]
        if same:
            return same[0]
        computed = ",".join(level for level in map(EXTREME_FRACTION.level_of, valid) if level is not None)
        wanted = f"{computed},{EXTREME_FRACTION.level_of(key)}"
        raise ProbeError(
            f"{path}: no metric {key} (thresholds computed: {computed}); "
            f"re-run `probe report {shlex.quote(str(run.root))} --thresholds {wanted}`"
        )
    raise unknown_key(key, valid, f"--max {key}")


def staleness_only(comp: dict, key: str) -> bool:
    """A policy comparison measures staleness, not engine mismatch: without --pair naming it, only the limits on
    the policy keys (router_shift_clip_fraction@0.8, ...) apply to it (docs/staleness.md)."""
    entry = declared(key)
    return comp.get("kind") == "policy" and (entry is None or entry.group != "policy")


def evaluate(
    run_root,
    limits: dict[str, float],
    pairs: list[str] | None = None,
    use_ci_upper: bool = False,
    baseline=None,  # a path or URL (see rundir.location.run_path)
    strict: bool = False,
    max_drift: float | None = None,
    history=(),  # paths or URLs of earlier runs of the same setup
) -> list[Check]:
    """Every (comparison, limited metric) check, then every check against the baseline. Exit 2 where the
    verdict would mean nothing: see gate_trust."""
    run = Run(run_root)
    pairs = pairs or []
    base_run = None if baseline is None else Run(baseline)  # Run takes a path or a URL
    if base_run is not None:  # before either report is computed: a wrong baseline should cost nothing
        check_kind(run, base_run, strict)
    history_runs = [Run(h) for h in history]
    for other in history_runs:
        check_kind(run, other, strict)
    metrics = load_metrics(run, pairs, limits)
    path = run.metrics_path
    comparisons = metrics["comparisons"]
    if pairs:
        wanted = [run.parse_pair(p) for p in pairs]
        available = {(c["reference"], c["candidate"]): c for c in comparisons}
        missing = [pair for pair in dict.fromkeys(wanted) if pair not in available]
        if missing:
            raise ProbeError(
                f"{path}: no comparison {', '.join(f'{a}:{b}' for a, b in missing)} (available: "
                f"{pair_labels(comparisons)}); add it with `{report_command(run.root, missing)}`"
            )
        comparisons = [available[p] for p in dict.fromkeys(wanted)]
    else:
        comparisons, left_out = default_scope(run, comparisons)
        say_left_out(left_out)
    valid = list(dict.fromkeys(key for c in comparisons for key in c["metrics"] if not key.endswith(CI_SUFFIX)))
    resolved = {_resolve_key(key, valid, path, run): limit for key, limit in limits.items()}
    checks = []
    for comp in comparisons:
        for key, limit in resolved.items():
            if not pairs and staleness_only(comp, key):
                continue
            value = comp["metrics"].get(key)  # a number or null: read_metrics checked
            checked, basis = upper_end(comp["metrics"], key) if use_ci_upper else (value, "value")
            if value is None:
                status = "skipped"
            else:
                status = "pass" if float(checked) <= limit else "fail"  # NaN compares False: fails
            ci = interval_of(comp["metrics"], key)
            checks.append(
                Check(
                    reference=comp["reference"],
                    candidate=comp["candidate"],
                    metric=key,
                    limit=limit,
                    value=value,
                    status=status,
                    ci95=ci,
                    checked=basis,
                )
            )
    if max_drift is not None:
        checks += drift_checks(path, comparisons, max_drift, Check)
    if history_runs:
        earlier = [(str(h.metrics_path), load_metrics(h, pairs, {})["comparisons"]) for h in history_runs]
        checks += history_checks(comparisons, earlier, history_keys(comparisons, list(resolved)), strict, Check)
    if base_run is None:
        require_compared(checks, str(run.root), comparisons)
        return checks
    base_comparisons = load_metrics(base_run, pairs, {})["comparisons"]
    checks += baseline_checks(path, comparisons, base_run.metrics_path, base_comparisons, list(resolved))
    require_compared(checks, str(run.root), comparisons, str(base_run.root), base_comparisons)
    return checks


def check_kind(run: Run, baseline: Run, strict: bool) -> None:
    """A baseline of another kind of run (another model, MoE against dense) gates nothing meaningful:
    a warning per difference on stderr, or exit 2 under --strict."""
    differences = kind_differences(run.manifest(), baseline.manifest())
    if differences and strict:
        raise ProbeError(
            f"{baseline.manifest_path}: the baseline is another kind of run than {run.root} "
            f"({'; '.join(differences)}); --strict refuses it"
        )
    for line in differences:
        console.print(f"warning: baseline {baseline.root}: {line}", highlight=False, markup=False, soft_wrap=True)


def baseline_checks(
    path: Path, comparisons: list[dict], base_path: Path, base_comparisons: list[dict], named: list[str]
) -> list[Check]:
    """Each comparison against the same (reference, candidate) of the baseline run; see gate_stats."""
    others = {(c["reference"], c["candidate"]): c["metrics"] for c in base_comparisons}
    checks = []
    for comp in comparisons:
        pair = (comp["reference"], comp["candidate"])
        where, base_where = (f"{p}: {pair[0]} vs {pair[1]}" for p in (path, base_path))
        for key in baseline_keys(comparisons, named):
            status, fields = regression(comp["metrics"], others.get(pair, {}), key, where, base_where)
            checks.append(
                Check(reference=pair[0], candidate=pair[1], metric=key, status=status, checked="baseline", **fields)
            )
    return checks


def checks_json(checks: list[Check], findings: list[dict] = ()) -> str:
    passed = not any(c.status == "fail" for c in checks) and not refused(findings)
    document = {"passed": passed, **summary_counts(checks), "checks": [asdict(c) for c in checks]}
    return json.dumps(document | {"findings": list(findings)}, indent=2)


def write_junit(path: Path, checks: list[Check], findings: list[dict] = ()) -> None:
    """One test case per (comparison, metric); skipped metrics are JUnit skips; one per doctor finding,
    a failure unless --allow named its check."""
    n_refused = sum(not f["allowed"] for f in findings)
    suite = ET.Element(
        "testsuite",
        name=JUNIT_SUITE,
        tests=str(len(checks) + len(findings)),
        failures=str(sum(c.status == "fail" for c in checks) + n_refused),
        skipped=str(sum(c.status == "skipped" for c in checks)),
    )
    for f in findings:
        case = ET.SubElement(suite, "testcase", classname="doctor", name=f["check"])
        if not f["allowed"]:
            ET.SubElement(case, "failure", message=f["found"])
    for c in checks:
        name = f"{c.metric} vs {c.checked}" if c.checked in ("baseline", HISTORY) else c.metric
        case = ET.SubElement(suite, "testcase", classname=c.comparison, name=name)
        properties = ET.SubElement(case, "properties")
        for key in ("value", "limit", "checked", "baseline", "step"):
            if getattr(c, key) is not None:
                ET.SubElement(properties, "property", name=key, value=str(getattr(c, key)))
        for key in ("ci95", "baseline_ci95"):
            for end, number in zip(("low", "high"), getattr(c, key) or ()):
                ET.SubElement(properties, "property", name=f"{key}_{end}", value=str(number))
        if c.status == "fail":
            ET.SubElement(case, "failure", message=_failure_message(c))
        elif c.status == "skipped":
            ET.SubElement(case, "skipped", message=f"{c.metric} does not apply to this comparison")
    root = ET.Element("testsuites")
    root.append(suite)
    xml = ET.tostring(root, encoding="utf-8", xml_declaration=True).decode("utf-8")
    write_text_atomic(junit_target(path), xml, what="JUnit XML")


JUNIT_SUITE = "probe gate"


def junit_target(path: Path) -> Path:
    """Where --junit writes: the file itself, or through a symbolic link what it points at. Exit 2 unless
    that is absent or JUnit XML that probe gate wrote: the user's own file is never replaced."""
    target = path.resolve() if path.is_symlink() else path
    if not target.exists():
        return target
    if not target.is_file():
        raise ProbeError(f"{path}: exists and is not a file; refusing to replace it with JUnit XML")
    try:
        root = ET.parse(target).getroot()
    except (ET.ParseError, OSError, UnicodeDecodeError):
        root = None
    if root is None or root.tag != "testsuites" or [s.get("name") for s in root] != [JUNIT_SUITE]:
        raise ProbeError(f"{path}: not JUnit XML that probe gate wrote; refusing to replace it")
    return target


def _failure_message(c: Check) -> str:
    if c.checked == DRIFT:
        return f"k3 rose {times(c.value, c.ci95)} from step {c.step}: the ratio's lower end exceeds {value(c.limit)}"
    if c.checked == HISTORY and c.metric == "history runs":
        return f"{int(c.value)} history runs; at least {int(c.limit)} are needed to gate against history (--strict)"
    if c.checked == HISTORY:
        return (
            f"{c.metric} = {with_interval(c.value, c.ci95)} lies above every history run's interval "
            f"(largest upper end {value(c.limit)})"
        )
    if c.checked == "baseline":
        return (
            f"{c.metric} = {with_interval(c.value, c.ci95)} lies above the baseline's "
            f"{with_interval(c.baseline, c.baseline_ci95)} (95% intervals do not overlap)"
        )
    if c.checked == "ci95_upper":
        return (
            f"{c.metric} = {with_interval(c.value, c.ci95) if c.ci95 else value(c.value) + ' [no interval]'}: "
            f"the interval's upper end exceeds limit {value(c.limit)}"
        )
    return f"{c.metric} = {value(c.value)} exceeds limit {value(c.limit)}"
