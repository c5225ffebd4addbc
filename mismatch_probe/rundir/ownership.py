"""What probe may replace or write into: a folder that is empty, or one probe recognisably wrote.

A `Layout` lists what probe writes in one kind of folder (a run, a score set, a report...): each entry a
name pattern, and either a file (optionally with a check that its content is probe's) or a folder of
another layout. A folder is probe's when every entry, all the way down, is one its layout lists, and its
marker (the manifest, say) is there and says it is probe's. Anything else is the user's: probe refuses
with exit 2 before it touches anything. Symbolic links are never probe's (it writes none), so clearing a
folder never follows one out of the tree.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import read_json


@dataclass(frozen=True)
class Entry:
    pattern: str  # the name, or an fnmatch pattern of names
    layout: Layout | None = None  # a folder of this layout; None: a file
    check: Callable[[Path], bool] | None = None  # a file: whether its content is probe's


@dataclass(frozen=True)
class Layout:
    what: str  # for messages: "a probe run"
    entries: tuple[Entry, ...]
    marker: str | None = None  # a non-empty folder must hold it (its entry's check says it is probe's)


def named_files(*patterns: str) -> tuple[Entry, ...]:
    """Plain files probe writes, each a name or a pattern, with no check of their content."""
    return tuple(Entry(pattern=pattern) for pattern in patterns)


def accepted_by(load: Callable[[Path], object]) -> Callable[[Path], bool]:
    """A check: `load` (a manifest's, say) reads the file without error."""

    def check(path: Path) -> bool:
        try:
            load(path)
        except ProbeError:
            return False
        return True

    return check


def json_with(*keys: str) -> Callable[[Path], bool]:
    """A check: the file is a JSON object with these keys (the shape probe writes)."""

    def check(path: Path) -> bool:
        try:
            return set(keys) <= set(read_json(path))
        except ProbeError:
            return False

    return check


def foreign_entry(folder: Path, layout: Layout) -> str | None:
    """What in `folder` probe did not write (a relative path, maybe with a reason), or None if nothing."""
    try:
        children = sorted(folder.iterdir())
    except OSError as exc:
        raise ProbeError(f"{folder}: cannot read ({exc.strerror or exc})") from exc
    for child in children:
        entry = next((e for e in layout.entries if fnmatchcase(child.name, e.pattern)), None)
        if child.is_symlink():
            return f"{child.name}, a symbolic link"
        if entry is None or (entry.layout is None) != child.is_file():
            return child.name
        if entry.check is not None and not entry.check(child):
            return f"{child.name}, which probe did not write"
        if entry.layout is not None:
            inner = foreign_entry(child, entry.layout)
            if inner is not None:
                return f"{child.name}/{inner}"
    if children and layout.marker and not (folder / layout.marker).is_file():
        return f"{children[0].name} but no {layout.marker}"
    return None


def refuse_foreign(folder: Path, layout: Layout) -> None:
    """Exit 2 unless `folder` is absent, empty or probe's; the message names one foreign entry."""
    if folder.exists() and not folder.is_dir():
        raise ProbeError(f"{folder}: exists and is not a directory")
    if folder.is_dir():
        foreign = foreign_entry(folder, layout)
        if foreign is not None:
            raise ProbeError(f"{folder}: not {layout.what} (holds {foreign}); refusing to replace it")


def clear(folder: Path, layout: Layout) -> None:
    """Empty a folder probe wrote, keeping the folder itself; checked again right before deleting."""
    refuse_foreign(folder, layout)
    for child in folder.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
