"""`python -m mismatch_probe`: the same command line as `probe`."""

from mismatch_probe.cli import app

if __name__ == "__main__":
    app(prog_name="probe")
