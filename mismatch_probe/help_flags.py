"""`probe CMD --help` lists a boolean flag as a flag (`--json`), not as an option taking `<bool>`.

Typer's rich help writes every option's type beside it, flags included; a flag takes no value, so
its type column stays empty."""

from __future__ import annotations

from typer.core import TyperOption


def show_flags_as_flags() -> None:
    original = TyperOption.display_type_rich
    if getattr(original, "flags_shown", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag else original(self, ctx)

    display_type_rich.flags_shown = True
    TyperOption.display_type_rich = display_type_rich
