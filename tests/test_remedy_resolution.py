"""The best remedy is named only when its k3 ratio's interval lies below 1; otherwise the line says none resolved
an effect, names the largest point estimate and the tokens a pass would need; a significant effect's size in
words."""

from __future__ import annotations

import math

import pytest

from mismatch_probe.report.verdict.best_remedy import HOW_ESTIMATED, best_remedy, tokens_to_resolve
from mismatch_probe.report.verdict.remedy_words import effect_words, size_words

ROUTER = {"variant": "hf-bf16+router_dtype-fp32", "side": "both", "changed": {"router_dtype": "fp32"}}
HEAD = {"variant": "hf-bf16+lm_head_dtype-fp32", "side": "both", "changed": {"lm_head_dtype": "fp32"}}


def entry(base: dict, ratio: float, ci: list[float], n: int = 400) -> dict:
    significant = ci[1] < 1 or ci[0] > 1
    return base | {"ratio": ratio, "ratio_ci95": ci, "n_tokens": n, "significant": significant, "speed_ratio": 1.0}


def test_unresolved_sweep_names_no_remedy_and_the_tokens_it_would_take():
    router, head = entry(ROUTER, 0.488, [0.123, 19.9]), entry(HEAD, 0.9, [0.5, 1.6])
    line = best_remedy({"remedies": [head, router]})
    assert line.startswith(
        "none: no remedy resolved an effect at this sample size; the largest point estimate is router in fp32 on "
        "both sides: k3 0.488× [0.123×, 19.9×] (hf-bf16+router_dtype-fp32); resolving it would take about "
    )
    assert HOW_ESTIMATED in line and "this pass compared 400)" in line
    # by hand: the upper half-width in log ratio, log(19.9/0.488) = 3.71, must shrink below -log(0.488) = 0.717
    expected = 400 * (math.log(19.9 / 0.488) / -math.log(0.488)) ** 2  # 10,686, rounded to 2 digits
    assert tokens_to_resolve(router) == pytest.approx(expected, rel=0.05)
    assert "about 11,000 tokens" in line
    # a point above 1: no tokens can resolve a reduction
    worse = entry(HEAD, 1.2, [0.8, 1.7])
    assert tokens_to_resolve(worse) is None
    assert best_remedy({"remedies": [worse]}).endswith("no variant lowered k3 even as a point estimate")


def test_resolved_remedy_is_the_smallest_ratio_below_one_with_its_size():
    higher = entry(HEAD, 3.2, [2.1, 4.4])  # significant, but k3 higher: never a remedy
    small = entry(ROUTER, 0.987, [0.871, 0.998])
    assert best_remedy({"remedies": [higher, small]}) == (
        "router in fp32 on both sides: k3 0.987× [0.871×, 0.998×] (k3 1.3% lower), at 1.00× the speed "
        "(hf-bf16+router_dtype-fp32)"
    )
    assert effect_words(higher).startswith("k3 3.20× [2.10×, 4.40×] (k3 3.2× higher)")
    assert best_remedy({"remedies": []}) == "no remedy measured"


@pytest.mark.parametrize(
    "ratio, words",
    [(0.987, "1.3% lower"), (3.2, "3.2× higher"), (0.42, "2.4× lower"), (1.25, "25% higher"), (1.0, "unchanged")],
)
def test_size_words(ratio, words):
    assert size_words(ratio) == words
