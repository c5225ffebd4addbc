"""`python -m mismatch_probe`: the same command line as `probe`."""

from .cli import app

app(prog_name="probe")
