"""Tiny checkpoints that ship their own modeling code, as remote-code checkpoints on the hub do: config.json's
`auto_map` names a configuration and a modeling file in the folder, loaded only with --trust-remote-code.

Remote code either copies a transformers family's modeling file under its own model_type (Kimi-K2 copies
DeepSeek-V3's classes, names and all) or subclasses the family's classes. The copies are made here at test
time from the installed transformers, with its package-relative imports made absolute, as such files do."""

from __future__ import annotations

import json
import re
import shutil
from importlib.util import find_spec
from pathlib import Path

import torch
from conftest import DEMO_MOE
from moe_families import FAMILIES

TRANSFORMERS = Path(find_spec("transformers").origin).parent
VOCAB = 512  # the demo tokenizer's


def _absolute_imports(source: str, family_dir: str, config_module: str) -> str:
    source = re.sub(
        r"^from \.\.\.(\w[\w.]*)? import",
        lambda m: f"from transformers{'.' + m[1] if m[1] else ''} import",
        source,
        flags=re.M,
    )
    return re.sub(rf"^from \.configuration_{family_dir} import", f"from .{config_module} import", source, flags=re.M)


def copied_family_files(folder: Path, family_dir: str, model_type: str, rename: tuple[str, str] | None = None) -> dict:
    """configuration_FAMILY.py and modeling_FAMILY.py of transformers, copied into `folder` with `model_type`
    (and every class name prefix `rename[0]` replaced by `rename[1]`); returns the classes for `auto_map`."""
    files = {}
    for kind in ("configuration", "modeling"):
        source = (TRANSFORMERS / "models" / family_dir / f"{kind}_{family_dir}.py").read_text()
        source = _absolute_imports(source, family_dir, f"configuration_{family_dir}")
        if kind == "configuration":
            source = re.sub(r'^(\s+model_type = )"\w+"', rf'\1"{model_type}"', source, count=1, flags=re.M)
        if rename:
            source = source.replace(rename[0], rename[1])
        (folder / f"{kind}_{family_dir}.py").write_text(source)
        files[kind] = source
    config_class = re.search(r"^class (\w+)\(PreTrainedConfig\)", files["configuration"], re.M)[1]
    model_class = re.search(r"^class (\w+ForCausalLM)\(", files["modeling"], re.M)[1]
    return {
        "AutoConfig": f"configuration_{family_dir}.{config_class}",
        "AutoModelForCausalLM": f"modeling_{family_dir}.{model_class}",
    }


def family_config(name: str, **changes):
    config = next(f for f in FAMILIES if f.name == name).config()
    for key, value in {"vocab_size": VOCAB, **changes}.items():
        setattr(config, key, value)
    return config


def save_remote_checkpoint(folder: Path, model: torch.nn.Module, model_type: str, auto_map: dict) -> Path:
    """Weights of `model` (built from transformers' own classes, whose parameter names the remote code shares),
    config.json rewritten to the remote model_type and `auto_map`, and the demo tokenizer. The weights keep the
    module's own names (fused experts): transformers converts names only for the model types it registers."""
    model.save_pretrained(folder, save_original_format=False)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type=model_type, auto_map=auto_map, architectures=[auto_map["AutoModelForCausalLM"].split(".")[-1]]
    )
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEMO_MOE / name, folder / name)
    return folder


def random_model(config, seed: int = 0) -> torch.nn.Module:
    """transformers' own class for `config`, random init with a fixed seed; selection biases set non-zero (they
    start at zero) so that they change choices, as trained ones do."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            with torch.no_grad():
                bias.copy_(torch.linspace(-0.2, 0.2, bias.numel())[torch.randperm(bias.numel())])
    return model


def copied_kimi_k2(folder: Path) -> Path:
    """model_type `kimi_k2` whose modeling file is a copy of DeepSeek-V3's: same class names, other classes."""
    folder.mkdir(parents=True)
    auto_map = copied_family_files(folder, "deepseek_v3", "kimi_k2")
    return save_remote_checkpoint(folder, random_model(family_config("kimi_k2")), "kimi_k2", auto_map)


def renamed_mixtral(folder: Path, model_type: str = "tiny_moe") -> Path:
    """A Mixtral copy with every class renamed (`TinyTopKRouter`, `TinySparseMoeBlock`...) under its own
    model_type: nothing names the family, only `--moe-family` can."""
    folder.mkdir(parents=True)
    auto_map = copied_family_files(folder, "mixtral", model_type, rename=("Mixtral", "Tiny"))
    return save_remote_checkpoint(folder, random_model(family_config("mixtral")), model_type, auto_map)


def copied_phimoe(folder: Path, model_type: str = "mystery_moe") -> Path:
    """An MoE no adapter knows (PhiMoE's copy under a model_type of its own)."""
    from transformers import PhimoeConfig

    folder.mkdir(parents=True)
    auto_map = copied_family_files(folder, "phimoe", model_type)
    config = PhimoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    return save_remote_checkpoint(folder, random_model(config), model_type, auto_map)


TUNED_QWEN3_MOE = '''
"""A fine-tune's own classes: Qwen3-MoE's, subclassed under new names and a model_type of its own."""
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter


class TunedConfig(Qwen3MoeConfig):
    model_type = "tuned_qwen3_moe"


class TunedRouter(Qwen3MoeTopKRouter):
    pass


class TunedSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    def __init__(self, config):
        super().__init__(config)
        self.gate = TunedRouter(config)


class TunedForCausalLM(Qwen3MoeForCausalLM):
    config_class = TunedConfig

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock):
                layer.mlp = TunedSparseMoeBlock(config)
        self.post_init()
'''


def tuned_qwen3_moe(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "modeling_tuned.py").write_text(TUNED_QWEN3_MOE)
    auto_map = {"AutoConfig": "modeling_tuned.TunedConfig", "AutoModelForCausalLM": "modeling_tuned.TunedForCausalLM"}
    return save_remote_checkpoint(folder, random_model(family_config("qwen3_moe")), "tuned_qwen3_moe", auto_map)


DEEPSEEK_OWN_GATE = '''
"""DeepSeek-V3's block under its transformers name, with the router of DeepSeek's own modeling code: it
returns (expert ids, weights), not the (logits, weights, expert ids) the transformers router returns."""
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter


class OwnConfig(DeepseekV3Config):
    model_type = "kimi_k2"


class MoEGate(DeepseekV3TopkRouter):
    def forward(self, hidden_states):
        _, weights, ids = super().forward(hidden_states)
        return ids, weights


class OwnMoE(DeepseekV3MoE):
    def __init__(self, config):
        super().__init__(config)
        self.gate = MoEGate(config)

    def forward(self, hidden_states):
        ids, weights = self.gate(hidden_states)
        flat = hidden_states.view(-1, hidden_states.shape[-1])
        return self.experts(flat, ids, weights).view(hidden_states.shape) + self.shared_experts(hidden_states)


class OwnForCausalLM(DeepseekV3ForCausalLM):
    config_class = OwnConfig

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            if isinstance(layer.mlp, DeepseekV3MoE):
                layer.mlp = OwnMoE(config)
        self.post_init()
'''


def deepseek_own_gate(folder: Path, model_type: str = "kimi_k2") -> Path:
    folder.mkdir(parents=True)
    (folder / "modeling_own.py").write_text(DEEPSEEK_OWN_GATE.replace('"kimi_k2"', f'"{model_type}"'))
    auto_map = {"AutoConfig": "modeling_own.OwnConfig", "AutoModelForCausalLM": "modeling_own.OwnForCausalLM"}
    return save_remote_checkpoint(folder, random_model(family_config("kimi_k2")), model_type, auto_map)


def copied_dense(folder: Path, model_type: str = "own_dense") -> Path:
    """A dense model (Qwen3's copy) under a model_type of its own."""
    from transformers import Qwen3Config

    folder.mkdir(parents=True)
    auto_map = copied_family_files(folder, "qwen3", model_type)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=48,
        bos_token_id=0,
        eos_token_id=1,
    )
    return save_remote_checkpoint(folder, random_model(config), model_type, auto_map)
