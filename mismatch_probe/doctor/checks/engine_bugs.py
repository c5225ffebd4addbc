"""The doctor's second round of checks: the engine and transport bugs RL teams reported most, each detectable
from a run's data alone. Names are public (`probe gate --allow` takes them); each fix names the probe flag
or engine setting, then the framework's key where one exists. The thread each check imitates is in
docs/doctor.md."""

from __future__ import annotations

from mismatch_probe.doctor.finding import Check, Fix

ROUTES_CONSTANT = Check(
    name="routes_constant",
    cause="a layer's routing was never captured: a fused MoE kernel bypasses the capture hook and every token "
    "reports the same experts (all zeros in vLLM#54730, vllm-ascend#16314), or a pipeline stage's layers were "
    "never filled in when routes were gathered across stages",
    fix=Fix(
        probe="vllm: use a MoE backend that records routes (not the monolithic FlashInfer kernel); "
        "sglang: --enable-return-routed-experts with every pipeline stage's routes gathered",
        verl="actor_rollout_ref.rollout.engine_kwargs (a MoE backend that records routes)",
        slime="--use-routing-replay (its validator rejects all-zero layers)",
        nemo_rl=None,
    ),
)
ROUTES_INVALID = Check(
    name="routes_invalid",
    cause="the engine returned routes that no router chose: expert ids at or above the model's expert count "
    "(physical ids of redundant EPLB replicas not mapped back to logical experts), or one expert listed twice "
    "in a token's top-k",
    fix=Fix(
        probe="sglang: start the server without EPLB / redundant experts (--ep-num-redundant-experts 0); "
        "vllm: without --enable-eplb; check the engine's routed-expert capture for the repeated ids",
        verl="actor_rollout_ref.rollout.engine_kwargs (no EPLB / redundant experts)",
        slime="--sglang-ep-num-redundant-experts 0",
        nemo_rl=None,
    ),
)
LAYER_ROUTES_OUTLIER = Check(
    name="layer_routes_outlier",
    cause="one layer's routes come from elsewhere: in the first MoE layer, an MTP or draft model's router "
    "overwrote the target's routes (vLLM PR #48622, SGLang#26980); in another layer, that layer's capture "
    "is mapped to the wrong layer index",
    fix=Fix(
        probe="vllm: no --speculative-config (or a build with the MTP routing fix); sglang: "
        "leave --speculative-algorithm unset while routes are captured",
        verl="actor_rollout_ref.model.mtp.enable_rollout=False while routes are replayed",
        slime="no --sglang-speculative-algorithm with --use-routing-replay",
        nemo_rl=None,
    ),
)
POSITION_ONSET = Check(
    name="position_onset",
    cause="the mismatch steps up at a fixed position: an fp8 KV cache (vLLM#54035, FA3 with fp8_e4m3: bitwise "
    "equal up to position 96, then not), or an attention kernel whose tile or split size changes the "
    "reduction order from that position on",
    fix=Fix(
        probe="vllm: --kv-cache-dtype auto; sglang: --kv-cache-dtype auto (a bf16 KV cache); or pin the "
        "attention backend whose tiles match the training side's",
        verl="actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype=auto",
        slime="--sglang-kv-cache-dtype auto",
        nemo_rl="policy.generation.vllm_cfg.kv_cache_dtype=auto",
    ),
)
CUMULATIVE_LOGPROBS = Check(
    name="cumulative_logprobs",
    cause="log-probs were mangled in transport: a streamed log-prob array was cumulative where incremental "
    "values were expected, or each stream chunk's total was spread over its tokens "
    "(ai-dynamo/dynamo PRs #13879 and #13996, SGLang#39260)",
    fix=Fix(
        probe="read per-token log-probs from the engine's final (non-streamed) response, or difference "
        "cumulative ones; sglang: output_token_logprobs of the finished request; vllm: the completion's "
        "logprobs.token_logprobs",
        verl=None,
        slime=None,
        nemo_rl=None,
    ),
)
DUPLICATE_SAMPLES = Check(
    name="duplicate_samples",
    cause="the samples of one prompt are clones: every sample of a group was drawn with the same seed "
    "(UniRL PR #208), or one response was copied into the group",
    fix=Fix(
        probe="probe generate --seed (one seed per run; probe derives each sample's own); sglang: no fixed "
        "sampling_seed per request of a group; vllm: no fixed SamplingParams.seed per sample",
        verl="actor_rollout_ref.rollout.seed (one seed for the engine, never one per sample)",
        slime="--rollout-seed (once per run, not per sample)",
        nemo_rl=None,
    ),
)

DECODE_PATH = Check(
    name="decode_path",
    cause="the inference engine's decode path leaves its own prefill of the same tokens, and more so further along "
    "the sequence: an fp8 KV cache (SGLang#25790, vLLM#54035), a stale prefix cache reused across weight "
    "updates (NeMo-RL#4018, #3152), a decode kernel or CUDA graph of another reduction order, speculative "
    "decoding, or Mamba/GDN layers whose decode state drifts from prefill (vLLM#42259, prime-rl#2671)",
    fix=Fix(
        probe="check the server's kv_cache_dtype (auto: the model's dtype), its prefix cache (sglang "
        "--disable-radix-cache, vllm --no-enable-prefix-caching, or flush it at each weight update), CUDA graphs "
        "(sglang --disable-cuda-graph, vllm --enforce-eager) and speculative decoding (off); then "
        "`probe generate` and `probe rescore RUN --engine sglang|vllm` again",
        verl="actor_rollout_ref.rollout.engine_kwargs (kv_cache_dtype auto; prefix caching off or reset on update)",
        slime="--sglang-kv-cache-dtype auto; --sglang-disable-radix-cache",
        nemo_rl="policy.generation.vllm_cfg.kv_cache_dtype=auto; reset the prefix cache after each weight sync",
    ),
)

ENGINE_BUG_CHECKS = (
    ROUTES_CONSTANT,
    ROUTES_INVALID,
    LAYER_ROUTES_OUTLIER,
    POSITION_ONSET,
    CUMULATIVE_LOGPROBS,
    DUPLICATE_SAMPLES,
    DECODE_PATH,
)
