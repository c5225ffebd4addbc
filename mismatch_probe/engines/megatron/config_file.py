"""`--engine-arg config_file=PATH`: TransformerConfig overrides from the file a training framework already has.

Two forms, told apart by the first word of the file:
- YAML (verl): a mapping of fields, either at the top level, under `override_transformer_config`, or at
  verl's full path `actor_rollout_ref.actor.megatron.override_transformer_config`;
- Megatron-LM flags as slime passes them (`--moe-router-dtype fp32 --no-rope-fusion ...`, one or many per
  line, `#` comments, `\\` continuations, a bash array `NAME=( ... )` around them). A flag names the field
  with dashes for underscores; `--no-FIELD` / `--disable-FIELD` set a bool field false and a bare `--FIELD`
  sets it true. `FLAG_FIELDS` maps the flags whose name is not their field's.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import torch

from mismatch_probe.engines.extras import require_engine
from mismatch_probe.engines.megatron.needs import choose_layer_spec
from mismatch_probe.engines.megatron.overrides import EXPLICIT, Entry, config_hints, convert_entries, unknown_field
from mismatch_probe.errors import ProbeError

VERL_PATH = ("actor_rollout_ref", "actor", "megatron", "override_transformer_config")

# Megatron-LM flags named otherwise than their TransformerConfig field (its arguments.py, and the argparse
# names TransformerConfig's own field metadata gives), with the value a bare flag sets (None: takes a value).
FLAG_FIELDS: dict[str, tuple[tuple[str, object], ...]] = {
    "--norm-epsilon": (("layernorm_epsilon", None),),
    "--apply-layernorm-1p": (("layernorm_zero_centered_gamma", True),),
    "--disable-bias-linear": (("add_bias_linear", False),),
    "--fp8-format": (("fp8", None),),
    "--fp4-format": (("fp4", None),),
    "--fp8-param-gather": (("fp8_param", True),),
    "--fp4-param-gather": (("fp4_param", True),),
    "--num-experts": (("num_moe_experts", None),),
    "--no-persist-layer-norm": (("persist_layer_norm", False),),
    "--no-bias-swiglu-fusion": (("bias_activation_fusion", False),),
    "--no-bias-gelu-fusion": (("bias_activation_fusion", False),),
    "--no-rope-fusion": (("apply_rope_fusion", False),),
    "--te-rng-tracker": (("use_te_rng_tracker", True),),
    # Megatron-LM's --swiglu: gated linear units with SiLU, what every family probe builds already uses.
    "--swiglu": (("gated_linear_unit", True), ("activation_func", torch.nn.functional.silu)),
    # Only lets megatron read --num-query-groups, which names the field itself.
    "--group-query-attention": (),
}
NEGATIONS = ("no_", "disable_")


def resolve_overrides(explicit: dict, config_file: str | None) -> dict[str, object]:
    """The file's overrides, then the explicit ones (which win), typed and checked against this machine."""
    if not explicit and config_file is None:
        return {}  # megatron-core is not even imported
    require_engine("megatron")
    entries = read_config_file(config_file) if config_file is not None else []
    entries += [Entry(where=EXPLICIT, name=str(name), field=str(name), value=value) for name, value in explicit.items()]
    overrides, sources = convert_entries(entries)
    choose_layer_spec(overrides, sources)
    return overrides


def read_config_file(text_path: str) -> list[Entry]:
    """The file's overrides, in file order; exit 2 naming the file when it cannot be read as either form."""
    path = Path(text_path).expanduser()
    where = f"--engine-arg config_file={text_path}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ProbeError(f"{where}: cannot read it ({err.strerror or err})") from None
    words = _flag_words(text)
    if words and words[0].startswith("--"):
        return flag_entries(words, f"{path}: ")
    return yaml_entries(text, path, where)


# ---- verl's YAML block --------------------------------------------------------------------------------------


def yaml_entries(text: str, path: Path, where: str) -> list[Entry]:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ProbeError(f"{where}: neither Megatron-LM flags nor valid YAML ({_first_line(err)})") from None
    block = _override_block(data)
    if not isinstance(block, dict):
        raise ProbeError(
            f"{where}: expected a YAML mapping of TransformerConfig fields (or override_transformer_config: "
            "under it), or Megatron-LM flags (--moe-router-dtype fp32 ...)"
        )
    return [
        Entry(where=f"{path}: override_transformer_config.", name=str(k), field=str(k), value=v)
        for k, v in block.items()
    ]


def _override_block(data):
    """verl's full path, then a top-level override_transformer_config, then the mapping itself."""
    if isinstance(data, dict) and VERL_PATH[0] in data:
        node = data
        for key in VERL_PATH:
            node = node.get(key) if isinstance(node, dict) else None
        return {} if node is None else node
    if isinstance(data, dict) and "override_transformer_config" in data:
        return data["override_transformer_config"] or {}
    return {} if data is None else data


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0]


# ---- Megatron-LM flags --------------------------------------------------------------------------------------


def _flag_words(text: str) -> list[str]:
    try:
        words = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError:  # unbalanced quotes: not a flags file (YAML may still read it)
        return []
    # A bash array around the flags, as slime's scripts hold them: MODEL_ARGS=( ... ).
    return [w for w in words if w != ")" and not re.fullmatch(r"[A-Za-z_]\w*=\(", w)]


def flag_entries(words: list[str], where: str) -> list[Entry]:
    """`--flag [value ...]` groups as entries; a flag with several values gives a list."""
    hints = config_hints()
    entries: list[Entry] = []
    for flag, values in _groups(words, where):
        for field, bare in _fields(flag, hints, where):
            if values:
                value = values[0] if len(values) == 1 else values
            elif bare is not None:
                value = bare
            else:
                raise ProbeError(f"{where}{flag}: expected a value ({field})")
            entries.append(Entry(where=where, name=flag, field=field, value=value))
    return entries


def _groups(words: list[str], where: str) -> list[tuple[str, list[str]]]:
    groups: list[tuple[str, list[str]]] = []
    for word in words:
        if word.startswith("--"):
            flag, eq, value = word.partition("=")
            groups.append((flag, [value] if eq else []))
        elif groups:
            groups[-1][1].append(word)
        else:
            raise ProbeError(f"{where}'{word}': expected a Megatron-LM flag (--name)")
    return groups


def _fields(flag: str, hints: dict, where: str) -> tuple[tuple[str, object], ...]:
    """(field, value of the bare flag or None) for each field the flag sets."""
    if flag in FLAG_FIELDS:
        return FLAG_FIELDS[flag]
    name = flag[2:].replace("-", "_")
    if name in hints:
        return ((name, True if hints[name] is bool else None),)
    for prefix in NEGATIONS:
        rest = name.removeprefix(prefix)
        if rest != name and hints.get(rest) is bool:
            return ((rest, False),)
    raise unknown_field(Entry(where=where, name=flag, field=name, value=None), hints)
