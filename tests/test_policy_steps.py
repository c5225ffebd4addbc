"""Policy-step checkpoints (issue 33): the demo rewards, group-mean advantages, and checkpoints made from
a small rollout of the demo MoE model that load, move further with each step, and repeat bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from mismatch_probe.engines import training_engine
from mismatch_probe.engines.base import EngineConfig, ScoreOptions
from mismatch_probe.engines.hf.model import load_hf_model
from mismatch_probe.errors import ProbeError
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.pipeline.demo.policy_batch import group_advantages
from mismatch_probe.pipeline.demo.policy_loss import tis_loss, token_logprobs
from mismatch_probe.pipeline.demo.policy_steps import POLICY_STEP_FILE, make_policy_checkpoints
from mismatch_probe.pipeline.demo.rewards import reward
from mismatch_probe.rundir.layout import MANIFEST
from mismatch_probe.rundir.manifests import COMPLETE, RolloutManifest
from mismatch_probe.rundir.parts import iter_score_requests, write_part
from mismatch_probe.rundir.records import ScoreRequest, SequenceRecord
from mismatch_probe.schema import token_schema
from mismatch_probe.vocab import FP32
from tests.conftest import DEMO_MOE

EOS = "<|endoftext|>"
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "prompt, response, expected",
    [
        ("2+44=", " 46" + EOS, 1.0),
        ("2+44=", " 45" + EOS, 0.0),
        ("2+44=", " 046", 0.0),
        ("14*6=", "84<|im_end|>", 1.0),
        ("14*6=", "85<|im_end|>", 0.0),
        ("count from 71 to 81:", " 71 72 73 74 75 76 77 78 79 80 81" + EOS, 1.0),
        ("count from 71 to 81:", " 71 72 73 74 75 76 77 78 79 80" + EOS, 0.0),
        ("reverse: wall white star cat ->", " cat star white wall" + EOS, 1.0),
        ("reverse: wall white star cat ->", " wall white star cat" + EOS, 0.0),
        ("sort 1 4 7 5 4:", " 1 4 4 5 7" + EOS, 1.0),
        ("sort 1 4 7 5 4:", " 1 4 5 7" + EOS, 0.0),
        ("say tree 4 times:", " tree tree tree tree" + EOS, 1.0),
        ("say tree 4 times:", " tree tree tree" + EOS, 0.0),
        ("walk from 66:", " 66 65 66 67 68 69 68 67 66 65" + EOS, 1.0),  # 10 numbers
        ("walk from 66:", " 66 65 66 67 68 69 68 67 66" + EOS, 0.0),  # 9 numbers
        ("walk from 66:", " 66 65 66 67 68 70 68 67 66 65" + EOS, 0.0),  # a step of 2
        ("walk from 66:", " 67 66 67 68 69 70 69 68 67 66" + EOS, 0.0),  # starts elsewhere
        ("walk from 5:", " " + " ".join(str(5 + i % 2) for i in range(16)) + EOS, 1.0),
        ("walk from 5:", " " + " ".join(str(5 + i % 2) for i in range(17)) + EOS, 0.0),
        ("pick 8 of red box barn:", " red red box barn box red barn barn" + EOS, 1.0),
        ("pick 8 of red box barn:", " red red box barn box red barn" + EOS, 0.0),  # 7 words
        ("pick 8 of red box barn:", " red red box barn box red barn sky" + EOS, 0.0),  # sky is not named
        ("the young cow", " slept under the tree." + EOS, 0.0),  # free text: no signal
        ("story of the brown fish:", " the brown fish swam under the box. the end." + EOS, 0.0),
        ("hello", " 46" + EOS, 0.0),  # no demo task
        (CHAT.format("2+44="), "46<|im_end|>" + EOS, 1.0),  # chat template: no leading space
        (CHAT.format("2+44="), "46<|im_end|>47", 1.0),  # the answer ends at its first end marker
        ("2+44=", " 46 46" + EOS, 0.0),
    ],
)
def test_reward_known_answers(prompt, response, expected):
    assert reward(prompt, response) == expected


def test_group_advantages_subtract_the_mean_of_each_prompts_samples():
    requests = [
        ScoreRequest(sample_id=i, prompt_id=p, token_ids=np.zeros(2), prompt_len=1)
        for i, p in enumerate([7, 7, 3, 7, 3, 7])
    ]
    rewards = np.array([1.0, 0.0, 1.0, 0.0, 0.5, 1.0])  # means: 0.5 for prompt 7, 0.75 for 3
    np.testing.assert_array_equal(group_advantages(requests, rewards), [0.5, -0.5, 0.25, -0.5, -0.25, 0.5])


def test_tis_loss_known_answer():
    """w = min(exp(l - mu), cap) held constant; a token without mu is left out; the mean is over the whole batch."""
    logprob = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    mu, advantage = np.array([-1.0, -2.5, np.nan]), np.array([1.0, -1.0, 2.0])
    loss = tis_loss(logprob, mu, advantage, tis_cap=1.5, loss_tokens=4)  # weights 1 and min(e^0.5, 1.5) = 1.5
    assert loss.item() == pytest.approx(-(1 * 1 * -1.0 + 1.5 * -1 * -2.0) / 4)
    loss.backward()
    np.testing.assert_allclose(logprob.grad.numpy(), [-1 / 4, 1.5 / 4, 0.0])


# (prompt, responses): each prompt's group holds right and wrong answers, except the free-text one.
SAMPLES = (
    ("2+44=", (" 46", " 45", " 46", " 44")),
    (
        "walk from 66:",
        (" 66 65 66 67 68 69 68 67 66 65", " 66 67 68 69 70 71 72 73 74", " 66 65 64 63 62 61 60 59 58 57"),
    ),
    ("pick 8 of red box barn:", (" red red box barn box red barn barn", " red box sky")),
    ("the young cow", (" slept under the tree.", " ran on the road.")),
)
STEPS = (1, 2, 4)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory) -> Path:
    """A rollout of the demo MoE model in the project's schema; μ is its own fp32 log-prob, so the IS weights are 1."""
    run = tmp_path_factory.mktemp("policy-run")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MOE)
    info = load_model_info(DEMO_MOE)
    requests = []
    for prompt_id, (prompt, responses) in enumerate(SAMPLES):
        head = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for response in responses:
            tail = tokenizer(response + EOS, add_special_tokens=False)["input_ids"]
            ids = np.array(head + tail, dtype=np.int64)
            requests.append(
                ScoreRequest(sample_id=len(requests), prompt_id=prompt_id, token_ids=ids, prompt_len=len(head))
            )
    with torch.no_grad():
        logprob = token_logprobs(load_hf_model(info, FP32), requests, 2.0, 0).numpy()
    records, offset = [], 0
    for r in requests:
        valid = np.arange(len(r)) >= r.prompt_len
        mu = np.zeros(len(r), dtype=np.float32)
        mu[valid] = logprob[offset : offset + valid.sum()]
        offset += valid.sum()
        records.append(
            SequenceRecord(
                sample_id=r.sample_id,
                prompt_id=r.prompt_id,
                token_ids=r.token_ids,
                prompt_len=r.prompt_len,
                logprob=mu,
                logprob_valid=valid,
            )
        )
    write_part(run / "rollout", records, token_schema(info.routing), info.routing)
    RolloutManifest.started(**info.manifest_fields(), scoring_temperature=2.0).save(run / MANIFEST)
    manifest = RolloutManifest.load(run / MANIFEST)
    manifest.status = COMPLETE
    manifest.save(run / MANIFEST)
    return run


@pytest.fixture(scope="module")
def checkpoints(rollout, tmp_path_factory) -> dict[int, Path]:
    return make_policy_checkpoints(rollout, DEMO_MOE, tmp_path_factory.mktemp("steps") / "new", steps=STEPS)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def _stored_logprobs(model: Path, rollout_run: Path) -> np.ndarray:
    requests = [
        r
        for _, chunk in iter_score_requests(rollout_run / "rollout", load_model_info(model).routing, False)
        for r in chunk
    ]
    with torch.no_grad():
        return token_logprobs(load_hf_model(load_model_info(model), FP32), requests, 2.0, 0).numpy()


def test_logprobs_match_the_hf_engines_scores(rollout):
    """The right-padded training forward scores the stored tokens as `probe rescore --engine hf` does."""
    info = load_model_info(DEMO_MOE)
    requests = [r for _, chunk in iter_score_requests(rollout / "rollout", info.routing, False) for r in chunk]
    engine = training_engine("hf", info, EngineConfig(dtype=FP32, batch_size=len(requests)))
    records = engine.score(requests, ScoreOptions(temperature=2.0))
    expected = np.concatenate([rec.logprob[rec.logprob_valid] for rec in records])
    np.testing.assert_allclose(_stored_logprobs(DEMO_MOE, rollout), expected, atol=2e-5)


def test_checkpoints_load_and_move_further_with_each_step(checkpoints, rollout):
    assert sorted(checkpoints) == list(STEPS)
    source = _weights(DEMO_MOE)
    before = _stored_logprobs(DEMO_MOE, rollout)
    weight_moves, logprob_moves = [], []
    for step, path in sorted(checkpoints.items()):
        assert path.name == f"step-{step}"
        model = AutoModelForCausalLM.from_pretrained(path)  # a loadable transformers checkpoint on its own
        assert model.dtype == torch.float32
        assert AutoTokenizer.from_pretrained(path).chat_template
        facts = json.loads((path / POLICY_STEP_FILE).read_text())
        assert facts["step"] == step and facts["lr"] == 1e-4 and facts["tis_cap"] == 5.0
        assert facts["source_model"] == str(DEMO_MOE.resolve())
        assert facts["mean_reward"] == pytest.approx(5 / 11)
        assert facts["samples_with_signal"] == 9  # the free-text prompt's two samples carry no advantage
        weights = _weights(path)
        weight_moves.append(max(float((weights[k] - v).abs().max()) for k, v in source.items()))
        logprob_moves.append(float(np.abs(_stored_logprobs(path, rollout) - before).mean()))
    assert 0 < weight_moves[0] < weight_moves[1] < weight_moves[2]
    assert 0 < logprob_moves[0] < logprob_moves[1] < logprob_moves[2]


def test_rewarded_answers_become_more_likely(checkpoints, rollout):
    """The right answer to 2+44= (sample 0) gains log-prob; the wrong 45 (sample 1) loses it."""
    before, after = _stored_logprobs(DEMO_MOE, rollout), _stored_logprobs(checkpoints[4], rollout)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MOE)
    first = len(tokenizer(" 46" + EOS, add_special_tokens=False)["input_ids"])
    second = len(tokenizer(" 45" + EOS, add_special_tokens=False)["input_ids"])
    assert after[:first].sum() > before[:first].sum()
    assert after[first : first + second].sum() < before[first : first + second].sum()


def test_zero_learning_rate_and_no_steps_change_nothing(rollout, tmp_path):
    saved = make_policy_checkpoints(rollout, DEMO_MOE, tmp_path / "lr0", steps=(1,), lr=0.0)
    source = _weights(DEMO_MOE)
    assert all(torch.equal(_weights(saved[1])[k], v) for k, v in source.items())
    assert make_policy_checkpoints(rollout, DEMO_MOE, tmp_path / "none", steps=()) == {}
    assert not any((tmp_path / "none").glob("step-*"))


def test_same_seed_gives_bitwise_same_weights(rollout, checkpoints, tmp_path):
    again = make_policy_checkpoints(rollout, DEMO_MOE, tmp_path / "again", steps=(2,), seed=0)
    first, second = _weights(checkpoints[2]), _weights(again[2])
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_rerun_replaces_its_own_checkpoints_but_not_a_users_folder(rollout, tmp_path):
    out = tmp_path / "new"
    make_policy_checkpoints(rollout, DEMO_MOE, out, steps=(1,))
    make_policy_checkpoints(rollout, DEMO_MOE, out, steps=(1,))  # its own: replaced
    (out / "step-1" / "notes.txt").write_text("mine")
    with pytest.raises(ProbeError, match="notes.txt"):
        make_policy_checkpoints(rollout, DEMO_MOE, out, steps=(1,))


def test_bad_inputs_fail_with_one_line(rollout, tmp_path):
    def fails(match, **kwargs):
        args = dict(run=rollout, model=DEMO_MOE, out=tmp_path / "out") | kwargs
        with pytest.raises(ProbeError, match=match) as err:
            make_policy_checkpoints(**args)
        assert "\n" not in str(err.value)

    fails("expected positive whole numbers", steps=(0, 1))
    fails("lr", lr=-1.0)
    fails("tis_cap", tis_cap=0.0)
    fails("run directory not found", run=tmp_path / "no-run")
    empty = tmp_path / "empty"
    (empty / "rollout").mkdir(parents=True)
    shutil.copy(rollout / MANIFEST, empty / MANIFEST)
    fails("no part-", run=empty)
    dense = tmp_path / "dense"
    shutil.copytree(rollout, dense)
    manifest = RolloutManifest.load(dense / MANIFEST)
    manifest.num_layers = manifest.top_k = manifest.num_experts = 0
    manifest.save(dense / MANIFEST)
    fails("dense", run=dense)
    fails("config", model=DEMO_MOE.parent / "dense")  # not the rollout's checkpoint
