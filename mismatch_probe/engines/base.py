"""The two engine interfaces. Every engine is one file behind one of these."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field

from ..modelinfo import ModelInfo
from ..records import PromptRequest, ScoreRequest, SequenceRecord

DTYPES = ("bf16", "fp16", "fp32", "fp32-bf16w")  # fp32-bf16w: fp32 compute on weights rounded to bf16


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 64
    seed: int = 0

    @property
    def scoring_temperature(self) -> float:
        """Greedy decoding (T = 0) is scored at T = 1, as SGLang does."""
        return self.temperature if self.temperature > 0 else 1.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option the CLI knows; each engine reads the ones it needs."""

    dtype: str = "bf16"
    batch_size: int = 16
    server_url: str | None = None
    concurrency: int = 8
    timeout_s: float = 600.0
    max_retries: int = 4
    tensor_parallel: int = 1
    expert_parallel: int = 1
    logprob_chunk: int = 256  # positions per LM-head chunk: O(chunk x vocab) float32 at a time
    extra: dict = field(default_factory=dict)


class InferenceEngine(ABC):
    """Samples responses and reports, per position, the sampled token's log-prob and the routing."""

    name: str

    def __init__(self, model: ModelInfo, config: EngineConfig):
        self.model = model
        self.config = config

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

    def check_ready(self, params: SamplingParams) -> None:
        """Fail early (ProbeError with the fix) when the engine cannot give what we need."""

    def describe(self) -> dict:
        """Engine name, versions and settings for the manifest."""
        return {"engine": self.name, "dtype": self.config.dtype}

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class ScoreOptions:
    temperature: float
    replay: str = "none"  # "none" | "r3"
    extra_padding: int = 0  # pad every micro-batch by this many more positions (batch-variance probe)


class TrainingEngine(ABC):
    """Scores stored token ids with one full-sequence forward per micro-batch."""

    name: str

    def __init__(self, model: ModelInfo, config: EngineConfig):
        self.model = model
        self.config = config

    @abstractmethod
    def score(self, batch: list[ScoreRequest], options: ScoreOptions) -> list[SequenceRecord]:
        """Score one micro-batch. Response positions get log-probs (temperature from options);
        every position the model forwards gets routing. With replay "r3", positions whose
        request carries valid replay experts are routed to exactly those experts."""

    def describe(self) -> dict:
        return {"engine": self.name, "dtype": self.config.dtype}

    def close(self) -> None:
        pass
