"""`probe doctor`: checks a run's data for the setup bugs that pass for training-inference mismatch."""
