"""Where a k3 KL sits, and the word a person acts on: ok, watch or act.

The bands are data, here and only here, each with where it comes from (cited in the README too):
- this run's noise floor, when a score set was rescored twice (pass against pass): a comparison whose k3
  interval reaches down into the floor's interval is indistinguishable from rescoring noise;
- practitioners' published ranges of k3 between an inference engine and a training engine at bf16:
  dense models about 1e-5..1e-3, MoE models about 1e-3..1e-1 (routing flips add to numerics);
- an acceptable level: NeMo-RL treats a multiplicative probability error under 1e-3 as acceptable;
- a quantized rollout (weights or activations in fp8/MXFP8 and the like) against a training side that is not
  quantized has a band of its own, from the published figures of such rollouts (issue 40):
  miles PR #1678: rollout KL 1.2e-4 at bf16 against 0.060 with an fp8 rollout (flat across steps);
  prime-rl PR #3112: UE8M0 (power-of-two) scales raised the mismatch KL from 0.0038 to about 0.006;
  NeMo-RL PR #4080: MXFP8 generation KL 0.028-0.043.
  So about 3.8e-3..6e-2: inside it a quantized rollout is as far off as published ones (watch), above it
  further (act). A truncated rollout (top-p/top-k log-probs) is judged after its truncation share: on the k3
  of the pass with the rollout's truncation (`probe rescore RUN --sampling rollout`) where the run has one
  (summary.py).

Words: ok at the noise floor or at most the acceptable level; watch inside the model kind's range (above
acceptable); act above it. A TOML file's `[bands]` table overrides the numbers (the gate's --config file
may carry it): `acceptable = 1e-3`, `dense = [1e-5, 1e-3]`, `moe = [1e-3, 1e-1]`, `quantized = [3.8e-3, 6e-2]`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import read_document
from mismatch_probe.report import numbers

OK, WATCH, ACT = "ok", "watch", "act"


@dataclass(frozen=True)
class Band:
    low: float
    high: float
    source: str


@dataclass(frozen=True)
class Bands:
    """The published ranges per model kind and the acceptable level; `probe report --bands FILE` overrides."""

    dense: Band
    moe: Band
    acceptable: float
    acceptable_source: str
    quantized: Band = field(default_factory=lambda: QUANTIZED)

    def kind(self, is_moe: bool, quantized: bool = False) -> tuple[str, Band]:
        if quantized:
            return "quantized-rollout", self.quantized
        return ("MoE", self.moe) if is_moe else ("dense", self.dense)


QUANTIZED = Band(
    low=3.8e-3,
    high=6e-2,
    source="quantized (fp8, MXFP8) rollouts against bf16 training, as published: miles PR #1678 (bf16 1.2e-4 "
    "against fp8 0.060), prime-rl PR #3112 (0.0038 to about 0.006 with UE8M0 scales), NeMo-RL PR #4080 "
    "(MXFP8 gen-KL 0.028-0.043)",
)


PUBLISHED = Bands(
    dense=Band(
        low=1e-5,
        high=1e-3,
        source="bf16 inference vs training of dense LLMs, as reported by practitioners "
        "(e.g. Yao et al. 2025, 'Your efficient RL framework secretly brings you off-policy RL training')",
    ),
    moe=Band(
        low=1e-3,
        high=1e-1,
        source="MoE LLMs, where routing flips add to numerics "
        "(e.g. Ma et al. 2025, 'Stabilizing MoE reinforcement learning by aligning training and inference routers')",
    ),
    acceptable=1e-3,
    acceptable_source="NeMo-RL, 'Add New Models': a multiplicative probability error under 1e-3 is acceptable",
)


@dataclass(frozen=True)
class Placement:
    """A k3's word and where it sits, in words: `ok`, `at this run's noise floor`."""

    word: str
    where: str


def place(k3: float | None, k3_ci, floor_ci, bands: Bands, is_moe: bool, quantized: bool = False) -> Placement | None:
    """floor_ci: the interval of this run's noise floor that applies, or None; quantized: one side is quantized
    and the other is not (the quantized band)."""
    if k3 is None:
        return None
    name, band = bands.kind(is_moe, quantized)
    if floor_ci and k3_ci and k3_ci[0] <= floor_ci[1]:
        return Placement(word=OK, where="at this run's noise floor")
    if k3 <= bands.acceptable:
        return Placement(word=OK, where=f"below the acceptable {numbers.value(bands.acceptable)}")
    if k3 <= band.high:
        return Placement(word=WATCH, where=f"in the {name} band")
    return Placement(word=ACT, where=f"above the {name} band")


def _pair(value, where: str) -> tuple[float, float]:
    ok = isinstance(value, list) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value)
    if not ok or not 0 < value[0] < value[1]:
        raise ProbeError(f"{where}: expected [low, high] with 0 < low < high, e.g. [1e-5, 1e-3]; got {value!r}")
    return float(value[0]), float(value[1])


def read_bands(path: Path, base: Bands = PUBLISHED) -> Bands:
    """`base` with the `[bands]` table of a TOML file applied; a file without one changes nothing."""
    data = read_document(path, tomllib.loads, "TOML", (tomllib.TOMLDecodeError,))
    table = data.get("bands", {})
    if not isinstance(table, dict):
        raise ProbeError(f"{path}: [bands] must be a table, e.g. [bands] moe = [1e-3, 1e-1]")
    unknown = sorted(set(table) - {"dense", "moe", "quantized", "acceptable"})
    if unknown:
        raise ProbeError(f"{path}: [bands] {unknown[0]}: unknown band (known: acceptable, dense, moe, quantized)")
    bands = base
    for name in ("dense", "moe", "quantized"):
        if name in table:
            low, high = _pair(table[name], f"{path}: [bands] {name}")
            bands = replace(bands, **{name: Band(low=low, high=high, source=f"{path} [bands]")})
    if "acceptable" in table:
        value = table["acceptable"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ProbeError(f"{path}: [bands] acceptable: expected a number above 0, e.g. 1e-3; got {value!r}")
        bands = replace(bands, acceptable=float(value), acceptable_source=f"{path} [bands]")
    return bands
