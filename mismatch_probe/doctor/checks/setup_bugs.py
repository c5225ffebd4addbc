"""The doctor's third round (issue 40): truncated sampling and quantization, the settings production rollouts
use and a run may not say it used. Names are public (`probe gate --allow` takes them); each fix names the probe
flag or engine setting, then the framework's key where one exists. The threads each imitates are in
docs/doctor.md."""

from __future__ import annotations

from mismatch_probe.doctor.finding import Check, Fix

TRUNCATED_LOGPROBS = Check(
    name="truncated_logprobs",
    cause="the rollout's log-probs are renormalised over the top-p/top-k support it sampled from (vLLM's "
    "processed_logprobs, SGLang's and most servers' sampled-token log-probs under top_p/top_k), but the run "
    "does not say so: each token's log-prob is raised by minus the log of the mass its support kept, while the "
    "training side scores over the full vocabulary",
    fix=Fix(
        probe="vllm: --engine-arg logprobs_mode=raw_logprobs (full-vocabulary log-probs); probe generate "
        "--logprobs-mode raw; or score the training side over the same support: probe rescore RUN --sampling "
        "rollout",
        verl="actor_rollout_ref.rollout.engine_kwargs.vllm.logprobs_mode=raw_logprobs, or "
        "actor_rollout_ref.rollout.top_p=1.0 / top_k=-1",
        slime="--rollout-top-p 1.0 --rollout-top-k -1 (or train on the same truncated support)",
        nemo_rl="policy.generation.top_p=1.0, top_k=null",
    ),
)
QUANTIZED_ROUTER = Check(
    name="quantized_router",
    cause="a MoE router (the gate) or the lm_head is quantized on one side only: router logits decide the "
    "experts and the lm_head every log-prob, so their rounding moves routes and log-probs on every token "
    "(NeMo-RL PR #3614 keeps both unquantized in its FP8 rollouts, as SGLang's and vLLM's FP8 schemes do)",
    fix=Fix(
        probe="--engine-arg weight_quant_skip=default (keeps mlp.gate., .router. and lm_head unquantized); "
        "vllm/sglang: the FP8 checkpoint's ignored_layers / modules_to_not_convert list the gates and lm_head",
        verl="the rollout's FP8 quantization config: ignored_layers with the routers and lm_head",
        slime="the FP8 conversion's ignore list (mlp.gate, lm_head)",
        nemo_rl="policy.generation.vllm_cfg fp8 settings with the router and lm_head kept in bf16 (PR #3614)",
    ),
)
QUANT_MODULES_DIFFER = Check(
    name="quant_modules_differ",
    cause="both sides are quantized, but over different sets of modules (verl #7519: the trainer's and the "
    "rollout's FP8 configs skipped different layers), so the two sides round different weights",
    fix=Fix(
        probe="--engine-arg weight_quant_skip= the same list on both sides (probe rescore and probe generate)",
        verl="one quantization config (ignored layers) for actor and rollout",
        slime="one FP8 ignore list for training and the SGLang rollout",
        nemo_rl=None,
    ),
)
FIRST_TOKEN_SPIKE = Check(
    name="first_token_spike",
    cause="the mismatch is concentrated on the first response token, where the engine switches from prefill "
    "to decode: the first token's logits come from the prefill kernel (another attention backend, chunked "
    "prefill, a prefix-cache hit, or a prefill/decode disaggregated server) and the rest from decode "
    "(miles #2722)",
    fix=Fix(
        probe="sglang: --disable-radix-cache and the same --attention-backend for prefill and decode "
        "(--prefill-attention-backend); vllm: --no-enable-prefix-caching --no-enable-chunked-prefill",
        verl="actor_rollout_ref.rollout.enable_prefix_caching=False, enable_chunked_prefill=False",
        slime="--sglang-disable-radix-cache",
        nemo_rl="policy.generation.vllm_cfg.enable_prefix_caching=false",
    ),
)

SETUP_BUG_CHECKS = (TRUNCATED_LOGPROBS, QUANTIZED_ROUTER, QUANT_MODULES_DIFFER, FIRST_TOKEN_SPIKE)
