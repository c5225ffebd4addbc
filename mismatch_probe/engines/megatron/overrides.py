"""`--engine-arg override_transformer_config.FIELD=VALUE`: any megatron-core TransformerConfig field, as verl
names the block (actor_rollout_ref.actor.megatron.override_transformer_config), checked before anything runs.

Each value is converted by the field's declared type in megatron-core 0.16.1 (bool, int, float, str, a
Literal's choices, an enum's member names, torch.dtype, lists, optionals and unions of those). Refused, with
exit 2 and one line: a name that is no field (naming the closest), a value of the wrong type, and a field
probe sets itself (`OWNED`); needs.py refuses a value that needs a package this machine lacks.
`config_file.py` reads the same overrides from a verl YAML block or a file of Megatron-LM flags; explicit
engine args win.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mismatch_probe.engines.options import NONE, as_type
from mismatch_probe.errors import ProbeError

EXPLICIT = "--engine-arg override_transformer_config."

# Fields the engine sets from its own options: an override would contradict them (or break the build).
OWNED = {
    "params_dtype": "set by --dtype",
    "bf16": "set by --dtype",
    "fp16": "set by --dtype",
    "tensor_model_parallel_size": "set by --engine-arg tensor_parallel",
    "expert_model_parallel_size": "set by --engine-arg expert_parallel",
    "pipeline_model_parallel_size": "the megatron engine builds one pipeline stage",
    "virtual_pipeline_model_parallel_size": "the megatron engine builds one pipeline stage",
    "context_parallel_size": "the megatron engine initialises no context-parallel group",
    "moe_enable_routing_replay": "the engine captures and replays routing through it",
    "perform_initialization": "every weight is loaded from the checkpoint",
    "use_cpu_initialization": "set by the device the engine builds on",
}

# Fields whose value fixes a weight's shape or the routing record's width: an override must equal what the
# checkpoint's config.json implies (checked at build time, where config.json is read).
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_layer_freq",
    "moe_shared_expert_intermediate_size",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
)


class _Invalid(Exception):
    """The value does not convert to the hint."""


@dataclass(frozen=True)
class Entry:
    """One override as given: `where` + `name` is how the user wrote it (an engine arg, a YAML key, a flag)."""

    where: str
    name: str
    field: str
    value: object

    def label(self, with_value: bool = False) -> str:
        text = f"{self.where}{self.name}" + (f"={_shown(self.value)}" if with_value else "")
        return text if self.name == self.field else f"{text} ({self.field})"


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def config_hints() -> dict[str, object]:
    """Every init field of TransformerConfig and MLATransformerConfig (a subclass) with its declared type."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return {f.name: f.type for f in dataclasses.fields(MLATransformerConfig) if f.init}


def mla_only_fields() -> set[str]:
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return {f.name for f in dataclasses.fields(MLATransformerConfig)} - {
        f.name for f in dataclasses.fields(TransformerConfig)
    }


def unknown_field(entry: Entry, hints: Mapping[str, object]) -> ProbeError:
    close = difflib.get_close_matches(entry.field, list(hints), n=1)
    hint = f" (closest: {close[0]})" if close else ""
    return ProbeError(f"{entry.where}{entry.name}: not a TransformerConfig field{hint}")


def convert_entries(entries: list[Entry]) -> tuple[dict[str, object], dict[str, Entry]]:
    """Entries in order (a later one wins) as {field: typed value} and {field: the entry that set it};
    ProbeError on the first bad one."""
    hints = config_hints()
    typed: dict[str, object] = {}
    sources: dict[str, Entry] = {}
    for entry in entries:
        if entry.field not in hints:
            raise unknown_field(entry, hints)
        if entry.field in OWNED:
            raise ProbeError(f"{entry.label()}: {OWNED[entry.field]}")
        try:
            typed[entry.field] = _to(entry.value, hints[entry.field])
        except _Invalid:
            raise ProbeError(f"{entry.label(with_value=True)}: expected {type_label(hints[entry.field])}") from None
        sources[entry.field] = entry
    return typed, sources


# ---- conversion by declared type ----------------------------------------------------------------------------

DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def _is_none(value) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in NONE)


def _to(value, hint):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and _is_none(value):
            return None
        for arm in (a for a in args if a is not type(None)):
            try:
                return _to(value, arm)
            except _Invalid:
                continue
        raise _Invalid
    if origin is typing.Literal:
        for choice in args:
            if value == choice or (isinstance(value, str) and value.strip() == str(choice)):
                return choice
        raise _Invalid
    if origin in (list, tuple):
        return _sequence(value, origin, args)
    if hint is torch.dtype:
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and value.strip().lower().removeprefix("torch.") in DTYPE_NAMES:
            return DTYPE_NAMES[value.strip().lower().removeprefix("torch.")]
        raise _Invalid
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        if isinstance(value, hint):
            return value
        if isinstance(value, str) and value.strip() in hint.__members__:
            return hint[value.strip()]
        raise _Invalid
    if hint in (bool, int, float, str):
        converted = as_type(value, hint)
        if converted is None:
            raise _Invalid
        return converted
    # A Python object (callable, context manager, recipe): settable from Python, never from text.
    if isinstance(value, str) or not (callable(value) or (isinstance(hint, type) and isinstance(value, hint))):
        raise _Invalid
    return value


def _sequence(value, origin, args):
    if isinstance(value, str):
        text = value.strip()
        try:
            items = ast.literal_eval(text) if text[:1] in "[(" else [p.strip() for p in text.split(",") if p.strip()]
        except (ValueError, SyntaxError):
            raise _Invalid from None
    else:
        items = value
    if not isinstance(items, list | tuple):
        raise _Invalid
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(items) != len(args):
            raise _Invalid
        return tuple(_to(item, arm) for item, arm in zip(items, args))
    arm = args[0] if args else str
    converted = [_to(item, arm) for item in items]
    return tuple(converted) if origin is tuple else converted


def type_label(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        arms = [type_label(a) for a in args if a is not type(None)]
        return " or ".join(arms + (["none"] if type(None) in args else []))
    if origin is typing.Literal:
        return "one of " + ", ".join(str(c) for c in args)
    if origin in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a tuple of {len(args)} ({', '.join(type_label(a) for a in args)})"
        return f"a list of {type_label(args[0]) if args else 'str'}"
    if hint is torch.dtype:
        return "a dtype (fp32, bf16, fp16)"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(hint.__members__)
    if hint in (bool, int, float, str):
        return hint.__name__
    return "a Python object (not settable from text)"
