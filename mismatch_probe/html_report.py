"""report/index.html: one self-contained page (plots are sibling PNGs) that opens from disk."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from .bootstrap import CI_SUFFIX, ci_key, format_with_interval
from .corrections import CORRECTION_KEYS, LEVEL_PREFIXES
from .manifests import RolloutManifest, now_iso
from .metrics import EXTREME_PREFIX, PROBABILITY_KEYS, ROUTING_KEYS
from .rundir import ROLLOUT, SCORES, Run

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f3f3f3; }
.note { color: #8a5300; }
figure { display: inline-block; margin: 0.5em; vertical-align: top; }
figcaption { font-size: 0.85em; color: #555; }
"""


def _fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(
            f'<td class="num">{escape(_fmt(v))}</td>' if isinstance(v, (int, float)) and j else f"<td>{escape(_fmt(v))}</td>"
            for j, v in enumerate(row)
        ) + "</tr>"
        for row in rows
    )  # fmt: skip
    return f"<table><tr>{head}</tr>{body}</table>"


def _sides_table(run: Run, manifest: RolloutManifest) -> str:
    """One line per side: engine name, dtype, replay and pass (the full engine settings are in the manifests)."""
    rows = [[ROLLOUT, manifest.engine_name, manifest.dtype or "unknown", "—", "—"]]
    for name in run.score_sets():
        side = run.score_manifest(name)
        passes = f"{side.pass_index} of {side.repeats}" if side.pass_index else "—"
        rows.append([f"{SCORES}/{name}", side.engine_name, side.dtype or "unknown", side.replay or "none", passes])
    return _table(["side", "engine", "dtype", "replay", "pass"], rows)


def _manifest_summary(manifest: RolloutManifest) -> str:
    keys = ("model", "engine", "dtype", "num_layers", "top_k", "num_experts", "moe_layer_indices", "seed", "created_at")
    rows = [[key, getattr(manifest, key)] for key in keys if getattr(manifest, key) is not None]
    rows.append(["sampling", manifest.sampling])
    rows += [[f"version: {name}", version] for name, version in (manifest.versions or {}).items() if version]
    return _table(["field", "value"], rows)


def _metrics_table(metrics: dict) -> str:
    comps = metrics["comparisons"]
    extreme = [k for k in comps[0]["metrics"] if k.startswith(EXTREME_PREFIX) and not k.endswith(CI_SUFFIX)] if comps else []
    extra = ["n_response_tokens", "n_skipped", "n_null_ref", "n_null_cand", "n_nonfinite_ref", "n_nonfinite_cand",
             "n_argmax_compared", "n_routing_tokens", "n_routing_sequences"]  # fmt: skip
    corrections = [k for k in comps[0]["metrics"] if k in CORRECTION_KEYS
                   or (k.startswith(LEVEL_PREFIXES) and not k.endswith(CI_SUFFIX))] if comps else []  # fmt: skip
    keys = [*PROBABILITY_KEYS, *extreme, "argmax_flip_rate", *ROUTING_KEYS, *corrections, *extra]
    header = ["metric"] + [f"{c['reference']} → {c['candidate']}" for c in comps]
    rows = [[key] + [_cell(c["metrics"], key) for c in comps] for key in keys]
    return _table(header, rows) + "<p>[low, high]: 95% bootstrap interval over sequences.</p>"


def _cell(metrics: dict, key: str):
    """The value, or `value [low, high]` where the key has a 95% interval."""
    ci = metrics.get(ci_key(key))
    return format_with_interval(metrics.get(key), ci) if ci else metrics.get(key)


def write_index(directory: Path, run: Run, manifest: RolloutManifest, metrics: dict, plots) -> Path:
    notes = sorted({note for c in metrics["comparisons"] for note in c["notes"]})
    figures = "\n".join(
        f'<figure><img src="{escape(p.filename)}" alt="{escape(p.title)}"><figcaption>{escape(p.title)}</figcaption></figure>'
        for p in plots
    )
    scope = metrics["comparisons"][0]["routing_scope"] if metrics["comparisons"] else "all"
    html = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>mismatch report: {escape(run.root.name)}</title>
<style>{STYLE}</style></head><body>
<h1>Training-inference mismatch: {escape(run.root.name)}</h1>
<p>Generated {escape(now_iso())}. Probability metrics cover response tokens with finite log-probs on both sides;
routing metrics cover {"prompt and response" if scope == "all" else "response"} positions with routing on both sides.</p>
{"".join(f'<p class="note">{escape(n)}</p>' for n in notes)}
<h2>Run</h2>
{_manifest_summary(manifest)}
<h2>Sides</h2>
{_sides_table(run, manifest)}
<h2>Metrics</h2>
{_metrics_table(metrics)}
<p>Raw numbers, histograms and F(t) curves: <a href="metrics.json">metrics.json</a>.</p>
<h2>Plots</h2>
{figures}
</body></html>
"""
    path = directory / "index.html"
    tmp = directory / ".index.html.tmp"
    tmp.write_text(html)
    tmp.replace(path)
    return path
