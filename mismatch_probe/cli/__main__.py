"""`python -m mismatch_probe.cli`: the same command line as `probe` (tests and torchrun launch it so)."""

import sys

from mismatch_probe.cli import app

if __name__ == "__main__":
    sys.exit(app())
