"""Record both sides' log-probs from inside a training loop, as a probe run (docs/record.md).

    with Recorder("runs/step-logs") as rec:
        for step, batch in enumerate(loader):
            ...
            rec.add(prompt_ids, response_ids, inference_logprobs, training_logprobs, step=step)

Each `add` is one sequence; arrays may be lists, numpy arrays or torch tensors (on any device). Samples are
buffered and written as Parquet parts every `part_tokens` tokens (default rundir/logged.PART_TOKENS), so memory stays bounded; leaving the
`with` block (normally or by an exception) writes the rest and finishes the manifests, and an exception
is noted in the manifest. The result is an ordinary run: `probe report RUN` compares rollout with
scores/training.
"""

from __future__ import annotations

from pathlib import Path

from mismatch_probe.importers.job import named
from mismatch_probe.rundir.logged import LoggedRunWriter, LoggedSample, Provenance


class Recorder:
    def __init__(
        self,
        out,
        *,
        model: str | None = None,
        temperature: float | None = None,
        num_experts: int | None = None,
        inference_engine: str | None = None,
        training_engine: str | None = None,
        overwrite: bool = False,
        part_tokens: int | None = None,
    ):
        """`out` must be absent or empty (or a probe run, with overwrite=True). The keywords are what the
        loop knows about its setup; each one left None is recorded as unknown in the manifest. `model`, a
        local model folder, supplies the config hash, vocabulary and routing shape (and num_experts)."""
        provenance = Provenance(
            source_format="recorder",
            source=str(Path(out)),
            num_experts=num_experts,
            inference_engine=inference_engine,
            training_engine=training_engine,
        )
        named(provenance, model, temperature)
        self.writer = LoggedRunWriter(out, provenance, overwrite=overwrite, part_tokens=part_tokens)

    @property
    def root(self) -> Path:
        return self.writer.run.root

    def add(
        self,
        prompt_ids,
        response_ids,
        inference_logprobs,
        training_logprobs,
        routed_experts=None,
        step: int | None = None,
        response_mask=None,
    ) -> int:
        """One sequence: log-probs per response token; routed_experts [positions, layers, top_k] from the
        inference engine (position p of prompt + response), if it returned them. Returns the sample id."""
        return self.writer.add(
            LoggedSample(
                prompt_ids=prompt_ids,
                response_ids=response_ids,
                inference_logprobs=inference_logprobs,
                training_logprobs=training_logprobs,
                routed_experts=routed_experts,
                response_mask=response_mask,
                step=step,
            )
        )

    def close(self, error: BaseException | None = None) -> None:
        self.writer.close(error)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)
