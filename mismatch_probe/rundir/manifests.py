"""The two manifests of a run (SPEC section 3): what produced the rollout, and what produced each score set.

On disk each is a plain JSON object whose key names users read and script against; in code each is a
dataclass whose fields carry those names, in the order they are written. Keys this version does not
know (written by a newer one) are kept in `extra` and written back unchanged.
"""

from __future__ import annotations

import hashlib
import platform
from dataclasses import MISSING, dataclass, field, fields
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from mismatch_probe import __version__
from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import read_json, write_json_atomic
from mismatch_probe.schema import READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION, RoutingShape

if TYPE_CHECKING:  # modelinfo imports torch through the MoE adapters; reading a run never needs it
    from mismatch_probe.model.routing_shape import ModelInfo

RUNNING = "running"
COMPLETE = "complete"
NEW_POLICY = "new"  # a score set's policy role: scored at a checkpoint other than the rollout's
ROUTING_FIELDS = ("num_layers", "top_k", "num_experts")


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"mismatch-probe": __version__, "python": platform.python_version()}
    for dist in ("torch", "transformers", "megatron-core", "sglang", "vllm", "pyarrow"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(kw_only=True)
class JsonManifest:
    """to_json/from_json shared by both manifests: fields without a default are required keys."""

    WRITTEN_BY: ClassVar[str] = ""
    REQUIRED: ClassVar[tuple[str, ...]] = ()  # required keys among the shared fields below
    extra: dict = field(default_factory=dict, repr=False)  # unknown keys, kept for the round trip
    # What produced the output, shared by both manifests and written first.
    schema_version: int | None = None
    created_at: str | None = None
    status: str | None = None
    engine: dict | str | None = None
    dtype: str | None = None
    # {weight, act, kv, quantized_modules, skipped_modules} of a fake-quantized side (mismatch_probe/quant/);
    # None where the side is not quantized
    quantization: dict | None = None
    versions: dict | None = None

    @classmethod
    def _keys(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "extra"]

    @classmethod
    def from_json(cls, obj: dict, path: Path):
        for f in fields(cls):
            required = f.default is MISSING and f.default_factory is MISSING or f.name in cls.REQUIRED
            if required and f.name not in obj:
                raise ProbeError(f"{path}: missing '{f.name}' (expected {cls.WRITTEN_BY})")
        keys = cls._keys()
        known = {key: value for key, value in obj.items() if key in keys}
        return cls(**known, extra={key: value for key, value in obj.items() if key not in keys})

    def to_json(self) -> dict:
        out = {key: getattr(self, key) for key in self._keys()}
        return out | {key: value for key, value in self.extra.items() if key not in out}

    @classmethod
    def started(cls, **fields):
        """A manifest of output being written from now on: versioned, dated, and running until finished."""
        return cls(
            schema_version=SCHEMA_VERSION, created_at=now_iso(), status=RUNNING, versions=package_versions(), **fields
        )

    @classmethod
    def load(cls, path: Path):
        return cls.from_json(read_json(path), path)

    def save(self, path: Path) -> None:
        write_json_atomic(path, self.to_json())

    @property
    def engine_name(self) -> str | None:
        """`engine` is a dict from `describe()` (its name under "engine") or, in older runs, a bare name."""
        engine = getattr(self, "engine", None)
        return engine.get("engine") if isinstance(engine, dict) else engine


@dataclass(kw_only=True)
class RolloutManifest(JsonManifest):
    """RUN/manifest.json: the model, inference engine, sampling and MoE shape of the rollout."""

    WRITTEN_BY: ClassVar[str] = "a rollout manifest written by `probe generate`"
    REQUIRED: ClassVar[tuple[str, ...]] = ("schema_version",)
    tool_version: str | None = None
    model: str
    model_type: str | None = None
    architecture: str | None = None
    config_hash: str
    num_hidden_layers: int | None = None
    vocab_size: int | None = None
    num_layers: int
    top_k: int
    num_experts: int
    moe_layer_indices: list[int] | None = None
    sampling: dict | None = None
    scoring_temperature: float
    seed: int | None = None
    prompts_file: str | None = None
    prompts_sha256: str | None = None
    num_prompts: int | None = None
    samples_per_prompt: int | None = None
    num_samples: int | None = None
    batch_size: int | None = None
    window_size: int | None = None
    completed_samples: int | None = None
    weights_sha256: str | None = None  # over every weight file of the checkpoint (engines/weight_files.py)
    # response tokens per second of the last `probe generate` that wrote samples (the cost `probe sweep` compares)
    tokens_per_second: float | None = None
    # every --engine-arg option of the inference engine, defaults included (what `probe sweep` rebuilds it with)
    engine_options: dict | None = None
    # the end ids the rollout's samples stop at (model/generation.py); None in runs made before they were recorded
    eos_token_ids: list[int] | None = None
    # a generate that stopped part-way (out of memory in a window): {"stopped_at": sample id, "samples_done",
    # "samples", "why"}; its status stays unfinished, and `probe generate --resume` continues from there
    incomplete: dict | None = None

    @property
    def routing(self) -> RoutingShape:
        return RoutingShape(num_layers=self.num_layers, top_k=self.top_k, num_experts=self.num_experts)

    def check_compatible(self, path: Path) -> None:
        """This version can read the run: its schema version, and routing fields that describe a model."""
        if isinstance(self.schema_version, bool) or self.schema_version not in READABLE_SCHEMA_VERSIONS:
            readable = " or ".join(map(str, READABLE_SCHEMA_VERSIONS))
            raise ProbeError(f"{path}: schema_version {self.schema_version!r}, expected {readable}")
        for key in ROUTING_FIELDS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ProbeError(f"{path}: {key} is {value!r}, expected a non-negative integer")
        if self.num_layers and not 1 <= self.top_k <= self.num_experts:
            raise ProbeError(
                f"{path}: top_k {self.top_k!r} and num_experts {self.num_experts!r} "
                "do not describe an MoE model (expected 1 <= top_k <= num_experts)"
            )

    def check_finished(self, path: Path) -> None:
        source = self.extra.get("source")
        if self.status == RUNNING and isinstance(source, dict):  # written by `probe import` or a Recorder
            raise ProbeError(
                f"{path}: unfinished: the {source.get('format')} writer stopped before closing (status 'running'); "
                "the part files it finished are complete Parquet, but the run is not: import or record it again"
            )
        if self.status == RUNNING:
            raise ProbeError(
                f"{path}: the rollout is unfinished (status 'running'); finish it with `probe generate ... --resume`"
            )

    def check_scoring_temperature(self, path: Path) -> None:
        t = self.scoring_temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ProbeError(f"{path}: scoring_temperature is {t!r}, expected a number > 0")

    def check_model(self, model: ModelInfo, new_policy: bool = False) -> None:
        """The model about to score the rollout must be the rollout's: the same routing shape, then the same config.
        A new policy's checkpoint (`new_policy`) is another checkpoint of the same model: trainers re-save
        config.json (another transformers_version, dtype or key order), so it must match on architecture and
        shape, not byte for byte."""
        where = f"{model.path}/config.json vs the rollout manifest"
        expected = {
            "moe_layer_indices": list(model.moe_layer_indices),
            "top_k": model.top_k if model.moe_layer_indices else 0,
            "num_experts": model.num_experts if model.moe_layer_indices else 0,
        }
        if new_policy:
            expected |= {
                "model_type": model.model_type,
                "architecture": model.architecture,
                "num_hidden_layers": model.num_hidden_layers,
                "vocab_size": model.vocab_size,
            }
        for key, value in expected.items():
            if getattr(self, key) is not None and getattr(self, key) != value:
                raise ProbeError(f"{where}: {key} is {getattr(self, key)}, but the model at {model.path} has {value}")
        if new_policy:
            return
        if model.config_hash != self.config_hash:
            raise ProbeError(
                f"{model.path}/config.json: config hash {model.config_hash} differs from the rollout manifest's "
                f"{self.config_hash} (model {self.model})"
            )

    def check_resumable(self, new: RolloutManifest, path: Path) -> None:
        """A resumed generate must produce the same samples: same model, prompts, sample count and engine."""
        for key in ("config_hash", "prompts_sha256", "num_samples"):
            if getattr(self, key) != getattr(new, key):
                raise ProbeError(
                    f"{path.name}: cannot resume: {key} was {getattr(self, key)!r}, now {getattr(new, key)!r}"
                )
        if self.engine_name != new.engine_name:
            raise ProbeError(f"{path.name}: cannot resume: engine was {self.engine_name!r}")


@dataclass(kw_only=True)
class ScoreManifest(JsonManifest):
    """RUN/scores/NAME/manifest.json: the training engine, dtype, replay and pass of one score set."""

    WRITTEN_BY: ClassVar[str] = "a score-set manifest written by `probe rescore`"
    name: str | None = None
    # `matched` (the training side as the team runs it) or a diagnostic role (rundir/roles.py); None: not recorded
    role: str | None = None
    replay: str | None = None
    temperature: float
    repeat_group: str | None = None
    pass_index: int | None = None
    repeats: int | None = None
    batch_layout: dict | None = None
    model: str | None = None
    config_hash: str
    rollout_created_at: str | None = None
    weights_sha256: str | None = None  # over every weight file of the checkpoint scored (engines/weight_files.py)
    # A pass that stopped part-way (out of memory in a batch): {"stopped_at": part, "parts_done", "parts", "why"};
    # its status stays unfinished, and `probe rescore --resume` continues from there (and drops this entry).
    incomplete: dict | None = None
    # A pass at a new policy's checkpoint: {"role": "new", "step", "old", "replay_source"}; None for a score set
    # of the rollout's own checkpoint (the old policy, θ_old). See pipeline/policy_pass.py.
    policy: dict | None = None
    # {temperature, top_p, top_k, logprobs_mode} this side scored with: raw (top_p 1, top_k 0) unless
    # `--sampling rollout` (the rollout's top-p/top-k, each position renormalised over this side's own support)
    sampling: dict | None = None
    # --sampling rollout: sampled tokens outside this side's own support (their log-prob stored as null)
    n_outside_support: int | None = None
    # tokens scored per second by the last `probe rescore` that scored any (the cost `probe sweep` compares)
    tokens_per_second: float | None = None
    # every --engine-arg option of the training engine, defaults included (what `probe sweep` matches to reuse it)
    engine_options: dict | None = None
    # "engine-prefill" for the inference engine's own prefill of the rollout (`probe rescore --engine sglang|vllm`);
    # None for a training engine's set
    kind: str | None = None
    # an engine-prefill set's temperature rule and what the server said (engines/serving/prefill.py)
    prefill: dict | None = None

    @property
    def is_new_policy(self) -> bool:
        return isinstance(self.policy, dict) and self.policy.get("role") == NEW_POLICY

    def check_finished(self, path: Path, run_root: Path) -> None:
        if self.status == RUNNING:
            raise ProbeError(
                f"{path}: score set is unfinished (status 'running'); finish it with `probe rescore {run_root} --resume`"
            )

    def check_scores(self, rollout: RolloutManifest, path: Path) -> None:
        """The score set scored the rollout's model (or, for a new policy, a checkpoint of it) at the rollout's
        scoring temperature."""
        if self.config_hash != rollout.config_hash and not self.is_new_policy:
            raise ProbeError(
                f"{path}: config_hash {self.config_hash!r} differs from the rollout manifest's "
                f"{rollout.config_hash!r} (scored with model {self.model!r}, rollout model {rollout.model!r})"
            )
        if self.temperature != rollout.scoring_temperature:
            raise ProbeError(
                f"{path}: temperature {self.temperature!r} differs from the rollout manifest's "
                f"scoring_temperature {rollout.scoring_temperature!r}"
            )
