"""The single error path: every user-facing failure is a ProbeError with a one-line message."""


class ProbeError(Exception):
    """Unusable input (missing file, schema drift, misaligned sides...): exit code 2."""

    exit_code = 2


class EngineFailure(ProbeError):
    """An engine ran but failed (server error after retries, model crash): exit code 1."""

    exit_code = 1


class WorkerLost(ProbeError):
    """A worker process of a parallel pass died (killed, out of memory): exit code 1, not the input's fault."""

    exit_code = 1


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (its type's name when it has none): for one-line errors."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
