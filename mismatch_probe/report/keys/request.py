"""What a report was asked for (pairs, thresholds, routing scope, ...), remembered in its metrics.json.

A plain `probe report RUN` reproduces the last report of the run: each option not given is the
remembered one. `--pair A:B` replaces the pairs; `--pair +A:B` adds to them (to the remembered pairs,
or to the defaults: rollout against every score set, and consecutive repeated passes). A request that
keeps the defaults recomputes them at every report, so a score set rescored later joins the report.
Hints that suggest a report print `probe report RUN --pair +A:B`: the remembered request plus the change.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import read_json
from mismatch_probe.report.keys.levels import (
    DEFAULT_GEO_BOUNDS,
    DEFAULT_MIN_RATIO,
    DEFAULT_PPO_BOUNDS,
    DEFAULT_THRESHOLDS,
    DEFAULT_TIS_CAPS,
    DEFAULT_WORST,
    parse_bounds,
    parse_caps,
    parse_levels,
    parse_ppo_bounds,
    parse_worst,
    ppo_bound_labels,
)
from mismatch_probe.rundir.layout import Run

REQUEST_KEY = "request"
ADD = "+"
ROUTING_SCOPES = ("all", "response")
OPTIONS = ("thresholds", "routing_scope", "tis_caps", "geo_bounds", "worst", "drift_ratio", "ppo_bounds")


def parse_thresholds(values) -> tuple[str, ...]:
    """Thresholds keep the spelling the user gave (their key is `extreme_fraction@<as given>`)."""
    return parse_levels(values, "--thresholds", lambda t: t >= 1, ">= 1 (max(r, 1/r) is never below 1)", "1.5,2,5,10")


def parse_drift_ratio(value) -> float:
    """The factor a change of k3 over steps must clear to be named a drift (a drop: 1 / this)."""
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        raise ProbeError(f"--drift-ratio: {value!r} is not a number") from None
    if not math.isfinite(ratio) or ratio <= 1:
        raise ProbeError(f"--drift-ratio: {value} must be a finite number > 1, e.g. 1.5")
    return ratio


def parse_scope(scope: str) -> str:
    if scope not in ROUTING_SCOPES:
        raise ProbeError(f"--routing-scope: {scope!r}, expected one of {', '.join(ROUTING_SCOPES)}")
    return scope


@dataclass(frozen=True, kw_only=True)
class ReportRequest:
    """A report's pairs and options (OPTIONS), every one set: the one object that carries the options from
    build_report through the pass (ScanJob) to each comparison's accumulators (Comparison.new)."""

    default_pairs: bool = True  # the run's default pairs, recomputed at each report
    pairs: tuple[str, ...] = ()  # REFERENCE:CANDIDATE with canonical side names: added to the defaults, or alone
    thresholds: tuple[str, ...] = parse_thresholds(DEFAULT_THRESHOLDS)
    routing_scope: str = "all"
    tis_caps: tuple[str, ...] = parse_caps(DEFAULT_TIS_CAPS)
    geo_bounds: tuple[str, ...] = parse_bounds(DEFAULT_GEO_BOUNDS)
    worst: int = DEFAULT_WORST
    drift_ratio: float = DEFAULT_MIN_RATIO
    ppo_bounds: tuple[tuple[str, str], ...] = DEFAULT_PPO_BOUNDS

    def to_json(self) -> dict:
        return {
            "default_pairs": self.default_pairs,
            "pairs": list(self.pairs),
            "thresholds": list(self.thresholds),
            "routing_scope": self.routing_scope,
            "tis_caps": list(self.tis_caps),
            "geo_bounds": list(self.geo_bounds),
            "worst": self.worst,
            "drift_ratio": self.drift_ratio,
            "ppo_bounds": ppo_bound_labels(self.ppo_bounds),
        }

    @classmethod
    def parsed(
        cls,
        default_pairs=True,
        pairs=(),
        thresholds=None,
        routing_scope=None,
        tis_caps=None,
        geo_bounds=None,
        worst=None,
        drift_ratio=None,
        ppo_bounds=None,
    ) -> ReportRequest:
        """A request from option values (None: the default), each checked as its option is."""
        d = cls()
        return cls(
            default_pairs=bool(default_pairs),
            pairs=tuple(pairs),
            thresholds=d.thresholds if thresholds is None else parse_thresholds(thresholds),
            routing_scope=d.routing_scope if routing_scope is None else parse_scope(routing_scope),
            tis_caps=d.tis_caps if tis_caps is None else parse_caps(tis_caps),
            geo_bounds=d.geo_bounds if geo_bounds is None else parse_bounds(geo_bounds),
            worst=d.worst if worst is None else parse_worst(worst),
            drift_ratio=d.drift_ratio if drift_ratio is None else parse_drift_ratio(drift_ratio),
            ppo_bounds=d.ppo_bounds if ppo_bounds is None else parse_ppo_bounds(ppo_bounds),
        )

    def pair_list(self, run: Run) -> list[tuple[str, str]]:
        pairs = run.default_pairs() if self.default_pairs else []
        return list(dict.fromkeys(pairs + [run.parse_pair(p) for p in self.pairs]))

    def options(self) -> list[str]:
        """The `probe report` options that ask for this request on a run that remembers none."""
        d = ReportRequest()
        out = [f"--pair {ADD if self.default_pairs else ''}{p}" for p in self.pairs]
        for name in ("thresholds", "tis_caps", "geo_bounds"):
            if getattr(self, name) != getattr(d, name):
                out.append(f"--{name.replace('_', '-')} {','.join(getattr(self, name))}")
        if self.routing_scope != d.routing_scope:
            out.append(f"--routing-scope {self.routing_scope}")
        if self.drift_ratio != d.drift_ratio:
            out.append(f"--drift-ratio {self.drift_ratio:g}")
        if self.ppo_bounds != d.ppo_bounds:
            out.append(f"--ppo-bounds {','.join(ppo_bound_labels(self.ppo_bounds))}")
        return out + ([f"--worst {self.worst}"] if self.worst != d.worst else [])


def remembered(run: Run) -> ReportRequest | None:
    """The request kept in the run's metrics.json; None when there is none this version can read (no
    report yet, a report written before requests were kept, a damaged file): then the defaults apply."""
    try:
        stored = read_json(run.metrics_path).get(REQUEST_KEY)
        pairs = stored.get("pairs", []) if isinstance(stored, dict) else None
        if not isinstance(pairs, list) or not all(isinstance(p, str) for p in pairs):
            return None
        return ReportRequest.parsed(
            **{key: stored[key] for key in ("default_pairs", "pairs", *OPTIONS) if key in stored}
        )
    except (ProbeError, TypeError):
        return None


def resolve(run: Run, pairs=None, **options) -> tuple[ReportRequest, bool]:
    """This report's request, and whether it reuses anything remembered (for the summary to say so).
    Each option given wins, else the remembered one, else the default. pairs: strings `A:B` replace the
    pairs and `+A:B` add to them; (reference, candidate) tuples replace them. options: by the names in OPTIONS."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:  # a caller's typo, not the user's: the CLI passes only these names
        raise TypeError(f"not a report option: {', '.join(unknown)} (the options: {', '.join(OPTIONS)})")
    base = remembered(run) or ReportRequest()
    given = {key: value for key, value in options.items() if value is not None}
    request = ReportRequest.parsed(**{key: getattr(base, key) for key in OPTIONS} | given)
    if pairs is None:
        request = replace(request, default_pairs=base.default_pairs, pairs=tuple(_checked(run, p) for p in base.pairs))
    else:
        request = _with_pairs(run, base, request, list(pairs))
    d = ReportRequest()
    replaced = pairs is not None and any(not (isinstance(p, str) and p.startswith(ADD)) for p in pairs)
    reused = any(key not in given and getattr(base, key) != getattr(d, key) for key in OPTIONS) or (
        not replaced and (bool(base.pairs) or not base.default_pairs)
    )
    return request, reused


def _with_pairs(run: Run, base: ReportRequest, request: ReportRequest, pairs: list) -> ReportRequest:
    added = [p[len(ADD) :] for p in pairs if isinstance(p, str) and p.startswith(ADD)]
    alone = [p for p in pairs if not (isinstance(p, str) and p.startswith(ADD))]
    canonical = [_canonical(run, p) for p in alone + added]
    if alone:  # A:B replaces the pairs; a +C:D given with it joins them
        return replace(request, default_pairs=False, pairs=tuple(dict.fromkeys(canonical)))
    kept = [_checked(run, p) for p in base.pairs]
    return replace(request, default_pairs=base.default_pairs, pairs=tuple(dict.fromkeys(kept + canonical)))


def _canonical(run: Run, pair) -> str:
    ref, cand = run.parse_pair(pair) if isinstance(pair, str) else (run.side_name(pair[0]), run.side_name(pair[1]))
    return f"{ref}:{cand}"


def _checked(run: Run, remembered_pair: str) -> str:
    """A remembered pair whose side is gone is bad input that says where the pair came from."""
    try:
        return _canonical(run, remembered_pair)
    except ProbeError as exc:
        raise ProbeError(
            f"{run.metrics_path}: remembered pair {remembered_pair}: {exc} "
            "(pass --pair REFERENCE:CANDIDATE to replace the remembered pairs)"
        ) from None


def report_command(run_root: Path, added=()) -> str:
    """`probe report RUN --pair +A:B`: the run's remembered request plus these pairs."""
    return " ".join([f"probe report {shlex.quote(str(run_root))}", *(f"--pair {ADD}{a}:{b}" for a, b in added)])
