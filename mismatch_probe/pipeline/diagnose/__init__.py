"""`probe diagnose`: one command from a checkpoint and a rollout to the whole diagnosis (docs/diagnose.md)."""
