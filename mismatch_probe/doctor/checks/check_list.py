"""Every doctor check (the catalogue, once doctor/catalogue.py): its name (the public one `probe gate --allow`
takes), likely cause and fix. The first round's checks are defined here; engine_bugs.py defines the second
round's, setup_bugs.py the third's (issue 40), and CHECKS lists them all (CHECK_NAMES: the names `probe gate --allow` accepts).
"""

from __future__ import annotations

from mismatch_probe.doctor.checks.engine_bugs import ENGINE_BUG_CHECKS
from mismatch_probe.doctor.checks.setup_bugs import SETUP_BUG_CHECKS
from mismatch_probe.doctor.finding import Check, Fix

PROCESSED_LOGPROBS = Check(
    name="processed_logprobs",
    cause=(
        "the inference engine returns log-probs at another temperature than the one sampled with "
        "(e.g. raw logits when T != 1); log-probs renormalised over a top-k/top-p support are "
        "truncated_logprobs"
    ),
    fix=Fix(
        probe="vllm: --engine-arg logprobs_mode=processed_logprobs; sglang returns log_softmax(logits / T), "
        "pass --temperature explicitly",
        verl="actor_rollout_ref.rollout.engine_kwargs.vllm.logprobs_mode=processed_logprobs",
        slime="--rollout-temperature (the same T the log-probs are taken at)",
        nemo_rl="policy.generation.vllm_cfg (logprobs_mode: processed_logprobs)",
    ),
)
TEMPERATURE_MISMATCH = Check(
    name="temperature_mismatch",
    cause="the training side divides the logits by another temperature than the one the rollout sampled at",
    fix=Fix(
        probe="the training side reads scoring_temperature from the rollout manifest; do not edit it",
        verl="actor_rollout_ref.rollout.temperature (the actor reuses it for log-probs)",
        slime="--rollout-temperature",
        nemo_rl="policy.generation.temperature",
    ),
)
OFF_BY_ONE = Check(
    name="off_by_one",
    cause="a log-prob is stored one position away from its token (logits[p] scores token p+1)",
    fix=Fix(
        probe="store the log-prob of token p from the logits at position p-1 (engines/forward/logprobs.py does)",
        verl="the logits[:, :-1] / input_ids[:, 1:] shift of the actor's log-prob computation",
        slime="the logits/tokens shift of the training log-prob computation",
        nemo_rl="the logits/tokens shift of the policy's log-prob computation",
    ),
)
TOKEN_IDS_DIFFER = Check(
    name="token_ids_differ",
    cause="a side scored other token ids than the rollout sampled: text re-tokenised, or another chat template",
    fix=Fix(
        probe="score the stored token ids (`probe rescore` never re-tokenises)",
        verl="keep the rollout's response ids (do not decode and re-encode)",
        slime="keep the rollout's token ids (do not decode and re-encode)",
        nemo_rl="keep the generation's token ids (do not decode and re-encode)",
    ),
)
WEIGHTS_DIFFER = Check(
    name="weights_differ",
    cause="the two sides ran different weights: inference weights stale after a refit, or another checkpoint",
    fix=Fix(
        probe="--model of `probe rescore` must be the rollout's checkpoint",
        verl="actor_rollout_ref.rollout weight sync (check the refit after each step)",
        slime="the weight update to the rollout engines after each step",
        nemo_rl="the refit of the generation backend after each step",
    ),
)
REPLAY_MISALIGNED = Check(
    name="replay_misaligned",
    cause="routes are recorded or replayed at the wrong position (off by one, MTP tokens, padding)",
    fix=Fix(
        probe="--replay r3 replays the route of position p in the forward whose input token is p",
        verl="actor_rollout_ref.actor.router_replay.mode",
        slime="--use-routing-replay",
        nemo_rl=None,
    ),
)
ROUTING_ROWS_LOST = Check(
    name="routing_rows_lost",
    cause="routes are missing where the token was forwarded: prefix-cache hits reuse or drop routing rows",
    fix=Fix(
        probe="sglang: start the server with --disable-radix-cache; vllm: --no-enable-prefix-caching",
        verl="actor_rollout_ref.rollout.enable_prefix_caching=False",
        slime="--sglang-disable-radix-cache",
        nemo_rl="policy.generation.vllm_cfg.enable_prefix_caching=false",
    ),
)
GREEDY = Check(
    name="greedy",
    cause="the rollout was decoded greedily (temperature 0): F(t) and importance weights describe no sampler",
    fix=Fix(
        probe="probe generate --temperature T (the temperature RL samples at)",
        verl="actor_rollout_ref.rollout.temperature (and do_sample=True)",
        slime="--rollout-temperature",
        nemo_rl="policy.generation.temperature",
    ),
)
EMPTY_RESPONSES = Check(
    name="empty_responses",
    cause="most responses are empty (only the end token): the prompt format or max_new_tokens is wrong",
    fix=Fix(
        probe="probe generate --max-new-tokens; check the prompts' chat template",
        verl="data.max_response_length",
        slime="--rollout-max-response-len",
        nemo_rl="policy.generation.max_new_tokens",
    ),
)
PAST_END_TOKEN = Check(
    name="past_end_token",
    cause="responses go on after an end token the rollout's model stops at: an engine loaded the checkpoint "
    "without its generation_config.json end ids (or ignored them), so tokens RL never trains on are scored",
    fix=Fix(
        probe="probe generate reads the end ids of config.json and generation_config.json (the rollout manifest's "
        "eos_token_ids); a served engine: start it on the checkpoint folder with its generation_config.json",
        verl="actor_rollout_ref.rollout (the engine's generation config: eos_token_id of generation_config.json)",
        slime="--rollout-stop-token-ids (the checkpoint's every end id)",
        nemo_rl="policy.generation.stop_token_ids",
    ),
)
TOO_FEW_TOKENS = Check(
    name="too_few_tokens",
    cause="the comparison rests on too few response tokens for its numbers to mean anything",
    fix=Fix(
        probe="probe generate --num-prompts / --samples-per-prompt / --max-new-tokens (more tokens)",
        verl="data.train_batch_size",
        slime="--rollout-batch-size",
        nemo_rl="grpo.num_prompts_per_step",
    ),
)

CHECKS = (
    PROCESSED_LOGPROBS,
    TEMPERATURE_MISMATCH,
    OFF_BY_ONE,
    TOKEN_IDS_DIFFER,
    WEIGHTS_DIFFER,
    REPLAY_MISALIGNED,
    ROUTING_ROWS_LOST,
    GREEDY,
    EMPTY_RESPONSES,
    PAST_END_TOKEN,
    TOO_FEW_TOKENS,
    *ENGINE_BUG_CHECKS,
    *SETUP_BUG_CHECKS,
)
CHECK_NAMES = tuple(check.name for check in CHECKS)
