"""In-memory form of one sequence, as engines produce it and the token table stores it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SequenceRecord:
    """Per-position arrays for one sequence (prompt + response), all of length n.

    A position's value is only meaningful where its validity mask is True; the masks
    become Parquet nulls. `experts` is `[n, num_moe_layers, top_k]`.
    """

    sample_id: int
    prompt_id: int
    token_ids: np.ndarray
    prompt_len: int
    logprob: np.ndarray
    logprob_valid: np.ndarray
    top_token_id: np.ndarray | None = None
    top_logprob: np.ndarray | None = None
    experts: np.ndarray | None = None
    experts_valid: np.ndarray | None = None
    expert_logprobs: np.ndarray | None = None  # [n, L, k] the router's log-prob of each chosen expert
    expert_logprobs_at_old: np.ndarray | None = None  # [n, L, k] ... of each expert the --old set chose
    router_margin: np.ndarray | None = None  # [n, num_moe_layers] float32, meaningful where experts_valid
    step: int | None = None  # the RL step of a recorded or imported sample (the `step` column), if known
    # [n] float32: log of the probability mass of the support the log-prob is renormalised over (<= 0), where
    # the engine knows it; meaningful at scored positions (a response token whose log-prob is null included)
    kept_logmass: np.ndarray | None = None
    # what a serving engine said of this sample's path, where it says it: prompt tokens its prefix cache served,
    # and the version of the weights that sampled it (the `cached_tokens` and `weight_version` columns)
    cached_tokens: int | None = None
    weight_version: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class ScoreRequest:
    """One stored sequence to push through a training engine.

    Carrying `replay_experts` is what asks for replay (R3); positions where `replay_valid` is
    False are routed freely (engines/forward/scoring.py states the whole rule).
    """

    sample_id: int
    prompt_id: int
    token_ids: np.ndarray
    prompt_len: int
    replay_experts: np.ndarray | None = None  # [n, L, k]
    replay_valid: np.ndarray | None = None  # [n] bool
    old_experts: np.ndarray | None = None  # [n, L, k] the --old set's experts, where router log-probs are read

    def __len__(self) -> int:
        return len(self.token_ids)

    def record(self, logprob: np.ndarray, valid: np.ndarray, **columns) -> SequenceRecord:
        """This sequence's scores: `logprob` where `valid` (0 and masked elsewhere), the other columns as given."""
        return SequenceRecord(
            sample_id=self.sample_id,
            prompt_id=self.prompt_id,
            token_ids=np.asarray(self.token_ids),
            prompt_len=self.prompt_len,
            logprob=np.where(valid, logprob, 0.0).astype(np.float32),
            logprob_valid=valid,
            **columns,
        )


@dataclass
class PromptRequest:
    """One sample to generate: the tokenized prompt and the ids that place it in the run."""

    sample_id: int
    prompt_id: int
    prompt_ids: list[int]
