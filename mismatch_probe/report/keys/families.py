"""Every parameterised key family, named once: the catalogue declares each under its `pattern` and the code that
computes, reads or shows one builds its keys with `at`, so a family's name is spelled in this file only.

The part of a pattern after `@` names the parameter (T, C, B, G: a level, levels.py; SPLIT, MODE: fixed values).
"""

from __future__ import annotations

from dataclasses import dataclass

from mismatch_probe.report.keys.levels import PPO_SIDES, threshold_label


@dataclass(frozen=True)
class Family:
    pattern: str  # the catalogue's name of the family: "extreme_fraction@T"

    def __post_init__(self):
        if self.pattern.count("@") != 1:
            raise ValueError(f"a family's pattern is NAME@PARAMETER, not {self.pattern!r}")

    @property
    def prefix(self) -> str:
        """`extreme_fraction@`: every key of the family starts with it."""
        return self.pattern.partition("@")[0] + "@"

    def at(self, level) -> str:
        """The key at one level, spelled as the user gave it: EXTREME_FRACTION.at(2) == "extreme_fraction@2"."""
        return self.prefix + threshold_label(level)

    def level_of(self, key: str) -> str | None:
        """What follows the prefix in one of this family's keys (or in its interval's: "2_ci95"); None for others."""
        return key.removeprefix(self.prefix) if key.startswith(self.prefix) else None


# ---- per-token (--thresholds) ----
EXTREME_FRACTION = Family("extreme_fraction@T")

# ---- routing: compared tokens split by whether their expert sets differ (levels.ROUTING_SPLITS) ----
N_TOKENS_SPLIT = Family("n_tokens@SPLIT")
K3_KL_SPLIT = Family("k3_kl@SPLIT")

# ---- correction what-ifs: token-level truncated IS weights (--tis-caps) ----
IS_ESS = Family("is_ess@C")
IS_MEAN = Family("is_mean@C")
IS_STD = Family("is_std@C")
IS_MIN = Family("is_min@C")
IS_MAX = Family("is_max@C")
IS_FRACTION_LOW = Family("is_fraction_low@C")
IS_SEQ_MEAN = Family("is_seq_mean@C")
IS_SEQ_STD = Family("is_seq_std@C")
IS_SEQ_MIN = Family("is_seq_min@C")
IS_SEQ_MAX = Family("is_seq_max@C")
IS_SEQ_MAX_DEVIATION = Family("is_seq_max_deviation@C")
IS_SEQ_FRACTION_HIGH = Family("is_seq_fraction_high@C")
IS_SEQ_FRACTION_LOW = Family("is_seq_fraction_low@C")
TIS_CLIP_FRACTION = Family("tis_clip_fraction@C")
# sequence-level IS weights (--tis-caps)
SEQ_IS_ESS = Family("seq_is_ess@C")
SEQ_IS_MEAN = Family("seq_is_mean@C")
SEQ_IS_STD = Family("seq_is_std@C")
SEQ_IS_FRACTION_LOW = Family("seq_is_fraction_low@C")
SEQ_IS_MAX = Family("seq_is_max@C")
SEQ_IS_MIN = Family("seq_is_min@C")
ICEPOP_OOB_FRACTION = Family("icepop_oob_fraction@C")
SEQ_TIS_CLIP_FRACTION = Family("seq_tis_clip_fraction@C")
# verl's rejection statistics (levels.MODES)
RS_MEAN = Family("rs_mean@MODE")
RS_SEQ_MEAN = Family("rs_seq_mean@MODE")
RS_SEQ_STD = Family("rs_seq_std@MODE")
RS_SEQ_MAX = Family("rs_seq_max@MODE")
RS_SEQ_MIN = Family("rs_seq_min@MODE")
RS_SEQ_MAX_DEVIATION = Family("rs_seq_max_deviation@MODE")
# sequence filters (--geo-bounds)
SEQ_GEO_REJECT_FRACTION = Family("seq_geo_reject_fraction@T")
SEQ_MEAN_K1_REJECT_FRACTION = Family("seq_mean_k1_reject_fraction@T")
SEQ_SUM_K1_REJECT_FRACTION = Family("seq_sum_k1_reject_fraction@T")

# ---- policy comparisons ----
ROUTER_SHIFT_CLIP_FRACTION = Family("router_shift_clip_fraction@G")  # at levels.GAMMA_MIN
# --ppo-bounds: one family per side of the bound, by side
PPO_RATIO_FRACTION = {side: Family(f"ppo_ratio_{side}_fraction@B") for side in PPO_SIDES}
RSPO_RATIO_FRACTION = {side: Family(f"rspo_ratio_{side}_fraction@B") for side in PPO_SIDES}
TOTAL_TIS_CLIP_FRACTION = Family("total_tis_clip_fraction@C")
