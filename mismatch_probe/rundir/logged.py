"""A run written from log-probs a training loop already holds: one rollout and one score set, streamed.

`probe import` (a framework's dump) and `mismatch_probe.record.Recorder` (a live training loop) both hand
`LoggedSample`s to `LoggedRunWriter`, which writes the ordinary run layout (SPEC section 3): the inference
log-probs (and routed experts) as `rollout/`, the training log-probs as `scores/training/`, part by part,
so memory stays bounded by one part whatever the number of samples. The manifests say where the data
came from and, line by line, what it lacks; nothing a source does not hold is filled in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mismatch_probe import __version__
from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir import checked
from mismatch_probe.rundir.layout import RUN_LAYOUT, Run, prepare_output
from mismatch_probe.rundir.manifests import COMPLETE, RUNNING, RolloutManifest, ScoreManifest, now_iso
from mismatch_probe.rundir.parts import write_part
from mismatch_probe.rundir.records import SequenceRecord
from mismatch_probe.rundir.roles import MATCHED
from mismatch_probe.schema import RoutingShape, token_schema

TRAINING_SIDE = "training"
PART_TOKENS = 1 << 19  # tokens buffered per side before a part is written: bounds memory
WIDE_IDS = 65535  # expert count assumed for the column type while the real count is unknown (uint16 ids)


@dataclass
class LoggedSample:
    """One sequence with both sides' log-probs of its response tokens.

    `routed_experts` is `[m, layers, top_k]`: row p is the inference engine's routing for position p of
    prompt + response (m may be shorter than the sequence: later positions have no routing).
    `response_mask` marks the response tokens whose log-probs are meaningful (the loss mask); others are null.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    inference_logprobs: np.ndarray
    training_logprobs: np.ndarray
    routed_experts: np.ndarray | None = None
    response_mask: np.ndarray | None = None
    prompt_id: int | None = None
    step: int | None = None
    where: str = ""  # for messages: the file (and line or index) the sample came from


@dataclass
class Provenance:
    """What the source says about how both sides were produced; None wherever it does not say."""

    source_format: str
    source: str
    model: str | None = None
    inference_engine: str | None = None
    training_engine: str | None = None
    inference_dtype: str | None = None
    training_dtype: str | None = None
    temperature: float | None = None
    num_experts: int | None = None
    replay: str | None = None
    # what the source says of the rollout's sampling ({temperature, top_p, top_k}, the keys it holds): the
    # rollout manifest's `sampling`; None where it says nothing
    sampling: dict | None = None
    lacks: list[str] = field(default_factory=list)  # one line per missing field and the comparison it prevents
    # The rollout manifest's model fields (ModelInfo.manifest_fields()) of a model the user names: its
    # config hash, vocabulary and routing shape then hold, and `probe rescore` can add score sets.
    model_fields: dict | None = None
    trust_pickle: bool = False  # the dump was unpickled in full (`probe import --trust-pickle`): the manifest says so

    def __post_init__(self):
        if self.model_fields:
            self.name_model(self.model_fields)

    def name_model(self, fields: dict) -> None:
        """The model the user names: its manifest fields, and the model and expert count they imply."""
        self.model_fields = fields
        self.model = fields["model"]
        self.num_experts = fields["num_experts"] or None


class LoggedRunWriter:
    """Streams LoggedSamples into RUN; `close()` finishes the manifests (status complete)."""

    def __init__(self, root, provenance: Provenance, overwrite: bool = False, part_tokens: int | None = None):
        self.run = Run(Path(root))
        self.provenance = provenance
        self.part_tokens = part_tokens or PART_TOKENS
        prepare_output(
            self.run.root, resume=False, overwrite=overwrite, what="a probe run", layout=RUN_LAYOUT, resumable=False
        )
        self.shape: RoutingShape | None = None  # fixed by the first sample: routed or not
        self.inference: list[SequenceRecord] = []
        self.training: list[SequenceRecord] = []
        self.buffered = 0
        self.samples = 0
        self.tokens = 0
        self.max_expert = -1
        self.routed = False  # whether any sample carried routed experts
        self.steps: list[list[int]] = []  # [step, first sample id, last sample id]
        self.closed = False
        self._save_manifests(RUNNING)

    # ---- adding -----------------------------------------------------------------------------------

    def add(self, sample: LoggedSample) -> int:
        """Buffer one sample; write a part when enough tokens are buffered. Returns its sample id."""
        if self.closed:
            raise ProbeError(f"{self.run.root}: the run is closed; no more samples can be added")
        sample_id = self.samples
        inference, training = self._records(sample, sample_id)
        self.inference.append(inference)
        self.training.append(training)
        self.samples += 1
        self.tokens += len(inference)
        self.buffered += len(inference)
        if sample.step is not None:
            if self.steps and self.steps[-1][0] == sample.step and self.steps[-1][2] == sample_id - 1:
                self.steps[-1][2] = sample_id
            else:
                self.steps.append([int(sample.step), sample_id, sample_id])
        if self.buffered >= self.part_tokens:
            self.flush()
        return sample_id

    def _records(self, s: LoggedSample, sample_id: int) -> tuple[SequenceRecord, SequenceRecord]:
        where = s.where or f"sample {sample_id}"
        prompt, response = (
            checked.ids(_flat(s.prompt_ids, where, "prompt ids"), where, "prompt ids"),
            checked.ids(_flat(s.response_ids, where, "response ids"), where, "response ids"),
        )
        tokens = np.concatenate([prompt, response])
        if not len(tokens):
            raise ProbeError(f"{where}: no tokens (expected a prompt and a response)")
        vocab = (self.provenance.model_fields or {}).get("vocab_size") or checked.ID_LIMIT
        bad = tokens[tokens >= vocab]
        if bad.size:
            raise ProbeError(f"{where}: token id {int(bad[0])} out of range (expected 0 <= id < {vocab})")
        n, p = len(tokens), len(prompt)
        mask = np.ones(len(response), dtype=bool)
        if s.response_mask is not None:
            mask = checked.flags(_flat(s.response_mask, where, "response mask"), where, "response mask")
            _require_length(where, "response mask", mask, len(response))
        sides = []
        for name, values in (
            ("inference log-probs", s.inference_logprobs),
            ("training log-probs", s.training_logprobs),
        ):
            with np.errstate(over="ignore"):  # a value past float32's range is non-finite: no log-prob
                lp = checked.logprobs(_flat(values, where, name), where, name).astype(np.float32, copy=False)
            _require_length(where, name, lp, len(response))
            logprob = np.zeros(n, dtype=np.float32)
            logprob[p:] = lp
            valid = np.zeros(n, dtype=bool)
            valid[p:] = mask & np.isfinite(lp)  # a non-finite value (exported as null) is no log-prob
            checked.at_most_zero(lp[valid[p:]], where, name)
            sides.append((np.nan_to_num(logprob, nan=0.0, posinf=0.0, neginf=0.0), valid))
        experts, experts_valid = self._experts(s, where, n)
        prompt_id = sample_id if s.prompt_id is None else int(s.prompt_id)
        step = None if s.step is None else _step(s.step, where)
        common = dict(sample_id=sample_id, prompt_id=prompt_id, token_ids=tokens, prompt_len=p, step=step)
        inference = SequenceRecord(
            **common, logprob=sides[0][0], logprob_valid=sides[0][1], experts=experts, experts_valid=experts_valid
        )
        training = SequenceRecord(**common, logprob=sides[1][0], logprob_valid=sides[1][1])
        return inference, training

    def _experts(self, s: LoggedSample, where: str, n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        routed = (
            None
            if s.routed_experts is None
            else checked.ids(s.routed_experts, where, "routed experts", ndim=3, what="expert id")
        )
        if self.shape is None:
            self.shape = self._routing_shape(routed, where)
        if routed is None:
            return None, None
        if not self.shape.is_moe:
            if self.provenance.model_fields:
                raise ProbeError(f"{where}: has routed experts, but the model {self.provenance.model} is dense")
            raise ProbeError(f"{where}: has routed experts, but the first sample had none (expected all or none)")
        routed = self._moe_layers(routed)
        if routed.ndim != 3 or routed.shape[1:] != (self.shape.num_layers, self.shape.top_k):
            raise ProbeError(
                f"{where}: routed experts have shape {tuple(routed.shape)}, expected "
                f"[positions, {self.shape.num_layers}, {self.shape.top_k}] (the run's routing shape)"
            )
        if routed.shape[0] > n:
            raise ProbeError(f"{where}: routed experts cover {routed.shape[0]} positions, the sequence has {n}")
        if routed.size:
            low, high = int(routed.min()), int(routed.max())
            limit = self.provenance.num_experts or WIDE_IDS + 1
            if low < 0 or high >= limit:
                raise ProbeError(f"{where}: routed expert id {low if low < 0 else high} out of range [0, {limit})")
            self.max_expert = max(self.max_expert, high)
        self.routed = True
        experts = np.zeros((n, self.shape.num_layers, self.shape.top_k), dtype=self.shape.id_dtype)
        experts[: routed.shape[0]] = routed
        valid = np.zeros(n, dtype=bool)
        valid[: routed.shape[0]] = True
        return experts, valid

    def _moe_layers(self, routed: np.ndarray) -> np.ndarray:
        """A dump with a row for every layer of a model whose first layers are dense keeps the MoE ones."""
        fields = self.provenance.model_fields
        if fields and routed.ndim == 3 and routed.shape[1] == fields["num_hidden_layers"] != fields["num_layers"]:
            return routed[:, fields["moe_layer_indices"]]
        return routed

    def _routing_shape(self, routed: np.ndarray | None, where: str) -> RoutingShape:
        fields = self.provenance.model_fields
        if fields:  # the named model's shape; the samples' routing must fit it
            return RoutingShape(
                num_layers=fields["num_layers"], top_k=fields["top_k"], num_experts=fields["num_experts"]
            )
        if routed is None:
            return RoutingShape()
        if routed.ndim != 3 or 0 in routed.shape[1:]:
            raise ProbeError(
                f"{where}: routed experts have shape {tuple(routed.shape)}, expected [positions, layers, top_k]"
            )
        num_experts = self.provenance.num_experts or WIDE_IDS
        return RoutingShape(num_layers=routed.shape[1], top_k=routed.shape[2], num_experts=num_experts)

    # ---- writing ----------------------------------------------------------------------------------

    def flush(self) -> None:
        """Write the buffered samples as one part per side (atomic: a crash leaves only finished parts)."""
        if not self.inference:
            return
        shape = self.shape or RoutingShape()
        # a `step` column once the run records steps, so that DuckDB or polars group by step without probe
        schema = token_schema(shape, with_top=False, with_step=bool(self.steps))
        write_part(self.run.rollout_dir, self.inference, schema, shape)
        write_part(self.run.score_dir(TRAINING_SIDE), self.training, schema, shape)
        self.inference, self.training, self.buffered = [], [], 0

    def close(self, error: BaseException | None = None) -> None:
        """Write what is buffered and mark the run complete; after an `error`, the manifest says where it stopped."""
        if self.closed:
            return
        self.closed = True
        self.flush()
        self._save_manifests(COMPLETE, error)

    def lacks(self) -> list[str]:
        lines = list(self.provenance.lacks)
        if not self.routed:
            lines.append("routed experts: not in the source; routing comparisons cannot be made")
        else:
            lines.append(
                "training-side routing: not in the source; the rollout's routing is stored, "
                "routing agreement between the sides cannot be measured"
            )
            if self.provenance.num_experts is None:
                lines.append(
                    f"num_experts: not in the source; the manifest holds the largest routed id + 1 "
                    f"({self.max_expert + 1}), a lower bound"
                )
        if self.provenance.model is None:
            lines.append(
                "model: not in the source (name it with --model); worst tokens are listed as ids, without text, "
                "and `probe rescore` cannot add score sets"
            )
        if not {"top_p", "top_k"} & set(self.provenance.sampling or {}):
            lines.append(
                "top_p and top_k: not in the source; whether the rollout's log-probs are over a truncated support "
                "is not known"
            )
        if self.provenance.temperature is None:
            lines.append(
                "temperature: not in the source (give it with --temperature); the manifest's scoring_temperature "
                "is null and `probe rescore` cannot score"
            )
        return lines

    def _save_manifests(self, status: str, error: BaseException | None = None) -> None:
        prov, shape = self.provenance, self.shape or RoutingShape()
        num_experts = prov.num_experts or (self.max_expert + 1 if shape.is_moe else 0)
        model = prov.model_fields or {
            "model": None,
            "config_hash": None,
            "num_layers": shape.num_layers,
            "top_k": shape.top_k,
            "num_experts": num_experts,
        }
        extra = {
            "source": {"format": prov.source_format, "path": prov.source, "imported_at": now_iso()}
            | ({"trust_pickle": True} if prov.trust_pickle else {}),
            "not_in_source": self.lacks(),
        }
        if self.steps:
            extra["steps"] = self.steps
        if error is not None:
            extra["interrupted"] = (
                f"writing stopped by {type(error).__name__}: {str(error).strip()[:200]} after {self.samples} samples; "
                "the samples before it are complete"
            )
        rollout = RolloutManifest.started(
            engine={"engine": prov.inference_engine or "unknown"},
            dtype=prov.inference_dtype,
            tool_version=__version__,
            **model,
            scoring_temperature=prov.temperature,
            sampling=prov.sampling,
            num_samples=self.samples,
            completed_samples=self.samples,
            extra=extra,
        )
        rollout.status = status
        rollout.save(self.run.manifest_path)
        score = ScoreManifest.started(
            name=TRAINING_SIDE,
            role=MATCHED,  # the framework's own training log-probs: the side the team trains with
            engine={"engine": prov.training_engine or "unknown"},
            dtype=prov.training_dtype,
            replay=prov.replay,
            temperature=prov.temperature,
            model=model["model"],
            config_hash=model["config_hash"],
            extra={"source": extra["source"]},
        )
        score.status = status
        directory = self.run.score_dir(TRAINING_SIDE)
        directory.mkdir(parents=True, exist_ok=True)
        score.save(directory / "manifest.json")


def _step(value, where: str) -> int:
    """An RL step: a whole number that the `step` column (uint32) holds."""
    try:
        step = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ProbeError(f"{where}: step {checked.short(value)} is not a whole number") from None
    if step != value or not 0 <= step < 2**32:
        raise ProbeError(f"{where}: step {checked.short(value)}, expected a whole number 0 <= step < 2**32")
    return step


def _flat(values, where: str, name: str) -> np.ndarray:
    """A sequence as a Recorder may be given it: a list, or an array or tensor of any shape ([1, n] from a
    batch of one), flattened."""
    return checked.numbers(values, where, name, ndim=None).reshape(-1)


def _require_length(where: str, name: str, values: np.ndarray, expected: int) -> None:
    if len(values) != expected:
        raise ProbeError(f"{where}: {name} has {len(values)} values, expected {expected} (one per response token)")
