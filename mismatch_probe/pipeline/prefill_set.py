"""What `probe rescore` does differently for an engine-prefill set (`--engine sglang|vllm`): the server is the
rollout's own by default, the set is named ENGINE-prefill, and its manifest says kind engine-prefill, the
server's dtype and settings, and the temperature rule that applied."""

from __future__ import annotations

from dataclasses import fields, replace

from mismatch_probe.engines import PREFILL_ENGINES, engine_class
from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.layout import canonical_dtype
from mismatch_probe.rundir.manifests import RolloutManifest, ScoreManifest
from mismatch_probe.vocab import ENGINE_PREFILL, FP32, NO_REPLAY, RAW


def is_prefill(engine: str) -> bool:
    return engine in PREFILL_ENGINES


def prefill_job(job, manifest: RolloutManifest):
    """The job with the rollout engine's recorded options (its server URL, an in-process engine's settings) where
    none is given, and the set's default name."""
    if not is_prefill(job.engine):
        return job
    refused = [
        flag
        for flag, given in (
            (f"--replay {job.replay}", job.replay != NO_REPLAY),
            ("--old", job.old is not None),
            ("--router-logprobs", job.router_logprobs),
            (f"--sampling {job.sampling}", job.sampling != RAW),
        )
        if given
    ]
    if refused:  # a server scores its own prompt log-probs: it neither replays routes nor renormalises
        raise ProbeError(f"{refused[0]}: --engine {job.engine} scores the server's raw prompt log-probs only")
    args = dict(job.config.engine_args)
    if manifest.engine_name == job.engine:  # the rollout's own engine: its recorded options, then those given
        recorded = manifest.engine_options if isinstance(manifest.engine_options, dict) else {}
        url = manifest.engine.get("server_url") if isinstance(manifest.engine, dict) else None
        known = {f.name for f in fields(engine_class("training", job.engine).Options)}  # an older probe's, dropped
        args = {k: v for k, v in ({"server_url": url} | recorded).items() if v is not None and k in known} | args
    # --dtype not given: the rollout's own (an in-process engine loads at it; a server scores at its own anyway)
    dtype = job.config.dtype or canonical_dtype(manifest.dtype) or FP32
    config = replace(job.config, engine_args=args, dtype=dtype)
    return replace(job, config=config, name=job.name or f"{job.engine}-prefill")


def mark_prefill(side: ScoreManifest, engine) -> None:
    """An engine-prefill set's manifest entries (again at the end of the pass, when the rule is known)."""
    if not hasattr(engine, "prefill_entry"):
        return
    side.kind = ENGINE_PREFILL
    side.role = ENGINE_PREFILL  # its role too: a diagnostic set: never the verdict's matched one
    side.dtype = engine.describe().get("dtype") or side.dtype
    side.prefill = engine.prefill_entry()
