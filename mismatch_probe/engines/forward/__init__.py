"""What every torch forward shares (hf and megatron): token log-probs, host copies, weight fingerprints, the scoring contract."""
