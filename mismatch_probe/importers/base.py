"""What every importer returns, and the ways of reading a dump that several formats share.

An importer is one function `read(path) -> Dump`: the source's provenance, and an iterator of samples that
reads the dump lazily (line by line for JSONL, file by file for pickled dumps), so `probe import` holds
one batch at a time whatever the dump's size.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.importers.safe_pickle import torch_load_file
from mismatch_probe.rundir.logged import LoggedSample, Provenance


@dataclass
class Dump:
    provenance: Provenance
    samples: Iterator[LoggedSample]


def reason(exc: BaseException) -> str:
    """An exception as part of a one-line message: its type and text, whitespace collapsed, at most 300 characters."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def engines_not_in(what: str) -> list[str]:
    """The `lacks` line of every format so far: no dump names the engines or dtypes of its two sides."""
    return [f"engines and dtypes: not in the {what}; comparisons by engine or dtype cannot be made"]


def _natural(path: Path) -> list:
    """A path's sort key with its numbers compared as numbers: step_9 before step_10, 2.pt before 10.pt."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def step_in_name(path: Path) -> int | None:
    """The step a per-step dump's name gives, for dumps whose content does not: `12.pt` (slime's
    {rollout_id}.pt), `step_12/` (prime-rl), `..._step12.pkl`; None when the name holds no such number."""
    for name in (path.stem, path.parent.name):
        match = re.fullmatch(r"(?:.*?step_?)?(\d+)", name)
        if match:
            return int(match.group(1))
    return None


def dump_files(path: Path, pattern: str, what: str) -> list[Path]:
    """`path` itself, or the files matching `pattern` under it (recursively), in natural name order: a
    folder of per-step dumps is read step after step."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ProbeError(f"{path}: not found (expected {what})")
    files = sorted((p for p in path.rglob(pattern) if p.is_file()), key=_natural)
    if not files:
        raise ProbeError(f"{path}: no {pattern} files (expected {what})")
    return files


def jsonl_objects(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, object) per non-empty line, read one line at a time."""
    try:
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh, start=1):
                where = f"{path}:{number}"
                try:
                    line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a file may open with a BOM
                except UnicodeDecodeError as exc:
                    raise ProbeError(f"{where}: not UTF-8 text (byte {exc.start + 1} of the line)") from None
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ProbeError(f"{where}: not valid JSON ({exc.msg})") from exc
                except (ValueError, RecursionError) as exc:  # a number too long for int(), nesting too deep
                    raise ProbeError(f"{where}: not readable JSON ({reason(exc)})") from None
                if not isinstance(obj, dict):
                    raise ProbeError(f"{where}: expected a JSON object per line")
                yield where, obj
    except OSError as exc:
        raise ProbeError(f"{path}: cannot read ({exc})") from exc


def field(obj: dict, key: str, where: str, what: str):
    """A required field; its absence names the field and the comparison it prevents."""
    if key not in obj or obj[key] is None:
        raise ProbeError(f"{where}: missing field '{key}' ({what})")
    return obj[key]


SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def dump_sampling(provenance: Provenance, found: dict, where: str) -> None:
    """What a dump says of its sampling (`temperature`, `top_p`, `top_k`, where it holds them) into the rollout
    manifest's `sampling`. The temperature is also the one both sides' log-probs were computed at (the scoring
    temperature), unless `--temperature` says otherwise: then exit 2 naming both. A run samples one way: a later
    file that says otherwise is exit 2 too."""
    said = {
        key: found[key]
        for key in SAMPLING_KEYS
        if isinstance(found.get(key), (int, float)) and not isinstance(found.get(key), bool)
    }
    for key, value in said.items():
        if not math.isfinite(value):
            raise ProbeError(f"{where}: {key} {value}, expected a finite number")
    known = provenance.sampling or {}
    for key, value in said.items():
        if key in known and known[key] != value:
            raise ProbeError(f"{where}: {key} {value}, but {known[key]} earlier in the dump (one run samples one way)")
    if not said:
        return
    provenance.sampling = known | said
    temperature = said.get("temperature")
    if temperature is None or temperature <= 0:  # greedy decoding: log-probs are scored at the user's T
        return
    if provenance.temperature is None:
        provenance.temperature = float(temperature)
    elif provenance.temperature != temperature:
        raise ProbeError(
            f"{where}: the dump samples at temperature {temperature}, but --temperature is {provenance.temperature}"
        )


def torch_load(path: Path, trust_pickle: bool = False):
    """A pickled torch dump (torch.save), read on the CPU through safe_pickle's allowlist: a global its writer
    does not emit is refused, unless `trust_pickle` (--trust-pickle)."""
    try:
        return torch_load_file(path, trust_pickle)
    except ProbeError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle is unusable input
        raise ProbeError(f"{path}: not a readable torch dump ({reason(exc)})") from exc
