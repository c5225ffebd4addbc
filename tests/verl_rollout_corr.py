"""Run inside the verl virtualenv (scripts/verl_env.sh) by tests/test_verl_parity.py: verl 0.9.1's own
rollout-correction metrics on the padded arrays of a probe run, under probe's key names.

python tests/verl_rollout_corr.py ARRAYS.npz CAPS BOUNDS MODES OUT.json    # each a comma-separated list
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo import rollout_corr_helper as verl
from verl.utils.debug import metrics as debug

# probe key (before @C) -> verl's metric with rollout_is: token (rollout_corr_helper.compute_is_metrics)
TOKEN_IS = {
    "is_ess": "rollout_is_eff_sample_size",
    "is_mean": "rollout_is_mean",
    "is_std": "rollout_is_std",
    "is_min": "rollout_is_min",
    "is_max": "rollout_is_max",
    "is_fraction_low": "rollout_is_ratio_fraction_low",
    "tis_clip_fraction": "rollout_is_ratio_fraction_high",
    "is_seq_mean": "rollout_is_seq_mean",
    "is_seq_std": "rollout_is_seq_std",
    "is_seq_min": "rollout_is_seq_min",
    "is_seq_max": "rollout_is_seq_max",
    "is_seq_max_deviation": "rollout_is_seq_max_deviation",
    "is_seq_fraction_high": "rollout_is_seq_fraction_high",
    "is_seq_fraction_low": "rollout_is_seq_fraction_low",
}
RS_STATS = (
    "mean",
    "seq_mean",
    "seq_std",
    "seq_max",
    "seq_min",
    "seq_max_deviation",
)  # probe's rs_STAT@MODE: rollout_rs_MODE_STAT
# probe key (after seq_, before @C) -> verl's metric with rollout_is: sequence
SEQUENCE_IS = {key: TOKEN_IS[key] for key in ("is_ess", "is_mean", "is_std", "is_fraction_low", "is_max", "is_min")}
# probe key -> calculate_debug_metrics' name (verl/utils/debug/metrics.py)
DEBUG = {
    "abs_prob_diff_mean": "training/rollout_probs_diff_mean",
    "abs_prob_diff_max": "training/rollout_probs_diff_max",
    "abs_prob_diff_std": "training/rollout_probs_diff_std",
    "prob_corr": "training/rollout_actor_probs_pearson_corr",
}
# probe key -> compute_offpolicy_metrics' name
OFFPOLICY = {
    "k1_kl": "kl",
    "k3_kl": "k3_kl",
    "ppl_cand": "training_ppl",
    "log_ppl_cand": "training_log_ppl",
    "ppl_ref": "rollout_ppl",
    "log_ppl_ref": "rollout_log_ppl",
    **{name: name for name in ("log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min")},
    **{name: name for name in ("ppl_ratio", "chi2_token", "chi2_seq")},
}


def main(arrays: str, caps: str, bounds: str, modes: str, out: str) -> None:
    data = np.load(arrays)
    # verl's arguments: old_log_prob (the trainer's: probe's candidate), rollout_log_prob (probe's reference)
    old, rollout = torch.from_numpy(data["cand"]), torch.from_numpy(data["ref"])
    mask = torch.from_numpy(data["mask"]).to(torch.float64)
    got = {key: verl.compute_offpolicy_metrics(old, rollout, mask)[name] for key, name in OFFPOLICY.items()}
    batch = {"rollout_log_probs": rollout, "old_log_probs": old, "response_mask": mask, "responses": mask}
    logged = debug.calculate_debug_metrics(DataProto.from_dict(tensors=batch))
    got |= {key: logged[name] for key, name in DEBUG.items()}
    # verl's training/rollout_logprobs_mismatch_count (after 0.9.1) counts what calculate_token_list_diff does
    # over every response token with a log-prob on both sides, NaN included (a NaN differs from everything)
    raw_old, raw_rollout = torch.from_numpy(data["cand_raw"]), torch.from_numpy(data["ref_raw"])
    valued = torch.from_numpy(data["valued"]).to(torch.float64)
    got["logprob_bit_mismatch_count"] = debug.calculate_token_list_diff(raw_old, raw_rollout, valued).sum()

    def run(**options) -> dict:
        _, _, metrics = verl.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **options)
        return {name.removeprefix("rollout_corr/"): value for name, value in metrics.items()}

    for cap in caps.split(","):
        token = run(rollout_is="token", rollout_is_threshold=float(cap))
        got |= {f"{key}@{cap}": token[name] for key, name in TOKEN_IS.items()}
        icepop = run(rollout_is="token", rollout_is_threshold=f"{1.0 / float(cap)!r}_{cap}")
        got[f"icepop_oob_fraction@{cap}"] = icepop["rollout_is_oob_ratio"]
        sequence = run(rollout_is="sequence", rollout_is_threshold=float(cap))
        got[f"seq_tis_clip_fraction@{cap}"] = sequence["rollout_is_ratio_fraction_high"]
        got |= {f"seq_{key}@{cap}": sequence[name] for key, name in SEQUENCE_IS.items()}
    for bound in bounds.split(","):
        for mode in ("seq_mean_k1", "seq_sum_k1"):
            rejected = run(rollout_is=None, rollout_rs=mode, rollout_rs_threshold=float(bound))
            got[f"{mode}_reject_fraction@{bound}"] = rejected[f"rollout_rs_{mode}_seq_masked_fraction"]
    for mode in modes.split(","):  # statistics that do not depend on the threshold
        stats = run(rollout_is=None, rollout_rs=mode, rollout_rs_threshold=2.0)
        got |= {f"rs_{stat}@{mode}": stats[f"rollout_rs_{mode}_{stat}"] for stat in RS_STATS}
    with open(out, "w") as f:
        json.dump({key: float(value) for key, value in got.items()}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
