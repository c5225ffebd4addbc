"""The policy comparison of a new policy's pass against its θ_old score set (SPEC section 7b,
docs/staleness.md): which sides it reads, and one accumulator per concern.

- sides.py: the rollout μ, the old and new training passes and the natural (replay none) new pass N;
- decomposition.py: per token a = ℓ_old − μ, s = ℓ_new − ℓ_old, t = a + s, b = ℓ_new − ℓ_new^N;
- router_shift.py: RSPO's γ from router log-probs, and how often a replay overrides the natural routes;
- totals.py: per-sequence sums with bootstrap intervals, which both accumulators use;
- kind.py: which comparisons are policy ones (the verdict and attribution leave them out);
- table.py, words.py, terminal.py: the staleness table, the R2-against-R3 sentence and their terminal view
  (the page's section: render/policy_section.py and render/plots_policy.py).
"""
