"""Mismatch over an RL run's steps: the per-step split of the report's pass (`split`), the step where the
mismatch changed (`drift`) and its slope over steps (`trend`). Steps come from the manifest's sample-id
ranges (`ranges`)."""
