"""`probe` with the stand-in `sglang.Engine` of tests/fake_sglang.py, for tests that run it as a process."""

if __name__ == "__main__":
    from fake_sglang import install

    install()
    from mismatch_probe.cli import app

    app(prog_name="probe")
