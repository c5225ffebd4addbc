"""`--engine-arg device=auto|cpu|cuda|cuda:N` and `device_map=...` of the `hf` engines: parsing, refusal
of CUDA where torch sees none (a real check, no GPU here), the resolved device in both manifests, and
the one-copy transfer of a step's results from the device."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines import inference_engine, training_engine
from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.engines.forward.host_copy import pack, to_host, unpack
from mismatch_probe.engines.hf.device import DeviceOptions
from mismatch_probe.engines.options import build_options
from mismatch_probe.errors import ProbeError
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import PromptRequest

runner = CliRunner()
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no GPU")
NO_CUDA = f"CUDA is not available (torch {torch.__version__} sees no GPU); use device=cpu or device=auto"


def probe(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [5 + i, 6, 7, 8][: 2 + i]}) + "\n" for i in range(3)))
    return path


def test_device_values_parse_and_auto_resolves_where_torch_says():
    assert build_options(DeviceOptions, "hf", {}) == DeviceOptions(device="auto", device_map=None)
    assert build_options(DeviceOptions, "hf", {"device": "cpu", "device_map": "none"}).torch_device() == torch.device(
        "cpu"
    )
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert DeviceOptions().torch_device() == expected


@pytest.mark.parametrize(
    "args, message",
    [
        ({"device": "gpu"}, "--engine-arg device=gpu: expected auto, cpu, cuda or cuda:N"),
        ({"device": "cuda:x"}, "--engine-arg device=cuda:x: expected auto, cpu, cuda or cuda:N"),
        (
            {"device_map": "everywhere"},
            "--engine-arg device_map=everywhere: expected one of auto, balanced, balanced_low_0, sequential",
        ),
        (
            {"device_map": "auto", "device": "cpu"},
            "--engine-arg device_map=auto places the model itself; give device=cpu or device_map, not both",
        ),
    ],
)
def test_bad_device_values_are_refused(args, message):
    with pytest.raises(ProbeError) as info:
        build_options(DeviceOptions, "hf", args)
    assert str(info.value) == message and info.value.exit_code == 2


@no_cuda
@pytest.mark.parametrize(
    "args, what",
    [
        ({"device": "cuda"}, "device=cuda"),
        ({"device": "cuda:1"}, "device=cuda:1"),
        ({"device_map": "auto"}, "device_map=auto"),
    ],
)
def test_cuda_where_torch_sees_none_is_refused(args, what):
    with pytest.raises(ProbeError) as info:
        build_options(DeviceOptions, "hf", args)
    assert str(info.value) == f"--engine-arg {what}: {NO_CUDA}"


@no_cuda
def test_cli_device_cuda_without_cuda_exits_2_before_anything(tmp_path, tiny_moe, prompts):
    run = tmp_path / "run"
    result = probe("generate", "--model", tiny_moe, "--prompts", prompts, "--out", run, "--engine-arg", "device=cuda")
    assert result.exit_code == 2
    assert result.output.strip() == f"error: --engine-arg device=cuda: {NO_CUDA}"
    assert not run.exists()
    result = probe("rescore", tmp_path, "--engine", "hf", "--engine-arg", "device=cuda:0")
    assert result.exit_code == 2
    assert result.output.strip() == f"error: --engine-arg device=cuda:0: {NO_CUDA}"


def test_manifests_record_the_resolved_device(tmp_path, tiny_moe, prompts):
    resolved = str(DeviceOptions().torch_device())  # "cpu" here
    for device in ("cpu", "auto"):
        run = tmp_path / device
        for args in (
            [
                "generate",
                "--model",
                tiny_moe,
                "--prompts",
                prompts,
                "--out",
                run,
                "--max-new-tokens",
                3,
                "--engine-arg",
                f"device={device}",
            ],
            ["rescore", run, "--engine-arg", f"device={device}", "--replay", "r3"],
        ):
            result = probe(*args)
            assert result.exit_code == 0, result.output
        rollout = json.loads((run / "manifest.json").read_text())["engine"]
        scores = json.loads((run / "scores" / "hf-fp32-r3" / "manifest.json").read_text())["engine"]
        expected = "cpu" if device == "cpu" else resolved
        fingerprints = [side.pop("weights_fingerprint") for side in (rollout, scores)]
        assert fingerprints[0] == fingerprints[1] is not None  # the same weights, held in bf16 and fp32
        knobs = {"attn_implementation": "sdpa", "router_dtype": "fp32", "lm_head_dtype": "fp32"}  # effective values
        assert rollout == {"engine": "hf", "dtype": "bf16", "device": expected} | knobs | {
            "router_dtype": "bf16",
            "lm_head_dtype": "bf16",
        }
        assert scores == {"engine": "hf", "dtype": "fp32", "device": expected} | knobs


def test_engines_place_model_and_inputs_on_the_device(tiny_moe):
    info = load_model_info(tiny_moe)
    gen = inference_engine("hf", info, EngineConfig(dtype="fp32", engine_args={"device": "cpu"}))
    train = training_engine("hf", info, EngineConfig(dtype="fp32", engine_args={"device": "auto"}))
    assert gen.device == torch.device("cpu") and {p.device for p in gen.hf.parameters()} == {torch.device("cpu")}
    assert train.device == DeviceOptions().torch_device()
    records = gen.generate(
        [PromptRequest(0, 0, [5, 6, 7]), PromptRequest(1, 1, [9])],
        SamplingParams(temperature=1.0, max_new_tokens=4, seed=2),
    )
    # Routing comes back to the host step by step: no router call is left on the device.
    assert all(c.device.type == "cpu" for calls in gen.tap.layer_calls() + gen.tap.layer_margins() for c in calls)
    assert all(r.experts_valid.sum() == len(r) - 1 for r in records)


def test_one_copy_packing_gives_every_tensor_back_unchanged():
    tensors = [
        torch.tensor([-0.1234567, float("nan"), float("-inf"), 3e38], dtype=torch.float32),
        torch.tensor([[151_935, 0], [7, 2**40]], dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.tensor([1.5, -2.0e-3], dtype=torch.bfloat16),
        torch.tensor([[0.1], [65504.0]], dtype=torch.float16),
        torch.zeros((2, 0), dtype=torch.int64),
    ]
    flat = pack(tensors, torch.device("cpu"))
    assert flat.dtype == torch.float64 and flat.shape == (4 + 4 + 3 + 2 + 2,)
    for got, want in zip(unpack(flat, tensors), tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(
            got.float().numpy() if got.dtype == torch.bfloat16 else got.numpy(),
            want.float().numpy() if want.dtype == torch.bfloat16 else want.numpy(),
        )
    assert all(got is want for got, want in zip(to_host(tensors), tensors))  # on the CPU already: no copy at all
