"""`probe import FORMAT PATH --out RUN`: stream a framework's dump into a probe run."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.importers import DumpFormat, reader
from mismatch_probe.rundir.layout import removed_unless_written
from mismatch_probe.rundir.logged import LoggedRunWriter, Provenance


@dataclass
class ImportJob:
    format: DumpFormat
    path: Path
    out: Path
    model: Path | None = None
    temperature: float | None = None
    overwrite: bool = False
    trust_pickle: bool = False  # --trust-pickle: a full unpickle of a pickled dump (safe_pickle.py)


@dataclass
class ImportResult:
    samples: int
    tokens: int
    lacks: list[str]


def run_import(job: ImportJob) -> ImportResult:
    if not job.path.exists():
        raise ProbeError(f"{job.path}: not found (expected a {job.format.value} dump)")
    dump = reader(job.format)(job.path, trust_pickle=job.trust_pickle)
    dump.provenance.trust_pickle = job.trust_pickle
    named(dump.provenance, job.model, job.temperature)
    created = not job.out.exists()
    writer = LoggedRunWriter(job.out, dump.provenance, overwrite=job.overwrite)
    # Bad input before the first part leaves nothing behind (a retry needs no --overwrite); after it, the
    # manifests stay 'running', so no reader takes the parts written so far for a finished import.
    with removed_unless_written(writer.run, created):
        for sample in dump.samples:
            writer.add(sample)
        if writer.samples == 0:
            raise ProbeError(f"{job.path}: no samples in the dump")
    writer.close()
    return ImportResult(samples=writer.samples, tokens=writer.tokens, lacks=writer.lacks())


def named(provenance: Provenance, model, temperature: float | None) -> None:
    """What the user states about the source: the model (its config gives hash, vocabulary and routing
    shape) and the temperature both sides scored at."""
    if temperature is not None:
        if not 0 < temperature < math.inf:  # NaN and inf too: the manifest is JSON, which holds neither
            raise ProbeError(f"--temperature {temperature}: expected a finite number > 0")
        provenance.temperature = float(temperature)
    if model is not None:
        from mismatch_probe.model.routing_shape import load_model_info  # torch, through the MoE adapters

        provenance.name_model(load_model_info(model).manifest_fields())
