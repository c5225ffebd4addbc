"""The two engine interfaces. Every engine is one class behind one of these, in its backend's subpackage."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from mismatch_probe.engines.options import NoOptions, build_options
from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.records import PromptRequest, ScoreRequest, SequenceRecord
from mismatch_probe.vocab import BF16, LOGPROBS_MODES, RAW, LogprobsMode

if TYPE_CHECKING:  # modelinfo imports torch; the CLI's report and gate commands never need it
    from mismatch_probe.model.routing_shape import ModelInfo


@dataclass(frozen=True)
class Truncation:
    """The support a sampler draws from: the k largest logits (top_k > 0), then, renormalised over those, the
    tokens whose exclusive cumulative probability in descending order is below top_p (HF's and vLLM's rule).
    engines/forward/truncation.py computes it."""

    top_p: float = 1.0
    top_k: int = 0  # 0: off

    @property
    def active(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 64
    seed: int = 0
    logprobs_mode: LogprobsMode = RAW  # raw: log_softmax(logits / T); processed: renormalised over the support

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ProbeError(f"--logprobs-mode {self.logprobs_mode}: expected one of {', '.join(LOGPROBS_MODES)}")

    @property
    def scoring_temperature(self) -> float:
        """Greedy decoding (T = 0) is scored at T = 1, as SGLang does."""
        return self.temperature if self.temperature > 0 else 1.0

    @property
    def truncation(self) -> Truncation:
        """The support sampled from; none under greedy decoding."""
        if self.temperature <= 0:
            return Truncation()
        return Truncation(top_p=self.top_p, top_k=self.top_k)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EngineConfig:
    """The options every engine shares, plus `engine_args` (KEY -> text or value) for the
    chosen engine's own options dataclass (`Engine.Options`), which checks them."""

    dtype: str = BF16
    batch_size: int = 16
    engine_args: dict = field(default_factory=dict)


class Engine(ABC):
    """What every engine has: a name, its own options dataclass, the model and the shared config."""

    name: str
    Options: type = NoOptions
    writes_router_margin: bool = False  # its records carry `router_margin` (the optional column)

    def __init__(self, model: ModelInfo, config: EngineConfig):
        self.model = model
        self.config = config
        self.options = build_options(self.Options, self.name, config.engine_args)

    def describe(self) -> dict:
        """Engine name, versions and settings for the manifest."""
        return {"engine": self.name, "dtype": self.config.dtype}

    def quantization(self) -> dict | None:
        """The manifest's `quantization` entry: the schemes and the modules they reach; None when not quantized."""
        return None

    def close(self) -> None:  # noqa: B027 - optional: most engines hold nothing to release
        pass


class InferenceEngine(Engine):
    """Samples responses and reports, per position, the sampled token's log-prob and the routing."""

    logprobs_modes: tuple[str, ...] = (RAW,)  # the --logprobs-mode values it can produce
    writes_kept_logmass: bool = False  # its records carry `kept_logmass`
    writes_serving_path: bool = False  # its records carry `cached_tokens` and `weight_version` where it says them

    @abstractmethod
    def generate(self, requests: list[PromptRequest], params: SamplingParams) -> list[SequenceRecord]:
        """Generate one response per request. Records hold prompt + response positions.

        `logprob[p]` is `log_softmax(logits / T)[token_ids[p]]` for response positions;
        `experts[p]` is the routing of the forward whose input token sits at p.
        """

    @property
    def window_size(self) -> int:
        """How many samples go to one `generate` call (and one part file)."""
        return self.config.batch_size

    @property
    def dtype(self) -> str:
        """The dtype the samples were computed in, as the manifest records it."""
        return self.config.dtype

    def end_ids(self) -> list[int]:
        """The end ids its samples stop at, for the manifest: the checkpoint's generation_config.json and
        config.json ids, which the serving engines apply (the hf engine states its own)."""
        from mismatch_probe.model.generation import end_ids
        from mismatch_probe.model.hf_config import load_hf_config

        return end_ids(self.model.path, load_hf_config(self.model.path, self.model.trust_remote_code))

    def check_ready(self, params: SamplingParams) -> None:
        """Fail early (ProbeError with the fix) when the engine cannot give what we need."""

    @classmethod
    def check_logprobs_mode(cls, params: SamplingParams) -> None:
        """--logprobs-mode must be one this engine produces (checked before the run folder is written)."""
        if params.logprobs_mode not in cls.logprobs_modes:
            raise ProbeError(
                f"--logprobs-mode {params.logprobs_mode}: the {cls.name} engine produces only "
                f"{', '.join(cls.logprobs_modes)} (processed log-probs with their kept mass: --engine hf)"
            )


@dataclass(frozen=True)
class ScoreOptions:
    temperature: float
    extra_padding: int = 0  # pad every micro-batch by this many more positions (batch-variance probe)
    router_logprobs: bool = False  # records carry the router's log-prob of each chosen (and --old) expert
    # --sampling rollout: renormalise over this side's own top-p/top-k support (kept_logmass written); None: raw
    truncation: Truncation | None = None


class TrainingEngine(Engine):
    """Scores stored token ids with one full-sequence forward per micro-batch."""

    @abstractmethod
    def score(self, batch: list[ScoreRequest], options: ScoreOptions) -> list[SequenceRecord]:
        """Score one micro-batch under the contract in engines/forward/scoring.py: scored positions get
        log-probs (temperature from options), every position gets routing, and a request carrying
        replay experts is routed to exactly those experts where they are valid (R3)."""

    def reconfigure(self, engine_args: dict) -> bool:
        """Switch the loaded model to these `--engine-arg` options in place, when every option that differs from
        the current ones can be switched without loading the checkpoint again: `probe sweep` then loads a
        checkpoint once per engine and dtype, not once per variant. Returns False, having changed nothing, when
        some option needs a fresh load (the sweep then builds a new engine)."""
        return False
