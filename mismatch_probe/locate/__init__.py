"""`probe locate`: the layer and the operation where two engine configurations first disagree.

Both configurations score the same stored token ids with forward hooks; per (layer, operation) two
measures: accumulated (b's tensor against a's, carrying everything from below) and own (b's operation on
a's input against a's output). docs/locate.md says what each measures, the floors and the rule.

spec (ENGINE:DTYPE[:KEY=VALUE,...]) -> defaults (from the run's manifests) -> choose (worst and sampled
sequences) -> side + ops (the hooked hf model) or megatron_side (the hooked megatron-core model, its
tensors turned into hf's layout) -> measures (the sums) -> rule (floors, what stands out, the
sentence) -> show (terminal, JSON) and page (RUN/locate/index.html); job.py runs them in that order.
"""
