"""The best remedy a sweep measured (metrics.json `remedies`), named only when resolved.

A variant is a remedy when its k3 ratio's 95% interval lies entirely below 1. When none does, the line says that
no remedy resolved an effect at this sample size, names the variant of largest point effect (smallest ratio) with
its interval, and estimates the tokens a pass would need to resolve it: the interval's width (in log ratio) shrinks
as 1/sqrt(tokens), so the upper half-width h measured over n tokens becomes h·sqrt(n/N) over N; the interval clears
1 once that is below -log(ratio), at N = n·(h / -log ratio)². A rough figure (it assumes the point stays put).
"""

from __future__ import annotations

import math

from mismatch_probe.report import numbers
from mismatch_probe.report.verdict.remedy_words import REMEDIES_KEY, changed_words, effect_words

HOW_ESTIMATED = "estimated from the interval's width, which shrinks as 1/sqrt(tokens)"


def resolved(entry: dict) -> bool:
    """The ratio's interval lies entirely below 1: the variant lowered k3 at this sample size."""
    ci = entry.get("ratio_ci95")
    return bool(ci) and ci[1] is not None and ci[1] < 1


def tokens_to_resolve(entry: dict) -> int | None:
    """Tokens a pass would need for the ratio's interval to clear 1 (module docstring); None where it cannot tell:
    no interval, no token count, or a point at or above 1."""
    ratio, ci, n = entry.get("ratio"), entry.get("ratio_ci95"), entry.get("n_tokens")
    if not ci or not n or ratio is None or not 0 < ratio < 1 or not ci[1] or ci[1] <= ratio:
        return None
    half_width = math.log(ci[1]) - math.log(ratio)
    needed = n * (half_width / -math.log(ratio)) ** 2
    return int(float(f"{math.ceil(needed):.2g}"))  # 2 significant digits: it is an estimate


def best_remedy(metrics: dict) -> str:
    """`router in fp32 on both sides: k3 0.42× [...] (k3 2.4× lower) (VARIANT)`; or why no remedy is named."""
    measured = [e for e in metrics.get(REMEDIES_KEY) or [] if e.get("ratio") is not None]
    if not measured:
        return "no remedy measured"
    good = [e for e in measured if resolved(e)]
    if good:
        best = min(good, key=lambda e: e["ratio"])
        return f"{changed_words(best)}: {effect_words(best)} ({best['variant']})"
    largest = min(measured, key=lambda e: e["ratio"])
    text = (
        "none: no remedy resolved an effect at this sample size; the largest point estimate is "
        f"{changed_words(largest)}: k3 {numbers.times(largest['ratio'], largest.get('ratio_ci95'))} "
        f"({largest['variant']})"
    )
    needed = tokens_to_resolve(largest)
    if needed is not None:
        text += (
            f"; resolving it would take about {numbers.count(needed)} tokens ({HOW_ESTIMATED}; this pass compared "
            f"{numbers.count(largest['n_tokens'])})"
        )
    elif largest["ratio"] >= 1:
        text += "; no variant lowered k3 even as a point estimate"
    return text
