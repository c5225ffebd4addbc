"""What `probe diagnose` is asked, and what the run says of its rollout: the two things its plan is made from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mismatch_probe.pipeline.generate import GenerateJob
from mismatch_probe.report.verdict.production import Production
from mismatch_probe.rundir.layout import canonical_dtype
from mismatch_probe.rundir.manifests import RolloutManifest


@dataclass(frozen=True, kw_only=True)
class DiagnoseJob:
    run: Path
    model: Path | None = None  # --model: the checkpoint the training passes score (default: the manifest's)
    train_engine: str = "hf"
    train_args: dict = field(default_factory=dict)  # --train-arg K=V: every training pass's --engine-arg
    dtype: str | None = None  # --dtype: the matched pass's dtype (default: the rollout's)
    budget_s: float | None = None  # --budget
    dry_run: bool = False
    as_json: bool = False
    batch_size: int = 8  # sequences per forward of the training passes
    generate: GenerateJob | None = None  # the second form: sample the rollout first, as `probe generate` would
    generate_command: str = ""  # that `probe generate`, spelled out
    trust_remote_code: bool = False
    moe_family: str | None = None


@dataclass(frozen=True, kw_only=True)
class RolloutFacts:
    """What the plan reads of a rollout: its engine and dtype, quantization and sampling, MoE or dense, model."""

    engine: str | None
    dtype: str | None
    quantization: dict | None
    sampling: dict | None
    is_moe: bool
    model: str | None  # the checkpoint the manifest names; None for an imported or recorded run
    tokens: int  # positions every training pass forwards (prompt and response)
    samples: int
    server_url: str | None = None  # the inference server that sampled it, where the manifest records one

    @property
    def truncates(self) -> bool:
        return Production(quantization=self.quantization, sampling=self.sampling).truncates

    @classmethod
    def of_manifest(cls, manifest: RolloutManifest, tokens: int) -> RolloutFacts:
        return cls(
            engine=manifest.engine_name,
            dtype=canonical_dtype(manifest.dtype),
            quantization=manifest.quantization,
            sampling=manifest.sampling,
            is_moe=manifest.routing.is_moe,
            model=manifest.model,
            tokens=tokens,
            samples=manifest.num_samples or manifest.completed_samples or 0,
            server_url=manifest.engine.get("server_url") if isinstance(manifest.engine, dict) else None,
        )

    @classmethod
    def of_generate(cls, job: GenerateJob, is_moe: bool, prompts: int, prompt_tokens: int) -> RolloutFacts:
        """A rollout not sampled yet (a dry run of the second form): as its generate job will record it, its
        tokens counted at max_new_tokens per response."""
        args = job.config.engine_args
        quant = {"weight": args.get("weight_quant"), "act": args.get("act_quant"), "kv": args.get("kv_quant")}
        params = job.params
        samples = prompts * job.samples_per_prompt
        return cls(
            engine=job.engine,
            dtype=canonical_dtype(job.config.dtype),
            quantization=quant if any(quant.values()) else None,
            sampling={"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
            | {"logprobs_mode": params.logprobs_mode},
            is_moe=is_moe,
            model=str(job.model),
            tokens=prompt_tokens * job.samples_per_prompt + samples * params.max_new_tokens,
            samples=samples,
            server_url=args.get("server_url"),
        )
