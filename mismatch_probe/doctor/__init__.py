"""`probe doctor`: checks a run's data for the setup bugs that pass for training-inference mismatch.

checks/ names every check with its cause and fix (check_list: all of them, engine_bugs: the second round's);
stats/ streams the sums the checks read over the aligned frames (frames/); rules/ turns those sums into
findings. At the root: finding (the Check and Finding types), state (the streaming state over one run), run
(`probe doctor RUN`, a pass of its own) and show (terminal and JSON). The doctor reads frames/, the run
directory and report.keys, never the report's accumulators or its pass.
"""
