"""One card per distinct comparison in report/index.html: its sides, headline numbers with intervals, the
routing split, its worst tokens and its own figures (folded). Identical comparisons share one card under
both names; a replayed comparison says so instead of drawing routing plots that would be empty.
Text from the model or manifests is escaped."""

from __future__ import annotations

from html import escape

from mismatch_probe.report.keys.families import EXTREME_FRACTION, K3_KL_SPLIT, N_TOKENS_SPLIT
from mismatch_probe.report.keys.levels import ROUTING_SPLITS
from mismatch_probe.report.numbers import count, value
from mismatch_probe.report.render.tables import breakable, fmt, value_html
from mismatch_probe.report.verdict.production import productions
from mismatch_probe.rundir.layout import ROLLOUT, SCORES, Run
from mismatch_probe.rundir.manifests import RolloutManifest

HEADLINES = (
    ("k3 KL", "k3_kl"),
    ("F(2): tokens with p ratio beyond 2×", EXTREME_FRACTION.at(2)),
    ("argmax flip rate", "argmax_flip_rate"),
    ("router diff rate", "router_diff_rate"),
    ("token diff rate", "token_diff_rate"),
    ("IS effective sample size", "is_ess"),
    ("log-ppl |diff|", "log_ppl_abs_diff"),
)
WORST_SHOWN = 2  # rows visible; the rest of the list is folded (a card per comparison: keep each short)
REPLAYED = "routing replayed: identical by construction (router and token diff rates are 0)"
CONTEXT_CHARS = 80  # characters of decoded context shown before the token


def side_facts(run: Run, manifest: RolloutManifest, side: str, setup: bool = True) -> str:
    """`engine hf · dtype bf16 · replay none · pass 1 of 2` as plain text (the full settings are in the manifests);
    with `setup`, a quantized or truncated side's quantization and sampling after it."""
    if side == ROLLOUT:
        facts = [
            f"engine {manifest.engine_name or 'unknown'}",
            f"dtype {manifest.dtype or 'unknown'}",
            "the sampled rollout",
        ]
    else:
        scores = run.score_manifest(side.removeprefix(f"{SCORES}/"))
        facts = [
            f"engine {scores.engine_name or 'unknown'}",
            f"dtype {scores.dtype or 'unknown'}",
            f"replay {scores.replay or 'none'}",
        ]
        if scores.pass_index:
            facts.append(f"pass {scores.pass_index} of {scores.repeats}")
    production = productions(run, [side])[side]
    if setup and production.production:
        facts.append(production.setup_line())
    return " · ".join(facts)


def _box(label: str, metrics: dict, key: str) -> str:
    return f'<div class="num-box"><div class="what">{escape(label)}</div><div class="value">{value_html(metrics, key)}</div></div>'


def _headline_boxes(metrics: dict) -> str:
    boxes = [_box(label, metrics, key) for label, key in HEADLINES if metrics.get(key) is not None]
    return f'<div class="headline-numbers">{"".join(boxes)}</div>'


def bitwise_equal(metrics: dict) -> bool:
    """k3 = 0 and no token whose float32 log-probs differ in any bit: the two sides agree exactly."""
    return (
        bool(metrics.get("n_tokens")) and metrics.get("k3_kl") == 0 and metrics.get("logprob_bit_mismatch_count") == 0
    )


def _compared(metrics: dict) -> str:
    """The tokens compared, and `bitwise equal` for a comparison whose log-probs agree in every bit."""
    equal = " · <strong>bitwise equal</strong> (every log-prob the same float32 bits)" if bitwise_equal(metrics) else ""
    mismatched = metrics.get("logprob_bit_mismatch_count")
    differ = "" if equal or mismatched is None else f" · {count(mismatched)} differ in some bit"
    return f'<span class="role">compared</span> {count(metrics.get("n_tokens"))} tokens{equal}{differ}'


def _routing_split(metrics: dict) -> str:
    """k3 over tokens routed identically in every MoE layer against tokens where some layer differs, in a line."""
    words = ("routing identical in every layer", "routing differs in a layer")  # of each of ROUTING_SPLITS
    parts = [
        f"{what} ({count(metrics.get(N_TOKENS_SPLIT.at(split)))} tokens): {value_html(metrics, K3_KL_SPLIT.at(split))}"
        for what, split in zip(words, ROUTING_SPLITS, strict=True)
        if metrics.get(K3_KL_SPLIT.at(split)) is not None
    ]
    return f'<p class="split">k3 KL where {"; where ".join(parts)}</p>' if parts else ""


def _tail(text: str | None, limit: int) -> str:
    if not text:
        return ""
    return text if len(text) <= limit else "…" + text[-limit:]


def _token_text(text: str | None, token_id) -> str:
    """The decoded token, with whitespace made visible; its id when it was not decoded."""
    if text is None:
        return f"id {token_id}"
    if not text.strip():
        # characters every font has: a newline token shows as \n, a space as a middle dot
        return text.replace(" ", "·").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r") or "(empty)"
    return text


def _context_html(entry: dict) -> str:
    context = entry.get("context") or {}
    prompt = _tail(context.get("prompt_tail"), CONTEXT_CHARS // 2)
    response = _tail(context.get("response_before"), CONTEXT_CHARS)
    token = _token_text(entry.get("token"), entry.get("token_id"))
    prompt_html = f'<span class="prompt">{escape(prompt)}</span>' if prompt else ""
    return f'<td class="context">{prompt_html}{escape(response)}<mark>{escape(token)}</mark></td>'


def _top_tokens(entry: dict) -> str:
    """Each side's most likely token: decoded text, its id when not decoded, — when the side has none."""
    shown = [
        "—"
        if entry.get(f"top_token_id_{side}") is None
        else _token_text(entry.get(f"top_token_{side}"), entry.get(f"top_token_id_{side}"))
        for side in ("ref", "cand")
    ]
    return f"<td><code>{escape(shown[0])}</code> / <code>{escape(shown[1])}</code></td>"


def _worst_row(entry: dict, routed: bool) -> str:
    cells = [f'<td class="num">{escape(fmt(entry.get(key)))}</td>' for key in ("sample_id", "position")]
    cells.append(_context_html(entry))
    cells += [f'<td class="num">{escape(value(entry.get(key)))}</td>' for key in ("p_ref", "p_cand", "delta")]
    cells.append(_top_tokens(entry))
    if routed:
        cells.append(f'<td class="num">{escape(fmt(entry.get("routing_diff_layers")))}</td>')
    return f"<tr>{''.join(cells)}</tr>"


def _worst_table(entries: list[dict], routed: bool) -> str:
    header = ["sample", "position", "context, then the token", "p ref", "p cand", "δ", "top-1 ref / cand"]
    header += ["layers routed differently"] if routed else []
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    rows = "".join(_worst_row(e, routed) for e in entries)
    return f'<div class="scroll"><table class="worst"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>'


def worst_tokens_html(entries: list[dict] | None) -> str:
    """The first WORST_SHOWN entries, the rest folded; the routing column only where some entry has routing."""
    if not entries:
        return ""
    routed = any(e.get("routing_diff_layers") is not None for e in entries)
    html = _worst_table(entries[:WORST_SHOWN], routed)
    if entries[WORST_SHOWN:]:
        html += f"<details><summary>{len(entries) - WORST_SHOWN} more</summary>{_worst_table(entries[WORST_SHOWN:], routed)}</details>"
    return f"<h4>Tokens with the largest |δ| = |log p cand − log p ref|</h4>{html}"


def _figures(plots) -> str:
    plots = list(plots)
    if not plots:
        return ""
    names = ", ".join(p.kind for p in plots)
    figures = "".join(
        f'<figure class="{escape(p.kind)}">{p.svg}<figcaption>{escape(p.title)}</figcaption></figure>' for p in plots
    )
    return f'<details class="figures"><summary>Figures: {escape(names)}</summary><div class="figures">{figures}</div></details>'


def comparison_card(row, comparisons: list[dict], run: Run, manifest: RolloutManifest, plots) -> str:
    """The card of one distinct comparison (`row` from report/verdict/summary.py), under each of its names."""
    index = row.indices[0]
    comparison = comparisons[index]
    titles = "<br>".join(f'{breakable(ref)} <span class="vs">vs</span> {breakable(cand)}' for ref, cand in row.names)
    same = (
        f'<p class="note">The same two sides under {len(row.names)} names: identical numbers, shown once.</p>'
        if len(row.names) > 1
        else ""
    )
    reference, candidate = comparison["reference"], comparison["candidate"]
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in comparison.get("notes") or [])
    routing = f'<p class="replayed">{escape(REPLAYED)}</p>' if row.replayed else _routing_split(comparison["metrics"])
    anchors = "".join(f'<span id="comparison-{i}"></span>' for i in row.indices[1:])
    word = "" if row.placement is None else f' <span class="word {row.placement.word}">{row.placement.word}</span>'
    return f"""<section class="card" id="comparison-{index}">{anchors}
<h3>{titles}{word}</h3>{same}
<p class="sides"><span class="role">reference</span> {escape(reference)}: {escape(side_facts(run, manifest, reference))}<br>
<span class="role">candidate</span> {escape(candidate)}: {escape(side_facts(run, manifest, candidate))}<br>
{_compared(comparison["metrics"])}</p>
{_headline_boxes(comparison["metrics"])}
{routing}
{notes}
{worst_tokens_html(comparison.get("worst_tokens"))}
{_figures(p for p in plots if p.comparison == index)}
</section>"""
