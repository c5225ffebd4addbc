"""The verdict and summary table of a report: what the page's first screen and `probe report`'s stdout show.

Read from metrics.json and the run's sides only. Comparisons of identical numbers (the same two sides
scored twice, e.g. a score set and its first repeated pass) are one row under both names. Policy comparisons
(a new policy's pass against its θ_old set) measure staleness, not engine mismatch: they have no row here, so
neither the verdict nor the evidence groups count them (the page shows them under Policy staleness)."""

from __future__ import annotations

from dataclasses import dataclass

from mismatch_probe.frames.bootstrap import ci_key
from mismatch_probe.report import numbers
from mismatch_probe.report.keys.families import EXTREME_FRACTION
from mismatch_probe.report.policy.kind import is_policy
from mismatch_probe.report.steps.words import drift_phrase
from mismatch_probe.report.verdict.bands import OK, Bands, Placement, place
from mismatch_probe.report.verdict.matched import choose, plain_at_rollout_dtype
from mismatch_probe.report.verdict.production import QUANT_SHARE, TRUNCATION_SHARE, what_quantized
from mismatch_probe.vocab import NO_REPLAY

K3, F2, ROUTER = "k3_kl", EXTREME_FRACTION.at(2), "router_diff_rate"


@dataclass
class Row:
    """One distinct comparison: its names (several when comparisons are identical) and its numbers."""

    names: list[tuple[str, str]]
    indices: list[int]  # into metrics["comparisons"]
    metrics: dict
    placement: Placement | None
    replayed: bool  # some side replays the rollout's routing: routing is identical by construction
    roles: frozenset = frozenset()  # the candidates' roles against the rollout (rundir/roles.py); None: plain
    plain_at_rollout_dtype: bool = False  # a plain candidate (no role) at the rollout's dtype (verdict/matched.py)

    @property
    def label(self) -> str:
        return " = ".join(f"{ref} vs {cand}" for ref, cand in self.names)

    def cells(self) -> list[str]:
        m = self.metrics
        router = "replayed" if self.replayed and m.get(ROUTER) is not None else numbers.value(m.get(ROUTER))
        where = "—" if self.placement is None else f"{self.placement.word}: {self.placement.where}"
        return [
            self.label,
            numbers.with_interval(m.get(K3), m.get(ci_key(K3))),
            numbers.value(m.get(F2)),
            router,
            where,
        ]


@dataclass(frozen=True)
class Group:
    """Comparisons shown together: the same replay (none or R3), then the same engines."""

    title: str
    members: list[int]  # indices into metrics["comparisons"], one per distinct comparison
    replayed: bool = False


def evidence_groups(table: list[Row], infos: dict) -> list[Group]:
    """No replay first, then R3; within each, by the engines compared, in the order first seen."""

    def engine(side: str) -> str:
        info = infos.get(side)
        return info.engine if info else side

    keyed: dict[tuple, list[int]] = {}
    for row in table:
        ref, cand = row.names[0]
        engines = f"{engine(cand)} training" if ref == "rollout" else "training vs training"
        keyed.setdefault((row.replayed, engines), []).append(row.indices[0])
    ordered = sorted(keyed.items(), key=lambda item: item[0][0])  # stable: first-seen order within a replay
    return [
        Group(title=f"{'R3 replay' if replayed else 'no R3'}, {engines}", members=members, replayed=replayed)
        for (replayed, engines), members in ordered
    ]


HEADER = ["comparison", "k3 KL [95% interval]", "F(2)", "router diff", "verdict: where k3 sits"]


def distinct(comparisons: list[dict]) -> list[list[int]]:
    """Groups of comparison indices with the same reference and exactly the same metrics, first seen first;
    policy comparisons are in none."""
    groups: list[list[int]] = []
    for i, c in enumerate(comparisons):
        if is_policy(c):
            continue
        same = next(
            (
                g
                for g in groups
                if comparisons[g[0]]["reference"] == c["reference"] and comparisons[g[0]]["metrics"] == c["metrics"]
            ),
            None,
        )
        if same is None or not c["metrics"].get("n_tokens"):
            groups.append([i])
        else:
            same.append(i)
    return groups


def _replay(infos: dict, side: str) -> str:
    info = infos.get(side)
    return NO_REPLAY if info is None else info.replay


def floor_interval(metrics: dict, infos: dict, comparison: dict) -> list | None:
    """The k3 interval of this run's noise floor for the candidate's engine, dtype and replay, if measured."""
    cand = infos.get(comparison["candidate"])
    floors = (metrics.get("attribution") or {}).get("noise_floor") or []
    for floor in floors:
        if cand is not None and (floor["engine"], floor["dtype"], floor["replay"]) == (
            cand.engine,
            cand.dtype,
            cand.replay,
        ):
            if comparison["reference"] != floor["reference"] or comparison["candidate"] != floor["candidate"]:
                return floor.get(ci_key(K3))
    return None


def one_side_quantized(reference: str, candidate: str, quantized) -> bool:
    """Exactly one side quantized: the comparison is judged against the quantized-rollout band."""
    return len({reference, candidate} & set(quantized)) == 1


def _placement(metrics: dict, first: dict, floor, bands: Bands, is_moe: bool, quantized) -> Placement | None:
    """Where the comparison's k3 sits. One side quantized and the other not: against the quantized band.
    A truncated rollout against a raw training side: after its truncation share, on the k3 of the pass with
    the rollout's truncation (`--sampling rollout`) where the run has one."""
    m = first["metrics"]
    k3, ci = m.get(K3), m.get(ci_key(K3))
    truncation = _share_of(metrics, [(first["reference"], first["candidate"])], TRUNCATION_SHARE)
    if truncation is not None and truncation["k3_kl_matched"] is not None:
        k3, ci = truncation["k3_kl_matched"], truncation["k3_kl_matched_ci95"]
    one_quantized = one_side_quantized(first["reference"], first["candidate"], quantized)
    placement = place(k3, ci, floor, bands, is_moe, quantized=one_quantized)
    if placement is not None and truncation is not None and truncation["k3_kl_matched"] is not None:
        where = f"{placement.where} once truncation is matched (k3 {numbers.value(k3)} against {truncation['matched']})"
        placement = Placement(word=placement.word, where=where)
    return placement


def rows(metrics: dict, infos: dict, bands: Bands, is_moe: bool, quantized=frozenset()) -> list[Row]:
    """quantized: the sides whose manifest records weight or activation quantization (production.quantized_sides)."""
    comparisons = metrics["comparisons"]
    out = []
    for group in distinct(comparisons):
        first = comparisons[group[0]]
        m = first["metrics"]
        floor = floor_interval(metrics, infos, first)
        out.append(
            Row(
                names=[(comparisons[i]["reference"], comparisons[i]["candidate"]) for i in group],
                indices=group,
                metrics=m,
                placement=_placement(metrics, first, floor, bands, is_moe, quantized),
                replayed=any(_replay(infos, side) != NO_REPLAY for side in (first["reference"], first["candidate"])),
                **_roles(infos, [comparisons[i] for i in group]),
            )
        )
    return out


def _roles(infos: dict, comparisons: list[dict]) -> dict:
    """The Row fields verdict/matched.py chooses by: the roles of the candidates scored against the rollout, and
    whether one of them is plain at the rollout's dtype."""
    rollout = infos.get("rollout")
    against = [infos.get(c["candidate"]) for c in comparisons if c["reference"] == "rollout"]
    against = [info for info in against if info is not None]
    plain = any(plain_at_rollout_dtype(info, rollout) for info in against)
    return {"roles": frozenset(info.score_role for info in against), "plain_at_rollout_dtype": plain}


def headline_row(table: list[Row]) -> Row | None:
    """The comparison the verdict speaks of: the rollout against the matched set (verdict/matched.py's rule)."""
    return choose(table).row


def _share_of(metrics: dict, row, name: str = "routing_share") -> dict | None:
    """The share entry (routing_share, quant_share or truncation_share) whose side without the fix is one of
    the row's candidates; row: a Row or its names."""
    shares = (metrics.get("attribution") or {}).get(name) or []
    names = {cand for _, cand in (row.names if isinstance(row, Row) else row)}
    side = "without_replay" if name == "routing_share" else "plain"
    return next((s for s in shares if s[side] in names and s["share"] is not None), None)


def _production_phrases(metrics: dict, row: Row) -> str:
    text = ""
    quant = _share_of(metrics, row, QUANT_SHARE)
    if quant is not None:
        what = what_quantized(quant["weight"], quant["act"])
        text += f"; {what} explains {numbers.percent(quant['share'], quant['share_ci95'])} of k3"
    truncation = _share_of(metrics, row, TRUNCATION_SHARE)
    if truncation is not None:
        text += (
            f"; truncated sampling explains {numbers.percent(truncation['share'], truncation['share_ci95'])} of k3 "
            f"(k3 {numbers.value(truncation['k3_kl_matched'])} with the same truncation on both sides)"
        )
    return text


def verdict(metrics: dict, table: list[Row]) -> str:
    """One sentence: agree or disagree, k3 with its interval and band, routing's share and R3's cut."""
    chosen = choose(table)
    row = chosen.row
    if row is None or row.metrics.get(K3) is None:
        return "No comparison has a k3 KL: no token was compared."
    k3 = numbers.with_interval(row.metrics[K3], row.metrics.get(ci_key(K3)))
    place = row.placement
    agree = place is not None and place.word == OK
    text = f"training and inference {'agree' if agree else 'disagree'}"
    text += f" ({place.word}): k3 {k3}, {place.where}" if place is not None else f": k3 {k3}"
    share = _share_of(metrics, row)
    if share is not None:
        text += f"; routing explains {numbers.percent(share['share'], share['share_ci95'])}"
        with_r3 = share["k3_kl_with_replay"]
        if with_r3:
            text += f"; R3 cuts k3 {numbers.times(share['k3_kl_without_replay'] / with_r3)}"
    text += _production_phrases(metrics, row)
    drift = drift_phrase(metrics["comparisons"][row.indices[0]].get("drift"))
    if drift is not None:
        text += f"; {drift}"
    text = f"{text} ({row.label}: {chosen.rule})."
    return text[:1].upper() + text[1:]
