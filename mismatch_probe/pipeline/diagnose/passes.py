"""The passes `probe diagnose` plans, each with the one question it answers, and the entry plan.json keeps of it.

A pass is one stand-alone probe command (`command`, reproducible by hand). Its `value` weighs what its answer
tells (the headline first, then the shares, then the noise floor, the remedies and the location); the plan runs
passes in the order of value per estimated second (estimate.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

RAN, REUSED, SKIPPED, FAILED, PLANNED = "ran", "reused", "skipped", "failed", "planned"
STATUSES = (RAN, REUSED, SKIPPED, FAILED, PLANNED)
BUDGET = "budget"  # the why of a pass the budget left out

GENERATE, MATCHED, FP32, REPEATS, R3_PASS, QUANT, SAMPLING = (
    "generate",
    "matched",
    "fp32",
    "repeats",
    "r3",
    "quant",
    "sampling",
)
DOCTOR, SWEEP, LOCATE, REPORT = "doctor", "sweep", "locate", "report"
ENGINE_PREFILL_PASS = "engine-prefill"  # the rollout's inference engine scores it by prefill (prefill_pass.py)
SCORING = (MATCHED, FP32, REPEATS, R3_PASS, QUANT, SAMPLING)  # one `probe rescore` each
END = (DOCTOR, REPORT)  # read the run only: they run whatever the budget, when there is a score set to read

QUESTIONS = {
    GENERATE: "What does the inference engine sample, with which log-probs and routes?",
    MATCHED: "How large is the mismatch between the rollout and the training engine at the rollout's dtype?",
    FP32: "How much of each side's error is its own precision (each side against fp32)?",
    REPEATS: "How large is this setup's noise floor: the training engine against itself with other batching?",
    R3_PASS: "What share of the mismatch do MoE routing differences explain (R3 replays the rollout's experts)?",
    QUANT: "What share of the mismatch does the rollout's quantization explain?",
    SAMPLING: "What share of the mismatch do the rollout's truncated (top-p/top-k) log-probs explain?",
    DOCTOR: "Is a setup bug (temperature, off-by-one, other weights, other token ids, ...) behind the numbers?",
    SWEEP: "How much does each remedy What to do next proposes remove, and at what speed?",
    LOCATE: "In which layer and operation does the disagreement start, on the worst sequences?",
    REPORT: "What is the verdict, its band, and which part explains how much?",
    ENGINE_PREFILL_PASS: "How much of the mismatch is the inference engine's decode path, not its kernels (its own prefill)?",
}
# What an answer tells, in relative units: the plan's order is value per estimated second.
VALUE = {
    MATCHED: 10.0,
    ENGINE_PREFILL_PASS: 8.0,
    R3_PASS: 8.0,
    QUANT: 8.0,
    SAMPLING: 8.0,
    FP32: 5.0,
    REPEATS: 5.0,
    SWEEP: 3.0,
    LOCATE: 2.0,
}


@dataclass(kw_only=True)
class Pass:
    name: str
    command: str
    status: str = PLANNED
    why: str = ""
    estimate_s: float | None = None
    seconds: float | None = None
    score_sets: list[str] = field(default_factory=list)  # what it writes under RUN/scores/
    knobs: list[str] = field(default_factory=list)  # the sweep's --vary values
    group: str | None = None  # the loaded training checkpoint it scores with: engine, dtype, weights' options
    checkpoint: str = ""  # the plan's word on its checkpoint load: loads it, or shares one
    result: str = ""  # its answer in one line, once it ran
    load_s: float = 0.0  # of its estimate, the checkpoint load it pays
    memory: object | None = None  # memory.PassMemory: its estimated and measured peak bytes

    @property
    def question(self) -> str:
        return QUESTIONS[self.name]

    @property
    def value(self) -> float:
        return VALUE.get(self.name, 0.0)

    def skip(self, why: str) -> None:
        self.status, self.why = SKIPPED, why

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "question": self.question,
            "command": self.command,
            "status": self.status,
            "why": self.why,
            "estimate_s": None if self.estimate_s is None else round(self.estimate_s, 2),
            "seconds": None if self.seconds is None else round(self.seconds, 2),
            "score_sets": self.score_sets,
            "checkpoint": self.checkpoint,
            "result": self.result,
            "memory": None if self.memory is None else self.memory.to_json(),
        }
