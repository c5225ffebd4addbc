"""token_ids_differ: the ids the two sides actually scored, compared sample by sample.

Never a re-encoding of the rollout's text: at T = 2 a third of clean demo samples do not survive decode ->
encode, so a re-encoding test would blame clean runs. Run only when the aligned pass refused the run, so a
healthy run pays nothing for it.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from mismatch_probe.doctor.checks import check_list as C
from mismatch_probe.doctor.finding import Finding
from mismatch_probe.rundir.layout import ROLLOUT, Run
from mismatch_probe.rundir.parts import require_parts

SHOWN = 8  # ids shown around the first difference


def _side(run: Run, side: str) -> pl.LazyFrame:
    parts = [str(p) for p in require_parts(run.side_dir(side))]
    return pl.scan_parquet(parts).select("sample_id", "position", "token_id", "is_response")


def _per_sample(frame: pl.LazyFrame) -> pl.LazyFrame:
    return frame.group_by("sample_id").agg(
        pl.len().alias("rows"),
        pl.col("is_response").not_().sum().alias("prompt_rows"),
        pl.struct("position", "token_id").hash(seed=0).sum().alias("digest"),
    )


def token_id_findings(run: Run, sides: list[str]) -> list[Finding]:
    findings = []
    base = ROLLOUT if ROLLOUT in sides else sides[0]
    ref = _per_sample(_side(run, base)).collect()
    for side in sides:
        if side == base:
            continue
        other = _per_sample(_side(run, side)).collect()
        joined = ref.join(other, on="sample_id", how="full", suffix="_o", coalesce=True)
        differ = joined.filter(
            pl.col("digest").ne_missing(pl.col("digest_o")) | pl.col("rows").ne_missing(pl.col("rows_o"))
        ).sort("sample_id")
        if differ.is_empty():
            continue
        prompt = int(differ.filter(pl.col("prompt_rows").ne_missing(pl.col("prompt_rows_o"))).height)
        sample = int(differ["sample_id"][0])
        rows = [_side(run, s).filter(pl.col("sample_id") == sample).collect() for s in (base, side)]
        a, b = (r["token_id"].to_numpy() for r in rows)
        common = min(len(a), len(b))
        differs = np.flatnonzero(a[:common] != b[:common])
        first = int(differs[0]) if len(differs) else common
        where = "response" if first < len(a) and rows[0]["is_response"][first] else "prompt"
        shown_a, shown_b = a[first : first + SHOWN].tolist(), b[first : first + SHOWN].tolist()
        findings.append(
            Finding.of(
                C.TOKEN_IDS_DIFFER,
                f"{side}: token ids differ from {base} in {differ.height} of {joined.height} samples; first: "
                f"sample {sample} position {first} ({where}): {base} {shown_a} vs {side} {shown_b} "
                f"({len(a)} vs {len(b)} tokens)",
                {
                    "side": side,
                    "samples_differing": differ.height,
                    "samples_prompt_differing": prompt,
                    "n_samples": joined.height,
                    "first_sample": sample,
                    "first_position": first,
                    "first_in": where,
                    "ids_reference": shown_a,
                    "ids_candidate": shown_b,
                },
            )
        )
    return findings
