"""`--engine-arg override_transformer_config.FIELD=VALUE` and `config_file=PATH` for the megatron engine:
typed by the TransformerConfig field, refused with one line (exit 2) before any folder is made, applied to
the built model, and recorded in the score manifest."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines.base import EngineConfig, ScoreOptions
from mismatch_probe.engines.options import build_options
from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.records import ScoreRequest

pytest.importorskip("megatron.core")

from megatron.core.transformer.enums import AttnBackend  # noqa: E402

from mismatch_probe.engines.megatron.training import MegatronOptions, MegatronTrainingEngine  # noqa: E402
from mismatch_probe.model.routing_shape import load_model_info  # noqa: E402

runner = CliRunner()
NO_TE = importlib.util.find_spec("transformer_engine") is None
OVERRIDE = "override_transformer_config."

VERL_YAML = """\
actor_rollout_ref:
  actor:
    megatron:
      override_transformer_config:
        moe_router_dtype: fp32
        moe_token_dispatcher_type: alltoall
        attention_backend: local
        hidden_dropout: 0.1
        init_method_std: 0.05
        masked_softmax_fusion: false
        add_bias_linear: false
        layernorm_epsilon: 1.0e-6
"""
# The same settings as slime passes them: Megatron-LM flags in a bash array, flags renamed and negated.
SLIME_FLAGS = """\
# perf
PERF_ARGS=(
   --moe-router-dtype fp32 --moe-token-dispatcher-type alltoall \\
   --attention-backend local
   --hidden-dropout 0.1 --init-method-std=0.05
   --no-masked-softmax-fusion
   --disable-bias-linear
   --norm-epsilon 1e-6
)
"""
SAME = {
    "moe_router_dtype": "fp32",
    "moe_token_dispatcher_type": "alltoall",
    "attention_backend": AttnBackend.local,
    "hidden_dropout": 0.1,
    "init_method_std": 0.05,
    "masked_softmax_fusion": False,
    "add_bias_linear": False,
    "layernorm_epsilon": 1e-6,
}


def probe(*args) -> object:
    return runner.invoke(app, [str(a) for a in args])


def options(**args) -> MegatronOptions:
    return build_options(MegatronOptions, "megatron", args)


def overrides(**args) -> dict:
    return options(**{OVERRIDE + key: value for key, value in args.items()}).transformer_overrides


# ---- option parsing (no model is built) -----------------------------------------------------------------------


def test_values_convert_by_the_fields_declared_type():
    typed = overrides(
        moe_router_dtype="fp32",  # Optional[Literal['fp32', 'fp64']]
        attention_backend="unfused",  # the AttnBackend enum, by member name
        hidden_dropout="0.25",  # float
        moe_router_topk="2",  # int
        qk_layernorm="yes",  # bool
        moe_router_num_groups="none",  # Optional[int]
        moe_layer_freq="[1, 0, 1]",  # Union[int, List[int]]
        pipeline_dtype="bf16",  # torch.dtype
        window_size="(4, 0)",  # Optional[Tuple[int, int]]
    )
    assert typed == {
        "moe_router_dtype": "fp32",
        "attention_backend": AttnBackend.unfused,
        "hidden_dropout": 0.25,
        "moe_router_topk": 2,
        "qk_layernorm": True,
        "moe_router_num_groups": None,
        "moe_layer_freq": [1, 0, 1],
        "pipeline_dtype": torch.bfloat16,
        "window_size": (4, 0),
    }
    # Typed values (from Python, or a whole mapping) take the same path.
    whole = options(override_transformer_config={"hidden_dropout": 1, "moe_layer_freq": 2}).transformer_overrides
    assert whole == {"hidden_dropout": 1.0, "moe_layer_freq": 2}
    assert options().transformer_overrides == {}


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("moe_router_dtyp", "fp32", "not a TransformerConfig field (closest: moe_router_dtype)"),
        ("hidden_dropout", "abc", "expected float"),
        ("moe_router_dtype", "bf16", "expected one of fp32, fp64 or none"),
        ("attention_backend", "sdpa", "expected one of flash, fused, unfused, local, auto"),
        ("moe_layer_freq", "([0]*1+[1]*2)", "expected int or a list of int"),
        ("activation_func", "gelu", "expected a Python object (not settable from text)"),
        ("bf16", "true", "set by --dtype"),
        ("expert_model_parallel_size", "2", "set by --engine-arg expert_parallel"),
        ("moe_enable_routing_replay", "false", "the engine captures and replays routing through it"),
    ],
)
def test_bad_overrides_are_one_line_naming_the_field(key, value, message):
    with pytest.raises(ProbeError) as err:
        overrides(**{key: value})
    shown = f"={value}" if message.startswith("expected") else ""
    assert str(err.value) == f"--engine-arg {OVERRIDE}{key}{shown}: {message}"


@pytest.mark.skipif(not NO_TE, reason="TransformerEngine is installed here")
@pytest.mark.parametrize(
    "key, value, package, why, fine",
    [
        ("attention_backend", "flash", "transformer_engine", "TE's flash/fused attention", "local"),
        ("transformer_impl", "transformer_engine", "transformer_engine", "the TE layer spec", "local"),
        ("moe_permute_fusion", "true", "transformer_engine", "TE's fused token permutation", "false"),
        ("apply_rope_fusion", "true", "transformer_engine", "TE's fused RoPE", "false"),
        ("moe_grouped_gemm", "true", "grouped_gemm", "GroupedMLP's grouped GEMM", "false"),
        ("moe_token_dispatcher_type", "flex", "deep_ep", "DeepEP", "alltoall"),
    ],
)
def test_a_value_needing_a_missing_package_names_it(key, value, package, why, fine):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(ProbeError) as err:
        overrides(**{key: value})
    assert str(err.value) == f"--engine-arg {OVERRIDE}{key}={value}: needs {package}, which is not installed ({why})"
    assert key in overrides(**{key: fine})  # a value this machine can run is taken


def test_layer_spec_requests_that_conflict_are_refused():
    with pytest.raises(ProbeError) as err:
        overrides(attention_backend="local", transformer_impl="transformer_engine")
    if NO_TE:
        assert "transformer_impl=transformer_engine: needs transformer_engine" in str(err.value)
    with pytest.raises(ProbeError, match="transformer_impl=inference_optimized: probe builds the local or"):
        overrides(transformer_impl="inference_optimized")


def test_both_config_file_forms_give_the_same_overrides(tmp_path):
    yaml_file, flags_file = tmp_path / "verl.yaml", tmp_path / "slime.sh"
    yaml_file.write_text(VERL_YAML)
    flags_file.write_text(SLIME_FLAGS)
    assert options(config_file=str(yaml_file)).transformer_overrides == SAME
    assert options(config_file=str(flags_file)).transformer_overrides == SAME
    # Also the block alone, and the fields with no block around them.
    block = "override_transformer_config:\n" + "\n".join(line[6:] for line in VERL_YAML.splitlines()[4:])
    (tmp_path / "block.yaml").write_text(block)
    (tmp_path / "flat.yaml").write_text("\n".join(line[8:] for line in VERL_YAML.splitlines()[4:]))
    for name in ("block.yaml", "flat.yaml"):
        assert options(config_file=str(tmp_path / name)).transformer_overrides == SAME


def test_explicit_overrides_win_over_the_file(tmp_path):
    (tmp_path / "f.txt").write_text(SLIME_FLAGS)
    typed = options(config_file=str(tmp_path / "f.txt"), **{OVERRIDE + "hidden_dropout": "0.3"}).transformer_overrides
    assert typed == {**SAME, "hidden_dropout": 0.3}


def test_megatron_lm_flags_map_to_their_fields(tmp_path):
    flags = tmp_path / "flags.txt"
    flags.write_text("--swiglu --no-rope-fusion --apply-layernorm-1p --num-experts 8 --qk-layernorm --no-qk-layernorm")
    typed = options(config_file=str(flags)).transformer_overrides
    assert typed == {
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "apply_rope_fusion": False,
        "layernorm_zero_centered_gamma": True,
        "num_moe_experts": 8,
        "qk_layernorm": False,  # the later flag wins, as argparse does
    }


@pytest.mark.parametrize(
    "text, message",
    [
        ("--moe-router-dtyp fp32", "{f}: --moe-router-dtyp: not a TransformerConfig field (closest: moe_router_dtype)"),
        ("--hidden-dropout high", "{f}: --hidden-dropout=high (hidden_dropout): expected float"),
        ("--norm-epsilon", "{f}: --norm-epsilon: expected a value (layernorm_epsilon)"),
        ("--fp16", "{f}: --fp16 (fp16): set by --dtype"),
        ("override_transformer_config:\n  moe_router_dtyp: fp32\n", None),
        ("- a\n- b\n", None),
    ],
)
def test_bad_config_files_name_the_file_and_entry(tmp_path, text, message):
    path = tmp_path / "cfg"
    path.write_text(text)
    with pytest.raises(ProbeError) as err:
        options(config_file=str(path))
    if message is None and text.startswith("override"):
        message = "{f}: override_transformer_config.moe_router_dtyp: not a TransformerConfig field (closest: moe_router_dtype)"
    elif message is None:
        message = (
            "--engine-arg config_file={f}: expected a YAML mapping of TransformerConfig fields (or "
            "override_transformer_config: under it), or Megatron-LM flags (--moe-router-dtype fp32 ...)"
        )
    assert str(err.value) == message.format(f=path)


# ---- the command line: refused before any folder is made ------------------------------------------------------


@pytest.fixture(scope="module")
def run(tiny_moe, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("overrides")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [3 + i, 4, 5, 6 + i]}) + "\n" for i in range(4)))
    made = probe("generate", "--model", tiny_moe, "--prompts", prompts, "--out", root / "run", "--max-new-tokens", 4)
    assert made.exit_code == 0, made.output
    return root / "run"


@pytest.mark.parametrize(
    "arg, message",
    [
        (
            "override_transformer_config.moe_router_dtyp=fp32",
            "--engine-arg override_transformer_config.moe_router_dtyp: not a TransformerConfig field "
            "(closest: moe_router_dtype)",
        ),
        (
            "override_transformer_config.init_method_std=wide",
            "--engine-arg override_transformer_config.init_method_std=wide: expected float",
        ),
        pytest.param(
            "override_transformer_config.moe_permute_fusion=true",
            "--engine-arg override_transformer_config.moe_permute_fusion=true: needs transformer_engine, which is "
            "not installed (TE's fused token permutation)",
            marks=pytest.mark.skipif(not NO_TE, reason="TransformerEngine is installed here"),
        ),
    ],
)
def test_cli_refuses_before_any_score_folder(run, arg, message):
    result = probe("rescore", run, "--engine", "megatron", "--engine-arg", arg)
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {message}"
    assert not (run / "scores").exists()


def test_help_engine_names_the_override_keys():
    lines = probe("rescore", "--engine", "megatron", "--help-engine").output.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[2:] if line.startswith("  ")}
    assert rows["override_transformer_config.FIELD"][1:4] == ["by", "field", "{}"]
    assert rows["config_file"][1:5] == ["str", "or", "none", "None"]
    assert "moe_router_dtype=fp32" in lines[-1] and "transformer_engine" in lines[-1]


# ---- built models (megatron-core end to end) ------------------------------------------------------------------


def _batch(vocab: int, n: int = 16, length: int = 40) -> list[ScoreRequest]:
    rng = np.random.default_rng(0)
    return [ScoreRequest(i, i, rng.integers(2, vocab, size=length).astype(np.int32), 8) for i in range(n)]


def _engine(model: Path, dtype: str, **args) -> MegatronTrainingEngine:
    engine_args = {OVERRIDE + key: value for key, value in args.items() if key != "config_file"}
    if "config_file" in args:
        engine_args["config_file"] = args["config_file"]
    return MegatronTrainingEngine(load_model_info(model), EngineConfig(dtype=dtype, engine_args=engine_args))


def _score(engine: MegatronTrainingEngine, batch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    records = engine.score(batch, ScoreOptions(1.0))
    return tuple(
        np.concatenate([getattr(r, name) for r in records]) for name in ("logprob", "experts", "router_margin")
    )


@pytest.mark.slow
def test_overrides_reach_the_built_model(tiny_moe):
    engine = _engine(tiny_moe, "fp32", moe_router_dtype="fp32", hidden_dropout="0.25", init_method_std="0.05")
    config = engine.module.config
    assert (config.moe_router_dtype, config.hidden_dropout, config.init_method_std) == ("fp32", 0.25, 0.05)
    router = engine.module.decoder.layers[0].mlp.router
    assert router.config.moe_router_dtype == "fp32"
    assert engine.layer_spec == "local" and config.transformer_impl == "local"


@pytest.mark.slow
def test_fp32_router_is_bitwise_at_fp32_and_moves_bf16_only_near_ties(tiny_moe):
    batch = _batch(load_model_info(tiny_moe).vocab_size)
    plain, fp32_router = (
        _score(_engine(tiny_moe, "fp32"), batch),
        _score(_engine(tiny_moe, "fp32", moe_router_dtype="fp32"), batch),
    )
    for a, b in zip(plain, fp32_router):
        np.testing.assert_array_equal(a, b)  # the router already runs in float32
    bf16, bf16_fp32_router = (
        _score(_engine(tiny_moe, "bf16"), batch),
        _score(_engine(tiny_moe, "bf16", moe_router_dtype="fp32"), batch),
    )
    # Measured on this model: log-probs move by up to 0.51 (mean 0.012) over 640 scored tokens; 3 of 1280
    # (token, MoE layer) selections change, each where the bf16 router's margin was 0 or 0.0018 (median 0.069).
    assert np.nanmax(np.abs(bf16[0] - bf16_fp32_router[0])) > 1e-3
    valid = (bf16[1] >= 0).all(-1)
    changed = (np.sort(bf16[1], -1) != np.sort(bf16_fp32_router[1], -1)).any(-1) & valid
    assert 0 < changed.sum() < 0.01 * valid.sum()
    assert (bf16[2][changed] < 0.1 * np.nanmedian(bf16[2][valid])).all()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_alltoall_dispatcher_and_local_attention_run_here_and_change_nothing(tiny_moe, dtype):
    batch = _batch(load_model_info(tiny_moe).vocab_size, n=4)
    plain = _score(_engine(tiny_moe, dtype), batch)
    for args in (
        {"moe_token_dispatcher_type": "alltoall"},
        {"attention_backend": "unfused"},
        {"attention_backend": "local"},
    ):
        engine = _engine(tiny_moe, dtype, **args)
        name, value = next(iter(args.items()))
        assert getattr(getattr(engine.module.config, name), "name", getattr(engine.module.config, name)) == value
        for a, b in zip(plain, _score(engine, batch)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_both_config_file_forms_build_the_same_config(tiny_moe, tmp_path):
    (tmp_path / "verl.yaml").write_text(VERL_YAML)
    (tmp_path / "slime.sh").write_text(SLIME_FLAGS)
    records = [_engine(tiny_moe, "fp32", config_file=str(tmp_path / f)).describe() for f in ("verl.yaml", "slime.sh")]
    assert records[0]["transformer_config"] == records[1]["transformer_config"]
    assert records[0]["transformer_config"]["init_method_std"] == 0.05
    assert records[0]["transformer_config"]["add_bias_linear"] is False


@pytest.mark.slow
def test_manifest_records_the_effective_config_and_layer_spec(run):
    result = probe(
        "rescore", run, "--engine", "megatron", "--dtype", "bf16", "--name", "mg",
        "--engine-arg", "override_transformer_config.moe_router_dtype=fp32",
        "--engine-arg", "override_transformer_config.attention_backend=local",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    engine = json.loads((run / "scores" / "mg" / "manifest.json").read_text())["engine"]
    assert engine["layer_spec"] == "local"
    assert engine["override_transformer_config"] == {"moe_router_dtype": "fp32", "attention_backend": "local"}
    config = engine["transformer_config"]
    assert (config["moe_router_dtype"], config["attention_backend"], config["params_dtype"]) == (
        "fp32",
        "local",
        "bfloat16",
    )
    assert (config["bf16"], config["transformer_impl"]) == (True, "local")
    assert config["activation_func"] == "torch.nn.functional.silu"  # a callable, by name
    assert config["num_moe_experts"] == 8 and config["moe_layer_freq"] == [1, 0, 1]
