"""Per side: empty responses and responses that go on past an end token (rollout), and routing rows missing
where a token was forwarded.

Per-sample tallies (sparse: sample ids need not be dense) merge by adding, so two ranges merge exactly. A
position's route is made in the forward whose input is that token, so every row but a sample's last
(the last sampled token is never forwarded at inference) should carry one wherever the side has routing.
"""

from __future__ import annotations

import numpy as np

from mismatch_probe.doctor.stats.pairwise import Pairwise, Rows, SampleCounts, same_sample

TALLIES = ("rows", "response", "eos", "past_eos", "lost", "first_null", "last_routed")
NAMED_SAMPLES = 5  # how many of the samples that continue past an end token a finding names


class SideStats(Pairwise):
    def __init__(self, role: str, pair_index: int, eos_ids=()):
        super().__init__()
        self.role, self.pair_index = role, pair_index  # which frame and which of its sides this side is
        self.eos_ids = np.asarray(sorted(eos_ids), dtype=np.uint32)
        self.t = {name: SampleCounts() for name in TALLIES}
        self.routed_rows = 0
        self.first_lost: tuple[int, int] | None = None  # (sample, position) of the first lost route

    def payload(self, frame) -> Rows:
        chunk = getattr(frame, self.role)
        rows = {
            "sample_id": chunk.sample_id,
            "position": chunk.position,
            "is_response": chunk.is_response,
            "token_id": chunk.token_id,
        }
        if chunk.experts_valid is not None:
            rows["routed"] = chunk.experts_valid
        return rows

    def add_rows(self, rows: Rows) -> None:
        sample, response = rows["sample_id"], rows["is_response"]
        self.t["rows"].add(sample)
        self.t["response"].add(sample[response])
        self.t["eos"].add(sample[response & np.isin(rows["token_id"], self.eos_ids)])
        if "routed" in rows:
            self.routed_rows += int(np.count_nonzero(rows["routed"]))

    def add_pairs(self, rows: Rows) -> None:
        same, sample = same_sample(rows), rows["sample_id"]
        if len(self.eos_ids):  # an end token followed by another response token of the same sample
            response = rows["is_response"]
            end = response[:-1] & np.isin(rows["token_id"][:-1], self.eos_ids)
            self.t["past_eos"].add(sample[:-1][end & same & response[1:]])
        if "routed" not in rows:
            return
        routed = rows["routed"]
        lost = np.flatnonzero(same & ~routed[:-1])
        if len(lost):
            self.t["lost"].add(sample[lost])
            first = (int(sample[lost[0]]), int(rows["position"][lost[0]]))
            self.first_lost = min(first, self.first_lost or first)
        ends = np.flatnonzero(~same)  # row j ends a sample, row j+1 starts the next
        self.t["last_routed"].add(sample[ends[routed[ends]]])
        self.t["first_null"].add(sample[ends + 1][~routed[ends + 1]])

    def add_sums(self, other: SideStats) -> None:
        for name in TALLIES:
            self.t[name].merge(other.t[name])
        self.routed_rows += other.routed_rows
        if other.first_lost is not None:
            self.first_lost = min(other.first_lost, self.first_lost or other.first_lost)

    def finish(self) -> dict:
        """Tallies over the samples seen; the run's first and last rows have no pair, so they are read here."""
        universe, _ = self.t["rows"].compact()  # every sample has rows
        t = {name: counts.on(universe) for name, counts in self.t.items()}
        if self.head is not None and "routed" in self.head:  # the run's first and last rows
            first, last = (int(np.searchsorted(universe, rows["sample_id"][0])) for rows in (self.head, self.tail))
            t["first_null"][first] += int(not self.head["routed"][0])
            t["last_routed"][last] += int(self.tail["routed"][0])
        seen = t["rows"] > 0
        empty = seen & ((t["response"] == 0) | ((t["response"] == 1) & (t["eos"] == 1)))
        # A sample whose first row lacks a route while its last has one is routed one position late: a
        # misalignment (replay_misaligned), not a lost row.
        shifted = (t["first_null"] > 0) & (t["last_routed"] > 0) & seen
        past = universe[t["past_eos"] > 0]
        lost = t["lost"] - shifted
        return {
            "n_samples": int(seen.sum()),
            "n_empty": int(empty.sum()),
            "n_eos_only": int((seen & (t["response"] == 1) & (t["eos"] == 1)).sum()),
            "n_past_eos": len(past),
            "past_eos_samples": [int(s) for s in past[:NAMED_SAMPLES]],
            "eos_ids": [int(i) for i in self.eos_ids],
            "routed_rows": self.routed_rows,
            "n_rows": int(t["rows"].sum()),
            "lost_rows": int(lost.clip(min=0).sum()),
            "lost_samples": int((lost > 0).sum()),
            "first_lost": self.first_lost,
            "shifted_samples": int(shifted.sum()),
        }
