"""`probe sweep`: variants of a training (and rollout) configuration, measured on one run (docs/remedies.md)."""
