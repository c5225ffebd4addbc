"""`probe CMD --help` lists a boolean flag as a flag (`--json`), not as an option taking `<bool>`.

typer 0.29 writes every option's type beside it in the rich help, flags included; older typers leave a
flag's column empty. An empty `metavar` (public typer.Option API) gives the empty column on every typer
in the declared range; no typer or click internals are patched. typer's own `--help` still shows
`<bool>` on typer 0.29: nothing public reaches it.
"""

from __future__ import annotations

from typing import Any

import typer


def flag(*args: Any, **kwargs: Any) -> Any:
    """typer.Option for a boolean flag, with no type shown beside it in --help."""
    kwargs.setdefault("metavar", "")
    return typer.Option(*args, **kwargs)
