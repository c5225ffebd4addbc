"""The probe's words for how a side was computed: its replay mode and its dtype, as manifests, score-set names
and options spell them. Plain strings (Literal types), so manifests stay `"r3"` and `"bf16"` in JSON.

No torch here: the CLI's report and gate never load it. Engines turn a torch name into a dtype with
`getattr(torch, name)`.
"""

from __future__ import annotations

from typing import Literal

Replay = Literal["none", "r2", "r3"]
NO_REPLAY: Replay = "none"
R2: Replay = "r2"  # a new-policy pass fed the experts its --old score set chose (the training engine's, at θ_old)
R3: Replay = "r3"  # the candidate is fed the rollout's experts (routing replay)
REPLAYS: tuple[Replay, ...] = (NO_REPLAY, R2, R3)

DType = Literal["bf16", "fp16", "fp32", "fp32-bf16w"]
BF16: DType = "bf16"
FP16: DType = "fp16"
FP32: DType = "fp32"
FP32_BF16W: DType = "fp32-bf16w"  # fp32 compute on weights rounded to bf16
DTYPES: tuple[DType, ...] = (BF16, FP16, FP32, FP32_BF16W)
PRECISION_ORDER: tuple[DType, ...] = (BF16, FP16, FP32_BF16W, FP32)  # lowest precision first
HALF: tuple[DType, ...] = (BF16, FP16)

# torch's name of the type each dtype computes in, and of the type its weights are rounded to.
COMPUTE_TORCH = {BF16: "bfloat16", FP16: "float16", FP32: "float32", FP32_BF16W: "float32"}
WEIGHT_TORCH = COMPUTE_TORCH | {FP32_BF16W: "bfloat16"}
# As SGLang and vLLM spell the dtypes they run (not fp32-bf16w: the weights are theirs to load).
PACKAGE_DTYPES = {name: COMPUTE_TORCH[name] for name in (BF16, FP16, FP32)}
# Other spellings an engine may record (servers, synthetic runs) -> the probe's names.
DTYPE_ALIASES: dict[str, DType] = {"float32": FP32, "float": FP32, "bfloat16": BF16, "float16": FP16, "half": FP16}

# The manifest key (under "engine") of the weights fingerprint engines/forward/fingerprint.py records.
FINGERPRINT_KEY = "weights_fingerprint"

# Which log-probs a side records (`--logprobs-mode`, `--sampling`): `raw` is log_softmax(logits / T) over the full
# vocabulary; `processed` is renormalised over the top-p/top-k support sampled from (vLLM's processed_logprobs
# under top-p, SGLang's), with that support's log mass in the `kept_logmass` column.
LogprobsMode = Literal["raw", "processed"]
RAW: LogprobsMode = "raw"
PROCESSED: LogprobsMode = "processed"
LOGPROBS_MODES: tuple[LogprobsMode, ...] = (RAW, PROCESSED)
# `probe rescore --sampling`: raw (today), or the rollout's temperature, top-p and top-k on the training logits
ScoreSampling = Literal["raw", "rollout"]
ROLLOUT_SAMPLING: ScoreSampling = "rollout"
SCORE_SAMPLINGS: tuple[ScoreSampling, ...] = (RAW, ROLLOUT_SAMPLING)

# A score set of the inference engine's own prefill of the rollout (`probe rescore --engine sglang|vllm`): its
# manifest's `kind`; a training engine's set has none
ENGINE_PREFILL = "engine-prefill"
# a comparison's mean |delta| by absolute position, in metrics.json (report/accumulators/position_profile.py)
POSITION_PROFILE = "position_profile"
