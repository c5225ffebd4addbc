"""Where a run lives: a local folder, or a URL of a filesystem fsspec opens (s3://, gs://, az://, hdfs://...).

A URL becomes universal-pathlib's `UPath`, which reads, lists and writes like `pathlib.Path`, so the run's
code is the same for both (the optional extra `[remote]`: universal-pathlib, plus the filesystem's own fsspec
package, s3fs for s3://). Credentials and endpoints come from the environment, as each filesystem reads them
(for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL...), so Ray workers on other nodes need
them in theirs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from mismatch_probe.errors import ProbeError, first_line

if TYPE_CHECKING:
    from upath import UPath

INSTALL = "pip install 'mismatch-probe[remote]'"
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]+://")


def is_url(value) -> bool:
    return isinstance(value, str) and bool(_URL.match(value))


def run_path(value) -> Path | UPath:
    """A run's root as a path object: `Path` for a local folder (a `file://` URL included), `UPath` for any
    other URL. A path object given is kept as it is."""
    if isinstance(value, Path) or is_remote(value):
        return value
    text = os.fspath(value)
    if not is_url(text):
        return Path(text)
    if text.startswith("file://"):
        return Path(text.removeprefix("file://"))
    try:
        from upath import UPath
    except ImportError:
        raise ProbeError(f"{text}: a run at a URL needs universal-pathlib, which is not installed: {INSTALL}") from None
    try:
        path = UPath(text)
        path.fs  # noqa: B018 -- the filesystem is made on first use: an unknown scheme fails here, not mid-report
    except (ImportError, ValueError) as exc:  # no fsspec package for the scheme (gcsfs for gs://...)
        raise ProbeError(f"{text}: cannot open this URL ({first_line(exc)})") from None
    return path


def is_remote(path) -> bool:
    """A UPath of a filesystem other than the local one (a local UPath is a `pathlib.Path`). Checked by the
    class's module, so that a local run never imports universal-pathlib."""
    return type(path).__module__.startswith("upath") and not isinstance(path, Path)


def arrow_open(path) -> dict:
    """Keyword arguments that let pyarrow open `path`: the local path, or the path within its fsspec
    filesystem, which pyarrow reads through its fsspec handler."""
    if not is_remote(path):
        return {"source": path}
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    return {"source": path.path, "filesystem": PyFileSystem(FSSpecHandler(path.fs))}
